"""Pooling: average (with ceil_mode / count_include_pad / divisor_override), adaptive average,
max-pool backward from saved indices.  Backward ops reuse the forward through jax.vjp.
(max_pool*_with_indices and adaptive_max_pool* forward come from PyTorch's decompositions.)

The max-pool backward ops (3-D, adaptive, fractional) are no derivative formula: they take the
indices the forward saved and send each output's gradient to the element its index names, as
PyTorch defines them (PyTorch has no decomposition of them; the jax.vjp of a forward would pick
its own maxima instead of the given ones)."""
import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._decomp import decomposition_table

from .._core.registry import HALF_TYPES, lowering
from .decomposed import make_lowering
from .rounding import round_to


def _expand(v, nd, default=None):
    v = list(v) if v is not None else []
    if not v:
        return list(default) if default is not None else None
    return v * nd if len(v) == 1 else v


def _out_size(n, k, s, p, d, ceil_mode):
    eff = d * (k - 1) + 1
    num = n + 2 * p - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    k = _expand(kernel_size, nd)
    s = _expand(stride, nd, k)
    p = _expand(padding, nd)
    lead = x.ndim - nd
    spatial = x.shape[lead:]
    outs = [_out_size(n, kk, ss, pp, 1, ceil_mode) for n, kk, ss, pp in zip(spatial, k, s, p)]
    # Right padding so the last window fits (ceil_mode windows may run past the padding).
    extra = [max((o - 1) * ss + kk - (n + 2 * pp), 0) for o, ss, kk, n, pp in zip(outs, s, k, spatial, p)]
    pads = [(0, 0)] * lead + [(pp, pp + e) for pp, e in zip(p, extra)]
    window = (1,) * lead + tuple(k)
    strides = (1,) * lead + tuple(s)
    acc = jnp.float32 if x.dtype in HALF_TYPES else x.dtype
    total = lax.reduce_window(x.astype(acc), np.zeros((), acc), lax.add, window, strides, pads)
    if divisor_override:
        return (total / divisor_override).astype(x.dtype)
    # Element counts per window: padding counts when count_include_pad, the ceil_mode overhang never.
    ones = np.ones(spatial, np.float32)
    if count_include_pad:
        ones = np.pad(ones, [(pp, pp) for pp in p], constant_values=1)
        cpads = [(0, e) for e in extra]
    else:
        cpads = [(pp, pp + e) for pp, e in zip(p, extra)]
    count = lax.reduce_window(jnp.asarray(ones), 0.0, lax.add, tuple(k), tuple(s), cpads)
    return (total / count.astype(acc)).astype(x.dtype)


def _register_avg(nd):
    fwd_name = f"aten::avg_pool{nd}d.default"
    bwd_name = f"aten::avg_pool{nd}d_backward.default"

    @lowering(fwd_name)
    def avg_pool(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override, nd)

    @lowering(bwd_name)
    def avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                          divisor_override):
        f = lambda v: _avg_pool(v, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                divisor_override, nd)
        return jax.vjp(f, x)[1](grad.astype(x.dtype))[0]


_register_avg(2)
_register_avg(3)


def _adaptive_matrix(n_in, n_out):
    m = np.zeros((n_out, n_in), np.float32)
    for o in range(n_out):
        start = (o * n_in) // n_out
        end = -(-((o + 1) * n_in) // n_out)
        m[o, start:end] = 1.0 / (end - start)
    return m


def _adaptive_avg(x, output_size, nd):
    # A box average is separable: one averaging matrix per spatial dim.
    acc = jnp.float32 if x.dtype in HALF_TYPES else x.dtype
    y = x.astype(acc)
    for i, o in enumerate(output_size):
        axis = x.ndim - nd + i
        m = jnp.asarray(_adaptive_matrix(x.shape[axis], o), acc)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=[[axis], [1]],
                                       precision=lax.Precision.HIGHEST), -1, axis)
    return y.astype(x.dtype)


