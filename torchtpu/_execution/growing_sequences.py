"""Sequences that grow by `cat`: storages with room to spare, and attention over them.

Decoding appends to a few tensors at every step: generate()'s `input_ids` ([1, L] ->
[1, L + 1]) and, with transformers' default dynamic KV cache, each layer's keys and values
(`cat([past, new], dim=-2)`, [B, H, L, D] -> [B, H, L + 1, D]).  As plain ops, each step is a
new executable for the cat and for every op reading the grown tensor: its shape is new.

Here an append onto the result of an earlier one gives the result a storage whose JAX array has
room to spare (a power-of-two capacity) and computes it with the length as an argument, so the
arrays, and the executables reading them, keep their shapes until the capacity is used up.  The
tensors themselves are PyTorch's: contiguous, with the CPU's strides and storage sizes; the
elements past a storage's size are never read.  Attention over grown keys and values
(`attention`) reads them at their capacity, masks the keys past the length, and takes the
length as an argument too: a decode step over a new length compiles nothing.

Only appends onto an appended result grow (or onto the empty 1-D tensor a dynamic cache
starts from): a cat of fresh tensors (a model's cat, the same shapes every step) stays one op.
Along an inner dim they grow only where no gradient is recorded (see _inner_append).
"""
import functools
import math
import weakref

import jax.numpy as jnp
import torch

from .._core import storage
from .._core.dtypes import to_jax_dtype
from .._core.runtime import jax_precision
from .._lowerings.attention import _attention
from . import executables, modes, strided
from .kernels import kernel_for

aten = torch.ops.aten

_appended = weakref.WeakSet()  # the buffers that appends made (plain or grown)
# The smallest capacities.  Each new capacity is a new array shape: in fused eager, every
# segment reading generate()'s input_ids compiles again (~0.7 s each here), so a flat sequence
# starts with room for 1024 elements (8 KB of token ids).  A KV cache's rows are larger (B * H
# rows of D elements per position), and only the append and attention programs read them.
_MIN_FLAT = 1024  # elements
_MIN_POSITIONS = 64  # along an inner dim


def _capacity(n, minimum):
    return max(minimum, 1 << (n - 1).bit_length())


def _append_of(tensors, dim):
    """(a, b, d) when `cat(tensors, dim)` appends b after a along dim d, a being contiguous
    from the start of its storage (so that its buffer's array holds its elements first), or
    the empty 1-D tensor that PyTorch's cat skips (a dynamic KV cache's first update)."""
    if len(tensors) != 2 or modes.get_eager_mode() is modes.CAPTURE:
        return None
    a, b = tensors
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.device == b.device and a.device.type == "tpu" and b.dim() >= 1):
        return None
    d = dim % b.dim() if -b.dim() <= dim < b.dim() else None
    if d is None or b.numel() == 0:
        return None
    if a.shape == (0,) and b.dim() > 1:
        return a, b, d
    if a.dim() != b.dim() or a.shape[:d] + a.shape[d + 1:] != b.shape[:d] + b.shape[d + 1:]:
        return None
    if a.numel() == 0 or a.storage_offset() != 0 or not a.is_contiguous():
        return None
    return a, b, d


def cat(tensors, dim=0):
    append = _append_of(tensors, dim)
    if append is not None:
        a, b, d = append
        grown = None
        if a.numel() == 0:  # a grown result from the start, so that the first append is
            if math.prod(b.shape[:d]) > 1:  # the same program as every later one
                grown = _inner_append(None, b, d)
        elif storage.buffer_of(a) in _appended:
            flat = math.prod(a.shape[:d]) == 1
            grown = _flat_append(a, b, d) if flat else _inner_append(a, b, d)
        if grown is not None:
            _appended.add(storage.buffer_of(grown))
            return grown
    out = kernel_for(aten.cat.default)(tensors, dim)
    if append is not None:
        _appended.add(storage.buffer_of(out))
    return out


def _layout(t):
    """(shape, strides, offset) of t, with the strides of size-1 dims (which address nothing)
    made the contiguous ones: a new token's [B, H, 1, D] may be a transposed view or not."""
    strides = tuple(s if n != 1 else c for n, s, c in
                    zip(t.shape, t.stride(), storage.contiguous_strides(t.shape)))
    return tuple(t.shape), strides, t.storage_offset()


def _array_of(a):
    """The written array of `a`'s buffer holding a's elements, or None: never written, still
    recorded in fused eager's trace (reading it would run the trace), or of another dtype."""
    buf = storage.buffer_of(a)
    array = buf.peek()
    if type(array) is not storage.Array:
        if array is None or modes.recorded():
            return None  # (a plain op instead, which does not run the trace)
        array = buf.value()  # an op of strict eager still compiling: wait for it
    if array.dtype != to_jax_dtype(a.dtype):
        return None  # bytes of another type (a view of other elements)
    return array


def _flat_append(a, b, d):
    """Appending b's elements after a's in memory: b is written at a dynamic offset."""
    array = _array_of(a)
    if array is None:
        return None
    n = a.numel() + b.numel()
    if array.ndim != 1 or array.size < n:
        array = executables.capacity(_capacity(n, _MIN_FLAT))(array)
    shape = list(a.shape)
    shape[d] += b.shape[d]
    out = storage.wrap(array, shape, storage.contiguous_strides(shape), a.dtype,
                       storage.buffer_of(a).index, n * a.element_size())
    out.view(-1)[a.numel():].view(b.shape).copy_(b)
    return out


