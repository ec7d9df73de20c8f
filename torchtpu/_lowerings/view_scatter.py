"""The functional forms of writing through a view (what functionalization and decompositions
emit for `x[1:].zero_()`, `x.select(0, i).copy_(y)`, `x.diagonal().fill_(v)`...): a copy of
`input` with `src` written where the view would be."""
import jax.numpy as jnp

from .._core import storage
from .._core.registry import lowering


def _index(ndim, dim, key):
    return (slice(None),) * dim + (key,) + (slice(None),) * (ndim - dim - 1)


@lowering("aten::slice_scatter")
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim %= max(x.ndim, 1)
    start, end, step = slice(start, end, step).indices(x.shape[dim])
    return x.at[_index(x.ndim, dim, slice(start, end, step))].set(src.astype(x.dtype))


@lowering("aten::select_scatter")
def select_scatter(x, src, dim, index):
    dim %= x.ndim
    return x.at[_index(x.ndim, dim, index % x.shape[dim])].set(src.astype(x.dtype))


@lowering("aten::diagonal_scatter")
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = dim1 % x.ndim, dim2 % x.ndim
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    rows, cols = moved.shape[-2], moved.shape[-1]
    length = max(0, min(rows, cols - offset) if offset >= 0 else min(rows + offset, cols))
    i = jnp.arange(length)
    r, c = (i, i + offset) if offset >= 0 else (i - offset, i)
    moved = moved.at[..., r, c].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


def _check_as_strided_scatter(x, src, size, stride, storage_offset=None):
    offset = storage_offset or 0
    needed = storage.storage_numel(size, stride, offset)
    if needed > x.numel():
        itemsize = x.element_size()
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset}, and "
            f"itemsize {itemsize} requiring a storage size of {needed * itemsize} are out of bounds "
            f"for storage of size {x.numel() * itemsize}")


@lowering("aten::as_strided_scatter", validate=_check_as_strided_scatter)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    # The view is taken of a contiguous copy of `input` (as PyTorch's kernel does).
    flat = x.reshape(-1)
    positions = jnp.full(tuple(size), storage_offset or 0)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        positions = positions + (jnp.arange(n) * s).reshape(shape)
    return flat.at[positions.reshape(-1)].set(src.astype(x.dtype).reshape(-1)).reshape(x.shape)
