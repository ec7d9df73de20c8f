"""Convolutions (1d/2d/3d, transposed, groups, dilation) and their backward, on
lax.conv_general_dilated.  Float32 precision follows torch.get_float32_matmul_precision()."""
import jax
import jax.numpy as jnp
from jax import lax

from .registry import lowering


def _precision():
    from .._device.module import jax_precision
    return jax_precision()


def _dims(nd):
    sp = "DHW"[-nd:] if nd <= 3 else None
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride = _expand(stride, nd)
    padding = _expand(padding, nd)
    dilation = _expand(dilation, nd)
    # Checks PyTorch's CPU kernel makes and its meta kernel does not.
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d <= 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    if not transposed:
        y = lax.conv_general_dilated(
            x, w, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, dimension_numbers=_dims(nd), feature_group_count=groups,
            precision=_precision())
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
            precision=_precision())
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd)
    return y


def _expand(v, nd):
    v = list(v)
    return tuple(v * nd if len(v) == 1 else v)


@lowering("aten::convolution.default", promote=True, precision=True)
def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    return _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


@lowering("aten::convolution_backward.default", precision=True)
def convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def f(x_, w_):
        return _conv(x_, w_, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, x, w)
    gx, gw = vjp(grad.astype(x.dtype))
    nd = x.ndim - 2
    gb = jnp.sum(grad, axis=(0,) + tuple(range(2, 2 + nd))) if output_mask[2] else None
    return (gx if output_mask[0] else None), (gw if output_mask[1] else None), gb
