"""Matrix products; float32 precision follows torch.get_float32_matmul_precision()."""
import math

import jax.numpy as jnp
import torch
from jax import lax

from .._core.registry import HALF_TYPES, Promote, lowering
from .._core.runtime import jax_precision as _precision
from .._core.runtime import program_platform
from .meta import dtype_name


def _same_dtypes(*tensors):
    """Matrix products take no mixed dtypes on the CPU (no type promotion)."""
    dtypes = [t.dtype for t in tensors if isinstance(t, torch.Tensor)]
    if len(set(dtypes)) > 1:
        raise RuntimeError("expected the input tensors to have the same dtype, but got "
                           + ", ".join(dtype_name(d) for d in dtypes))


def _matmul(a, b):
    if a.dtype in _WIDE_INTEGERS and program_platform() == "tpu":
        return _wide_integer_matmul(a, b)
    # Half-precision products accumulate in float32 and stay float32 until the op's result is
    # rounded once, as in PyTorch's CPU kernels (and at no cost to the MXU's bf16 inputs).
    acc = jnp.float32 if a.dtype in HALF_TYPES else None
    return jnp.matmul(a, b, precision=_precision(), preferred_element_type=acc)


_WIDE_INTEGERS = (jnp.int64, jnp.uint64)
_WIDE_PRODUCT_ELEMENTS = 1 << 22  # the most elements of a's rows times b's columns at once


def _wide_integer_matmul(a, b):
    """jnp.matmul of 64-bit integers without a dot: XLA:TPU has no 64-bit integer dot (the
    compile fails, UNIMPLEMENTED), while its elementwise 64-bit arithmetic is emulated.  So
    the product is summed from elementwise products, wrapping modulo 2**64 as PyTorch's CPU
    kernel does; K is taken in chunks that keep each step's products within
    _WIDE_PRODUCT_ELEMENTS."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    batch = jnp.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    a2 = jnp.broadcast_to(a2, batch + a2.shape[-2:])
    b2 = jnp.broadcast_to(b2, batch + b2.shape[-2:])
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    per_k = max(1, math.prod(batch) * m * n)
    chunk = max(1, min(k, _WIDE_PRODUCT_ELEMENTS // per_k))

    def partial_product(lo, size):
        x = lax.slice_in_dim(a2, lo, lo + size, axis=-1)
        y = lax.slice_in_dim(b2, lo, lo + size, axis=-2)
        return jnp.sum(x[..., :, :, None] * y[..., None, :, :], axis=-2, dtype=a.dtype)

    whole, rest = divmod(k, chunk)
    out = jnp.zeros(batch + (m, n), a.dtype)
    if whole == 1:
        out = partial_product(0, chunk)
    elif whole:
        def step(i, acc):
            x = lax.dynamic_slice_in_dim(a2, i * chunk, chunk, axis=-1)
            y = lax.dynamic_slice_in_dim(b2, i * chunk, chunk, axis=-2)
            return acc + jnp.sum(x[..., :, :, None] * y[..., None, :, :], axis=-2, dtype=a.dtype)
        out = lax.fori_loop(0, whole, step, out)
    if rest:
        out = out + partial_product(whole * chunk, rest)
    if b.ndim == 1:
        out = out[..., 0]
    if a.ndim == 1:
        out = out[..., 0, :] if b.ndim != 1 else out[..., 0]
    return out


def _scaled_sum(bias, product, beta, alpha):
    """beta * bias + alpha * product, as PyTorch's addmm family computes it: integer tensors
    take integer scalars (0.6 becomes 0), and beta == 0 ignores bias (its NaNs too)."""
    if bias.dtype in HALF_TYPES:
        bias = bias.astype(jnp.float32)
    elif jnp.issubdtype(bias.dtype, jnp.integer) or bias.dtype == jnp.bool_:
        beta = jnp.trunc(jnp.asarray(beta)).astype(bias.dtype)
        alpha = jnp.trunc(jnp.asarray(alpha)).astype(bias.dtype)
    return jnp.where(beta == 0, 0, beta * bias) + alpha * product


@lowering("aten::mm.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def mm(a, b):
    return _matmul(a, b)


@lowering("aten::bmm.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def bmm(a, b):
    return _matmul(a, b)


@lowering("aten::addmm.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def addmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, b), beta, alpha)


@lowering("aten::baddbmm.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def baddbmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, b), beta, alpha)


@lowering("aten::addbmm.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def addbmm(bias, a, b, beta=1, alpha=1):
    if a.dtype not in HALF_TYPES or a.shape[0] == 0:
        return _scaled_sum(bias, jnp.sum(_matmul(a, b), axis=0), beta, alpha)
    # PyTorch's CPU kernel adds one batch at a time into the half-precision result.
    first = _scaled_sum(bias, _matmul(a[0], b[0]), beta, alpha).astype(a.dtype)

    def add_batch(out, ab):
        return _scaled_sum(out, _matmul(*ab), 1, alpha).astype(a.dtype), None

    return lax.scan(add_batch, first, (a[1:], b[1:]))[0]


@lowering("aten::mv.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def mv(a, v):
    return _matmul(a, v)


@lowering("aten::dot.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def dot(a, b):
    return _matmul(a, b) if a.dtype in _WIDE_INTEGERS else jnp.dot(a, b, precision=_precision())


@lowering("aten::vdot.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def vdot(a, b):
    if a.dtype in _WIDE_INTEGERS:
        return _matmul(a, b)
    return jnp.dot(jnp.conj(a), b, precision=_precision())  # the first argument conjugated


@lowering("aten::addmv.default", promote=Promote.RESULT, precision=True, validate=_same_dtypes)
def addmv(bias, a, v, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, v), beta, alpha)


@lowering("aten::addr.default", promote=Promote.RESULT)
def addr(bias, v1, v2, beta=1, alpha=1):
    # PyTorch's CPU kernel: beta * bias + (alpha * v1) * v2 elementwise, with alpha and beta
    # first converted to the tensors' dtype and, for half types, every step rounded to it.
    dtype = v1.dtype
    outer_shape = (v1.shape[0], v2.shape[0])
    if dtype == jnp.bool_:
        prod = jnp.asarray(alpha).astype(bool) & v1[:, None] & v2[None, :]
        return jnp.where(jnp.asarray(beta).astype(bool), bias | prod, prod)
    if jnp.issubdtype(dtype, jnp.integer):
        alpha, beta = jnp.trunc(jnp.asarray(alpha)), jnp.trunc(jnp.asarray(beta))
    alpha, beta = jnp.asarray(alpha).astype(dtype), jnp.asarray(beta).astype(dtype)
    prod = jnp.broadcast_to((alpha * v1)[:, None] * v2[None, :], outer_shape)
    return jnp.where(beta == 0, prod, beta * bias + prod)


@lowering("aten::linalg_cross.default", promote=Promote.RESULT)
def linalg_cross(a, b, dim=-1):
    # Written out as PyTorch's CPU kernel computes it: half types round after every product
    # and difference (PyTorch's reference decomposition computes in float32 instead).
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    a0, a1, a2 = (jnp.take(a, i, axis=dim) for i in range(3))
    b0, b1, b2 = (jnp.take(b, i, axis=dim) for i in range(3))
    return jnp.stack([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=dim)
