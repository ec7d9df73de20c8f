"""Advanced indexing (`x[idx]`, `x[mask]`, `x[mask] = v`, `index_put_`).

Index tensors may live on the CPU, as CUDA accepts them for these ops (and only these:
`index_select`, `gather` & co. refuse another device there too): they are copied to the
indexed tensor's device first.  A boolean mask's nonzero() positions decide the result's shape,
so a device mask synchronises (as on CUDA); then the integer-index lowering runs.

Small index ops whose inputs are ready run on the host, by PyTorch's CPU kernel, until their
pattern has cost as much host time as compiling it would (`_host_run`): each pattern (the
shapes of the indexed tensor, the index tensors and the values) is a program of its own,
which XLA compiles in ~80-200 ms for a gather of a few elements, against ~1 ms for the round
trip.  Code that indexes with ever new patterns (interactive work, PyTorch's advanced-indexing
tests: ~100 patterns on three tensors) compiles only those it repeats often; a pattern whose
inputs are still being computed (a training step's) compiles at once, as every op does."""
import math
import os
import time
import warnings

import jax
import torch

from .._core import metrics, storage
from . import debug, modes
from .kernels import kernel_for
from .transfer import to_host

aten = torch.ops.aten


def _check_masks(x, indices):
    """PyTorch's checks of mask indices: each mask's shape equals the dims it covers (nonzero()
    alone would select rows of a mismatched mask), and uint8 masks are deprecated."""
    d = 0
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            if i.dtype == torch.uint8:
                warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a "
                              "dtype torch.bool instead.")
            for j, n in enumerate(i.shape):
                if d + j >= x.dim() or x.shape[d + j] != n:
                    raise IndexError(
                        f"The shape of the mask {list(i.shape)} at index {j} does not match the "
                        f"shape of the indexed tensor {list(x.shape)} at index {d + j}")
            d += i.dim()
        else:
            d += 1


def _masked_fill_mask(x, indices, values):
    """ATen's canDispatchToMaskedFill: an index_put_ without accumulate whose one index is a
    bool or uint8 mask on x's device and whose value is one element on the CPU runs as
    masked_fill_ (which refuses a uint8 mask). The mask, broadcastable to x, or None."""
    if values.numel() != 1 or values.device.type != "cpu":
        return None
    mask, dims = None, 0
    for i in indices:
        if i is None:
            dims += 1
            continue
        if i.dtype not in (torch.bool, torch.uint8) or i.device != x.device or mask is not None:
            return None
        mask = i
        for j, n in enumerate(i.shape):
            if dims + j >= x.dim() or x.shape[dims + j] != n:
                raise IndexError(f"The shape of the mask {list(i.shape)} at index {j} does not "
                                 f"match the shape of the indexed tensor {list(x.shape)} at index "
                                 f"{dims + j}")
        dims += i.dim()
    if mask is None:
        return None
    return mask.reshape(mask.shape + (1,) * (x.dim() - dims))


def _integer_indices(x, indices):
    _check_masks(x, indices)
    out = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            out.extend(i.nonzero().unbind(1))
        else:
            out.append(i)
    # A 0-dim CPU index is an ordinary traced operand already; the rest are copied over.
    return [i.to(x.device) if i is not None and i.device != x.device and i.dim() else i for i in out]


# Patterns whose tensors all hold at most this many elements may run on the host.
_HOST_MAX_ELEMENTS = 1 << 14
# Host time a pattern may spend before it compiles: about what XLA:CPU takes to build one small
# index program (trace, lower and compile).  Renting until the rent equals the price is the
# classic way to lose at most 2x to the best choice made knowing the future.
_HOST_SECONDS = float(os.environ.get("TORCHTPU_INDEX_HOST_SECONDS", "0.1"))
_spent = {}  # pattern -> host seconds spent on it (cleared when it grows past _MAX_PATTERNS)
_MAX_PATTERNS = 4096
# The dtypes PyTorch's CPU index kernels take.
_HOST_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128}


def _ready(t):
    a = storage.buffer_of(t).peek()
    return a is None or (isinstance(a, jax.Array) and a.is_ready())


