"""Installs the full device module as `torch.tpu` (the name `tpu`, hooks and guard are
registered by torchtpu_autoload, at `import torch` or at the top of `import torchtpu`)."""
import torchtpu_autoload

from . import serialization
from .._distributed import _create
from .._execution import fallback


def register_backend(module):
    torchtpu_autoload.register(module, fallback._fallback, serialization._tag,
                               serialization._restore, _create)
