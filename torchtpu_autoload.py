"""PyTorch's device-backend autoload entry point, and the light half of the `tpu` device.

`import torch` calls `load()`, which only registers the name `tpu` (so `torch.device("tpu")`
parses), a stand-in `torch.tpu` module, a dispatcher fallback, the "tpu" c10d backend and the
torch.save/torch.load location. JAX
and the ~1,300 kernels load at the first use of the device: an op on a tpu tensor or device,
any `torch.tpu.*` attribute, `torch.compile(backend="tpu")`, `init_process_group("tpu")`.
`import torchtpu` loads everything at once.

Kept outside the package so that importing it imports no JAX, and so that a broken install can
only warn: `import torch` must never fail because of torchtpu. Set TORCH_DEVICE_BACKEND_AUTOLOAD=0
to skip it.

It also makes Hugging Face accelerate (and so the transformers Trainer) default to tpu, from a
bare `import torch` too (see `_patch_accelerate`).

It also guards processes: a forked child of a process whose JAX runtime had started, and a
DataLoader worker, get a clear error when they touch the device (JAX's runtime does not survive
fork, and tpu tensors cannot be sent between processes).
"""
import importlib.abc
import importlib.util
import os
import sys
import types
import warnings

import torch

_state = types.SimpleNamespace(
    stand_in=None,     # the _LazyDeviceModule
    module=None,       # the full torch.tpu module once loaded
    fallback=None,     # the full backend's PrivateUse1 fallback (CPU fallback or error)
    serialization=None,  # the full backend's torch.save tag and torch.load restore functions
    create_process_group=None,  # the full backend's c10d backend constructor
    after_bad_fork=[],  # what the full backend forgets in a forked child (on_bad_fork)
    library=None,      # the torch.library.Library holding our PrivateUse1 fallback
    bad_fork=False,
    seed=None,         # torch.manual_seed before the device loaded
)


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


# --- the processes that may not use the device ------------------------------------------------

_FORK_ERROR = (
    "Cannot re-initialize the tpu device in a forked subprocess: the parent process had already "
    "started JAX's device runtime, which does not survive fork(). To use tpu with "
    "multiprocessing, you must use the 'spawn' start method (and in DataLoader workers, return "
    "CPU tensors and move each batch to tpu in the main process).")
_WORKER_ERROR = (
    "DataLoader worker processes cannot use the tpu device: tpu tensors cannot be sent between "
    "processes. Return CPU tensors from the Dataset/collate_fn and move each batch to tpu in the "
    "main process (batch.to('tpu')).")


def _is_in_bad_fork():
    return _state.bad_fork


def check_process():
    """Raises if this process may not start or use the device (see the module docstring)."""
    if _state.bad_fork:
        raise RuntimeError(_FORK_ERROR)
    data = sys.modules.get("torch.utils.data")
    if data is not None and data.get_worker_info() is not None:
        raise RuntimeError(_WORKER_ERROR)


def _runtime_started():
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bridge.backends_are_initialized()


def _after_fork_in_child():
    if not _runtime_started():
        return  # JAX never started in the parent: the child may start its own runtime
    _state.bad_fork = True
    # Every kernel would run on the parent's (dead) runtime and hang: drop them all, so that
    # each tpu op reaches our fallback, which raises _FORK_ERROR.
    module = _state.module
    if module is not None:
        for lib in getattr(module, "_torchtpu_library", ()):
            lib._destroy()
        module._torchtpu_library = ()
        for forget in _state.after_bad_fork:
            forget()  # e.g. the runtime's devices: torch.tpu.* queries restart it, which raises


def on_bad_fork(forget):
    """Call `forget()` in a forked child of a process whose JAX runtime had started, once the
    full backend has loaded (the package's modules register what they must drop)."""
    _state.after_bad_fork.append(forget)


# --- loading --------------------------------------------------------------------------------

def ensure_loaded():
    """The full `torch.tpu` module, importing torchtpu (JAX, kernels) the first time."""
    if _state.module is None:
        check_process()
        try:
            import torchtpu  # noqa: F401  (sets _state.module through register())
        except Exception as e:
            # A half-imported module must not pass for the device: the next use tries again.
            torch.tpu = sys.modules["torch.tpu"] = _state.stand_in
            _state.module = _state.fallback = _state.serialization = None
            _state.create_process_group = None
            raise RuntimeError(
                f"The tpu device could not be loaded: importing torchtpu failed with {e!r}") from e
    return _state.module


def _fallback(op, *args, **kwargs):
    check_process()
    if _state.fallback is None:
        ensure_loaded()
        if _state.fallback is None:  # pragma: no cover - torchtpu always sets it
            raise RuntimeError("torchtpu loaded without installing its fallback")
        return op(*args, **kwargs)  # now the op's own tpu kernel, if it has one, runs
    return _state.fallback(op, *args, **kwargs)


