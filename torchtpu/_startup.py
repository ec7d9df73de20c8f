"""Start-up: everything `import torchtpu` does to make the device work, as one list of steps run
in one order (`STEPS`; the comment above each step says why it comes where it does).

The light half of the device is torchtpu_autoload's (outside the package, importing no JAX):
PyTorch's backend autoload runs it at `import torch`, and step 1 runs it here when the autoload
did not (TORCH_DEVICE_BACKEND_AUTOLOAD=0).  Every patch of a PyTorch or JAX global that a step
makes is listed, with its reason, in _frontend/patches.py (PATCHES); step 5 applies the ones
made at import, in that list's order.  Two modules act when they are first imported:
_core/runtime.py (JAX's x64 and the absent TPU; torchtpu/__init__.py imports it before step 1)
and _frontend/torch_tpu.py (its module's class; step 2); PATCHES lists them too.

A second execution of the package in one process (a retry of `import torchtpu` after a failed
one, a reload) registers the device module again but installs no kernel twice: step 4 runs once
per process, and the other steps may run again.
"""
import types

import torch

import torchtpu_autoload


def _light_half(start):
    torchtpu_autoload.install()


def _device_module(start):
    from ._frontend import torch_tpu
    from ._frontend import serialization
    from ._distributed import _create
    from ._execution import fallback
    torchtpu_autoload.register(torch_tpu, fallback._fallback, serialization._tag,
                               serialization._restore, _create)
    # From here torch.tpu is the full module, which keeps the kernels' libraries.
    start.first = not hasattr(torch.tpu, "_torchtpu_library")


def _lowering_table(start):
    from . import _lowerings  # noqa: F401  (each family's module adds its entries)


def _kernels(start):
    if not start.first:
        return
    from ._execution import dispatch
    from ._frontend import autocast, streams
    lib = torch.library.Library("aten", "IMPL")
    dispatch.install(lib)  # the special kernels' table, then an OpKernel per table op
    streams.register(lib)  # record_stream
    fallback_lib = torch.library.Library("_", "IMPL")  # (the PrivateUse1 fallback is the autoload's)
    autocast.register(lib, fallback_lib)  # AutocastPrivateUse1: the casting policies
    from ._execution.fallback import nested_unsupported, sparse_unsupported
    for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):  # no sparse layouts: one clear error
        fallback_lib.fallback(sparse_unsupported, dispatch_key=key)
    fallback_lib.fallback(nested_unsupported, dispatch_key="NestedTensorPrivateUse1")
    # Kept alive here (a Library's registrations end when it is freed); the autoload's fork
    # guard destroys them in a forked child of a started runtime.
    torch.tpu._torchtpu_library = lib, fallback_lib


def _patches(start):
    from ._frontend import patches
    patches.install()  # once per process (patches.install keeps count)


def _public_modules(start):
    from . import pallas, profiler  # noqa: F401
    torch.tpu.pallas = pallas


STEPS = (
    # 1. The light half (torchtpu_autoload.install): the name "tpu", the stand-in torch.tpu, the
    #    PrivateUse1 fallback, torch.load's location, the c10d backend "tpu", the fork guard and
    #    accelerate's hook.  Usually already run by `import torch`; it runs once.  First, because
    #    step 2 replaces its stand-in and hands its forwards their targets.  The c10d backend is
    #    registered here, and only here: its constructor (the autoload's) loads the package when
    #    init_process_group("tpu") comes first, and calls the package's once step 2 has run.
    _light_half,
    # 2. The full module becomes torch.tpu (torchtpu_autoload.register), and the stand-in's
    #    forwards get the package's functions: ops without a tpu kernel (the CPU fallback or its
    #    error), torch.save/torch.load of tpu storages, the c10d backend's process groups; a seed
    #    given before the device loaded is applied.  Before the kernels: from here `torch.tpu.x`
    #    reaches the module itself, where the stand-in would import torchtpu again (this very
    #    import, half done), and the module holds the kernels' libraries (step 4).
    _device_module,
    # 3. The lowering table: each `_lowerings` module adds its ops.  Before the kernels: step 4
    #    gives every table entry its kernel, so the table must be complete.
    _lowering_table,
    # 4. The kernels, once per process: every aten op's PrivateUse1 kernel (dispatch.install:
    #    the special kernels, then one OpKernel per table op), record_stream's, and autocast's
    #    AutocastPrivateUse1 kernels.  After the table (step 3); before the patches by choice,
    #    as since the list of patches exists: neither reads the other while it is installed.
    _kernels,
    # 5. The patches of PyTorch's and JAX's globals made at import (_frontend/patches.py, in the
    #    list's order: module conversions, torch.compile, the optimizer hooks, the compilation
    #    cache...).  Before `import torchtpu` returns: the user's first call may need any of them.
    _patches,
    # 6. The public modules beside the device: torch.tpu.pallas (jax_op: a JAX function as a
    #    torch op whose tpu kernel is an OpKernel) and torchtpu.profiler.  Last: nothing above
    #    needs them, and they build on the device the steps above made.
    _public_modules,
)


def run():
    """Runs STEPS in order (torchtpu/__init__.py calls it)."""
    start = types.SimpleNamespace(first=None)
    for step in STEPS:
        step(start)
