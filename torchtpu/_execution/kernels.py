"""Installs one PrivateUse1 kernel per overload of the lowering table."""
from .._ops import registry
from .strict import OpKernel

_kernels = {}


def kernel_for(overload):
    k = _kernels.get(overload)
    if k is None:
        low, functional = registry.TABLE[overload]
        k = _kernels[overload] = OpKernel(overload, low, functional)
    return k


def register_table(lib, skip=()):
    for overload in registry.TABLE:
        if overload in skip:
            continue
        lib.impl(overload, kernel_for(overload), "PrivateUse1")
