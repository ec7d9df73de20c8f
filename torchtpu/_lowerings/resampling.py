"""Resampling: the grid sampler (`F.grid_sample`) and upsampling (`F.interpolate`: linear,
bilinear, bicubic and trilinear; uint8 and antialiased bilinear), as PyTorch's CPU kernels
compute them, step by step. Both take their bicubic weights from PyTorch's cubic
convolution (`_cubic_far`, `_cubic_near`)."""
import functools
import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .._core.registry import HALF_TYPES, lowering
from .rounding import round_to


# --- grid sampling: PyTorch's CPU kernels step by step ---------------------------------------
# For float16/bfloat16 those kernels compute in the half type, rounding after every operation
# (the 2-D kernel on at::Vectorized<half>, the 3-D one on scalars); `r` rounds likewise here (a
# no-op for float32/float64). The 2-D and 3-D kernels also order their arithmetic differently.

def _unnormalize(r, coord, size, align_corners, vectorized):
    if vectorized:  # (c + 1) * scale [- 0.5], scale = half(size [- 1]) / 2
        if align_corners:
            return r(r(coord + 1) * r(r(size - 1) / 2))
        return r(r(r(coord + 1) * r(r(size) / 2)) - 0.5)
    if align_corners:
        return r(r(r(coord + 1) / 2) * r(size - 1))
    return r(r(r(r(coord + 1) * r(size)) - 1) / 2)


def _clip(coord, size):
    # Zero for NaN, and a zero gradient at both borders, as PyTorch's kernels give.
    coord = jnp.where(coord > 0, coord, 0)
    return jnp.where(coord < size - 1, coord, size - 1)


def _reflect(r, coord, size, align_corners, vectorized):
    if vectorized:  # about [low, low + span], through twice the span
        if align_corners and size <= 1:
            return jnp.zeros_like(coord)
        low = 0.0 if align_corners else -0.5
        twice_span = r(r(size - 1 if align_corners else size) * 2)
        folded = jnp.abs(r(coord - low))
        extra = r(folded - r(jnp.trunc(r(folded / twice_span)) * twice_span))
        return r(jnp.minimum(extra, r(twice_span - extra)) + low)
    twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = r(r(twice_low) / 2), r(r(twice_high - twice_low) / 2)
    folded = jnp.abs(r(coord - low))
    extra = jnp.fmod(folded, span)
    flips = jnp.floor(r(folded / span))
    return jnp.where(flips % 2 == 0, r(extra + low), r(r(span - extra) + low))


def _pad_coordinates(r, coord, size, padding_mode, align_corners, vectorized):
    if padding_mode == 1:  # border
        return _clip(coord, size)
    if padding_mode == 2:  # reflection
        return _clip(_reflect(r, coord, size, align_corners, vectorized), size)
    return coord


def _gather(x, index, sizes):
    """x (N, C, *sizes) at integer positions `index` (per dim, each (N, *out)) as (N, C, *out),
    zero where outside the input."""
    inside = functools.reduce(operator.and_, [(i >= 0) & (i < n) for i, n in zip(index, sizes)])
    # One gather from the flattened spatial dims: a per-sample gather of several index arrays
    # (a vmapped x[:, i, j, k]) transposes into scatters XLA takes seconds to compile.
    flat = functools.reduce(lambda acc, pair: acc * pair[1] + jnp.clip(pair[0], 0, pair[1] - 1),
                            zip(index, sizes), 0)
    n, c, out = x.shape[0], x.shape[1], flat.shape[1:]
    values = jnp.take_along_axis(x.reshape(n, c, -1), flat.reshape(n, 1, -1), axis=2)
    return jnp.where(inside[:, None], values.reshape(n, c, *out), 0)


# PyTorch's cubic convolution (A = -0.75), in its kernels' order of operations, `r` rounding
# after each one (identity: none).  5A, 8A, 4A, A + 2 and A + 3 are exact in every float type.
_CUBIC_A = -0.75


def _cubic_far(r, v):  # 1 < |v| < 2
    a = _CUBIC_A
    return r(r(r(r(r(r(a * v) - 5 * a) * v) + 8 * a) * v) - 4 * a)


