"""Every patch torchtpu makes to PyTorch's and JAX's globals: what, why, where it is applied,
and the torch versions it was checked on.  `install()` applies the ones made at import; the
others are applied where the table says, for the reason given there.  A new patch is one more
entry here (tests/test_layers.py fails on an assignment to a torch or jax global elsewhere)."""
import dataclasses
import gc
import sys
import threading
import types

import torch

from .._compile import backend, step
from .._core import storage
from . import current

CHECKED_ON = ("2.13",)


@dataclasses.dataclass(frozen=True)
class Patch:
    target: str
    why: str
    where: str = "patches.install(), at import"
    checked_on: tuple = CHECKED_ON


_SET_DEVICE = ("PyTorch's device guard for Python backends always answers device 0, so "
               "torch.tpu.set_device(local_rank) (torchrun's layout) would be ignored")
_DYNAMO = "_compile/backend.skip_own_frames(), at the first compilation for tpu (imports Dynamo)"

PATCHES = [
    Patch("torch.nn.Module._apply",
          "module.to('tpu') gives each module a new Parameter (PyTorch's list of 'shallow-copy "
          "compatible' backends leaves out PrivateUse1), untying shared weights; the ties are "
          "restored as on CUDA"),
    Patch("torch.Tensor.data (its setter; the getter is TensorBase's own)",
          "`p.data = t` between the CPU and tpu (FSDP2's `fully_shard` moves a CPU module's "
          "parameters to its mesh's device this way, as user code does on CUDA) fails "
          "PyTorch's check that the two are 'shallow-copy compatible', whose list of dense "
          "backends leaves out PrivateUse1 (pytorch/pytorch#196975); such a leaf takes `t`'s "
          "tensor in place, keeping its object, class, attributes, requires_grad and grad"),
    Patch("torch.Tensor.to", "an index-less 'tpu' means the current device: " + _SET_DEVICE),
    Patch("torch.accelerator.current_device_index, current_device_idx", _SET_DEVICE),
    Patch("torch.accelerator.set_device_index, set_device_idx", _SET_DEVICE),
    Patch("torch.accelerator.empty_cache, memory_stats, reset_peak_memory_stats, "
          "reset_accumulated_memory_stats, get_memory_info (and "
          "torch.accelerator.memory's, which memory_allocated and the others read)",
          "PyTorch's ask the device's C++ caching allocator, which a Python backend cannot "
          "register (an internal assert fails); accelerate >= 1.16 calls "
          "torch.accelerator.empty_cache() in Trainer.train() for devices it does not know"),
    Patch("torch.UntypedStorage.resize_",
          "PyTorch resizes a PrivateUse1 storage through a C++ hook Python cannot provide; "
          "FSDP2 frees and re-creates parameters with resize_(0) / resize_(n)"),
    Patch("torch.compile",
          "the first call makes Dynamo skip torchtpu's and JAX's frames, so importing "
          "torchtpu does not import Dynamo; backend=\"tpu\" with mode=\"reduce-overhead\" "
          "returns a whole step replayed as one executable (_compile/step.py)"),
    Patch("torch._TorchCompileInductorWrapper.__call__",
          "torch.compile's default backend (inductor) cannot generate code for tpu: graphs "
          "with tpu inputs go to the tpu backend"),
    Patch("torch._dynamo.trace_rules.SKIP_DIRS",
          "torchtpu's layers and JAX run below the dispatcher: Dynamo must not trace them",
          _DYNAMO),
    Patch("torch._dynamo.variables.optimizer.OptimizerVariable._set_capturable",
          "Dynamo compiles capturable optimizer steps only for CUDA/XPU parameters; on the "
          "host `step` would split every compiled step", _DYNAMO),
    Patch("torch._dynamo.variables.optimizer.OptimizerVariable.__init__",
          "the same marking where a step inlined into a compiled caller never reads "
          "`param_groups` through Dynamo's hook (a second optimizer in one process)", _DYNAMO),
    Patch("jax.config jax_enable_x64",
          "int64 (PyTorch's index type) and float64 would silently narrow",
          "_core/runtime.py, at import: before any array exists"),
    Patch("jax.config jax_cpu_collectives_implementation",
          "cross-process collectives on the CPU run on gloo",
          "_distributed/launch.py, before jax.distributed.initialize"),
    Patch("jax.config jax_compilation_cache_dir, jax_persistent_cache_min_compile_time_secs",
          "the persistent executable cache", "_compile/cache.enable(), at import"),
    Patch("torch.tpu's module class", "torch.tpu.eager_mode reads and assigns like an attribute",
          "_frontend/torch_tpu.py, at import"),
    Patch("torch.optim's global optimizer step post hook",
          "fused eager runs its trace when optimizer.step() returns",
          "_execution/fused.install(), at import"),
    Patch("torch.optim's global optimizer step pre hook",
          "SGD momentum buffers exist before the first step, which then compiles as every later one",
          "_execution/optimizer_state.install(), at import"),
    Patch("torch.optim's global optimizer step pre hook",
          "optimizers without state yet that a mode=\"reduce-overhead\" step warms up keep "
          "their state on the device (capturable, as Dynamo makes a compiled step's), so the "
          "step can be captured",
          "_compile/step.py, registered for each eager warm-up call and removed after it"),
    Patch("`__dynamo_disable` of the functions torch._disable_dynamo wraps (PyTorch's Python "
          "references, meta kernels and decompositions)",
          "their first call imports Dynamo (1.3-2.2 s here) to disable it around them, and "
          "many meta kernels of tpu ops are such functions: a process's first op on tpu paid "
          "it, where CPU torch does not. Until Dynamo is imported nothing can be tracing "
          "them, so they run as they are; their first call after that disables Dynamo as "
          "PyTorch's wrapper would (found by one scan of the garbage collector's objects, "
          "~0.07 s). torch.optim's are left as PyTorch made them: an optimizer's first step "
          "imports Dynamo anyway (its `_use_grad`), and stock PyTorch pays that import when "
          "the optimizer is made (`add_param_group`), not inside the first training step"),
    Patch("accelerate.state.PartialState.default_device (through a sys.meta_path finder)",
          "accelerate knows a fixed list of device types and would keep the Trainer's batches "
          "on the CPU while its model is on tpu; it picks tpu where it would pick the CPU",
          "torchtpu_autoload._install_accelerate_hook(), at import torch: accelerate.state is "
          "patched when it is imported"),
]


