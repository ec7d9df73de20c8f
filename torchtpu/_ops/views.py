"""Metadata-only kernels: PyTorch's own CPU kernels compute every view's sizes/strides/offset
over our storage (no buffer is touched), so aliasing is exactly PyTorch's."""
import torch

from .._device import runtime, storage

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
aten = torch.ops.aten

# Overloads whose CPU kernel only rewrites TensorImpl metadata.
METADATA_OPS = [
    aten.view.default, aten.as_strided.default, aten._reshape_alias.default, aten.alias.default,
    aten.unfold.default, aten.view.dtype, aten._unsafe_view.default,
    aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
    aten.set_.default, aten.as_strided_.default,
    aten.view_as_real.default, aten.view_as_complex.default, aten._conj.default,
    aten._neg_view.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.unsqueeze.default, aten.transpose.int, aten.permute.default, aten.t.default,
    aten.expand.default, aten.select.int, aten.slice.Tensor, aten.diagonal.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.narrow.default,
    aten.chunk.default, aten.detach.default, aten.lift_fresh.default,
    aten.squeeze_.default, aten.squeeze_.dim, aten.unsqueeze_.default, aten.transpose_.default,
    aten.t_.default, aten.view_as.default, aten.real.default, aten.imag.default,
]


def _redispatch(op):
    handle = op._handle

    def kernel(*args, **kwargs):
        return handle.redispatch_boxed(_CPU, *args, **kwargs)

    return kernel


def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dtype = dtype or torch.get_default_dtype()
    index = _device_index(device)
    if memory_format is None or memory_format in (torch.contiguous_format, torch.preserve_format):
        stride = storage.contiguous_strides(size)
    else:
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    return _empty(list(size), stride, dtype, index)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = dtype or torch.get_default_dtype()
    return _empty(list(size), list(stride), dtype, _device_index(device))


def _empty(size, stride, dtype, index):
    for n in size:
        if n < 0:
            raise RuntimeError(
                f"Trying to create tensor with negative dimension {n}: {list(size)}")
    return storage.wrap(None, size, stride, dtype, index)


def _device_index(device):
    if device is None:
        return runtime.current_device()
    device = torch.device(device)
    return runtime.current_device() if device.index is None else device.index


def register(lib):
    for op in METADATA_OPS:
        lib.impl(op, _redispatch(op), "PrivateUse1")
    lib.impl(aten.empty.memory_format, _empty_memory_format, "PrivateUse1")
    lib.impl(aten.empty_strided.default, _empty_strided, "PrivateUse1")
