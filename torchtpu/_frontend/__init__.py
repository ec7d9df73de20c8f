"""The front door: the `torch.tpu` module, backend registration, autocast, streams,
serialization, and the patches of PyTorch globals."""
