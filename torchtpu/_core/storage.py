"""Genuine PrivateUse1 tensors whose storage owns a JAX array.

A storage is a real `torch.UntypedStorage` of the right byte size whose data pointer is only an
identity (never dereferenced). Its Python object carries a `DeviceBuffer` holding the JAX array
of the storage's elements in memory order; PyTorch keeps that object alive exactly as long as
the storage, so device memory is freed with the last tensor that uses it.
"""
import itertools
import math
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import metrics, runtime
from .dtypes import to_jax_dtype
from .metrics import FlushReason

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle
_create_empty = torch._C._acc.create_empty_tensor
_storage_from_pointer = torch._C._construct_storage_from_data_pointer

# Fake addresses, spaced by each storage's size so that no two storages ever appear to overlap.
_next_address = [1 << 62]
_address_lock = threading.Lock()


def _reserve_address(nbytes):
    if nbytes <= _SMALL:
        # A slot of its own, from a counter: no lock (next() on it is atomic), 0.05 us
        # against 0.3 for the locked bump below, on every new storage.
        return next(_small_slots)
    with _address_lock:
        address = _next_address[0]
        _next_address[0] += (nbytes + 127) & ~63
    return address


# Storages up to 64 KiB take fixed slots of 128 KiB from 2**56 up (3 * 10**13 of them before
# the range of the larger ones, which bump an address from 2**62 up): the ranges never meet.
_SMALL = 1 << 16
_small_slots = itertools.count(1 << 56, 1 << 17)


class MemoryStats:
    __slots__ = ("allocated", "peak", "num_alloc", "num_free", "live_at_reset")

    def __init__(self):
        self.allocated = self.peak = self.num_alloc = self.num_free = 0
        self.live_at_reset = 0  # storages alive when the counts were last zeroed


_stats = {}


def memory_stats_for(index):
    s = _stats.get(index)
    if s is None:
        s = _stats[index] = MemoryStats()
    return s


class Pending:
    """The value of a storage that a deferred (fused) op will produce when its segment runs;
    reading it runs the segment (`trace.flush(reason)`)."""

    __slots__ = ("trace", "slot", "owner", "result")

    def __init__(self, trace, slot):
        self.trace = trace
        self.slot = slot
        self.owner = None  # weakref to the DeviceBuffer whose value this is
        # The array it became once its op ran (None before), for a holder its owner no longer
        # hands it to: a capture that restores the storages it wrote (_execution/tpu_graphs.py)
        self.result = None

    def holder(self):
        """The storage (DeviceBuffer) whose value this still is, or None: freed, or given
        another value since."""
        owner = self.owner() if self.owner is not None else None
        return owner if owner is not None and owner._array is self else None

    def settle(self, value):
        """Its op ran (or will never run: `value` a `Failed`): the storage still waiting for
        it gets `value`."""
        owner = self.holder()
        if owner is not None:
            owner._array = value

    def fail(self, error):
        """Its op will never run: reading its storage raises `error`."""
        self.settle(Failed(error))


