"""Installs every PrivateUse1 kernel of the device, from one declarative table.

Special kernels come first: dispatcher kernels whose contract a pure lowering cannot express
(views sharing storage, host transfers, boolean-mask indexing, ops with side effects), each
module's `kernels()` table.  Every other op of the lowering table gets its OpKernel; an op with
a special kernel never does, though the table may hold it (`copy_`, the in-place variant of
`aten::copy`, also moves data between devices; masks turn boolean indices into integer ones
before the table's `index`, in advanced_indexing.py).
"""
from .._core import storage
from . import (advanced_indexing, composed_kernels, executables, growing_sequences, kernels,
               padded, transfer, views)

SPECIAL_MODULES = (views, transfer, advanced_indexing, growing_sequences, composed_kernels)


def special_kernels():
    """{op: PrivateUse1 kernel} of the special kernels."""
    table = {}
    for module in SPECIAL_MODULES:
        table.update(module.kernels())
    return table


def install(lib):
    storage.use_zeros_executable(executables.zeros)  # kept across processes too
    special = special_kernels()
    for op, kernel in special.items():
        lib.impl(op, kernel, "PrivateUse1")
    for op, kernel in composed_kernels.autograd_kernels().items():
        lib.impl(op, kernel, "PrivateUse1")
        lib.impl(op, kernel, "AutogradPrivateUse1")
    for op, kernel in transfer.CPU_KERNELS.items():
        lib.impl(op, kernel, "CPU")
    kernels.register_table(lib, skip=special)
    padded.install()
