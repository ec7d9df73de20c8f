"""Renames PrivateUse1 to `tpu` and installs the device module, hooks and guard."""
import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self):
        return True

    def has_primary_context(self, dev_id):
        return True

    def is_built(self):
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def register_backend(module):
    if torch._C._get_privateuse1_backend_name() == "tpu" and getattr(torch, "tpu", None) is module:
        return
    _setup_privateuseone_for_python_backend("tpu", module, _Hooks(), _Guard())
