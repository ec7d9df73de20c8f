"""Running ops: strict, fused and debug eager, kernels, fallback, random state, metrics."""