def _cubic_near(r, v):  # |v| <= 1
    a = _CUBIC_A
    return r(r(r(r(r((a + 2) * v) - (a + 3)) * v) * v) + 1)


def _cubic_coefficients(r, t):
    """The four tap weights of the grid sampler's kernel (its last tap from 2 - t)."""
    return [_cubic_far(r, r(t + 1)), _cubic_near(r, t), _cubic_near(r, r(1 - t)),
            _cubic_far(r, r(2 - t))]


def _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners):
    nd = x.ndim - 2
    vectorized = nd == 2
    half = x.dtype in HALF_TYPES
    r = (lambda v: round_to(v, x.dtype)) if half else (lambda v: v)
    acc = jnp.float32 if half else x.dtype
    xs, grid = x.astype(acc), grid.astype(acc)
    sizes = x.shape[2:]
    coords = [_unnormalize(r, grid[..., nd - 1 - i], n, align_corners, vectorized)
              for i, n in enumerate(sizes)]  # per input dim, in (D,) H, W order
    if interpolation_mode == 2:  # bicubic (2-D only): padding applies to each tap
        base = [jnp.floor(c) for c in coords]
        cy, cx = (_cubic_coefficients(r, r(c - b)) for c, b in zip(coords, base))
        # The four row and four column positions each tap reads, padded.
        row_taps, col_taps = ([_pad_coordinates(r, r(b + (k - 1)), n, padding_mode,
                                                align_corners, True).astype(jnp.int32)
                               for k in range(4)] for b, n in zip(base, sizes))
        rows = []
        for yy in row_taps:
            row = None
            for j, xx in enumerate(col_taps):
                term = r(cx[j][:, None] * _gather(xs, (yy, xx), sizes))
                row = term if row is None else r(row + term)
            rows.append(row)
        out = None
        for i in range(4):
            term = r(cy[i][:, None] * rows[i])
            out = term if out is None else r(out + term)
        return out.astype(x.dtype)
    coords = [_pad_coordinates(r, c, n, padding_mode, align_corners, vectorized)
              for c, n in zip(coords, sizes)]
    if interpolation_mode == 1:  # nearest, halves to even
        index = [jnp.round(c).astype(jnp.int32) for c in coords]
        return _gather(xs, index, sizes).astype(x.dtype)
    low = [jnp.floor(c) for c in coords]
    above = [r(c - l) for c, l in zip(coords, low)]  # weight of the upper neighbour
    below = [r(1 - a) for a in above] if vectorized else \
        [r(r(l + 1) - c) for c, l in zip(coords, low)]
    # Corners in the kernels' order (last dim fastest), each weight a product over dims.
    corners = list(itertools.product((0, 1), repeat=nd))
    # All corners' values in one gather (stacked on the last axis): one gather per corner
    # transposes into as many scatters, which XLA compiles slowly.
    values = _gather(xs, [jnp.stack([(l + c[d]).astype(jnp.int32) for c in corners], -1)
                          for d, l in enumerate(low)], sizes)
    out = None
    for k, corner in enumerate(corners):
        ws = [(above if c else below)[i] for i, c in enumerate(corner)]
        # 2-D: nw = s * e (the row's weight first); 3-D: tnw = (x) * (y) * (z).
        w = functools.reduce(lambda p, q: r(p * q), ws if vectorized else ws[::-1])
        term = r(values[..., k] * w[:, None])
        out = term if out is None else r(out + term)
    return out.astype(x.dtype)


