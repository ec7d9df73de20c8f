"""Keeping a module's Parameter objects when it moves to tpu, as on CUDA.

`module.to(device)` changes a parameter in place (`param.data = ...`) only when PyTorch deems
the old and new tensors "shallow-copy compatible", which it decides by a fixed list of
backends that leaves out PrivateUse1; otherwise each module gets a new Parameter. Then weights
shared between modules (a language model's embedding and output projection) would silently
become two independent copies, and an optimizer built before the move (accelerate's
`prepare(model, optimizer)` pattern) would keep stepping the old CPU tensors. After a
conversion to tpu, each old Parameter object takes the converted value (torch.utils.swap_tensors,
what PyTorch's own swap-on-conversion mode does) and goes back to every place that held it;
likewise for conversions from tpu (to the CPU, to another dtype)."""
import threading

import torch

_depth = threading.local()


def _places(module):
    """Each Parameter object (by id) -> the object and every (module, name) holding it."""
    places = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), (p, []))[1].append((mod, name))
    return places.values()


def install():
    original = torch.nn.Module._apply
    if getattr(original, "_torchtpu", False):
        return

    def _apply(self, fn, recurse=True):
        outermost = not getattr(_depth, "active", False)
        if not outermost:
            return original(self, fn, recurse)
        places = list(_places(self)) if recurse else []
        _depth.active = True
        try:
            result = original(self, fn, recurse)
        finally:
            _depth.active = False
        for old, where in places:
            mod, name = where[0]
            new = mod._parameters[name]
            if new is None or new is old or "tpu" not in (old.device.type, new.device.type):
                continue
            cls, attributes = type(old), dict(old.__dict__)
            try:
                torch.utils.swap_tensors(old, new)
                # As with CUDA's in-place `param.data = ...`: the object keeps its Parameter
                # subclass and attributes, which PyTorch's conversion would drop.
                old.__class__ = cls
                old.__dict__.update(attributes)
                new = old
            except RuntimeError:
                # Objects swap_tensors refuses (weakly referenced, or whose tensor is shared by
                # a view) are replaced, as PyTorch does; ties are still restored.
                pass
            for mod, name in where:
                mod._parameters[name] = new
        return result

    _apply._torchtpu = True
    torch.nn.Module._apply = _apply
