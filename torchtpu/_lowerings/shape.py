"""Ops that build new tensors from pieces: cat, stack, flip, roll, tril/triu, pad, repeat..."""
import jax
import jax.numpy as jnp
from torch._prims_common import canonicalize_dim

from .._core.registry import Promote, lowering


def _legacy_empty(t):
    # PyTorch's cat skips 1-D empty tensors whatever the other tensors' shapes.
    return t.ndim == 1 and t.shape[0] == 0


def _check_cat(tensors, dim=0):
    shaped = [t for t in tensors if not _legacy_empty(t)]
    if shaped:  # the CPU wraps dim (by the first such tensor) before its other checks
        canonicalize_dim(shaped[0].dim(), dim)
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")


@lowering("aten::cat.default", promote=Promote.RESULT, validate=_check_cat, out_cast_error=TypeError)
def cat(tensors, dim=0):
    shaped = [t for t in tensors if not _legacy_empty(t)]
    return jnp.concatenate(shaped, axis=dim) if shaped else tensors[0]


def _check_narrow_copy(x, dim, start, length):
    # The CPU kernel checks a too-large dim itself (a RuntimeError); the meta kernel would
    # raise IndexError, as it does for a too-small one.
    if dim >= x.dim() > 0:
        raise RuntimeError("Expected dim < static_cast<int64_t>(self_sizes.size()) to be true, but "
                           "got false.  (Could this error message be improved?  If so, please report "
                           "an enhancement request to PyTorch.)")


@lowering("aten::narrow_copy.default", validate=_check_narrow_copy)
def narrow_copy(x, dim, start, length):
    start = start % x.shape[dim] if start < 0 else start
    return jax.lax.slice_in_dim(x, start, start + length, axis=dim)


def _check_stack(tensors, dim=0):
    # The CPU compares the shapes before it wraps dim.
    for i, t in enumerate(tensors):
        if t.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(tensors[0].shape)} at entry 0 and {list(t.shape)} at entry {i}")


@lowering("aten::stack.default", promote=Promote.RESULT, validate=_check_stack)
def stack(tensors, dim=0):
    return jnp.stack(tensors, axis=dim)


@lowering("aten::flip.default")
def flip(x, dims):
    return jnp.flip(x, axis=tuple(dims)) if x.ndim else x


def _check_roll(x, shifts, dims=()):
    # The CPU kernel's checks, before any dim is wrapped (the meta kernel wraps first).
    if not shifts:
        raise RuntimeError("`shifts` required")
    if dims and len(shifts) != len(dims) or not dims and len(shifts) != 1:
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")


@lowering("aten::roll.default", validate=_check_roll)
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts).reshape(x.shape)
    return jnp.roll(x, shifts, axis=tuple(dims))


@lowering("aten::tril.default")
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowering("aten::triu.default")
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowering("aten::repeat.default")
def repeat(x, repeats):
    x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@lowering("aten::constant_pad_nd.default")
def constant_pad_nd(x, pad, value=0):
    widths = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        widths[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    neg = any(lo < 0 or hi < 0 for lo, hi in widths)
    if not neg:
        return jnp.pad(x, widths, constant_values=value)
    from jax import lax
    return lax.pad(x, jnp.asarray(value, x.dtype), [(lo, hi, 0) for lo, hi in widths])


def _check_sort(x, dim=-1, *rest):
    canonicalize_dim(x.dim(), dim)  # a 0-dim tensor takes dims -1 and 0, as the CPU


@lowering("aten::sort.default", validate=_check_sort)
def sort(x, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=dim), idx


@lowering("aten::sort.stable", validate=lambda x, stable=None, dim=-1, *rest: _check_sort(x, dim))
def sort_stable(x, stable=None, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=dim), idx


@lowering("aten::topk.default")
def topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = jnp.argsort(x, axis=dim, stable=True, descending=largest)
    idx = jnp.take(idx, jnp.arange(k), axis=dim)
    return jnp.take_along_axis(x, idx, axis=dim), idx
