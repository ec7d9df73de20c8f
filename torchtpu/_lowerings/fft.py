"""FFTs: the three aten primitives every torch.fft function decomposes into.

`normalization` is ATen's fft_norm_mode: 0 none, 1 by 1/sqrt(n), 2 by 1/n (n = the product of
the transformed signal sizes)."""
import math

import jax.numpy as jnp

from .._core.registry import lowering


def _scale(y, sizes, normalization):
    n = math.prod(sizes)
    if normalization == 1:
        return y / jnp.sqrt(jnp.asarray(n, jnp.float32)).astype(y.dtype)
    if normalization == 2:
        return y / jnp.asarray(n, y.dtype)
    return y


def _complex(x):
    if jnp.iscomplexobj(x):
        return x
    return x.astype(jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64)


@lowering("aten::_fft_c2c.default")
def fft_c2c(x, dim, normalization, forward):
    dim = tuple(dim)
    if not dim:
        return x
    x = _complex(x)
    # Unnormalised in both directions, then PyTorch's normalisation.
    y = jnp.fft.fftn(x, axes=dim) if forward else jnp.fft.ifftn(x, axes=dim, norm="forward")
    return _scale(y, [x.shape[d] for d in dim], normalization).astype(x.dtype)


@lowering("aten::_fft_r2c.default")
def fft_r2c(x, dim, normalization, onesided):
    dim = tuple(dim)
    sizes = [x.shape[d] for d in dim]
    if onesided:
        y = jnp.fft.rfftn(x, axes=dim)
    else:
        y = jnp.fft.fftn(_complex(x), axes=dim)
    return _scale(y, sizes, normalization)


@lowering("aten::_fft_c2r.default")
def fft_c2r(x, dim, normalization, last_dim_size):
    dim = tuple(dim)
    x = _complex(x)
    s = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    y = jnp.fft.irfftn(x, s=s, axes=dim, norm="forward")
    return _scale(y, s, normalization)
