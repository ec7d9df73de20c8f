"""Running ops: the op kernel (every mode), strict, fused and debug eager, the dispatcher
kernels that are not lowerings (views, transfers, advanced indexing), the CPU fallback and
random state."""
