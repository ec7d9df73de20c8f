"""Batch normalisation: functional lowerings, and the eager ops that update running statistics.

`native_batch_norm` (what nn.BatchNorm calls) updates `running_mean`/`running_var` in place
although its schema does not say so, so a value-only lowering would silently leave them
stale. Its tpu kernel runs the functional form (`_native_batch_norm_legit_functional`, which
returns the new statistics, and is also what compiled graphs contain) and copies them back.
"""
import jax.numpy as jnp
import torch

from .registry import lowering

aten = torch.ops.aten


def _axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _per_channel(v, x):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _normalise(x, mean, invstd, weight, bias):
    y = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight, x)
    if bias is not None:
        y = y + _per_channel(bias, x)
    return y


def _batch_stats(x, eps):
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = xf.mean(_axes(x))
    var = ((xf - _per_channel(mean, x)) ** 2).mean(_axes(x))
    return xf, mean, var, 1.0 / jnp.sqrt(var + eps)


@lowering("aten::_native_batch_norm_legit_functional")
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        out, mean, invstd = batch_norm_no_training(x, weight, bias, running_mean, running_var,
                                                   momentum, eps)
        return out, mean, invstd, running_mean, running_var
    xf, mean, var, invstd = _batch_stats(x, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    new_var = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    return _normalise(xf, mean, invstd, weight, bias), mean, invstd, new_mean, new_var


@lowering("aten::_native_batch_norm_legit.no_stats")
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    xf, mean, var, invstd = _batch_stats(x, eps)
    return _normalise(xf, mean, invstd, weight, bias), mean, invstd


@lowering("aten::_native_batch_norm_legit_no_training")
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    # (PyTorch's meta kernel, which fixes the output shapes here, gives the per-channel
    # statistics; the CPU kernel returns empty tensors for them.)
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    invstd = 1.0 / jnp.sqrt(running_var + eps)
    return _normalise(xf, running_mean, invstd, weight, bias), running_mean, invstd


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


# --- the eager ops with in-place running statistics --------------------------------------

def _with_update(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if running_mean is None or running_var is None:
        if not training:
            raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
    if not training:
        out, _, _ = aten._native_batch_norm_legit_no_training(x, weight, bias, running_mean,
                                                               running_var, momentum, eps)
        # In evaluation nothing is saved for backward: empty, as the CPU kernel returns.
        stats_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        empty = x.new_empty((0,), dtype=stats_dtype)
        return out, empty, empty.clone()
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, invstd


def _batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    # The training-mode batch norm nn.BatchNorm uses since PyTorch 2.3; `reserve` is cuDNN's
    # workspace, empty elsewhere.
    out, mean, invstd = _with_update(x, weight, bias, running_mean, running_var, True,
                                     momentum, eps)
    return out, mean, invstd, x.new_empty((0,), dtype=torch.uint8)


def register(lib):
    lib.impl(aten.native_batch_norm.default, _with_update, "PrivateUse1")
    lib.impl(aten._native_batch_norm_legit.default, _with_update, "PrivateUse1")
    lib.impl(aten._batch_norm_with_update.default, _batch_norm_with_update, "PrivateUse1")
    return {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
            aten._batch_norm_with_update.default}