class Failed:
    """The value of a storage whose deferred op never ran because an earlier op failed."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


# The concrete JAX array type, named without creating an array: importing torchtpu must not
# start the XLA backends, or `jax.distributed.initialize` (multi-process jobs) could not run.
from jax._src.array import ArrayImpl as Array  # noqa: E402

class DeviceBuffer:
    """The device memory behind one storage: a JAX array (None until first written, or
    `Pending` while a deferred op will produce it)."""

    __slots__ = ("_array", "nbytes", "index", "dtype", "from_bytes", "shape", "made_as",
                 "__weakref__")

    def __init__(self, array, nbytes, index, dtype):
        self.from_bytes = False  # raw bytes from torch.load, not yet given their dtype
        self.shape = None  # (unwritten storages) the shape their zeros take, where one is known
        # (unwritten storages) the shape of the contiguous tensor `empty` made it for: zeros a
        # graph makes inside its program take it (recording._settle_zeros), so its views are
        # slices of their dims (strided.py)
        self.made_as = None
        self._array = array
        if type(array) is Pending:
            array.owner = weakref.ref(self)
        self.nbytes = nbytes
        self.index = index
        self.dtype = dtype  # jax dtype of `array`'s elements
        s = memory_stats_for(index)
        s.allocated += nbytes
        s.num_alloc += 1
        if s.allocated > s.peak:
            s.peak = s.allocated

    def __del__(self):
        s = _stats.get(getattr(self, "index", None))
        if s is not None:
            s.allocated -= self.nbytes
            s.num_free += 1

    @property
    def array(self):
        a = self._array
        if type(a) is Pending:
            a.trace.flush(FlushReason.READ)
            a = self._array
        if type(a) is Failed:
            raise RuntimeError(
                "This tensor has no value: an earlier deferred op failed with: "
                f"{a.error!r}") from a.error
        return a

    @array.setter
    def array(self, value):
        self._array = value

    def peek(self):
        """What it holds now, running nothing: an array, None (unwritten), a `Pending` value
        to come or a `Failed` one."""
        return self._array

    def defer(self, pending):
        """Its value is now `pending`, which an op still to run (or to compile) will settle."""
        pending.owner = weakref.ref(self)
        self._array = pending

    def pending_in(self, trace):
        """The `Pending` value that `trace` will produce for this storage, or None."""
        a = self._array
        return a if type(a) is Pending and a.trace is trace else None

    @property
    def unwritten(self):
        """Created by `empty` and never written (reads as zeros)."""
        return self._array is None

    def value(self):
        """The array; storage created by `empty` materialises as zeros on first read."""
        a = self._array
        if type(a) is Array:  # the hot path: no pending work, already materialised
            return a
        a = self.array
        if a is None:
            a = self.array = zeros_for(self.nbytes, jnp.dtype(self.dtype), self.index,
                                       self.zeros_shape)
        return a

    @property
    def zeros_shape(self):
        """(unwritten storages) the shape their zeros take: the tensor zeroed over the whole
        storage, else the contiguous tensor `empty` made it for, else None (flat).  A storage
        keeps its array's shape through writes: a model placed by `to_empty` then initialised
        in place kept flat weights, and on TPU every read of a flat weight as a matrix is a
        relayout copy of it (a 1.5B Llama's embedding and output, 1 GB each, six times a step)."""
        return self.shape if self.shape is not None else self.made_as


# Storages up to this size read as zeros through a transfer from the host, which compiles
# nothing: a loop over new sizes (`torch.empty(n).uniform_()`, `.long()`, `randn(n)` in
# PyTorch's device-generic tests) otherwise compiled a zeros program per size, 3 of an
# iteration's 10 executables.  Larger ones use a cached executable, whose call costs less than
# moving their size over the host link.
_HOST_ZEROS_BYTES = 1 << 16

# The cached executable making n zeros on a device (eager jnp.zeros costs far more):
# _execution.dispatch.install registers executables.zeros, which the persistent executable
# cache keeps (a restart loads them: an optimizer's state made by zeros_like is ~10 sizes of
# ~25 ms compiles each).  Until then every size comes from the host.
_zeros = None


def use_zeros_executable(zeros):
    """`zeros(n, dtype, device index)` -> the executable making n zeros there: larger unwritten
    storages are made by it (this layer cannot build executables itself)."""
    global _zeros
    _zeros = zeros


def zeros_array_shape(n, shape):
    """The shape of an unwritten storage's array of `n` elements: `shape` (its zeros_shape)
    where it holds them, else flat."""
    return tuple(shape) if shape is not None and math.prod(shape) == n else (n,)


def zeros_for(nbytes, dtype, index, shape=None):
    """The array of an unwritten storage of `nbytes` (its elements read as zeros): of `shape`
    where given (the tensor zeroed over the whole storage), else flat."""
    metrics.counters["zeros_materialized"] += 1
    shape = zeros_array_shape(nbytes // dtype.itemsize, shape)
    if nbytes <= _HOST_ZEROS_BYTES or _zeros is None:
        return jax.device_put(np.zeros(shape, dtype), runtime.jax_device(index))
    return _zeros(shape, dtype, index)()


def retype_loaded(buf, dtype):
    """Give bytes restored by torch.load the element type of the tensor rebuilt on them, so
    later ops read them without a per-op bitcast."""
    import numpy as np
    from jax import lax
    jdtype = to_jax_dtype(dtype)
    itemsize = np.dtype(jdtype).itemsize
    buf.from_bytes = False
    if buf.array is None or buf.nbytes % itemsize or jdtype == buf.dtype:
        return
    raw = buf.array.reshape(-1)
    buf.array = lax.bitcast_convert_type(raw.reshape(-1, itemsize), jdtype) if itemsize > 1 else \
        lax.bitcast_convert_type(raw, jdtype)
    buf.dtype = jdtype


def buffer_of(t):
    return t.untyped_storage()._tpu


def buffer_or_none(t):
    """`t`'s DeviceBuffer, or None for a tensor of another device."""
    return getattr(t.untyped_storage(), "_tpu", None)


def covers_storage(t):
    """Whether t is its storage's whole contents in storage order (offset 0, contiguous, every
    byte): an array of t's values can then become the storage's."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.itemsize == buffer_of(t).nbytes)


def shares_storage(t, others):
    """Whether any tensor of `others` is a view of t's storage (PyTorch refuses such operands
    of some in-place ops: overlap.py; a path that bypasses its check must leave them alone)."""
    buf = buffer_of(t)
    return any(buffer_of(o) is buf for o in others)


_torch_devices = {}


def _device(index):
    device = _torch_devices.get(index)
    if device is None:
        device = _torch_devices[index] = torch.device("tpu", index)
    return device


def new_storage(nbytes, index, array, dtype):
    storage = _storage_from_pointer(_reserve_address(nbytes), _device(index), nbytes)
    storage._tpu = DeviceBuffer(array, nbytes, index, dtype)
    return storage


def new_untyped(size=0, *, device):
    """`torch.UntypedStorage(size, device=tpu)`: `size` zero bytes, or the bytes of a sequence
    of ints (patches.py: the constructor's C++ allocation has no tpu allocator)."""
    if isinstance(size, int):
        host = np.zeros(size, np.uint8)
    elif isinstance(size, (list, tuple)):
        host = np.asarray(size, np.uint8)
    else:
        raise TypeError(f"UntypedStorage(): expected an int or a sequence of ints on the tpu "
                        f"device, but got {type(size).__name__}")
    index = device.index if device.index is not None else torch.tpu.current_device()
    array = jax.device_put(host, runtime.jax_device(index))
    return new_storage(host.size, index, array, jnp.uint8)


def contiguous_strides(shape):
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def storage_numel(shape, stride, offset=0):
    if any(n == 0 for n in shape):
        return offset
    return offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))