def _host_run(op, x, indices, values=None, rest=(), inplace=False):
    """`op` run on the host, or None where it should compile: in fused eager or a capture,
    with a tensor on another device, large or of a dtype the CPU lacks, or an in-place target
    that does not cover its storage (its new value replaces the storage's array).  A pattern
    also compiles, and stays compiled, once its host runs have cost _HOST_SECONDS or at a call
    where one of its inputs is still being computed: waiting for it would stall the device's
    queue, so a training step's index ops compile at its first run, as every op does."""
    if _HOST_SECONDS <= 0 or modes.recorded():
        return None
    tensors = [x] + [i for i in indices if i is not None]
    if values is not None:
        tensors.append(values)
    pattern = [op, inplace]
    for t in tensors:
        if t.device != x.device or t.numel() > _HOST_MAX_ELEMENTS or t.dtype not in _HOST_DTYPES:
            return None
        pattern += (t.dtype, t.shape, t.stride())
    if inplace and (not storage.covers_storage(x) or storage.shares_storage(x, tensors[1:])):
        return None
    pattern = tuple(pattern) + tuple(i is None for i in indices)
    spent = _spent.get(pattern, 0.0)
    if len(_spent) >= _MAX_PATTERNS:
        _spent.clear()
    if spent >= _HOST_SECONDS or not all(_ready(t) for t in tensors):
        _spent[pattern] = math.inf  # compiled now: it stays on the device
        return None
    t0 = time.perf_counter()
    host_indices = [None if i is None else to_host(i) for i in indices]
    host_values = () if values is None else (to_host(values),)
    host = to_host(x)
    try:
        out = op(host, host_indices, *host_values, *rest)
    except Exception as e:  # PyTorch's own error, naming the op and the line as strict's do
        raise debug.attributed(e, op, debug.describe_inputs(tensors), debug.user_frame(3)) from e
    if inplace:
        x.copy_(host)  # (x covers its storage: the transfer's array becomes the storage's)
        out = x
    else:
        out = out.to(x.device)
    _spent[pattern] = spent + time.perf_counter() - t0
    metrics.counters["index_ops_on_host"] += 1
    return out


def kernels():
    """The PrivateUse1 kernels of this module (see dispatch.py)."""
    index, index_put, index_put_, impl = (
        kernel_for(aten.index.Tensor), kernel_for(aten.index_put.default),
        kernel_for(aten.index_put_.default), kernel_for(aten._index_put_impl_.default))

    def index_kernel(x, indices):
        indices = _integer_indices(x, indices)
        out = _host_run(aten.index.Tensor, x, indices)
        return index(x, indices) if out is None else out

    def index_put_kernel(x, indices, values, accumulate=False):
        if not accumulate and (mask := _masked_fill_mask(x, indices, values)) is not None:
            return x.clone().masked_fill_(mask, values.item())
        indices = _integer_indices(x, indices)
        out = _host_run(aten.index_put.default, x, indices, values, (accumulate,))
        return index_put(x, indices, values, accumulate) if out is None else out

    def index_put__kernel(x, indices, values, accumulate=False):
        if not accumulate and (mask := _masked_fill_mask(x, indices, values)) is not None:
            return x.masked_fill_(mask, values.item())
        indices = _integer_indices(x, indices)
        out = _host_run(aten.index_put_.default, x, indices, values, (accumulate,), inplace=True)
        return index_put_(x, indices, values, accumulate) if out is None else out

    def index_put_impl_kernel(x, indices, values, accumulate=False, unsafe=False):
        if not accumulate and (mask := _masked_fill_mask(x, indices, values)) is not None:
            return x.masked_fill_(mask, values.item())
        indices = _integer_indices(x, indices)
        out = _host_run(aten._index_put_impl_.default, x, indices, values, (accumulate, unsafe),
                        inplace=True)
        return impl(x, indices, values, accumulate, unsafe) if out is None else out

    return {aten.index.Tensor: index_kernel, aten.index_put.default: index_put_kernel,
            aten.index_put_.default: index_put__kernel,
            aten._index_put_impl_.default: index_put_impl_kernel}
