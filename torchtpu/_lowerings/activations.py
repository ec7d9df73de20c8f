"""Activations (relu, gelu, silu, elu, ...) and softmax, and their backward ops.

A backward op is PyTorch's decomposition (decomposed.py picks up every op without a lowering
here) or the jax.vjp of its forward lowering; a hand-written one says beside it what it saves,
measured (python benchmarks/backward_lowerings.py). The formulas of threshold, leaky_relu,
hardtanh, softmax, log_softmax, layer norm and the mse/smooth_l1/huber losses gave way to
PyTorch's decompositions: they had no measured reason (the decompositions' first calls cost
up to 40 ms more, their steady calls the same), and the conformance runner passes the same samples
of the ops using them, float32 and bfloat16, gradients included (703 of 703)."""
import jax
import jax.numpy as jnp
import torch

from .._core.registry import HALF_TYPES, Promote, lowering


def _check_relu(x):
    if x.dtype == torch.bool:
        raise RuntimeError("Boolean inputs not supported for relu")
    if x.is_complex():
        raise NotImplementedError("\"clamp_min_cpu\" not implemented for 'ComplexFloat'")


@lowering("aten::relu.default", validate=_check_relu)
def relu(x):
    return jnp.maximum(x, 0)


@lowering("aten::threshold.default", promote=Promote.RESULT)
def threshold(x, threshold, value):
    return jnp.where(x <= threshold, value, x)


def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@lowering("aten::gelu.default", opmath=True)
def gelu(x, approximate="none"):
    return _gelu(x, approximate)


@lowering("aten::gelu_backward.default", opmath=True)
def gelu_backward(grad, x, approximate="none"):
    return jax.vjp(lambda v: _gelu(v, approximate), x)[1](grad)[0]


@lowering("aten::silu.default")
def silu(x):
    return jax.nn.silu(x)


# tanh_backward and sigmoid_backward are PyTorch's decompositions (decomposed.py): they take
# the conjugate for complex inputs and compute half-precision inputs in float32 as the CPU
# kernels do, which the restated formulas here did not.


@lowering("aten::leaky_relu.default")
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowering("aten::elu.default")
def elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


@lowering("aten::hardtanh.default")
def hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val)


@lowering("aten::softplus.default")
def softplus(x, beta=1, threshold=20):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@lowering("aten::_softmax.default", opmath=True)
def softmax(x, dim, half_to_float=False):
    x = x.astype(jnp.float32) if half_to_float else x
    if x.size == 0:  # the CPU returns before looking at the dtype (bool, integers)
        return x
    if x.ndim == 0:
        return jnp.exp(x - x)  # 1, or nan for inf/nan as PyTorch computes it
    return jax.nn.softmax(x, axis=dim)


@lowering("aten::_log_softmax.default")
def log_softmax(x, dim, half_to_float=False):
    # PyTorch's CPU kernel over an inner dim computes half types in float32 and rounds once;
    # its last-dim kernel rounds intermediate steps, as the half-precision JAX function does.
    inner = x.ndim > 0 and dim % x.ndim != x.ndim - 1
    if half_to_float or (inner and x.dtype in HALF_TYPES):
        x = x.astype(jnp.float32)
    if x.size == 0:  # as softmax
        return x
    if x.ndim == 0:
        return x - x
    return jax.nn.log_softmax(x, axis=dim)