def _adaptive_avg3d_in_half(x, output_size):
    """PyTorch's CPU kernel for half inputs: each window summed in half precision one element
    at a time, in (d, h, w) order, then divided by its size (a fori_loop over window offsets)."""
    wins = [_adaptive_windows(n, o) for n, o in zip(x.shape[-3:], output_size)]
    kd, kh, kw = (idx.shape[1] for idx, _ in wins)
    (di, dv), (hi, hv), (wi, wv) = ((jnp.asarray(i), jnp.asarray(v)) for i, v in wins)
    count = (dv.sum(1)[:, None, None] * hv.sum(1)[None, :, None] * wv.sum(1)[None, None, :])
    xf = x.astype(jnp.float32)

    def add(t, acc):
        i, j, k = t // (kh * kw), t // kw % kh, t % kw
        v = jnp.take(jnp.take(jnp.take(xf, di[:, i], axis=-3), hi[:, j], axis=-2), wi[:, k],
                     axis=-1)
        inside = dv[:, i, None, None] & hv[None, :, j, None] & wv[None, None, :, k]
        return round_to(acc + jnp.where(inside, v, 0), x.dtype)

    total = lax.fori_loop(0, kd * kh * kw, add,
                          jnp.zeros(x.shape[:-3] + tuple(output_size), jnp.float32))
    return round_to(total / count, x.dtype).astype(x.dtype)


def _check_adaptive_avg_pool2d(x, output_size):
    # The CPU kernel checks the spatial dims only (an empty batch or channel dim is fine).
    for d in range(x.dim() - 2, x.dim()):
        if x.shape[d] == 0:
            raise RuntimeError(
                "adaptive_avg_pool2d(): Expected input to have non-zero size for non-batch "
                f"dimensions, but input has sizes {list(x.shape)} with dimension {d} being empty")


def _check_nonempty(op, name):
    """The CPU's check of the dims after the first (PyTorch's meta kernels word it apart)."""
    def check(x, *rest):
        for d in range(1, x.dim()):
            if x.shape[d] == 0:
                raise RuntimeError(
                    f"{op}(): Expected {name} to have non-zero size for non-batch dimensions, "
                    f"but {name} has sizes {list(x.shape)} with dimension {d} being empty")
    return check


@lowering("aten::_adaptive_avg_pool2d.default", validate=_check_adaptive_avg_pool2d)
def adaptive_avg_pool2d(x, output_size):
    if 0 in output_size:  # an empty result (PyTorch's decomposition would divide by zero)
        return jnp.zeros(x.shape[:-2] + tuple(output_size), x.dtype)
    return _adaptive_avg_pool2d_decomposed(x, output_size)


_adaptive_avg_pool2d_decomposed = make_lowering(
    torch.ops.aten._adaptive_avg_pool2d.default,
    decomposition_table[torch.ops.aten._adaptive_avg_pool2d.default])


@lowering("aten::_adaptive_avg_pool3d.default")
def adaptive_avg_pool3d(x, output_size):
    if x.dtype in HALF_TYPES and x.size and 0 not in output_size:
        return _adaptive_avg3d_in_half(x, output_size)
    return _adaptive_avg(x, output_size, 3)


@lowering("aten::_adaptive_avg_pool2d_backward.default", validate=_check_nonempty("adaptive_avg_pool2d_backward", "grad_output"))
def adaptive_avg_pool2d_backward(grad, x):
    f = lambda v: _adaptive_avg(v, grad.shape[-2:], 2)
    return jax.vjp(f, x)[1](grad.astype(x.dtype))[0]


@lowering("aten::_adaptive_avg_pool3d_backward.default", validate=_check_nonempty("adaptive_avg_pool3d_backward", "grad_output"))
def adaptive_avg_pool3d_backward(grad, x):
    f = lambda v: _adaptive_avg(v, grad.shape[-3:], 3)
    return jax.vjp(f, x)[1](grad.astype(x.dtype))[0]


