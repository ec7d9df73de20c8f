"""torch.distributed on tpu: the c10d backend "tpu" (see process_group.py)."""
import torch.distributed as dist


def _create(opts, backend_options=None):
    from .process_group import create
    return create(opts, backend_options)


def register():
    if dist.is_available() and "TPU" not in dist.Backend._plugins:
        dist.Backend.register_backend("tpu", _create, extended_api=True, devices=["tpu"])
