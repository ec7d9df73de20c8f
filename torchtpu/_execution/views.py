"""Metadata-only kernels: PyTorch's own CPU kernels compute every view's sizes/strides/offset
over our storage (no buffer is touched), so aliasing is exactly PyTorch's."""
import torch

from .._core import storage
from .._core.runtime import device_index
from . import recording

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
aten = torch.ops.aten

# View/metadata overloads that PyTorch implements per backend (CPU, CUDA, ...) rather than as
# composites.  Every other view op (transpose, select, expand, detach, alias...) is a C++
# composite over these and must stay unregistered: a tensor returned by a Python kernel already
# has a Python object, which `nn.Parameter(t.detach())` and friends refuse.
METADATA_OPS = [
    aten.view.default, aten.as_strided.default, aten._reshape_alias.default, aten.unfold.default,
    aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
    aten.set_.default, aten.as_strided_.default, aten.view_as_real.default,
    aten.view_as_complex.default,
]


def _redispatch(op):
    handle = op._handle

    def kernel(*args, **kwargs):
        return handle.redispatch_boxed(_CPU, *args, **kwargs)

    return kernel


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    index = device_index(device)
    if memory_format is None or memory_format in (torch.contiguous_format, torch.preserve_format):
        stride = storage.contiguous_strides(size)
    else:
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return _empty(list(size), stride, dtype, index)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    if len(size) != len(stride):  # (checked before the storage's size, as ATen does)
        raise RuntimeError(f"dimensionality of sizes ({len(size)}) must match dimensionality of "
                           f"strides ({len(stride)})")
    dtype = dtype or torch.get_default_dtype()
    return _empty(list(size), list(stride), dtype, device_index(device))


def _empty(size, stride, dtype, index):
    for n in size:
        if n < 0:
            raise RuntimeError(
                f"Trying to create tensor with negative dimension {n}: {list(size)}")
    t = storage.wrap(None, size, stride, dtype, index)
    if tuple(stride) == storage.contiguous_strides(size):
        # Its zeros, if it is read before written, take its shape (recording.py, storage.py): its
        # views are then slices of their dims, not of a flat array (strided.py).
        storage.buffer_of(t).made_as = tuple(size)
    recording.note_new_storage(t)
    return t


def resize_storage(st, nbytes):
    """`UntypedStorage.resize_` (patches.py).  A tpu storage grown from nothing during a
    torch.tpu graph's capture is one the capture made, as `empty`'s are (recording.Trace.born):
    FSDP2 frees each unit's unsharded parameters with resize_(0) and makes them anew with
    resize_(n) before gathering into them, so in a captured step they are the program's own
    temporaries, not inputs and outputs held across replays (the whole model's parameters
    unsharded in HBM)."""
    grown = st.device.type == "tpu" and st.nbytes() == 0 and int(nbytes) > 0
    st = storage.resize_storage(st, nbytes)
    if grown:
        recording.note_new_buffer(st._tpu)
    return st


def _set_storage_kernel(op):
    handle = op._handle

    def kernel(self, source, *args, **kwargs):
        buf = getattr(source, "_tpu", None)
        if buf is not None and buf.from_bytes:
            storage.retype_loaded(buf, self.dtype)
        return handle.redispatch_boxed(_CPU, self, source, *args, **kwargs)

    return kernel


_SET_FROM_STORAGE = (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset)


def kernels():
    """The PrivateUse1 kernels of this module (see dispatch.py)."""
    table = {op: _set_storage_kernel(op) if op in _SET_FROM_STORAGE else _redispatch(op)
             for op in METADATA_OPS}
    table[aten.empty.memory_format] = _empty_memory_format
    table[aten.empty_strided.default] = _empty_strided
    return table