def _scatter_by_indices(grad, x, indices, nd):
    """Max-pool backward: each output's gradient goes to the input element its index names
    (indices are flat over the spatial dims, per batch and channel)."""
    lead = x.shape[: x.ndim - nd]
    n_sp = int(np.prod(x.shape[x.ndim - nd:]))
    b = int(np.prod(lead)) if lead else 1
    if x.size == 0 or grad.size == 0:  # nothing to scatter (an empty batch, an empty output)
        return jnp.zeros(x.shape, grad.dtype)
    g = grad.reshape(b, -1)
    idx = indices.reshape(b, -1)
    rows = jnp.arange(b)[:, None]
    out = jnp.zeros((b, n_sp), grad.dtype).at[rows, idx].add(g)
    return out.reshape(x.shape)


@lowering("aten::adaptive_max_pool2d_backward.default", validate=_check_nonempty("adaptive_max_pool2d_backward", "grad_output"))
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_by_indices(grad, x, indices, 2)


@lowering("aten::adaptive_max_pool3d_backward.default", validate=_check_nonempty("adaptive_max_pool3d_backward", "grad_output"))
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_by_indices(grad, x, indices, 3)


@lowering("aten::max_pool3d_with_indices_backward.default")
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return _scatter_by_indices(grad, x, indices, 3)