def _inner_append(a, b, d):
    """Appending along an inner dim (a KV cache's length; `a` None: onto nothing): every row
    of a moves, so the whole result is one program with a's length as an argument, at a's
    capacity or twice it.  Only where no gradient is recorded (decoding): a training step's
    cat of the same shapes every step gains nothing from room to spare.  In fused eager,
    reading b runs the trace, as strict eager would; `a` must already be written (a cache's
    past), so that a model's cat of a cat stays in its segment."""
    if b.requires_grad or (a is not None and a.requires_grad):
        return None
    rows, row, added = math.prod(b.shape[:d]), math.prod(b.shape[d + 1:]), b.shape[d]
    length, array = 0, None
    if a is not None:
        array = _array_of(a)
        if array is None:
            return None
        length = a.shape[d]
    size = 0 if array is None else array.size
    if size < rows * (length + added) * row:
        size = rows * _capacity(length + added, _MIN_POSITIONS) * row
    b_buf = storage.buffer_of(b)
    b_array = b_buf.value()
    program = _inner_append_program(
        rows, added, row, size, None if array is None else tuple(array.shape),
        jnp.dtype(to_jax_dtype(b.dtype)).name, tuple(b_array.shape), str(b_array.dtype),
        *_layout(b))
    args = (b_array,) if array is None else (b_array, array, length)
    shape = list(b.shape)
    shape[d] += length
    return storage.wrap(program(*args), shape, storage.contiguous_strides(shape), b.dtype,
                        b_buf.index, math.prod(shape) * b.element_size())


@functools.lru_cache(maxsize=64)
def _inner_append_program(rows, added, row, size, a_shape, dtype, b_array_shape, b_array_dtype,
                          b_shape, b_stride, b_offset):
    jdtype = jnp.dtype(dtype)

    def grow(b_array, a=None, length=0):
        b = strided.read(b_array, b_shape, b_stride, b_offset, jdtype).reshape(-1)
        i = jnp.arange(size)
        per_row = (length + added) * row
        r, rest = i // per_row, i % per_row
        at, col = rest // row, rest % row
        out = b[jnp.clip(r * (added * row) + (at - length) * row + col, 0, b.size - 1)]
        if a is not None:
            a = a.reshape(-1)
            from_a = a[jnp.clip(r * (length * row) + at * row + col, 0, a.size - 1)]
            out = jnp.where(at < length, from_a, out)
        return jnp.where(i < rows * per_row, out, jnp.zeros((), jdtype))

    key = ("inner_append", rows, added, row, size, a_shape, dtype, b_array_shape, b_array_dtype,
           b_shape, b_stride, b_offset)
    return executables.Executable(grow, executables.stable(key), "inner_append")


# --- attention over grown keys and values -------------------------------------------------

def _grown_rows(t):
    """The 1-D array of a grown tensor's buffer (its elements first, room to spare after)."""
    if not (t.is_contiguous() and t.storage_offset() == 0):
        return None
    if storage.buffer_of(t) not in _appended:
        return None
    array = _array_of(t)
    return array if array is not None and array.ndim == 1 else None


def attention(q, k, v, attn_mask, is_causal, scale):
    """softmax(q kᵀ) v as `_scaled_dot_product_fused_attention_overrideable` computes it, for
    keys and values grown by appends, in a program whose key length is an argument; None
    where that does not apply (a mask, a gradient to record, keys of another kind)."""
    if attn_mask is not None or modes.get_eager_mode() is modes.CAPTURE:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    k_array, v_array = _grown_rows(k), _grown_rows(v)
    if k_array is None or v_array is None:
        return None
    q_buf = storage.buffer_of(q)
    q_array = q_buf.value()
    rows = math.prod(k.shape[:-2])
    program = _attention_program(
        tuple(q_array.shape), str(q_array.dtype), *_layout(q),
        rows, k.shape[-3], k.shape[-1], v.shape[-1], k_array.size, v_array.size, is_causal,
        scale, jnp.dtype(to_jax_dtype(q.dtype)).name, str(jax_precision()))
    out = program(q_array, k_array, v_array, k.shape[-2])
    shape = (*q.shape[:-1], v.shape[-1])
    return storage.wrap(out, shape, storage.contiguous_strides(shape), q.dtype, q_buf.index)


@functools.lru_cache(maxsize=64)
def _attention_program(q_array_shape, q_array_dtype, q_shape, q_stride, q_offset, rows, heads,
                       k_dim, v_dim, k_size, v_size, is_causal, scale, dtype, precision):
    jdtype = jnp.dtype(dtype)
    positions = min(k_size // (rows * k_dim), v_size // (rows * v_dim))
    batch = q_shape[:-3]

    def attend(q_array, k_flat, v_flat, length):
        q = strided.read(q_array, q_shape, q_stride, q_offset, jdtype)
        at = jnp.arange(positions)
        valid = at < length

        def padded(flat, dim):  # [rows, positions, dim] of a [rows, length, dim] layout
            idx = ((jnp.arange(rows)[:, None] * length + at) * dim)[..., None] + jnp.arange(dim)
            x = flat[jnp.clip(idx, 0, flat.size - 1)]
            x = jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))  # (no inf/nan past it)
            return x.reshape(*batch, heads, positions, dim)

        out, _ = _attention(q, padded(k_flat, k_dim), padded(v_flat, v_dim), valid, is_causal,
                            scale)
        return out.astype(jdtype)

    # (`precision`: _attention reads the matmul precision while tracing)
    key = ("attention", q_array_shape, q_array_dtype, q_shape, q_stride, q_offset, rows, heads,
           k_dim, v_dim, k_size, v_size, is_causal, scale, dtype, precision)
    return executables.Executable(attend, executables.stable(key), "attention")


def kernels():
    """The PrivateUse1 kernels of this module (see dispatch.py)."""
    return {aten.cat.default: cat}
