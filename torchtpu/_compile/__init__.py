"""torch.compile(backend="tpu") and export to StableHLO."""