def _check_grid_sampler(nd):
    """ATen's check_grid_sampler_common, then its check of the rank, in its order and words
    (PyTorch's Python meta kernels word them apart, or unpack the wrong rank)."""
    def check(x, grid, interpolation_mode, *rest):
        sizes = f"input with sizes {list(x.shape)} and grid with sizes {list(grid.shape)}"
        if x.dim() and grid.dim() and x.shape[0] != grid.shape[0]:
            raise RuntimeError("grid_sampler(): expected grid and input to have same batch size, "
                               f"but got {sizes}")
        if grid.dim() and grid.shape[-1] != x.dim() - 2:
            raise RuntimeError(f"grid_sampler(): expected grid to have size {x.dim() - 2} in last "
                               f"dimension, but got grid with sizes {list(grid.shape)}")
        for i in range(2, x.dim()):
            if x.shape[i] == 0:
                raise RuntimeError("grid_sampler(): expected input to have non-empty spatial "
                                   f"dimensions, but input has sizes {list(x.shape)} with "
                                   f"dimension {i} being empty")
        if not (x.dim() == nd + 2 and grid.dim() == x.dim()):
            raise RuntimeError(f"grid_sampler(): expected {nd + 2}D input and grid with same number "
                               f"of dimensions, but got {sizes}")
        if nd == 3 and interpolation_mode not in (0, 1):
            raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    return check


def _grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    if x.size == 0 or grid.size == 0:  # an empty batch or no channels: nothing to sample
        return jnp.zeros(x.shape[:2] + grid.shape[1:-1], x.dtype)
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


lowering("aten::grid_sampler_2d.default", validate=_check_grid_sampler(2))(_grid_sampler)
lowering("aten::grid_sampler_3d.default", validate=_check_grid_sampler(3))(_grid_sampler)


# --- linear upsampling: PyTorch's CPU kernel (weights per output index, then a weighted sum) ---
def _source_index(in_size, out_size, align_corners, scale, f, cubic=False):
    i = np.arange(out_size).astype(f)
    if align_corners:
        return (f(in_size - 1) / f(out_size - 1) if out_size > 1 else f(0)) * i
    ratio = f(1.0 / scale) if scale is not None and scale > 0 else f(in_size) / f(out_size)
    src = (ratio * (i + f(0.5)) - f(0.5)).astype(f)
    return src if cubic else np.maximum(src, f(0))


def _linear_taps(in_size, out_size, align_corners, scale, dtype):
    """([index0, index1], [weight0, weight1]) per output index, as PyTorch's CPU kernel
    computes them: in float32 (float64 for float64), the weights stored in the input's dtype."""
    f = np.float64 if dtype == jnp.float64 else np.float32
    if out_size == in_size:  # a copy
        i = np.arange(out_size)
        return [i, i], [np.ones(out_size, f), np.zeros(out_size, f)]
    src = _source_index(in_size, out_size, align_corners, scale, f)
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    w1 = np.clip(src - i0.astype(f), 0, 1).astype(dtype)  # lambda1, then 1 - lambda1, stored
    w0 = (1 - w1.astype(f)).astype(dtype)
    return [i0, np.minimum(i0 + 1, in_size - 1)], [w0.astype(f), w1.astype(f)]


def _cubic_taps(in_size, out_size, align_corners, scale, dtype):
    """Four (index, weight) taps per output index: PyTorch's cubic convolution (A = -0.75)
    in float32, indices clamped to the input, the weights stored in the input's dtype."""
    f = np.float64 if dtype == jnp.float64 else np.float32
    src = _source_index(in_size, out_size, align_corners, scale, f, cubic=True)
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    t = np.clip(src - i0.astype(f), 0, 1).astype(f)
    exact = lambda v: v  # in `f` throughout, rounded only when stored below
    # The upsampling kernel takes its last tap from (1 - t) + 1.
    weights = [_cubic_far(exact, t + f(1)), _cubic_near(exact, t), _cubic_near(exact, f(1) - t),
               _cubic_far(exact, f(1) - t + f(1))]
    return ([np.clip(i0 + k - 1, 0, in_size - 1) for k in range(4)],
            [w.astype(f).astype(dtype).astype(f) for w in weights])


def _upsample_linear(x, output_size, align_corners, scales, taps=_linear_taps):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise NotImplementedError(f"interpolation of {x.dtype} tensors on tpu")
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    y = x.astype(acc)
    nd = len(output_size)
    # One dimension at a time from the last: the same products and sums, in the same order,
    # as the CPU kernel's nested evaluation, in float32; the result rounded once.
    for d in reversed(range(nd)):
        axis = x.ndim - nd + d
        index, weight = taps(x.shape[axis], output_size[d], align_corners, scales[d], x.dtype)
        shape = (-1,) + (1,) * (nd - 1 - d)
        terms = [jnp.take(y, i, axis=axis) * w.reshape(shape) for i, w in zip(index, weight)]
        y = functools.reduce(operator.add, terms)
    return y.astype(x.dtype)


