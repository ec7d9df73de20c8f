"""Keeping tied parameters tied when a module moves to tpu.

`module.to(device)` changes a parameter in place (`param.data = ...`) only when PyTorch deems
the old and new tensors "shallow-copy compatible", which it decides by a fixed list of
backends that leaves out PrivateUse1; otherwise each module gets a new Parameter, so weights
shared between modules (a language model's embedding and output projection) would silently
become two independent copies. After a conversion, modules that shared one Parameter share
the converted one again, as they do on CUDA."""
import threading

import torch

_depth = threading.local()


def _tied_groups(module):
    places = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((mod, name))
    return [group for group in places.values() if len(group) > 1]


def install():
    original = torch.nn.Module._apply
    if getattr(original, "_torchtpu", False):
        return

    def _apply(self, fn, recurse=True):
        outermost = not getattr(_depth, "active", False)
        if not outermost:
            return original(self, fn, recurse)
        groups = _tied_groups(self) if recurse else []
        _depth.active = True
        try:
            result = original(self, fn, recurse)
        finally:
            _depth.active = False
        for group in groups:
            first_module, first_name = group[0]
            shared = first_module._parameters[first_name]
            if shared is not None and shared.device.type == "tpu":
                for mod, name in group[1:]:
                    mod._parameters[name] = shared
        return result

    _apply._torchtpu = True
    torch.nn.Module._apply = _apply