_INT64_MAX = (1 << 63) - 1


def _capacity(index):
    """Bytes one storage on device `index` may hold: the device's limit, or on a platform that
    reports none (the CPU) the machine's physical memory."""
    cap = _capacities.get(index)
    if cap is None:
        stats = runtime.jax_device(index).memory_stats() or {}
        cap = int(stats.get("bytes_limit") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        _capacities[index] = cap
    return cap


_capacities = {}


def check_allocation(shape, stride, dtype, index):
    """Raise PyTorch's error for a storage too large to exist, before anything is allocated or
    compiled: XLA aborts the process on an extent product past int64, and a fake address past
    int64 would make every later storage fail."""
    numel = storage_numel(shape, stride)
    nbytes = numel * dtype.itemsize
    if numel > _INT64_MAX or nbytes > _INT64_MAX:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={list(shape)}")
    if nbytes > _capacity(index):
        # CUDA raises torch.OutOfMemoryError (a RuntimeError, as the CPU's allocator error).
        raise torch.OutOfMemoryError(
            f"tpu:{index}: tried to allocate {nbytes} bytes, more than the device's "
            f"capacity of {_capacity(index)} bytes")


def empty_on(index, shape, dtype):
    if index == 0:
        return _create_empty(shape, dtype)
    return _seed_for(index, shape, dtype)


def wrap(array, shape, stride, dtype, index, nbytes=None, offset=0):
    """A new tpu tensor over a new storage that owns `array` (storage-ordered elements)."""
    if nbytes is None:
        shape = list(shape)
        if array is None:
            check_allocation(shape, stride, dtype, index)
        nbytes = storage_numel(shape, stride, offset) * dtype.itemsize
    if index == 0 and not offset and RESIZES_IN_PLACE:
        # The common output, a new contiguous tensor on tpu:0: the empty tensor made with its
        # sizes already has its strides, and its empty storage takes the new one's size and
        # address by a swap, 1.0 us against 2.5 for `set_` (whose boxed redispatch dominated
        # the cost of every recorded op's output).
        t = _create_empty(shape, dtype)
        if t.stride() == (stride if type(stride) is tuple else tuple(stride)):
            storage = t.untyped_storage()
            storage._swap_data_ptr_(_storage_from_pointer(_reserve_address(nbytes), _device(0), nbytes))
            storage._tpu = DeviceBuffer(array, nbytes, 0, to_jax_dtype(dtype))
            return t
    else:
        t = empty_on(index, shape, dtype)
    storage = new_storage(nbytes, index, array, to_jax_dtype(dtype))
    _set_storage.redispatch_boxed(_CPU_KEYS, t, storage, offset, shape, stride)
    return t


def set_storage(t, storage, offset, shape, stride):
    _set_storage.redispatch_boxed(_CPU_KEYS, t, storage, offset, list(shape), list(stride))


# --- tensors on tpu:N for N > 0 --------------------------------------------------------
# PyTorch's Python backend hook only makes fresh tensors on device index 0, and `set_` refuses
# to move a tensor to a storage on another device.  A DLPack import of an "external device"
# capsule yields a PrivateUse1 tensor on any index; we import one such seed per device, then an
# `alias` redispatched below ADInplaceOrView gives a fresh TensorImpl (with its own version
# counter) on that device, ready for `set_`.
_seeds = {}
_alias = torch.ops.aten.alias.default._handle


def _seed_for(index, shape, dtype):
    seed = _seeds.get(index)
    if seed is None:
        seed = _seeds[index] = _dlpack_seed(index)
    t = _alias.redispatch_boxed(_CPU_KEYS, seed)
    return t if t.dtype == dtype else _retype(t, dtype)


def _retype(t, dtype):
    # `set_` keeps the tensor's dtype, so the alias must already carry the wanted one.
    return torch.ops.aten.view.dtype.redispatch(_CPU_KEYS, t, dtype)


def _dlpack_seed(index):
    import ctypes

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class DLManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p)]

    k_dl_ext_dev, k_dl_uint = 12, 1
    shape = (ctypes.c_int64 * 1)(0)
    strides = (ctypes.c_int64 * 1)(1)
    managed = DLManagedTensor()
    managed.dl_tensor.data = _reserve_address(64)
    managed.dl_tensor.device = DLDevice(k_dl_ext_dev, index)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = DLDataType(k_dl_uint, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = strides
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)
    seed = torch._C._from_dlpack(capsule)
    # The struct must outlive the seed: torch reads it lazily and never frees it (no deleter).
    _dlpack_keepalive.append((managed, shape, strides))
    return seed