class _LazyDeviceModule(types.ModuleType):
    """`torch.tpu` until the device loads: any attribute loads it, except the few that PyTorch
    itself reads on every `import torch`/`torch.manual_seed` (they must not cost a JAX import)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(ensure_loaded(), name)

    def __setattr__(self, name, value):
        setattr(ensure_loaded(), name, value)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def _is_in_bad_fork():
        return _state.bad_fork

    @staticmethod
    def manual_seed_all(seed):
        # torch.manual_seed seeds every device module; applied when the device loads.
        if _state.module is None:
            _state.seed = int(seed)
        else:
            _state.module.manual_seed_all(seed)


def _tag(obj):
    return None if _state.serialization is None else _state.serialization[0](obj)


def _restore(obj, location):
    if not str(location).startswith("tpu"):
        return None
    ensure_loaded()
    return _state.serialization[1](obj, location)


def _create_process_group(*args, **kwargs):
    ensure_loaded()
    return _state.create_process_group(*args, **kwargs)


# --- Hugging Face accelerate -----------------------------------------------------------------

_ACCELERATE = "accelerate.state"


def _patch_accelerate(state):
    """transformers finds the device through `torch.accelerator` (tpu), but accelerate's
    `PartialState.default_device` knows a fixed list of device types and falls back to the CPU,
    so the Trainer's model sat on tpu while accelerate kept the batches on the CPU.  Where
    accelerate would pick the CPU for lack of an accelerator, it picks tpu instead; an explicit
    choice still wins (`cpu=True` / `TrainingArguments(use_cpu=True)`, or the
    ACCELERATE_TORCH_DEVICE variable, which accelerate reads before it asks for a default).
    Answering costs no JAX import: the stand-in's `is_available` answers alone."""
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
    """Finds module `name` through the other finders and calls `patch(module)` once it has run
    (for modules a patch must not import: `import torch` must not import accelerate)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # one module, once: the finder's work is done either way
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                self.patch(module)

            spec.loader.exec_module = exec_module
        return spec


def patch_on_import(name, patch):
    """`patch(module)` of module `name` now if it is imported, else when it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


def _install_accelerate_hook():
    patch_on_import(_ACCELERATE, _patch_accelerate)


def install():
    """Registers the name `tpu` with the stand-in module, the fallback and the c10d backend,
    and the accelerate hook; once per process (at `import torch`, or as step 1 of
    `import torchtpu`, torchtpu/_startup.py)."""
    if _state.library is not None:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    _state.stand_in = _LazyDeviceModule("torch.tpu", __doc__)
    _setup_privateuseone_for_python_backend("tpu", _state.stand_in, _Hooks(), _Guard())
    _state.library = torch.library.Library("_", "IMPL")
    _state.library.fallback(_fallback, dispatch_key="PrivateUse1")
    _register_serialization()
    _register_c10d_backend()
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _install_accelerate_hook()


# The registrations below put torchtpu's functions into PyTorch's global state; they are
# listed in torchtpu/_frontend/patches.py with the other patches.

def _register_serialization():
    # torch.load(map_location="tpu") as the first use: PyTorch's generic path would copy into
    # a storage the device cannot make before it loads.
    torch.serialization.register_package(1, _tag, _restore)


def _register_c10d_backend():
    # The backend's only registration: `_create_process_group` loads the package when
    # init_process_group("tpu") is the first use of the device, and calls the package's
    # constructor (register()'s `create_process_group`) once it has loaded.
    import torch.distributed as dist
    if dist.is_available() and "TPU" not in dist.Backend._plugins:
        dist.Backend.register_backend("tpu", _create_process_group, extended_api=True,
                                      devices=["tpu"])


def register(module, fallback, tag, restore, create_process_group):
    """Step 2 of `import torchtpu` (torchtpu/_startup.py), after `install()`: the full module
    replaces the stand-in as `torch.tpu`, ops without a tpu kernel go to `fallback`,
    torch.save/torch.load of tpu storages to `tag` and `restore`, the "tpu" c10d backend's groups
    are made by `create_process_group`."""
    torch.tpu = sys.modules["torch.tpu"] = module
    _state.module = module
    _state.fallback = fallback
    _state.serialization = tag, restore
    _state.create_process_group = create_process_group
    if _state.seed is not None:
        module.manual_seed_all(_state.seed)


def load():
    try:
        install()
    except Exception as e:  # pragma: no cover - exercised only by broken installs
        warnings.warn(f"torchtpu could not register the tpu device: {e!r}")
