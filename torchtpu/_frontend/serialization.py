"""torch.save / torch.load of tpu storages (incl. map_location="tpu"); registered with PyTorch
by torchtpu_autoload."""
import torch

from .._core import runtime


def _tag(obj):
    if isinstance(obj, torch.UntypedStorage) and obj.device.type == "tpu":
        return f"tpu:{obj.device.index}"
    return None


def _restore(obj, location):
    if not str(location).startswith("tpu"):
        return None
    device = torch.device(location)
    index = runtime.current_device() if device.index is None else device.index
    from .._execution.transfer import from_host
    cpu_bytes = torch.empty(0, dtype=torch.uint8).set_(obj.untyped() if hasattr(obj, "untyped") else obj)
    t = from_host(cpu_bytes, index)
    st = t.untyped_storage()
    # The bytes are retyped to the dtype of the first tensor rebuilt on them (see views.set_).
    st._tpu.from_bytes = True
    return st

