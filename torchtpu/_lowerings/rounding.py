"""Float arithmetic rounded as PyTorch's CPU kernels round it, for the lowerings that match
them: an intermediate stored in a half-precision type (`round_to`), a correctly rounded
1 / sqrt, a fused multiply-add rounded once."""
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.registry import HALF_TYPES


def round_to(v, dtype):
    """Float32 `v` rounded to the half-precision `dtype` (kept in float32), where a PyTorch CPU
    kernel stores an intermediate in that type. XLA may drop a `.astype(half).astype(float32)`
    pair (it allows excess precision), never a reduce_precision."""
    if isinstance(v, (int, float)):  # a static value: rounded here
        return float(np.asarray(v, dtype)) if dtype in HALF_TYPES else v
    if dtype == jnp.bfloat16:
        return lax.reduce_precision(v, 8, 7)
    if dtype == jnp.float16:
        # reduce_precision flushes float16's subnormals: they are the multiples of 2**-24.
        return jnp.where(jnp.abs(v) < 2.0 ** -14, jnp.round(v * 2.0 ** 24) * 2.0 ** -24,
                         lax.reduce_precision(v, 5, 10))
    return v


def inverse_sqrt(v):
    """1 / sqrt(v) correctly rounded, as PyTorch's CPU kernels compute it: XLA would otherwise
    turn it into its rsqrt, which is not."""
    return 1 / lax.optimization_barrier(jnp.sqrt(v))


def fma(a, b, c):
    """a * b + c in float32 rounded once, as the fused multiply-add PyTorch's CPU kernels
    compile to (XLA has none): the product's rounding error, exact by Dekker's splitting, and
    the sum's, exact by TwoSum, are added back. It matters where the sum cancels."""
    def split(v):
        t = v * 4097.0
        hi = t - (t - v)
        return hi, v - hi

    p = a * b
    (ah, al), (bh, bl) = split(a), split(b)
    p_err = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    s = p + c
    v = s - p
    s_err = (p - (s - v)) + (c - v)
    return s + (s_err + p_err)