def _adaptive_windows(n_in, n_out):
    starts = [(o * n_in) // n_out for o in range(n_out)]
    ends = [-(-((o + 1) * n_in) // n_out) for o in range(n_out)]
    k = max(e - s for s, e in zip(starts, ends))
    idx = np.array([[min(s + j, e - 1) for j in range(k)] for s, e in zip(starts, ends)])
    valid = np.array([[s + j < e for j in range(k)] for s, e in zip(starts, ends)])
    return idx, valid


def _adaptive_max(x, output_size, nd):
    """Max over each adaptive window, with the flat spatial index of the (first) maximum."""
    lead = x.ndim - nd
    if x.size == 0 or 0 in output_size:  # an empty result (an empty batch, an output size 0)
        shape = x.shape[:lead] + tuple(output_size)
        return jnp.zeros(shape, x.dtype), jnp.zeros(shape, jnp.int64)
    spatial = x.shape[lead:]
    vals = x
    flat_idx = np.zeros((), np.int64)
    # Gather windows dim by dim: (..., o1, k1, o2, k2, ...).
    mask = np.ones((), bool)
    for i, (n, o) in enumerate(zip(spatial, output_size)):
        idx, valid = _adaptive_windows(n, o)
        axis = lead + 2 * i
        vals = jnp.take(vals, idx, axis=axis)
        shape = [1] * (2 * nd)
        shape[2 * i], shape[2 * i + 1] = idx.shape
        stride = int(np.prod(spatial[i + 1:]))
        flat_idx = flat_idx + idx.reshape(shape) * stride
        mask = mask & valid.reshape(shape)
    # Move the window dims last and flatten them.
    perm = list(range(lead)) + [lead + 2 * i for i in range(nd)] + [lead + 2 * i + 1 for i in range(nd)]
    vals = jnp.transpose(vals, perm)
    iperm = [2 * i for i in range(nd)] + [2 * i + 1 for i in range(nd)]
    full = np.broadcast_shapes(flat_idx.shape, mask.shape)
    flat_idx = np.transpose(np.broadcast_to(flat_idx, full), iperm)
    mask = np.transpose(np.broadcast_to(mask, full), iperm)
    out_shape = vals.shape[: lead + nd]
    vals = vals.reshape(out_shape + (-1,))
    flat_idx = flat_idx.reshape(tuple(output_size) + (-1,))
    mask = mask.reshape(tuple(output_size) + (-1,))
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    vals = jnp.where(mask, vals, lowest)
    # NaN counts as the maximum, as in PyTorch.
    key = jnp.where(jnp.isnan(vals), jnp.inf, vals) if jnp.issubdtype(x.dtype, jnp.floating) else vals
    am = jnp.argmax(key, axis=-1)
    nan_any = jnp.isnan(vals).any(axis=-1) if jnp.issubdtype(x.dtype, jnp.floating) else None
    if nan_any is not None:
        am = jnp.where(nan_any, jnp.argmax(jnp.isnan(vals), axis=-1), am)
    out = jnp.take_along_axis(vals, am[..., None], axis=-1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat_idx), vals.shape), am[..., None], axis=-1)[..., 0]
    return out, idx.astype(jnp.int64)


@lowering("aten::adaptive_max_pool2d.default", validate=_check_nonempty("adaptive_max_pool2d", "input"))
def adaptive_max_pool2d(x, output_size):
    return _adaptive_max(x, output_size, 2)


@lowering("aten::adaptive_max_pool3d.default", validate=_check_nonempty("adaptive_max_pool3d", "input"))
def adaptive_max_pool3d(x, output_size):
    return _adaptive_max(x, output_size, 3)


# --- fractional max pooling: windows placed by the given random samples -----------------------
def _fractional_starts(sample, in_size, pool, out_size):
    """PyTorch's pseudo-random window starts along one axis for one sample u in [0, 1)."""
    alpha = (in_size - pool) / (out_size - 1) if out_size > 1 else 0.0
    i = jnp.arange(out_size - 1, dtype=sample.dtype)
    starts = ((i + sample[..., None]) * alpha).astype(jnp.int64) - \
        (sample[..., None] * alpha).astype(jnp.int64)
    last = jnp.full(sample.shape + (1,), in_size - pool, jnp.int64)
    return jnp.concatenate([starts, last], axis=-1)


def _fractional_max_pool(x, kernel_size, output_size, samples):
    """x: (N, C, *spatial) (or without N), samples: (N, C, nd) uniform numbers in [0, 1)."""
    batched = x.ndim == len(kernel_size) + 2
    if not batched:
        x = x[None]
    nd = len(kernel_size)
    if x.size == 0 or 0 in output_size:
        shape = x.shape[:2] + tuple(output_size)
        empty = jnp.zeros(shape if batched else shape[1:], x.dtype)
        return empty, empty.astype(jnp.int64)
    spatial = x.shape[2:]
    samples = jnp.broadcast_to(samples.reshape(x.shape[0], -1, nd), x.shape[:2] + (nd,))
    # Which sample drives which axis: PyTorch's 2-D kernel takes (width, height), its 3-D kernel
    # (time, height, width).
    order = [1, 0] if nd == 2 else list(range(nd))
    starts = [_fractional_starts(samples[..., order[d]].astype(jnp.float64), spatial[d],
                                 kernel_size[d], output_size[d]) for d in range(nd)]
    # Per axis: the input positions of every (output position, window offset), (N, C, out, k).
    positions = [s[..., :, None] + jnp.arange(k) for s, k in zip(starts, kernel_size)]
    grids = []
    for d in range(nd):
        shape = [x.shape[0], x.shape[1]] + [1] * (2 * nd)
        shape[2 + d], shape[2 + nd + d] = output_size[d], kernel_size[d]
        grids.append(positions[d].reshape(shape))
    flat_pos = 0
    for d in range(nd):
        flat_pos = flat_pos * spatial[d] + grids[d]
    flat_x = x.reshape(x.shape[:2] + (-1,))
    shape = x.shape[:2] + tuple(output_size) + tuple(kernel_size)
    flat_pos = jnp.broadcast_to(flat_pos, shape).reshape(x.shape[:2] + tuple(output_size) + (-1,))
    windows = jnp.take_along_axis(flat_x[..., None, :], flat_pos.reshape(x.shape[:2] + (1, -1)),
                                  axis=-1).reshape(flat_pos.shape)
    # The first maximum wins, and a NaN beats any number (PyTorch's `val > max || isnan(val)`).
    score = jnp.where(jnp.isnan(windows), jnp.inf, windows)
    best = jnp.argmax(score, axis=-1)
    values = jnp.take_along_axis(windows, best[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat_pos, best[..., None], axis=-1)[..., 0]
    if not batched:
        values, indices = values[0], indices[0]
    return values, indices.astype(jnp.int64)


def _fractional_backward(grad, x, kernel_size, indices):
    """Each output's gradient goes to the input element its window's maximum came from."""
    nd = len(kernel_size)
    if x.size == 0 or grad.size == 0:
        return jnp.zeros(x.shape, grad.dtype)
    planes = x.shape[:x.ndim - nd]
    size = int(np.prod(x.shape[x.ndim - nd:]))
    rows = int(np.prod(planes))
    out = jax.vmap(lambda i, v: jnp.zeros(size, grad.dtype).at[i].add(v))(
        indices.reshape(rows, -1), grad.reshape(rows, -1))
    return out.reshape(x.shape)


def _check_fractional(nd):
    """ATen's checks of fractional_max_pool{2,3}d, in its words and order: its meta function's
    (PyTorch's Python meta kernels word them apart), then the kernel's of the samples."""
    name = f"fractional_max_pool{nd}d"
    where = "fractional_max_pool2d()" if nd == 2 else "fractional_max_pool3d_out()"
    ints = "Ints" if nd == 2 else "three Ints"
    axes = ("height", "width") if nd == 2 else ("time", "height", "width")

    def check(x, kernel_size, output_size, samples):
        for arg, size in (("kernel_size", kernel_size), ("output_size", output_size)):
            if len(size) != nd:
                raise RuntimeError(f"{name}: {arg} must either be a single Int or tuple of {ints}")
        if x.dim() not in (nd + 1, nd + 2):
            raise RuntimeError(f"{where}: Expected {nd + 1}D or {nd + 2}D tensor, but got: "
                               f"{list(x.shape)}")
        for i in range(1, x.dim()):
            if x.shape[i] == 0:
                raise RuntimeError(f"{where}: Expected input to have non-zero size for non-batch "
                                   f"dimensions, but got{list(x.shape)} with dimension {i} being "
                                   "empty.")
        for axis, out, pool, n in zip(axes, output_size, kernel_size, x.shape[-nd:]):
            if out + pool - 1 > n:
                raise RuntimeError(f"{where}: pool {axis} {pool} too large relative to input "
                                   f"{axis} {n}")
        if samples.dtype != x.dtype:
            raise RuntimeError("Expect _random_samples to have the same dtype as input")
        if samples.dim() != 3:
            raise RuntimeError(f"Expect _random_samples to have 3 dimensions, got {samples.dim()}")
        batch, channels = (1, x.shape[0]) if x.dim() == nd + 1 else x.shape[:2]
        if samples.shape[0] < batch:
            raise RuntimeError("Expect _random_samples.size(0) no less then input batch size.")
        if samples.shape[1] != channels:
            raise RuntimeError("Expect _random_samples.size(1) equals to input channel size.")
        if samples.shape[2] != nd:
            raise RuntimeError(f"Expect _random_samples.size(2) equals to {nd}; got "
                               f"{samples.shape[2]}.")
    return check


@lowering("aten::fractional_max_pool2d.default", validate=_check_fractional(2))
def fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples)


@lowering("aten::fractional_max_pool3d.default", validate=_check_fractional(3))
def fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples)


@lowering("aten::fractional_max_pool2d_backward.default")
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _fractional_backward(grad, x, kernel_size, indices)


@lowering("aten::fractional_max_pool3d_backward.default")
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _fractional_backward(grad, x, kernel_size, indices)
