"""Hugging Face accelerate (and so the transformers Trainer) trains on tpu by default.

transformers finds the device through `torch.accelerator` (tpu), but accelerate's
`PartialState.default_device` knows a fixed list of device types and falls back to the CPU, so
the Trainer's model sat on tpu while accelerate kept the batches on the CPU. Where accelerate
would pick the CPU for lack of an accelerator, it picks tpu instead; an explicit choice still
wins (`cpu=True` / `TrainingArguments(use_cpu=True)`, or the ACCELERATE_TORCH_DEVICE variable,
which accelerate reads before it asks for a default). accelerate is patched when it is imported,
so `import torch` does not import it.
"""
import importlib.abc
import importlib.util
import sys

import torch

_MODULE = "accelerate.state"


def _patch(state):
    cls = state.PartialState
    original = cls.default_device
    if getattr(original.fget, "_torchtpu", False):
        return

    def default_device(self):
        device = original.fget(self)
        if device.type == "cpu" and torch.tpu.is_available():
            return torch.device("tpu")
        return device

    default_device._torchtpu = True
    cls.default_device = property(default_device, doc=original.__doc__)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `accelerate.state` through the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once: the finder's work is done either way
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
        return spec


def install():
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
