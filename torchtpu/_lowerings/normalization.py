"""Layer and group normalisation (batch normalisation: batch_norm.py). Layer norm's backward
is PyTorch's decomposition (activations.py says why)."""
import jax.numpy as jnp

from .._core.registry import HALF_TYPES, lowering
from .rounding import fma, inverse_sqrt


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    half = x.dtype in HALF_TYPES
    xf = x.astype(jnp.float32) if half else x
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = inverse_sqrt(var + eps)
    if not half:
        y = (xf - mean) * rstd
        y = y * weight if weight is not None else y
        return (y + bias if bias is not None else y), mean, rstd
    # PyTorch's CPU kernel for half inputs: float32 throughout, with fused multiply-adds
    # (x * rstd - rstd * mean) * weight + bias, and the result rounded once.
    y = fma(xf, rstd, -rstd * mean)
    if weight is not None and bias is not None:
        y = fma(y, weight.astype(y.dtype), bias.astype(y.dtype))
    elif weight is not None:
        y = y * weight.astype(y.dtype)
    elif bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype), mean, rstd


@lowering("aten::native_layer_norm.default")
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    return _layer_norm(x, normalized_shape, weight, bias, eps)


@lowering("aten::native_group_norm.default", opmath=True)
def native_group_norm(x, weight, bias, n, c, hw, group, eps):
    xg = x.reshape(n, group, (c // group) * hw)
    mean = xg.mean(-1)
    centred = xg - mean[..., None]
    rstd = inverse_sqrt(jnp.square(centred).mean(-1) + eps)
    y = (centred * rstd[..., None]).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * weight.reshape(per_channel)
    if bias is not None:
        y = y + bias.reshape(per_channel)
    return y, mean, rstd
