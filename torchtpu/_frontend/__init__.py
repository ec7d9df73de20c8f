"""The front door: the `torch.tpu` module, autocast, streams, serialization, and the
patches of PyTorch globals (torchtpu/_startup.py installs them)."""
