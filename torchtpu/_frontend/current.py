"""The current tpu device where PyTorch asks the C++ device guard for it.

PyTorch's guard for Python backends always answers "device 0" (`getDevice()` is fixed in
torch/csrc/acc), so `tensor.to("tpu")` and `torch.accelerator.current_device_index()` would
ignore `torch.tpu.set_device`. One process per device with `set_device(local_rank)` — the usual
torchrun layout — needs both, so they are answered here from torch.tpu's own current device.
torch.accelerator's memory functions are answered from torch.tpu's counters too (below).
"""
import collections

import torch

from .._core import runtime

_tensor_to = torch.Tensor.to


def _indexed(device):
    """`device` with the current index filled in when it is an index-less tpu device."""
    if isinstance(device, str):
        if device != "tpu":
            return device
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "tpu" and device.index is None:
        return torch.device("tpu", runtime.current_device())
    return device


def tensor_to(self, *args, **kwargs):
    if runtime.current_device():  # device 0 is what PyTorch assumes already
        if args:
            args = (_indexed(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
    return _tensor_to(self, *args, **kwargs)


def _accelerator_is_tpu():
    return torch._C._accelerator_getAccelerator() == torch.device("tpu")


def current_device_index():
    if _accelerator_is_tpu():
        return runtime.current_device()
    return torch._C._accelerator_getDeviceIndex()


_set_device_index = torch.accelerator.set_device_index


def set_device_index(device, /):
    if _accelerator_is_tpu():
        return torch.tpu.set_device(device)
    return _set_device_index(device)


tensor_to.__doc__ = _tensor_to.__doc__


def accelerator_memory(original, name):
    """`torch.accelerator.<name>` (empty_cache, memory_stats, the resets, get_memory_info) that
    answers for tpu from `torch.tpu`'s counters: PyTorch's asks the device's C++ caching
    allocator, which a Python backend cannot register, and fails an internal assert
    (accelerate >= 1.16 calls torch.accelerator.empty_cache() for devices it does not know)."""
    if name == "memory_stats":  # PyTorch's is an OrderedDict sorted by key
        def ours(device_index=None, /):
            return collections.OrderedDict(sorted(torch.tpu.memory_stats(device_index).items()))
    elif name == "get_memory_info":
        ours = torch.tpu.mem_get_info
    else:
        ours = getattr(torch.tpu, name)

    def accelerator_fn(*args):
        if _accelerator_is_tpu():
            return ours(*args)
        return original(*args)
    accelerator_fn.__doc__ = original.__doc__
    return accelerator_fn
