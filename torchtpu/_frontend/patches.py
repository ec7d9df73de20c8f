"""Every patch torchtpu makes to PyTorch's and JAX's global state: what it changes, why, the
function that applies it, when, and the torch versions it was checked on.  A registration that
puts torchtpu's code into their global state (a global optimizer hook, a JAX event listener,
torch.load's location tag) is one too: it runs for every user of that state.

`install()` applies those made at import, in this order.  The others are applied by their
function, and only by it, at the moment `when` says (and why then).  tests/test_patches.py
checks the list at run time: every attribute of torch, jax or accelerate that holds torchtpu's
code or a changed config value after `import torchtpu`, a first device use and a first
compilation must be a target of an entry; and an assignment to a torch or jax global may only
be made in a function an entry names."""
import dataclasses
import gc
import sys
import threading
import types

import torch

import torchtpu_autoload

from .._compile import backend, step
from .._core import runtime, storage
from .._distributed import fsdp, launch
from .._execution import (flex_attention_kernels, fused, optimizer_state, persistent_cache,
                          tpu_graphs, views)
from . import current, torch_tpu

CHECKED_ON = ("2.13",)
AT_IMPORT = "patches.install(), at import (start-up step 5, torchtpu/_startup.py)"


@dataclasses.dataclass(frozen=True)
class Patch:
    targets: tuple  # the attributes it changes, dotted as a user reaches them
    why: str
    apply: object  # the function that makes it
    when: str = AT_IMPORT
    checked_on: tuple = CHECKED_ON


def _replace(owner, name, new):
    """`owner.name = new` once per process (a second import leaves the first patch)."""
    if not getattr(getattr(owner, name), "_torchtpu_patch", False):
        new._torchtpu_patch = True
        setattr(owner, name, new)


_ACCELERATOR_MEMORY = ("empty_cache", "memory_stats", "reset_peak_memory_stats",
                       "reset_accumulated_memory_stats", "get_memory_info")


def _keep_ties():
    _replace(torch.nn.Module, "_apply", _keeping_ties(torch.nn.Module._apply))


def _current_device_to():
    _replace(torch.Tensor, "to", current.tensor_to)


def _data_setter():
    if not isinstance(torch.Tensor.__dict__.get("data"), property):
        torch.Tensor.data = property(torch._C.TensorBase.data.__get__, _set_data,
                                     doc=torch._C.TensorBase.data.__doc__)


def _current_device_index():
    for name in ("current_device_index", "current_device_idx"):
        _replace(torch.accelerator, name, current.current_device_index)


def _set_device_index():
    for name in ("set_device_index", "set_device_idx"):
        _replace(torch.accelerator, name, current.set_device_index)


def _accelerator_memory():
    acc = torch.accelerator
    for name in _ACCELERATOR_MEMORY:
        fn = current.accelerator_memory(getattr(acc.memory, name), name)
        _replace(acc.memory, name, fn)
        _replace(acc, name, fn)


def _resize_storage():
    _replace(torch.UntypedStorage, "resize_", views.resize_storage)


def _compile():
    _replace(torch, "compile", backend.skipping_own_frames(step.whole_step(torch.compile)))


def _route_inductor():
    wrapper = torch._TorchCompileInductorWrapper
    _replace(wrapper, "__call__", backend.routed_to_tpu(wrapper.__call__))


def _defer_dynamo_disable_until_imported():
    if "torch._dynamo" not in sys.modules:
        _defer_dynamo_disable()