def _replace(owner, name, new):
    """`owner.name = new` once per process (a second import leaves the first patch)."""
    if not getattr(getattr(owner, name), "_torchtpu_patch", False):
        new._torchtpu_patch = True
        setattr(owner, name, new)


def install():
    acc = torch.accelerator
    _replace(torch.nn.Module, "_apply", _keeping_ties(torch.nn.Module._apply))
    _replace(torch.Tensor, "to", current.tensor_to)
    if not isinstance(torch.Tensor.__dict__.get("data"), property):
        torch.Tensor.data = property(torch._C.TensorBase.data.__get__, _set_data,
                                     doc=torch._C.TensorBase.data.__doc__)
    for name in ("current_device_index", "current_device_idx"):
        _replace(acc, name, current.current_device_index)
    for name in ("set_device_index", "set_device_idx"):
        _replace(acc, name, current.set_device_index)
    for name in ("empty_cache", "memory_stats", "reset_peak_memory_stats",
                 "reset_accumulated_memory_stats", "get_memory_info"):
        fn = current.accelerator_memory(getattr(acc.memory, name), name)
        _replace(acc.memory, name, fn)
        _replace(acc, name, fn)
    _replace(torch.UntypedStorage, "resize_", storage.resize_storage)
    _replace(torch, "compile", backend.skipping_own_frames(step.whole_step(torch.compile)))
    wrapper = torch._TorchCompileInductorWrapper
    _replace(wrapper, "__call__", backend.routed_to_tpu(wrapper.__call__))
    if "torch._dynamo" not in sys.modules:
        _defer_dynamo_disable()


# --- torch._disable_dynamo: no Dynamo import before Dynamo is used ---------------------------
class _UntilDynamoImported:
    """What `torch._disable_dynamo`'s wrapper calls for `fn` (its `__dynamo_disable`): `fn`
    itself while Dynamo is not imported, then (and from then on) `fn` with Dynamo disabled,
    made as PyTorch's wrapper makes it."""
    __slots__ = ("fn", "recursive")

    def __init__(self, fn, recursive):
        self.fn = fn
        self.recursive = recursive

    def __call__(self, *args, **kwargs):
        disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
        if disable is None:  # (also while Dynamo is being imported)
            return self.fn(*args, **kwargs)
        try:
            disabled = disable(self.fn, self.recursive, wrapping=False)
        except TypeError:  # a release whose disable() takes no `wrapping`
            disabled = disable(self.fn, self.recursive)
        setattr(self.fn, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)


def _defer_dynamo_disable():
    """Give every function that torch._disable_dynamo has wrapped so far an
    `_UntilDynamoImported` (PATCHES).  Its wrappers share one code object; they are reached
    only through the functions calling them, so they are found among all objects."""
    inner = torch._disable_dynamo(_defer_dynamo_disable).__code__
    if inner.co_freevars[:2] != ("fn", "recursive"):
        return  # another release's wrapper: left as it is
    for f in gc.get_objects():
        if type(f) is types.FunctionType and f.__code__ is inner:
            fn, recursive = (cell.cell_contents for cell in f.__closure__[:2])
            if (getattr(fn, "__module__", None) or "").startswith("torch.optim"):
                continue  # (PATCHES says why)
            if getattr(fn, "__dynamo_disable", None) is None:
                setattr(fn, "__dynamo_disable", _UntilDynamoImported(fn, recursive))


# --- Tensor.data = t across the CPU and tpu ----------------------------------------------------
_base_set_data = torch._C.TensorBase.data.__set__


def _set_data(self, new):
    try:
        return _base_set_data(self, new)
    except RuntimeError as e:
        if not (isinstance(new, torch.Tensor) and "incompatible tensor type" in str(e)
                and "tpu" in (self.device.type, new.device.type) and self.is_leaf):
            raise
        error = e
    # What set_data does between two dense devices (CPU and CUDA): the object keeps its
    # identity, class, attributes, requires_grad and grad, and takes `new`'s tensor.  The
    # tensor (TensorImpl) changes: it is swapped in, as nn.Module's conversions swap tensors.
    grad = self.grad
    replacement = new.detach().requires_grad_(self.requires_grad)
    if grad is not None:
        replacement.grad = grad.to(new.device)
    try:
        torch._C._swap_tensor_impl(self, replacement)
    except RuntimeError as swap_error:  # the old tensor is shared (a view, the autograd graph)
        raise error from swap_error


# --- nn.Module._apply: keeping tied parameters tied ------------------------------------------
_depth = threading.local()


def _places(module):
    """Each Parameter object (by id) -> the object and every (module, name) holding it."""
    places = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                places.setdefault(id(p), (p, []))[1].append((mod, name))
    return places.values()


def _keeping_ties(original):
    """After a conversion, modules that shared one Parameter share the converted one again."""
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
    return _apply
