"""Installs one PrivateUse1 kernel per overload of the lowering table."""
import torch

from .._core import registry
from . import bounded
from .op_kernel import OpKernel

_kernels = {}


def kernel_for(overload):
    k = _kernels.get(overload)
    if k is None:
        low = registry.TABLE[overload]
        k = _kernels[overload] = OpKernel(overload, low)
    return k


def _is_composite_implicit(overload):
    return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd")


# IMPL libraries of the table's ops outside `lib`'s namespace (torchtpu::attention), kept alive
_libraries = {}


def register_table(lib, skip=()):
    for overload in registry.TABLE:
        # A backend kernel for a CompositeImplicitAutograd op would bypass the autograd formula
        # of what it decomposes into (no grad_fn), so those always decompose.
        if overload in skip or _is_composite_implicit(overload):
            continue
        ns = overload.namespace
        if ns != lib.ns and ns not in _libraries:
            _libraries[ns] = torch.library.Library(ns, "IMPL")
        (lib if ns == lib.ns else _libraries[ns]).impl(overload, kernel_for(overload),
                                                        "PrivateUse1")


def clear_caches():
    for k in _kernels.values():
        k.cache.clear()
    bounded.op_executables.clear()
