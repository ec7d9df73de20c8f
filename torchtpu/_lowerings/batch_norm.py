"""Batch normalisation: functional lowerings (the eager ops that update running statistics
are in _execution/composed_kernels.py).

`native_batch_norm` (what nn.BatchNorm calls) updates `running_mean`/`running_var` in place
although its schema does not say so, so a value-only lowering would silently leave them
stale. Its tpu kernel runs the functional form (`_native_batch_norm_legit_functional`, which
returns the new statistics, and is also what compiled graphs contain) and copies them back.
"""
import jax.numpy as jnp
import numpy as np
import torch

from .._core.dtypes import to_jax_dtype
from .rounding import inverse_sqrt, round_to
from .._core.registry import HALF_TYPES, lowering

aten = torch.ops.aten


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _per_channel(v, x):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def stats_dtype(x, *params):
    """The (JAX) dtype PyTorch's CPU kernel keeps statistics in: a half-precision input's own
    type, unless some parameter is float32 ("mixed type"), then float32.  Takes arrays, or on
    the host tensors."""
    def dtype(t):
        return to_jax_dtype(t.dtype) if isinstance(t, torch.Tensor) else t.dtype

    if dtype(x) in HALF_TYPES and not any(p is not None and dtype(p) == jnp.float32 for p in params):
        return dtype(x)
    return jnp.promote_types(dtype(x), jnp.float32)


def _normalise(x, mean, invstd, weight, bias):
    # As the CPU kernel: y = x * alpha + beta, alpha and beta per channel in float32 from the
    # statistics as stored (rounded to half for a half-precision batch norm), y rounded once.
    acc = jnp.promote_types(x.dtype, jnp.float32)
    alpha = invstd.astype(acc) if weight is None else invstd.astype(acc) * weight.astype(acc)
    beta = -mean.astype(acc) * alpha
    if bias is not None:
        beta = bias.astype(acc) + beta
    return x.astype(acc) * _per_channel(alpha, x) + _per_channel(beta, x)


def _batch_stats(x, eps, sdt):
    """(mean, sum of squared deviations, invstd) as PyTorch's CPU kernel gets them: in float32,
    mean and invstd rounded to the statistics' dtype `sdt`; for bfloat16 also var_sum, and
    var_sum / n is a bfloat16 division."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    mean = xf.mean(_axes(x))
    var_sum = ((xf - _per_channel(mean, x)) ** 2).sum(_axes(x))
    n = jnp.asarray(x.size // x.shape[1], acc)
    if sdt == jnp.bfloat16:
        var_sum = round_to(var_sum, sdt)
        var = round_to(var_sum / round_to(n, sdt), sdt)
    else:
        var = var_sum / n
    return mean, var_sum, round_to(inverse_sqrt(var + eps), sdt)


@lowering("aten::_native_batch_norm_legit_functional")
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        out, mean, invstd = batch_norm_no_training(x, weight, bias, running_mean, running_var,
                                                   momentum, eps)
        return out, mean, invstd, running_mean, running_var
    sdt = stats_dtype(x, weight, bias, running_mean, running_var)
    mean, var_sum, invstd = _batch_stats(x, eps, sdt)
    n = x.size // x.shape[1]
    rm, rv = running_mean.astype(mean.dtype), running_var.astype(mean.dtype)
    if sdt == jnp.bfloat16:
        # The CPU kernel's bfloat16 arithmetic, rounding after every operation (momentum
        # itself rounded first): m * mean + (1 - m) * running_mean, var_sum / (n - 1).
        r = lambda v: round_to(v, sdt)
        m = float(np.asarray(momentum, sdt))
        keep = float(np.asarray(1 - m, sdt))
        unbiased = r(var_sum / r(jnp.asarray(max(n - 1, 1), var_sum.dtype)))
        new_mean = r(r(m * r(mean)) + r(keep * rm))
        new_var = r(m * unbiased + r(keep * rv))
    else:  # float32 arithmetic (float64 for float64), rounded once
        m = float(np.float32(momentum)) if sdt == jnp.float16 else momentum
        new_mean = m * mean + (1 - m) * rm
        new_var = m * (var_sum / max(n - 1, 1)) + (1 - m) * rv
    mean = round_to(mean, sdt)
    return (_normalise(x, mean, invstd, weight, bias), mean, invstd,
            new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype))


@lowering("aten::_native_batch_norm_legit.no_stats")
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    sdt = stats_dtype(x, weight, bias)
    mean, _, invstd = _batch_stats(x, eps, sdt)
    mean = round_to(mean, sdt)
    return _normalise(x, mean, invstd, weight, bias), mean, invstd


@lowering("aten::_native_batch_norm_legit_no_training")
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    # (PyTorch's meta kernel, which fixes the output shapes here, gives the per-channel
    # statistics; the CPU kernel returns empty tensors for them.)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    invstd = inverse_sqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
    return _normalise(x, running_mean, invstd, weight, bias), running_mean, invstd


# Hand-written: PyTorch's decomposition of this op costs 1.5x its first call (trace and compile:
# 209-226 ms against 136-146 ms for a [8, 64, 32, 32] float32 input; the steady call is the
# same), paid by every CNN's first training step and every new shape
# (python benchmarks/backward_lowerings.py --ops native_batch_norm_backward, 2026-12-03).
@lowering("aten::native_batch_norm_backward")
def batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd,
                        train, eps, output_mask):
    g = grad.astype(jnp.promote_types(grad.dtype, jnp.float32))
    xf = x.astype(g.dtype)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, 1.0 / jnp.sqrt(running_var + eps)
    xhat = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
    grad_bias = g.sum(_axes(x))
    grad_weight = (g * xhat).sum(_axes(x))
    scale = invstd if weight is None else invstd * weight
    if train:
        n = x.size // x.shape[1]
        grad_input = _per_channel(scale / n, x) * (
            n * g - _per_channel(grad_bias, x) - xhat * _per_channel(grad_weight, x))
    else:
        grad_input = g * _per_channel(scale, x)
    return tuple(v if wanted else None
                 for v, wanted in zip((grad_input, grad_weight, grad_bias), output_mask))
