"""`torch.compile(backend="tpu")`: Dynamo graphs through AOTAutograd (forward and backward
graphs in core ATen after decompositions), each compiled by fx_graph.CompiledGraph."""
import functools
import itertools
import warnings

import torch

from . import fx_graph

_graph_ids = itertools.count()
_OPTIONS = {"cpu_fallback"}


@functools.lru_cache(maxsize=None)
def _decompositions():
    from torch._decomp import core_aten_decompositions
    from .._core import registry
    table = dict(core_aten_decompositions())
    # Ops the lowering table implements directly stay whole (one fused kernel, not many).
    for op in list(table):
        if op in registry.TABLE:
            del table[op]
    return table


def _compiler(kind, options):
    def compile_graph(gm, example_inputs):
        name = f"{kind}_{next(_graph_ids)}"
        missing = fx_graph.unsupported_ops(gm)
        compiled = fx_graph.CompiledGraph(gm, name)
        if missing:
            op, where = missing[0]
            if options.get("cpu_fallback", torch.tpu.enable_cpu_fallback):
                warnings.warn(f"torchtpu: compiled graph {name} runs op by op with a CPU fallback: "
                              f"{', '.join(sorted({m for m, _ in missing}))} have no tpu lowering")
                compiled.eager = True
            else:
                raise NotImplementedError(
                    f"The operator '{op}' is not implemented for the tpu device and appears in a "
                    f"torch.compile graph" + (f", from:\n{where}" if where else "") +
                    "\nSet torch.tpu.enable_cpu_fallback = True to run such graphs op by op with "
                    "a CPU fallback for the missing op.")
        return compiled

    return compile_graph


def tpu_backend(gm, example_inputs, mode=None, options=None):
    """The Dynamo backend registered as "tpu"."""
    from torch._dynamo import disable
    from torch._functorch.aot_autograd import aot_module_simplified
    skip_own_frames()
    options = dict(options or {})
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"Unknown torchtpu compile options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    # `mode` ("default", "reduce-overhead", "max-autotune") changes nothing here: every graph
    # is already one XLA executable without per-op overhead.
    # aot_module_simplified directly rather than Dynamo's aot_autograd wrapper, which imports
    # inductor (a second of start-up) for its logging.
    compiled = aot_module_simplified(gm, example_inputs,
                                     fw_compiler=_compiler("forward", options),
                                     bw_compiler=_compiler("backward", options),
                                     inference_compiler=_compiler("inference", options),
                                     decompositions=_decompositions(),
                                     keep_inference_input_mutations=True)
    return disable(compiled, reason="a compiled tpu graph")


def _has_tpu_tensor(inputs):
    return any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in inputs)


def routed_to_tpu(original):
    """`torch.compile(model)` uses inductor, which cannot generate code for this device:
    graphs whose inputs live on tpu go to the tpu backend instead (the replacement of
    `torch._TorchCompileInductorWrapper.__call__`)."""
    def __call__(self, model_, inputs_):
        if _has_tpu_tensor(inputs_):
            return tpu_backend(model_, inputs_)
        return original(self, model_, inputs_)
    return __call__


_skipping = [False]


def skip_own_frames():
    """Dynamo must not trace into the device's own Python (this package and JAX): those frames
    run as kernels below the dispatcher, also between compiled graphs."""
    if _skipping[0]:
        return
    import os

    import jax
    import jaxlib
    from torch._dynamo import trace_rules

    for package in (jax, jaxlib):
        trace_rules.SKIP_DIRS.append(package.__path__[0] + os.sep)
    # torchtpu's own layers, named by path (the front door sits above this package).
    root = os.path.dirname(os.path.dirname(__file__))
    for name in ("_core", "_lowerings", "_execution", "_compile", "_frontend"):
        trace_rules.SKIP_DIRS.append(os.path.join(root, name) + os.sep)
    trace_rules._recompile_re()
    capturable_optimizers_on_tpu()
    _skipping[0] = True


def capturable_optimizers_on_tpu():
    """Dynamo compiles optimizer steps in capturable form (state such as `step` on the
    device) only for CUDA/XPU parameters; on the host, `step` would split every compiled
    step into host work.  Mark still-uninitialised groups of tpu parameters capturable too.

    Dynamo marks them when a trace reads `param_groups` through the optimizer's variable, which
    a step inlined into an already-compiled caller may never do (a second optimizer compiled in
    the same process: its foreach step then traced the host path and failed, "Expected scalars
    to be on CPU, got meta").  So the groups are also marked when that variable is made."""
    from torch._dynamo.variables.optimizer import OptimizerVariable
    original = getattr(OptimizerVariable, "_set_capturable", None)
    if original is None:  # a private hook of Dynamo's; without it, steps compile non-capturable
        warnings.warn("torchtpu: this torch's Dynamo has no OptimizerVariable._set_capturable; "
                      "compiled optimizer steps on tpu keep their state on the host")
        return
    if getattr(original, "_torchtpu", False):
        return
    original_init = OptimizerVariable.__init__

    def _set_capturable(self, tx):
        mark_capturable(self.value)
        return original(self, tx)

    def __init__(self, value, *args, **kwargs):
        mark_capturable(value)
        original_init(self, value, *args, **kwargs)

    _set_capturable._torchtpu = True
    OptimizerVariable._set_capturable = _set_capturable
    OptimizerVariable.__init__ = __init__


def mark_capturable(optimizer):
    for group in optimizer.param_groups:
        params = group.get("params", [])
        if ("capturable" in group and params
                and all(p.device.type == "tpu" and p not in optimizer.state for p in params)):
            group["capturable"] = True


def skipping_own_frames(compile_):
    """`torch.compile` that first runs `skip_own_frames()`.  Dynamo finds the "tpu" backend
    through this package's `torch_dynamo_backends` entry point, so importing torchtpu does not
    import Dynamo; its settings are made by the first torch.compile call."""
    @functools.wraps(compile_)
    def compile(*args, **kwargs):
        skip_own_frames()
        return compile_(*args, **kwargs)
    return compile