@lowering("aten::upsample_linear1d.default")
def upsample_linear1d(x, output_size, align_corners, scales=None):
    return _upsample_linear(x, output_size, align_corners, [scales])


def _bilinear_vectorized(x, output_size, align_corners, scales):
    """PyTorch's channels-last CPU kernel, which it also picks for small outputs: float32
    weights (never rounded to half), w00 = h0 * w0 ..., summed over the four corners."""
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    (hs, hws), (ws, wws) = (
        _linear_taps(x.shape[-2 + d], output_size[d], align_corners, scales[d], acc)
        for d in (0, 1))
    xf = x.astype(acc)
    out = None
    for hi, hw in zip(hs, hws):
        rows = jnp.take(xf, hi, axis=-2)
        for wi, ww in zip(ws, wws):
            term = jnp.take(rows, wi, axis=-1) * (hw[:, None] * ww[None, :])
            out = term if out is None else out + term
    return out.astype(x.dtype)


@lowering("aten::upsample_bilinear2d.default")
def upsample_bilinear2d(x, output_size, align_corners, scales_h=None, scales_w=None):
    scales = [scales_h, scales_w]
    if x.dtype == jnp.uint8:
        return _resize_uint8(x, output_size, align_corners, scales, antialias=False)
    if jnp.issubdtype(x.dtype, jnp.floating) and (
            sum(output_size) <= 128 or (x.shape[1] == 3 and torch.get_num_threads() == 1)):
        return _bilinear_vectorized(x, output_size, align_corners, scales)
    return _upsample_linear(x, output_size, align_corners, scales)


