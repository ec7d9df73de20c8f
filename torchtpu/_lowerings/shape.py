"""Ops that build new tensors from pieces: cat, stack, flip, roll, tril/triu, pad, repeat..."""
import jax
import jax.numpy as jnp

from .._core.registry import Promote, lowering


def _check_cat(tensors, dim=0):
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")


@lowering("aten::cat.default", promote=Promote.RESULT, validate=_check_cat)
def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    return jnp.concatenate(tensors, axis=dim)


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


@lowering("aten::stack.default", promote=Promote.RESULT)
def stack(tensors, dim=0):
    return jnp.stack(tensors, axis=dim)


@lowering("aten::flip.default")
def flip(x, dims):
    return jnp.flip(x, axis=tuple(dims)) if x.ndim else x


@lowering("aten::roll.default")
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


@lowering("aten::sort.default")
def sort(x, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=dim), idx


@lowering("aten::sort.stable")
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
