"""Reading and writing a tensor through its sizes/strides/offset over its storage's JAX array.

These run at trace time inside the per-op executables, so the layout logic costs nothing per
call once compiled.  Fast paths: the whole storage (a reshape), a contiguous range (a slice),
a strided pattern that is a sub-lattice of a dense layout (reshape + slice + transpose);
anything else (overlapping windows) becomes a gather with constant indices.

An offset is a Python int or, in op executables (every nonzero offset is an argument there, so
that views at other offsets share the program), a traced integer: slices become dynamic ones.
"""
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.dtypes import cast
from .._core.storage import contiguous_strides


def _as_dtype(array, dtype):
    if array.dtype == dtype:
        return array
    # XLA cannot bitcast bools either: they are the bytes 0 and 1.
    if array.dtype == jnp.bool_:
        return _as_dtype(array.astype(jnp.uint8), dtype)
    if dtype == jnp.bool_:
        return _as_dtype(array, jnp.uint8) != 0
    # XLA cannot bitcast complex values: go through their (real, imag) component pairs.
    if jnp.issubdtype(array.dtype, jnp.complexfloating):
        return _as_dtype(jnp.stack([array.real, array.imag], -1).reshape(-1), dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = _as_dtype(array, jnp.finfo(dtype).dtype).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    src, dst = jnp.dtype(array.dtype).itemsize, jnp.dtype(dtype).itemsize
    flat = array.reshape(-1)
    if src == dst:
        return lax.bitcast_convert_type(flat, dtype)
    if src > dst:  # one wide element -> several narrow ones
        return lax.bitcast_convert_type(flat, dtype).reshape(-1)
    return lax.bitcast_convert_type(flat.reshape(-1, dst // src), dtype)


# Writing back into an array of another dtype is the same reinterpretation the other way.
_from_dtype = _as_dtype


def _static(offset):
    return isinstance(offset, (int, np.integer))


def is_whole(array_shape, shape, stride, offset):
    return (_static(offset) and offset == 0 and tuple(array_shape) == tuple(shape)
            and tuple(stride) == contiguous_strides(shape))


def _gather_indices(shape, stride, offset):
    idx = np.full((), offset if _static(offset) else 0, dtype=np.int64)
    for n, s in zip(shape, stride):
        idx = idx[..., None] + np.arange(n, dtype=np.int64) * s
    return idx if _static(offset) else idx + offset


def _slice(flat, offset, n):
    """flat[offset:offset + n] (the view lies within the storage: no clamping happens)."""
    if _static(offset):
        return lax.slice(flat, (offset,), (offset + n,))
    return lax.dynamic_slice(flat, (offset,), (n,))


def read(array, shape, stride, offset, dtype):
    shape, stride = tuple(shape), tuple(stride)
    if array.dtype == dtype and is_whole(array.shape, shape, stride, offset):
        return array
    flat = _as_dtype(array, dtype).reshape(-1)
    n = math.prod(shape)
    if n == 0:
        return jnp.zeros(shape, dtype)
    if stride == contiguous_strides(shape):
        return _slice(flat, offset, n).reshape(shape)
    return _read_strided(flat, shape, stride, offset)


def _lattice(shape, stride, live):
    """The dims `live` by stride (descending), their sizes and strides, and whether they
    index a sub-lattice of a dense layout (no element twice; its block: `_block_shape`)."""
    order = sorted(live, key=lambda d: -stride[d])
    sizes = [shape[d] for d in order]
    strides = [stride[d] for d in order]
    lattice = bool(order) and strides[-1] > 0 and all(
        strides[k] % strides[k + 1] == 0 and strides[k] >= strides[k + 1] * sizes[k + 1]
        for k in range(len(order) - 1))
    return order, sizes, strides, lattice


def _block_shape(sizes, strides):
    return [sizes[0]] + [strides[k] // strides[k + 1] for k in range(len(sizes) - 1)] + [strides[-1]]


def _read_strided(flat, shape, stride, offset):
    live = [d for d, (n, s) in enumerate(zip(shape, stride)) if n > 1 and s != 0]
    order, sizes, strides, lattice = _lattice(shape, stride, live)
    if not lattice:
        if not order:  # every element is the same storage element
            value = _slice(flat, offset, 1).reshape((1,) * len(shape))
            return jnp.broadcast_to(value, shape)
        return flat[_gather_indices(shape, stride, offset)]
    span = sizes[0] * strides[0]
    if _static(offset):
        if offset + span > flat.shape[0]:
            flat = jnp.pad(flat, (0, offset + span - flat.shape[0]))
        block = lax.slice(flat, (offset,), (offset + span,))
    else:  # the elements the view reaches lie in the storage; the rest of the span is padding
        reach = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
        block = jnp.pad(_slice(flat, offset, reach), (0, span - reach))
    block_shape = _block_shape(sizes, strides)
    block = block.reshape(block_shape)
    block = lax.slice(block, [0] * len(block_shape), sizes + [1]).reshape(sizes)
    # `block` has dims in `order`; put them back in the tensor's order, then restore the
    # size-1 and broadcast (stride 0) dims.
    block = jnp.transpose(block, np.argsort(order))
    kept_shape = [shape[d] if d in live else 1 for d in range(len(shape))]
    return jnp.broadcast_to(block.reshape(kept_shape), shape)


def write(array, shape, stride, offset, dtype, value):
    """`array` with the tensor's elements replaced by `value` (already of the tensor's shape)."""
    shape, stride = tuple(shape), tuple(stride)
    value = cast(value, dtype)
    if is_whole(array.shape, shape, stride, offset) and array.dtype == dtype:
        return value
    n = math.prod(shape)
    if n == 0:
        return array
    flat = _as_dtype(array, dtype).reshape(-1)
    if stride == contiguous_strides(shape):
        flat = lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
    else:
        flat = _write_strided(flat, shape, stride, offset, value)
    return _from_dtype(flat, array.dtype).reshape(array.shape)


def _write_strided(flat, shape, stride, offset, value):
    """`flat` with the view's elements replaced by `value`.  A sub-lattice of a dense layout
    (e.g. half of each row: RoPE's halves, a chunk's gradient) is an update of the block of
    that layout around it, as `_read_strided` reads it; a scatter with an index per element
    (what any other view gets) cost XLA a scatter per write, 16 in a Llama step's program."""
    live = [d for d, n in enumerate(shape) if n > 1]  # (a stride-0 one is no lattice)
    order, sizes, strides, lattice = _lattice(shape, stride, live)
    if not lattice:
        return flat.at[_gather_indices(shape, stride, offset).reshape(-1)].set(value.reshape(-1))
    span = sizes[0] * strides[0]
    # The elements the view reaches lie in the storage; the block around them may not.
    reach = 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
    block_shape = _block_shape(sizes, strides)
    block = jnp.pad(_slice(flat, offset, reach), (0, span - reach)).reshape(block_shape)
    value = jnp.transpose(value.reshape([shape[d] for d in live]), [live.index(d) for d in order])
    block = lax.dynamic_update_slice(block, value.reshape(sizes + [1]), (0,) * len(block_shape))
    return lax.dynamic_update_slice(flat, block.reshape(-1)[:reach], (offset,))


def store(value, stride):
    """The storage-ordered array for a fresh output of the given strides (dense, any order)."""
    shape = value.shape
    if tuple(stride) == contiguous_strides(shape) or value.ndim < 2:
        return value
    order = sorted(range(value.ndim), key=lambda d: (-stride[d], -shape[d]))
    return jnp.transpose(value, order)
