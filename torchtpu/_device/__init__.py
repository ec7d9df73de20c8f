"""The device: registration, runtime, storages, dtypes, the torch.tpu module."""
