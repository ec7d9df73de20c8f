"""Moving values between the host and devices: copy_, .item(), resize_."""
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .._core import runtime, storage
from .._core.dtypes import numpy_to_tensor, tensor_to_numpy, to_jax_dtype
from . import fused, padded, recording, strided, sync
from .._core import metrics
from .._core.metrics import FlushReason
from .kernels import kernel_for

aten = torch.ops.aten


# NumPy arrays (the host side of every transfer) have at most 64 dims; torch tensors and JAX
# arrays may have more, so such values cross flat.
_NUMPY_MAX_DIMS = 64


@functools.lru_cache(maxsize=256)  # one executable per view layout read: bounded
def _reader(shape, stride, dtype):
    # The offset is an argument, as in op executables: reading x[i] for every i is one program.
    return jax.jit(lambda a, offset: strided.read(a, shape, stride, offset, dtype))


def value_of(t):
    """The JAX array of a tpu tensor's logical value (through its view)."""
    buf = storage.buffer_of(t)
    arr = buf.value()
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    jdtype = to_jax_dtype(t.dtype)
    if arr.dtype == jdtype and strided.is_whole(arr.shape, shape, stride, offset):
        return arr
    return _reader(shape, tuple(stride), jdtype)(arr, offset)


def to_host(t):
    """A tpu tensor's value as a new contiguous CPU tensor (synchronises)."""
    fused.flush(FlushReason.DEVICE_TO_HOST, "aten::copy_ (to the host: .cpu(), .tolist(), .numpy(), printing)")
    metrics.counters["device_to_host"] += 1
    metrics.counters["device_to_host_bytes"] += t.numel() * t.element_size()
    sync.wait()
    flat = _contiguous_run(t)
    if flat is not None:
        n, offset = t.numel(), t.storage_offset()
        a = np.array(jax.device_get(flat)[offset:offset + n])
        return numpy_to_tensor(a, t.dtype).reshape(t.shape)
    value = value_of(t)
    if value.ndim > _NUMPY_MAX_DIMS:
        value = value.reshape(-1)
    a = np.array(jax.device_get(value))  # writable: torch.from_numpy shares it
    return numpy_to_tensor(np.ascontiguousarray(a), t.dtype).reshape(t.shape)


def _contiguous_run(t):
    """The flat array of t's storage when t is a contiguous run of it that a host-side slice
    reads for at most twice t's bytes (a tensor with room to spare: a random fill's bucket,
    a growing sequence), or None.  Reading it on the device would compile a slicing program
    per size: a loop over new sizes would build one per `.cpu()`."""
    arr = storage.buffer_of(t).value()
    if arr.ndim != 1 or arr.dtype != to_jax_dtype(t.dtype) or not t.is_contiguous():
        return None
    n = t.numel()
    if n == arr.size or arr.size > 2 * n:
        return None
    return arr


def from_host(cpu, index):
    """A new contiguous tpu tensor holding a CPU tensor's values."""
    metrics.counters["host_to_device"] += 1
    metrics.counters["host_to_device_bytes"] += cpu.numel() * cpu.element_size()
    cpu = cpu.detach().resolve_conj().resolve_neg().contiguous()
    host = tensor_to_numpy(cpu.reshape(-1) if cpu.dim() > _NUMPY_MAX_DIMS else cpu)
    if runtime.platform() == "cpu":
        # The CPU client adopts suitably aligned host memory without copying, so the device
        # array would change whenever the CPU tensor is later modified.
        host = host.copy()
    arr = jax.device_put(host, runtime.jax_device(index))
    return storage.wrap(arr, tuple(cpu.shape), storage.contiguous_strides(cpu.shape), cpu.dtype, index)


def _copy_(self, src, non_blocking=False):
    if not isinstance(src, torch.Tensor):  # a Python number, as PyTorch's copy_ accepts
        src = torch.tensor(src)
    if self.device.type != "tpu":  # device -> host
        if self.numel() == 0 and src.numel() == 0:
            return self
        return self.copy_(to_host(src), non_blocking)
    if src.device.type != "tpu":  # host -> device
        src = from_host(src, self.device.index)
        if src.dtype == self.dtype and src.shape == self.shape and \
                recording.replace_value(self, storage.buffer_of(src).value()):
            return self
    elif src.untyped_storage()._tpu is self.untyped_storage()._tpu:
        _check_no_partial_overlap(self, src)
    elif src.device.index != self.device.index:  # device -> device
        moved = jax.device_put(value_of(src), runtime.jax_device(self.device.index))
        src = storage.wrap(moved, tuple(src.shape), storage.contiguous_strides(src.shape),
                           src.dtype, self.device.index)
    elif padded.copy(self, src):  # a 1-D tensor with room to spare, cast whole
        return self
    return kernel_for(aten.copy_.default)(self, src, non_blocking)