@lowering("aten::upsample_bicubic2d.default")
def upsample_bicubic2d(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_linear(x, output_size, align_corners, [scales_h, scales_w], _cubic_taps)


@lowering("aten::upsample_trilinear3d.default")
def upsample_trilinear3d(x, output_size, align_corners, scales_d=None, scales_h=None,
                         scales_w=None):
    return _upsample_linear(x, output_size, align_corners, [scales_d, scales_h, scales_w])


# --- uint8 bilinear resize: PyTorch's CPU integer kernel (as PIL's) --------------------------
# Weights are computed in float64 per output index, quantised to int16 with a precision shift
# chosen from the largest weight, and each pass (width, then height; a dimension of unchanged
# size is skipped) sums pixel * weight in int32, adds half, shifts, clamps to uint8.
def _uint8_taps(in_size, out_size, align_corners, scale, antialias):
    """(input index, int16 weight) per (output index, tap), and the precision shift."""
    if antialias:  # the float filter, computed in float64
        windows, taps = _tent_windows(in_size, out_size, align_corners, scale, np.float64)
        weights = np.zeros((out_size, taps))
        for i, (_, w) in enumerate(windows):
            weights[i, :len(w)] = w
        first = np.array([lo for lo, _ in windows], np.int64)
    else:  # the two linear weights, those of positions outside folded onto the border
        weights, first = _uint8_linear_weights(in_size, out_size, align_corners, scale)
    precision = 0
    while precision < 22 and int(0.5 + weights.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    w16 = np.trunc(scaled + np.where(scaled < 0, -0.5, 0.5)).astype(np.int32)
    index = np.minimum(first[:, None] + np.arange(weights.shape[1]), in_size - 1)
    return index, w16, precision


def _uint8_linear_weights(in_size, out_size, align_corners, scale):
    if align_corners:
        scale = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        scale = 1.0 / scale if scale is not None and scale > 0 else in_size / out_size
    taps = 2
    weights = np.zeros((out_size, taps))
    first = np.zeros(out_size, np.int64)
    for i in range(out_size):
        src = scale * i if align_corners else max(scale * (i + 0.5) - 0.5, 0.0)
        index = min(int(np.floor(np.float32(src))), in_size - 1)
        lam = min(max(src - index, 0.0), 1.0)
        n = min(max(min(index + 2, in_size) - max(index, 0), 0), taps)
        k = 0
        for j in range(taps):
            k = 0 if index + j <= 0 else n - 1 if index + j >= in_size - 1 else k
            weights[i, k] += max(1.0 - abs(j - lam), 0.0)
            k += 1
        first[i] = max(index, 0)
    return weights, first


def _resize_uint8(x, output_size, align_corners, scales, antialias):
    y = x
    for axis in (-1, -2):
        out = output_size[axis]
        if y.shape[axis] == out:
            continue
        index, w16, precision = _uint8_taps(y.shape[axis], out, align_corners, scales[axis],
                                            antialias)
        acc = jnp.full(y.shape[:axis % y.ndim] + (out,) + y.shape[y.ndim + axis + 1:],
                       1 << (precision - 1), jnp.int32)
        shape = (-1,) + (1,) * (-axis - 1)
        for j in range(index.shape[1]):
            acc = acc + jnp.take(y, index[:, j], axis=axis).astype(jnp.int32) * \
                w16[:, j].reshape(shape)
        y = jnp.clip(acc >> precision, 0, 255).astype(jnp.uint8)
    return y


# --- antialiased bilinear resize: PyTorch's (and PIL's) separable triangle filter --------------
def _tent_windows(in_size, out_size, align_corners, scale, f):
    """PyTorch's (and PIL's) antialiasing filter along one axis, computed in the float type `f`:
    per output index, the first input index it reads and its normalised tent weights; and the
    most taps any output reads."""
    if align_corners:
        scale = f((in_size - 1) / (out_size - 1)) if out_size > 1 else f(0)
    else:
        scale = f(1.0 / scale) if scale is not None and scale > 0 else f(in_size / out_size)
    support = f(scale) if scale >= 1.0 else f(1.0)  # interp_size / 2 = 1, widened by scale
    max_taps = int(np.ceil(support)) * 2 + 1
    invscale = f(1.0 / scale) if scale >= 1.0 else f(1.0)
    windows = []
    for i in range(out_size):
        center = f(scale * (i + 0.5))
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), max_taps)
        taps = np.maximum(
            0, 1 - np.abs((np.arange(xsize, dtype=f) + xmin - center + f(0.5)) * invscale)
        ).astype(f)
        total = taps.sum(dtype=f)
        windows.append((xmin, taps / total if total != 0 else taps))
    return windows, max_taps


def _aa_weights(in_size, out_size, align_corners, scale):
    """(out, in) float32 matrix of PyTorch's antialiasing weights along one axis."""
    windows, _ = _tent_windows(in_size, out_size, align_corners, scale, np.float32)
    weights = np.zeros((out_size, in_size), np.float32)
    for i, (xmin, taps) in enumerate(windows):
        weights[i, xmin:xmin + len(taps)] = taps
    return weights


def _aa_resize(x, output_size, align_corners, scales_h, scales_w):
    wh = _aa_weights(x.shape[-2], output_size[0], align_corners, scales_h)
    ww = _aa_weights(x.shape[-1], output_size[1], align_corners, scales_w)
    horizontal = jnp.einsum("...hw,ow->...ho", x.astype(jnp.float32), ww,
                            precision=lax.Precision.HIGHEST)
    out = jnp.einsum("...hw,oh->...ow", horizontal, wh, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@lowering("aten::_upsample_bilinear2d_aa.default")
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    if x.dtype == jnp.uint8:
        return _resize_uint8(x, output_size, align_corners, [scales_h, scales_w], antialias=True)
    return _aa_resize(x, output_size, align_corners, scales_h, scales_w)


@lowering("aten::_upsample_bilinear2d_aa_backward.default")
def upsample_bilinear2d_aa_backward(grad, output_size, input_size, align_corners, scales_h=None,
                                    scales_w=None):
    x = jnp.zeros(tuple(input_size), grad.dtype)
    _, pullback = jax.vjp(lambda a: _aa_resize(a, output_size, align_corners, scales_h,
                                               scales_w), x)
    return pullback(grad)[0]
