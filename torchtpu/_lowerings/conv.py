"""Convolutions (1d/2d/3d, transposed, groups, dilation) and their backward, on
lax.conv_general_dilated.  Float32 precision follows torch.get_float32_matmul_precision()."""
import itertools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .._core.dtypes import to_torch_dtype
from .._core.registry import HALF_TYPES, Promote, lowering
from .._core.runtime import jax_precision as _precision
from .._core.runtime import program_platform
from .meta import dtype_name
from .rounding import round_to


def _dims(nd):
    sp = "DHW"[-nd:] if nd <= 3 else None
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def _checked(stride, padding, dilation, groups, nd):
    stride, padding, dilation = (_expand(v, nd) for v in (stride, padding, dilation))
    # Checks PyTorch's CPU kernel makes and its meta kernel does not.
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    return stride, padding, dilation


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride, padding, dilation = _checked(stride, padding, dilation, groups, nd)
    # PyTorch's CPU kernels accumulate half-precision convolutions in float32 and round the
    # result (bias included) once; the MXU does the same natively.
    acc = jnp.float32 if x.dtype in HALF_TYPES else None
    if not transposed:
        y = lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, dimension_numbers=_dims(nd), feature_group_count=groups,
            precision=_precision(), preferred_element_type=acc)
    else:
        output_padding = _expand(output_padding, nd)
        # weight (C_in, C_out/g, *k) -> (C_out, C_in/g, *k), spatially flipped.
        cin, coutg = w.shape[0], w.shape[1]
        k = w.shape[2:]
        wt = w.reshape((groups, cin // groups, coutg) + k)
        wt = jnp.swapaxes(wt, 1, 2).reshape((groups * coutg, cin // groups) + k)
        wt = jnp.flip(wt, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
                for kk, p, d, op in zip(k, padding, dilation, output_padding)]
        y = lax.conv_general_dilated(
            x, wt, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride,
            rhs_dilation=dilation, dimension_numbers=_dims(nd), feature_group_count=groups,
            precision=_precision(), preferred_element_type=acc)
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd).astype(y.dtype)
    return y


def _expand(v, nd):
    v = list(v)
    return tuple(v * nd if len(v) == 1 else v)


def _cpu_uses_slow_transposed(x, w, stride, padding, dilation, output_padding, groups):
    """Whether PyTorch's CPU runs this transposed convolution with its im2col kernel (float16
    without oneDNN's fp16 support; bfloat16 when output_padding >= stride), which rounds
    differently from the oneDNN kernel: asked of PyTorch's own backend selection."""
    stand_in = lambda a: torch.empty_strided(a.shape, (0,) * a.ndim, dtype=to_torch_dtype(a.dtype))
    backend = torch._C._select_conv_backend(stand_in(x), stand_in(w), None, list(stride),
                                            list(padding), list(dilation), True,
                                            list(output_padding), groups, None)
    return str(backend).endswith(("SlowTranspose2d", "SlowTranspose3d"))


def _slow_transposed(x, w, bias, stride, padding, dilation, output_padding, groups):
    """PyTorch's im2col transposed convolution in half precision: each kernel tap's product
    (accumulated in float32) is rounded to half, then col2im adds the taps into the output
    one at a time in kernel order, in half, then the bias."""
    nd = x.ndim - 2
    n, cin = x.shape[:2]
    k = w.shape[2:]
    xg = x.reshape((n, groups, cin // groups) + x.shape[2:])
    wg = w.reshape((groups, cin // groups, w.shape[1]) + k)
    out_size = [(x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1)
                + output_padding[i] + 1 for i in range(nd)]
    acc = None
    for tap in itertools.product(*(range(kk) for kk in k)):
        part = jnp.einsum("ngi...,gio->ngo...", xg, wg[(Ellipsis,) + tap],
                          precision=_precision(), preferred_element_type=jnp.float32)
        part = round_to(part.reshape((n, -1) + x.shape[2:]), x.dtype)
        # Input position j lands on output j * stride + tap * dilation - padding.
        pads = [(0, 0, 0), (0, 0, 0)]
        for i in range(nd):
            low = tap[i] * dilation[i] - padding[i]
            high = out_size[i] - low - (x.shape[2 + i] - 1) * stride[i] - 1
            pads.append((low, high, stride[i] - 1))
        part = lax.pad(part, jnp.zeros((), part.dtype), pads)
        acc = part if acc is None else round_to(acc + part, x.dtype)
    if bias is not None:
        acc = acc + bias.reshape((1, -1) + (1,) * nd).astype(acc.dtype)
    return acc


def _check_dtypes(x, w, bias, *rest):
    """The CPU's convolutions take no mixed dtypes (no type promotion); a transposed one needs
    a weight with at least `groups` input channels."""
    for t in (w, bias):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"expected scalar type {dtype_name(x.dtype)} but found {dtype_name(t.dtype)}")
    transposed, groups = rest[3], rest[5]
    if transposed and w.shape[0] < groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be at least {groups} at "
                           f"dimension 0, but got weight of size {list(w.shape)} instead")


@lowering("aten::convolution.default", promote=Promote.RESULT, precision=True, validate=_check_dtypes)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    if x.dtype in (jnp.int64, jnp.uint64) and program_platform() == "tpu":
        # Refused before the TPU compiler fails on it (UNIMPLEMENTED), in PyTorch's words for
        # a dtype a device's kernel lacks.
        name = dtype_name(to_torch_dtype(x.dtype))
        raise RuntimeError(f'"convolution" not implemented for {name!r} on TPU (XLA:TPU has no '
                           f'64-bit integer convolution); use int32 or float32')
    if (transposed and x.dtype in HALF_TYPES and x.size and w.size
            and min(w.shape[2:], default=0) > 0):
        args = _checked(stride, padding, dilation, groups, nd) + (_expand(output_padding, nd),)
        if _cpu_uses_slow_transposed(x, w, *args, groups):
            return _slow_transposed(x, w, bias, *args, groups).astype(x.dtype)
    y = _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    if x.shape[1] == 0 and not transposed:
        y = y[:, :0]  # ATen returns an input without channels as an output without channels
    return y.astype(x.dtype)


@lowering("aten::convolution_backward.default", precision=True)
def convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    nd = x.ndim - 2
    if x.shape[1] == 0 and not transposed:  # an output without channels (see convolution)
        gb = jnp.zeros(bias_sizes, grad.dtype) if output_mask[2] else None
        return (jnp.zeros_like(x) if output_mask[0] else None), \
            (jnp.zeros_like(w) if output_mask[1] else None), gb

    def f(x_, w_):
        return _conv(x_, w_, None, stride, padding, dilation, transposed, output_padding, groups)

    y, vjp = jax.vjp(f, x, w)
    gx, gw = vjp(grad.astype(y.dtype))  # float32 for half inputs, as the forward accumulates
    gb = jnp.sum(grad.astype(y.dtype), axis=(0,) + tuple(range(2, 2 + nd))) \
        if output_mask[2] else None
    return (gx if output_mask[0] else None), (gw if output_mask[1] else None), gb