def _check_no_partial_overlap(dst, src):
    # PyTorch's CPU/CUDA copy_ refuses a source that partly overlaps the destination; meta
    # kernels cannot see memory, so the same rule is applied here on the byte ranges.
    def span(t):
        start = t.storage_offset() * t.element_size()
        return start, start + storage.storage_numel(t.shape, t.stride()) * t.element_size()

    if not (dst.is_contiguous() and src.is_contiguous()):
        return  # PyTorch only decides overlap for dense layouts ("too hard" otherwise)
    (a0, a1), (b0, b1) = span(dst), span(src)
    same = (a0, dst.shape, dst.stride(), dst.dtype) == (b0, src.shape, src.stride(), src.dtype)
    if a0 < b1 and b0 < a1 and not same:
        raise RuntimeError(
            "unsupported operation: some elements of the input tensor and the written-to tensor "
            "refer to a single memory location. Please clone() the tensor before performing the "
            "operation.")


# `.item()` of one element after another of the same array (`all(t)`, `for x in t: float(x)`,
# PyTorch's tests' loops over a million elements) reads the array to the host once, at its second
# element, and indexes the host copy from then on: a read per element costs a program run and a
# transfer each (~100 us), where the CPU's costs nanoseconds.  JAX arrays never change, so the
# copy stays right while that array is the storage's value; only arrays up to this size qualify.
_HOST_COPY_MAX_BYTES = 64 << 20
_item_source = {"array": None, "host": None}  # a weak reference to the last array read, its copy


def _host_copy(arr):
    last = _item_source["array"]
    if last is None or last() is not arr:
        _item_source.update(array=weakref.ref(arr), host=None)
        return None
    if _item_source["host"] is None and arr.nbytes <= _HOST_COPY_MAX_BYTES:
        _item_source["host"] = np.asarray(jax.device_get(arr)).reshape(-1)
    return _item_source["host"]


def _local_scalar_dense(self):
    fused.flush(FlushReason.ITEM, "aten::_local_scalar_dense (.item())")
    metrics.counters["device_to_host"] += 1
    metrics.counters["device_to_host_bytes"] += self.element_size()
    sync.wait()
    arr = storage.buffer_of(self).value()
    if arr.size > 1 and arr.dtype == to_jax_dtype(self.dtype) and \
            len(arr.sharding.device_set) == 1:  # (a sharded array is read through its program)
        host = _host_copy(arr)
        if host is not None:
            return host[self.storage_offset()].item()
    return np.asarray(jax.device_get(value_of(self))).reshape(()).item()


def _resize_(self, size, memory_format=None):
    shape = [int(n) for n in size]
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        stride = storage.contiguous_strides(shape)
    else:
        stride = torch.empty(shape, device="meta", memory_format=memory_format).stride()
    offset = self.storage_offset()
    needed = storage.storage_numel(shape, stride, offset) * self.dtype.itemsize
    st = self.untyped_storage()
    if needed > st.nbytes():
        # The storage grows in place, keeping its bytes, so that every view of it (a base this
        # tensor is a view of) sees the new elements, as when PyTorch reallocates.
        storage.check_allocation(shape, stride, self.dtype, self.device.index)
        st = storage.grown(st, needed)
    storage.set_storage(self, st, offset, shape, stride)
    return self


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _pin_memory(self, device=None):
    # PyTorch pins for the current accelerator through a C++ allocator hook a Python backend
    # cannot provide. JAX stages host buffers itself, so pinning for tpu is a plain copy
    # (pin_memory returns a copy); pinning for any other device is PyTorch's own.
    target = torch.device(device) if device is not None else torch.accelerator.current_accelerator()
    if target is not None and target.type == "tpu":
        return self.clone()
    return aten._pin_memory.default.redispatch(_COMPOSITE, self, device)


def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    # PyTorch's `_to_copy` gives a non-blocking device->host copy a pinned CPU output, made by
    # the same missing allocator hook. The host copy waits for the value anyway, so it is the
    # ordinary copy.
    if non_blocking and device is not None and torch.device(device).type == "cpu":
        non_blocking = False
    return aten._to_copy.default.redispatch(
        _COMPOSITE, self, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
        non_blocking=non_blocking, memory_format=memory_format)


def _equal(self, other):
    # A bool on the host, like PyTorch's kernels: same sizes and every element equal (NaN never is).
    if self.device != other.device:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                           f"two devices, {self.device} and {other.device}!")
    if self.dtype != other.dtype:
        raise RuntimeError(f"Expected object of scalar type {self.dtype} but got scalar type "
                           f"{other.dtype} for argument 'other'")
    if self.shape != other.shape:
        return False
    return bool(torch.eq(self, other).all().item())


def kernels():
    """The PrivateUse1 kernels of this module (see dispatch.py)."""
    return {aten._to_copy.default: _to_copy, aten.copy_.default: _copy_,
            aten._local_scalar_dense.default: _local_scalar_dense, aten.equal.default: _equal,
            aten.resize_.default: _resize_}


# Pinning a CPU tensor for the tpu: the CPU key's kernel.
CPU_KERNELS = {aten._pin_memory.default: _pin_memory}