_dlpack_keepalive = []


# --- UntypedStorage.resize_ ----------------------------------------------------------------
# PyTorch resizes a PrivateUse1 storage through a C++ hook Python cannot provide. FSDP2 frees
# and re-creates unsharded parameters with `storage.resize_(0)` / `resize_(n)`, so tpu storages
# resize here: a fresh address of the new size is swapped in (`_swap_data_ptr_` swaps the data
# pointer and the byte size, so every tensor on this storage sees the new size), and the
# device buffer keeps the old bytes that still fit.
_resize_ = torch.UntypedStorage.resize_


# torch 2.11 has no `_swap_data_ptr_` (2.12 added it): there a storage cannot change its size
# in place, so `UntypedStorage.resize_` (FSDP2) refuses with a clear error, and a tensor's
# `resize_` (and out= resizing) moves the tensor onto a new, larger storage instead.
RESIZES_IN_PLACE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _check_size(nbytes):
    nbytes = int(nbytes)
    if nbytes < 0:
        raise RuntimeError(f"Storage size calculation overflowed with sizes=[{nbytes}]")
    return nbytes


def _kept_bytes(old, nbytes):
    """A device array of `nbytes` holding the bytes of buffer `old` that fit (None: nothing
    to keep)."""
    if not (old.nbytes and nbytes and old._array is not None):
        return None
    itemsize = jnp.dtype(old.dtype).itemsize
    keep = min(old.nbytes, nbytes) // itemsize
    array = jnp.zeros(nbytes // itemsize, old.dtype, device=runtime.jax_device(old.index))
    return array.at[:keep].set(old.value().reshape(-1)[:keep])


def _resize_bytes(storage, nbytes):
    nbytes = _check_size(nbytes)
    old = storage._tpu
    if nbytes == old.nbytes:
        return storage
    if not RESIZES_IN_PLACE:
        raise RuntimeError(
            f"resizing a tpu storage in place (UntypedStorage.resize_, used by FSDP2) needs "
            f"torch 2.12 or newer: torch {torch.__version__} has no "
            "UntypedStorage._swap_data_ptr_")
    # `_swap_data_ptr_` needs one side empty: first empty this storage, then take the new size.
    if old.nbytes:
        storage._swap_data_ptr_(_storage_from_pointer(_reserve_address(0), storage.device, 0))
    if nbytes:
        storage._swap_data_ptr_(
            _storage_from_pointer(_reserve_address(nbytes), storage.device, nbytes))
    storage._tpu = DeviceBuffer(_kept_bytes(old, nbytes), nbytes, old.index, old.dtype)
    return storage


def grown(storage, nbytes):
    """`storage` with `nbytes` (more than it has), keeping its bytes: itself, resized in place
    so that every view sees the new size, or on torch 2.11 a new storage (only the tensor
    set onto it sees the new size)."""
    if RESIZES_IN_PLACE:
        return _resize_bytes(storage, nbytes)
    old = storage._tpu
    nbytes = _check_size(nbytes)
    return new_storage(nbytes, old.index, _kept_bytes(old, nbytes), old.dtype)


def resize_storage(storage, nbytes):
    if storage.device.type != "tpu":
        return _resize_(storage, nbytes)
    return _resize_bytes(storage, nbytes)
