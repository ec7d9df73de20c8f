"""The current tpu device where PyTorch asks the C++ device guard for it.

PyTorch's guard for Python backends always answers "device 0" (`getDevice()` is fixed in
torch/csrc/acc), so `tensor.to("tpu")` and `torch.accelerator.current_device_index()` would
ignore `torch.tpu.set_device`. One process per device with `set_device(local_rank)` — the usual
torchrun layout — needs both, so they are answered here from torch.tpu's own current device.
"""
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
    if runtime._current[0]:  # device 0 is what PyTorch assumes already
        if args:
            args = (_indexed(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
    return _tensor_to(self, *args, **kwargs)


def current_device_index():
    if torch._C._accelerator_getAccelerator() == torch.device("tpu"):
        return runtime.current_device()
    return torch._C._accelerator_getDeviceIndex()


_set_device_index = torch.accelerator.set_device_index


def set_device_index(device, /):
    if torch._C._accelerator_getAccelerator() == torch.device("tpu"):
        return torch.tpu.set_device(device)
    return _set_device_index(device)


tensor_to.__doc__ = _tensor_to.__doc__