def _storage_constructor():
    base_new = torch._C.StorageBase.__new__

    def __new__(cls, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "tpu":
            return storage.new_untyped(*args, device=torch.device(device), **kwargs)
        if device is not None:
            kwargs["device"] = device
        return base_new(cls, *args, **kwargs)
    _replace(torch.UntypedStorage, "__new__", __new__)


def _refuse_dlpack():
    import torch.utils.dlpack
    original = torch.utils.dlpack.to_dlpack

    def to_dlpack(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "tpu":
            raise RuntimeError(
                "Can't export a tpu tensor to DLPack: its memory is held by the XLA runtime, "
                "which gives no pointer another framework may read. Copy it to the host first "
                "(tensor.cpu()).")
        return original(tensor, *args, **kwargs)
    for module in (torch.utils.dlpack, torch):
        if getattr(module, "to_dlpack", None) is original:
            _replace(module, "to_dlpack", to_dlpack)
    exporter = torch.Tensor.__dlpack__

    def __dlpack__(self, *args, **kwargs):
        if self.device.type == "tpu":
            to_dlpack(self)  # raises
        return exporter(self, *args, **kwargs)
    _replace(torch.Tensor, "__dlpack__", __dlpack__)


def older_pytorch_test_files():
    """What PyTorch's test files of older releases need to import under the installed torch
    (the conformance runner's worker calls this before importing one): attributes it dropped,
    set only where missing (torch._C.has_mkldnn; distutils.version, which test_spectral_ops.py
    reads without importing it), `test_x_cpu` defined beside a generic `test_x` (2.1's
    test_nn.py, @onlyCPU) renamed `test_x_cpu_only` before instantiation (instantiating `test_x`
    for the CPU makes the same name, which newer releases refuse: "Redefinition of test"), and
    set-up hooks calling `super(self.__class__, self)` made finite (_as_class)."""
    try:
        import distutils.version  # noqa: F401
    except ImportError:  # Python 3.12 has no distutils
        pass
    if not hasattr(torch._C, "has_mkldnn"):
        torch._C.has_mkldnn = torch.backends.mkldnn.is_available()
    from torch.testing._internal import common_device_type as cdt
    original = cdt.instantiate_device_type_tests

    def instantiate_device_type_tests(generic_test_class, scope, *args, **kwargs):
        members = vars(generic_test_class)
        for name in [n for n in members if n.startswith("test_")]:
            for device in ("cpu", "cuda"):
                if name.endswith(f"_{device}") and name[:-len(device) - 1] in members:
                    setattr(generic_test_class, f"{name}_only", members[name])
                    delattr(generic_test_class, name)
        for hook in ("setUp", "tearDown"):
            fn = members.get(hook)
            if fn is not None and "__class__" in fn.__code__.co_names:
                setattr(generic_test_class, hook, _as_class(fn, generic_test_class))
        return original(generic_test_class, scope, *args, **kwargs)
    _replace(cdt, "instantiate_device_type_tests", instantiate_device_type_tests)


def _as_class(hook, cls):
    """2.1's test_linalg.py calls `super(self.__class__, self).setUp()`, which recurses forever
    once the device class derives from the generic one (newer releases): the hook runs with
    `self` seen as the generic class, whose super() is TestCase's."""
    def run(self):
        real, self.__class__ = self.__class__, cls
        try:
            return hook(self)
        finally:
            self.__class__ = real
    return run


def _flex_attention_device():
    from torch.nn.attention import flex_attention  # (7 ms; it imports no Dynamo)
    _replace(flex_attention, "_validate_device",
             _flex_attention_on_tpu(flex_attention._validate_device))


def _flex_attention_on_tpu(original):
    def _validate_device(query, key, value):
        if query.device.type != "tpu":
            original(query, key, value)
    return _validate_device


_SET_DEVICE = ("PyTorch's device guard for Python backends always answers device 0, so "
               "torch.tpu.set_device(local_rank) (torchrun's layout) would be ignored")
_DYNAMO = "the first compilation for tpu (imports Dynamo), by _compile/backend.skip_own_frames()"
_AUTOLOAD = ("torchtpu_autoload.install(), at `import torch` (or at `import torchtpu`: "
             "start-up step 1, torchtpu/_startup.py)")
_OPTIMIZER_HOOKS = ("torch.optim.optimizer._global_optimizer_pre_hooks",
                    "torch.optim.optimizer._global_optimizer_post_hooks")

PATCHES = [
    Patch(("jax.config.jax_enable_x64",),
          "int64 (PyTorch's index type) and float64 would silently narrow",
          runtime.enable_x64, "_core/runtime.py, at import: before any array exists"),
    Patch(("jax._src.xla_bridge._backend_factories",),
          "with libtpu installed and no TPU chip on the PCI bus, JAX would load libtpu at its "
          "first use and print its complaints about the host; its TPU backend is not offered",
          runtime.skip_absent_tpu, "_core/runtime.py, at import: before any backend starts"),
    Patch(("torch.tpu.__class__",), "torch.tpu.eager_mode reads and assigns like an attribute",
          torch_tpu.use_device_module_class,
          "_frontend/torch_tpu.py, at import: before the module is registered as torch.tpu"),
    Patch(("torch.serialization._package_registry",),
          "torch.save/torch.load of tpu storages; torch.load(map_location='tpu') as the first "
          "use would otherwise copy into a storage the device cannot make before it loads",
          torchtpu_autoload._register_serialization, _AUTOLOAD),
    Patch(("torch.distributed.Backend._plugins",),
          "the c10d backend \"tpu\" (init_process_group(\"tpu\") loads the device); its only "
          "registration, whether torchtpu or the autoload comes first",
          torchtpu_autoload._register_c10d_backend, _AUTOLOAD),
    Patch(("accelerate.state.PartialState.default_device", "sys.meta_path"),
          "accelerate knows a fixed list of device types and would keep the Trainer's batches "
          "on the CPU while its model is on tpu; it picks tpu where it would pick the CPU. "
          "A sys.meta_path finder patches accelerate.state when it is imported (`import torch` "
          "must not import accelerate)",
          torchtpu_autoload._install_accelerate_hook, _AUTOLOAD),
    Patch(("torch.nn.Module._apply",),
          "module.to('tpu') gives each module a new Parameter (PyTorch's list of 'shallow-copy "
          "compatible' backends leaves out PrivateUse1), untying shared weights; the ties are "
          "restored as on CUDA", _keep_ties),
    Patch(("torch.Tensor.data",),
          "`p.data = t` between the CPU and tpu (FSDP2's `fully_shard` moves a CPU module's "
          "parameters to its mesh's device this way, as user code does on CUDA) fails "
          "PyTorch's check that the two are 'shallow-copy compatible', whose list of dense "
          "backends leaves out PrivateUse1 (pytorch/pytorch#196975); such a leaf takes `t`'s "
          "tensor in place, keeping its object, class, attributes, requires_grad and grad. "
          "A property on torch.Tensor whose getter is TensorBase's own", _data_setter),
    Patch(("torch.Tensor.to",), "an index-less 'tpu' means the current device: " + _SET_DEVICE,
          _current_device_to),
    Patch(("torch.accelerator.current_device_index", "torch.accelerator.current_device_idx"),
          _SET_DEVICE, _current_device_index),
    Patch(("torch.accelerator.set_device_index", "torch.accelerator.set_device_idx"),
          _SET_DEVICE, _set_device_index),
    Patch(tuple(f"torch.accelerator.{name}" for name in _ACCELERATOR_MEMORY)
          + tuple(f"torch.accelerator.memory.{name}" for name in _ACCELERATOR_MEMORY),
          "PyTorch's ask the device's C++ caching allocator, which a Python backend cannot "
          "register (an internal assert fails); accelerate >= 1.16 calls "
          "torch.accelerator.empty_cache() in Trainer.train() for devices it does not know. "
          "torch.accelerator.memory's too: memory_allocated and the others read them",
          _accelerator_memory),
    Patch(("torch.UntypedStorage.resize_",),
          "PyTorch resizes a PrivateUse1 storage through a C++ hook Python cannot provide; "
          "FSDP2 frees and re-creates parameters with resize_(0) / resize_(n)", _resize_storage),
    Patch(("torch.UntypedStorage.__new__",),
          "PyTorch allocates `UntypedStorage(n, device=...)` with the device's C++ allocator, "
          "which a Python backend cannot register: for tpu it crashed the process (deepcopy "
          "and clone of a storage make one)", _storage_constructor),
    Patch(("torch.utils.dlpack.to_dlpack", "torch.to_dlpack", "torch.Tensor.__dlpack__"),
          "PyTorch packs a PrivateUse1 tensor's data pointer into the capsule, and ours is no "
          "address: torch.from_dlpack of it made a tensor without a tpu storage", _refuse_dlpack),
    Patch(("torch._C.has_mkldnn",
           "torch.testing._internal.common_device_type.instantiate_device_type_tests"),
          "PyTorch's own test files of older releases (../shared/pytorch-tests: 2.1) import "
          "under the installed torch", older_pytorch_test_files,
          when="the conformance runner's worker, before it imports a PyTorch test file"),
    Patch(("torch.compile",),
          "the first call makes Dynamo skip torchtpu's and JAX's frames, so importing "
          "torchtpu does not import Dynamo; backend=\"tpu\" with mode=\"reduce-overhead\" "
          "returns a whole step replayed as one executable (_compile/step.py)", _compile),
    Patch(("torch._TorchCompileInductorWrapper.__call__",),
          "torch.compile's default backend (inductor) cannot generate code for tpu: graphs "
          "with tpu inputs go to the tpu backend", _route_inductor),
    Patch(("__dynamo_disable of the functions torch._disable_dynamo wraps",),
          "PyTorch's Python references, meta kernels and decompositions: their first call "
          "imports Dynamo (1.3-2.2 s here) to disable it around them, and many meta kernels of "
          "tpu ops are such functions: a process's first op on tpu paid it, where CPU torch "
          "does not. Until Dynamo is imported nothing can be tracing them, so they run as they "
          "are; their first call after that disables Dynamo as PyTorch's wrapper would (found "
          "by one scan of the garbage collector's objects, ~0.07 s). torch.optim's are left as "
          "PyTorch made them: an optimizer's first step imports Dynamo anyway (its "
          "`_use_grad`), and stock PyTorch pays that import when the optimizer is made "
          "(`add_param_group`), not inside the first training step",
          _defer_dynamo_disable_until_imported),
    Patch(("torch.nn.attention.flex_attention._validate_device",),
          "FlexAttention refuses devices outside its list (cuda, cpu, xpu, hpu, mps: \"only "
          "supported on CUDA, CPU, HPU, or MPS devices\"); on tpu its eager path and compiled "
          "graphs run the flex_attention operator's own dense implementation in tpu ops, "
          "forward and backward (the CPU's refusal of a backward stays the CPU's)",
          _flex_attention_device),
    Patch(("torch._higher_order_ops.flex_attention.flex_attention.py_kernels",
           "torch._higher_order_ops.flex_attention.flex_attention_backward.py_kernels"),
          "the flex_attention operators' kernels for tpu tensors (PrivateUse1, below "
          "autograd; eager and compiled): JAX's Pallas splash-attention kernel for the calls "
          "it takes, the operators' own dense implementation for the others "
          "(_execution/flex_attention_kernels.py)", flex_attention_kernels.install),
    Patch(_OPTIMIZER_HOOKS[1:], "fused eager runs its trace when optimizer.step() returns",
          fused.install),
    Patch(_OPTIMIZER_HOOKS[:1],
          "SGD momentum buffers exist before the first step, which then compiles as every "
          "later one", optimizer_state.install),
    Patch(_OPTIMIZER_HOOKS,
          "a torch.tpu graph being captured refuses optimizers that are not capturable or have "
          "no state yet before their step, and records the step's end after it",
          tpu_graphs.install),
    Patch(("jax._src.compilation_cache._cache", "jax._src.compilation_cache._cache_initialized",
           "jax.config.jax_compilation_cache_dir",
           "jax.config.jax_persistent_cache_min_compile_time_secs",
           "jax._src.monitoring._event_listeners"),
          "the persistent executable cache: JAX takes any CacheInterface as its backend once "
          "`_cache` is set, and ours keeps entries private and verified (JAX's own file cache "
          "creates files with the umask and loads whatever it finds); JAX consults it only "
          "when jax_compilation_cache_dir is set; the listener counts JAX's cache hits in "
          "torchtpu.metrics(). Nothing is patched when the cache is off",
          persistent_cache.enable),
    Patch(("torch._dynamo.trace_rules.SKIP_DIRS",),
          "torchtpu's layers and JAX run below the dispatcher: Dynamo must not trace them",
          backend.skip_own_frames, _DYNAMO),
    Patch(("torch._dynamo.variables.optimizer.OptimizerVariable._set_capturable",
           "torch._dynamo.variables.optimizer.OptimizerVariable.__init__"),
          "Dynamo compiles capturable optimizer steps only for CUDA/XPU parameters; on the "
          "host `step` would split every compiled step. __init__ marks them too where a step "
          "inlined into a compiled caller never reads `param_groups` through Dynamo's hook (a "
          "second optimizer in one process)", backend.capturable_optimizers_on_tpu, _DYNAMO),
    Patch(_OPTIMIZER_HOOKS[:1],
          "optimizers without state yet that a mode=\"reduce-overhead\" step warms up keep "
          "their state on the device (capturable, as Dynamo makes a compiled step's), so the "
          "step can be captured", step.capturable_optimizers,
          "_compile/step.py, around each eager warm-up call (the hook is removed after it)"),
    Patch(tuple(f"torch.distributed.fsdp._fully_shard._fsdp_param_group.{name}" for name in
                ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"))
          + ("sys.meta_path",),
          "on a group over TPU chips, FSDP2 gathers and reduce-scatters each parameter on its "
          "own: its one buffer per unit, copied in and out column by column, compiled on TPU "
          "to relayout loops over the whole unit (one Llama-1B layer's step on v5e:2x2: 45.6 "
          "against 34.9 GB, compile 78 against 36 s); FSDP2's own functions run everywhere else", fsdp.install,
          "_distributed/process_group.py, when a tpu process group is made (FSDP2 needs one), "
          "or by a sys.meta_path finder when FSDP2 is imported after it (importing it there "
          "would import and register more of torch.distributed than the job uses)"),
    Patch(("jax.config.jax_cpu_collectives_implementation", "os.environ XLA_FLAGS"),
          "cross-process collectives on the CPU run on gloo; and --xla_cpu_enable_concurrency_"
          "optimized_scheduler=false (unless XLA_FLAGS names it): that scheduler ordered "
          "collectives that do not depend on each other differently in different processes, "
          "and gloo pairs them by order (two FSDP blocks' all-gathers swapped their data); "
          "--xla_gpu_enable_latency_hiding_scheduler=true (unless named): a GPU program's "
          "collectives overlap its compute, as NVIDIA's JAX images set it",
          launch.initialize,
          "_distributed/launch.initialize(), before jax.distributed.initialize (multi-process "
          "jobs only; XLA reads its flags when its backends start, which is after)"),
]

_installed = []


def install():
    """Apply the patches made at import, once per process."""
    if _installed:
        return
    _installed.append(True)
    for patch in PATCHES:
        if patch.when == AT_IMPORT:
            patch.apply()


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
