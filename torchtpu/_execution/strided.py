"""Reading and writing a tensor through its sizes/strides/offset over its storage's JAX array.

These run at trace time inside the per-op executables, so the layout logic costs nothing per
call once compiled.  Fast paths: the whole storage (a reshape), a view at a known offset that
is a strided slice of the storage array's own dims (a slice, or an update of one: `_on_dims`),
a contiguous range (a slice), a strided pattern that is a sub-lattice of a dense layout
(reshape + slice + transpose); anything else (overlapping windows) becomes a gather with
constant indices.

A storage's array has the shape of the tensor that made it (in memory order), so most views
(a chunk's half of each row, a head's columns, a row) are slices of its dims.  Reading them so
matters on TPU, where an array's memory is tiled by its two minor dims: flattening it to read
a range is a relayout copy of the whole storage (the Llama step on v5e moved 3.2x JAX's bytes,
most in such flattening, padding and slicing); on the CPU a flattening is free.

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


def _on_dims(array_shape, shape, stride, offset):
    """The view as a strided slice of an array of `array_shape` (its elements in memory
    order), when it is one: (starts, limits, steps, dims), `dims[d]` the array dim that view dim
    d walks (None: a size-1 or broadcast dim); else None.  The offset must be known: it gives
    each array dim's start (its digits in the array's strides): `_plan` checks it is, and that
    the array has elements."""
    astrides = contiguous_strides(array_shape)
    starts = []
    rest = offset
    for s in astrides:
        q, rest = divmod(rest, s)
        starts.append(q)
    if starts[0] >= array_shape[0]:
        return None
    limits = [b + 1 for b in starts]
    steps = [1] * len(array_shape)
    dims = []
    for n, s in zip(shape, stride):
        if n == 1 or s == 0:
            dims.append(None)
            continue
        # The outermost dim whose stride divides the view's: the view steps along it.
        j = next((j for j, (m, t) in enumerate(zip(array_shape, astrides))
                  if m > 1 and t <= s and s % t == 0), None)
        if j is None or j in dims:
            return None
        step = s // astrides[j]
        last = starts[j] + (n - 1) * step
        if last >= array_shape[j]:  # the view crosses into the next of the outer dim
            return None
        limits[j], steps[j] = last + 1, step
        dims.append(j)
    return starts, limits, steps, dims


def _refined(array_shape, shape, stride):
    """The array's shape with its dims split where the view's strides fall inside them (an
    array [1024, 1408] read as [8, 128, 704] views of strides (180224, 1408, 1) is an
    [8, 128, 1408] array), so that each view dim walks a dim of its own; None if the strides
    do not nest (each a multiple of the next).  Splitting a major dim is free on every
    platform; a minor one is what the view's layout asks for anyway."""
    total = math.prod(array_shape)
    bounds = set(contiguous_strides(array_shape)) | {total}
    bounds |= {s for n, s in zip(shape, stride) if n > 1 and 0 < s < total}
    chain = sorted(bounds, reverse=True)
    if chain[-1] != 1 or any(a % b for a, b in zip(chain, chain[1:])):
        return None
    return tuple(a // b for a, b in zip(chain, chain[1:]))


def _plan(array_shape, shape, stride, offset):
    """(the shape to see the array as, _on_dims's plan) for a view that is a strided slice of
    the array's dims once split (_refined), or None."""
    if not _static(offset) or not array_shape or 0 in array_shape:
        return None
    plan = _on_dims(array_shape, shape, stride, offset)
    if plan is not None:
        return tuple(array_shape), plan
    refined = _refined(array_shape, shape, stride)
    if not refined or refined == tuple(array_shape):  # () for a one-element array
        return None
    plan = _on_dims(refined, shape, stride, offset)
    return None if plan is None else (refined, plan)


def _read_on_dims(array, shape, plan):
    starts, limits, steps, dims = plan
    block = lax.slice(array, starts, limits, steps)
    used = sorted(j for j in dims if j is not None)
    block = block.reshape([block.shape[j] for j in used])
    live = [j for j in dims if j is not None]
    block = jnp.transpose(block, [used.index(j) for j in live])
    kept = [n if j is not None else 1 for n, j in zip(shape, dims)]
    return jnp.broadcast_to(block.reshape(kept), shape)


def _write_on_dims(array, shape, plan, value):
    starts, limits, steps, dims = plan
    used = sorted(j for j in dims if j is not None)
    live = [j for j in dims if j is not None]
    value = value.reshape([n for n, j in zip(shape, dims) if j is not None])
    value = jnp.transpose(value, [live.index(j) for j in used])
    block = [limits[j] - starts[j] for j in range(array.ndim)]
    return lax.dynamic_update_slice(array, value.reshape(block), starts)


def read(array, shape, stride, offset, dtype):
    shape, stride = tuple(shape), tuple(stride)
    if array.dtype == dtype:
        if is_whole(array.shape, shape, stride, offset):
            return array
        found = _plan(array.shape, shape, stride, offset)
        if found is not None:
            return _read_on_dims(array.reshape(found[0]), shape, found[1])
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
    if array.dtype == dtype:
        found = _plan(array.shape, shape, stride, offset)
        # (a view with steps, or one that reads an element twice, is written below)
        if found is not None and set(found[1][2]) == {1} and all(
                s != 0 for m, s in zip(shape, stride) if m > 1):
            return _write_on_dims(array.reshape(found[0]), shape, found[1], value).reshape(array.shape)
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
