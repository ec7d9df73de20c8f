"""torch.tpu graphs: a whole step captured once into one executable and replayed, with the API
of torch.cuda graphs (TPUGraph, `with torch.tpu.graph(g):`, `g.replay()`,
`make_graphed_callables`).

Capture records the step into a fused eager trace that is never flushed while capturing: a
backward pass, `optimizer.step()` and the trace's length do not cut it, and anything that
needs a value before the end (a host read, a data-dependent op, a CPU fallback) is a capture
error naming the op and the user's line.  As with CUDA, capture runs nothing: storages the
step writes keep their values, and tensors it creates read as zeros until the first replay.

The graph reads each external input from the storage it came from, so a replay sees what the
static inputs, parameters, gradients and optimizer state hold *now* (`copy_` new data in), and
its results go to the storages the step wrote and to the tensors it created that are still
alive (outputs, new gradients): one executable call, no per-op Python, no recompiles.  The
storages it overwrites are donated.  Random ops draw fresh numbers on each replay (one new
generator offset per op, in eager's order).  Python numbers are baked in: an optimizer's
non-tensor hyperparameters are compared at each replay, and a changed one raises (use a tpu
tensor `lr` with `capturable=True` to schedule it).

A step's index checks run in the executable too.  Its new values for the storages it
overwrites are selected against them, so a failed check leaves every existing tensor as it was
although those storages were donated; the checks are read when the host next waits (see
sync.py), and the error names the op and the line that recorded it.

Memory: a storage's memory belongs to its tensors (PJRT allocates it); graphs keep no private
pool, so `pool=`/`graph_pool_handle()` are accepted for compatibility and change nothing.
"""
import gc

import torch

from .._core import metrics, runtime
from .._core.metrics import FlushReason
from .._core.storage import Array
from . import debug, fused, recording, sync
from .segment import PackedScalars, Segment, donation_warnings_ignored

_capturing = None  # the TPUGraph being captured


class _Pool:
    """What `graph_pool_handle()` and `TPUGraph.pool()` return (see the module docstring)."""


def graph_pool_handle():
    return _Pool()


def is_current_stream_capturing():
    return _capturing is not None


_CHECK_NOTE = ("a device-side check in a torch.tpu graph, read when the host next waited; the "
               "replay changed no existing tensor")
_REASONS = {
    "item": "reads a value on the host",
    "device_to_host": "copies a value to the host",
    "data_dependent": "has an output whose shape depends on the data",
    "cpu_fallback": "has no tpu lowering and would run on the CPU",
    "read": "needs a value computed inside the graph",
}


def _capture_error(e):
    what = _REASONS.get(e.reason, f"forces the recorded ops to run ({e.reason})")
    return RuntimeError(
        f"torch.tpu graph capture: {e.op or 'an op'} {what}, which a captured graph cannot do "
        f"(it runs as one executable at replay); called from {debug.format_where(e.where)}. "
        "Move it out of the captured region.")


class TPUGraph:
    """One captured step (see the module docstring); `keep_graph` is accepted for
    compatibility (the executable is always kept)."""

    def __init__(self, keep_graph=False):
        self._captured = False
        self._capture = None  # (recording.start_capture's handle, the mode to restore)
        self._pool = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        global _capturing
        if _capturing is not None:
            raise RuntimeError("torch.tpu graphs: another graph is being captured")
        if self._captured:
            raise RuntimeError("This TPUGraph instance already owns a captured graph. "
                               "To capture a new graph, create a new instance or call reset().")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._hyper = []
        self._opt_state = {}
        self._capture = recording.start_capture(runtime.current_device(), by_storage=True)
        _capturing = self

    def capture_end(self):
        recorded = self._stop()
        try:
            if not recorded.intact:
                # Only reached when the capture error raised at the op was caught and ignored.
                raise RuntimeError(
                    "torch.tpu graph capture: the captured ops were forced to run part-way")
            with donation_warnings_ignored():
                self._build(recorded)
        finally:
            # Capturing commits nothing: storages the step wrote get back the values they had,
            # and tensors it created read as zeros (like fresh memory) until a replay writes them.
            recorded.restore()

    def _abort(self):
        self._stop().restore()

    def _stop(self):
        global _capturing
        _capturing = None
        capture, self._capture = self._capture, None
        return recording.stop_capture(*capture)

    def _build(self, recorded):
        self._device = recorded.device
        self._inputs = list(recorded.input_storages)
        source = {id(b): k for k, b in enumerate(self._inputs)}
        slots, guarded, self._outputs = [], [], []
        for p in recorded.outputs:
            k = source.get(id(p.owner()))
            if k is not None:  # a storage the step overwrites
                guarded.append((len(slots), k))
            self._outputs.append((p.owner, len(slots)))
            slots.append(p.slot)
        self._written = [k for _, k in guarded]
        written = set(self._written)
        self._held = tuple(int(k in written) for k in range(len(self._inputs)))
        self._where = list(recorded.where)
        self.ran_backward = recorded.ran_backward  # (a compiled step asks, step.py)
        self._scalars = PackedScalars.of(recorded)
        # One runner for recorded op sequences: the graph is a Segment whose results for the
        # storages it overwrites are guarded (a failed check keeps them), so it donates them
        # even where index checks can fail.
        self._segment = Segment.from_recording(recorded, "tpu_graph", slots, guarded, baked=True)
        # Loaded from the store, or compiled on a thread of its own while the host goes on
        # (the first replay waits for it); traced here, so that what the lowering refuses
        # raises here.
        self._segment.prebuild(recorded.inputs, tuple(bool(h) for h in self._held),
                               self._scalars.for_run())
        self._captured = True
        metrics.counters["tpu_graph_captures"] += 1

    def hyperparameters_changed(self):
        """Why the optimizers' Python hyperparameters differ from the captured ones, or None."""
        for group, key, value, optimizer in self._hyper:
            if _hyper_value(group[key]) != value:
                return (f"{type(optimizer).__name__}'s param_groups[...]['{key}'] is {group[key]!r} "
                        f"but was {value!r} when the graph was captured, and that value is baked "
                        "into the graph. To change it between replays, pass it as a tpu tensor "
                        "(e.g. lr=torch.tensor(0.01, device='tpu')) with capturable=True, or "
                        "capture again.")
        return None

    @property
    def input_storages(self):
        """The storages (DeviceBuffers) a replay reads, by input index."""
        return tuple(self._inputs)

    @property
    def written_inputs(self):
        """The input indices whose storages a replay overwrites."""
        return tuple(self._written)

    @property
    def output_storages(self):
        """The storages, still alive, that a replay gives new values."""
        return tuple(b for b in (ref() for ref, _ in self._outputs) if b is not None)

    def replay(self, inputs=None, checked=False):
        """`inputs` (private, for a compiled step): {input index: the storage to read instead};
        `checked`: the caller has just compared the hyperparameters (_hyper_changed)."""
        if not self._captured:
            raise RuntimeError("torch.tpu graphs: replay() of a graph that was not captured")
        fused.flush(FlushReason.GRAPH_REPLAY)
        changed = None if checked else self.hyperparameters_changed()
        if changed is not None:
            raise RuntimeError(f"torch.tpu graph replay: {changed}")
        if inputs:
            inputs = [inputs.get(k, b) for k, b in enumerate(self._inputs)]
        else:
            inputs = self._inputs
        arrays = [b.peek() for b in inputs]
        for k, b in enumerate(inputs):
            if type(arrays[k]) is not Array:
                arrays[k] = b.value()
        segment = self._segment
        packed = self._scalars.for_run()
        # Donated: what nothing but its storage, which the step overwrites, holds.
        call = segment.prepare(arrays, packed, held=self._held)
        results, checks = segment.run(arrays, call, packed)
        del arrays
        metrics.counters["tpu_graph_replays"] += 1
        if any(checks):  # read when the host next waits (sync.defer)
            sync.defer(checks, segment.check_error(self._where, _CHECK_NOTE))
        for ref, r in self._outputs:
            b = ref()
            if b is not None:
                b.array = results[r]
        if results:
            sync.track(results[0])  # what torch.tpu.synchronize() waits for

    def reset(self):
        if self._capture is not None:
            self._abort()
        self._captured = False
        self._inputs = self._outputs = self._segment = None

    def pool(self):
        return self._pool

    def instantiate(self):
        """Nothing to do: capture_end() already built the executable."""

    def enable_debug_mode(self):
        pass

    def compile_for(self, target):
        """The captured step compiled for a TPU slice (`target`, e.g. "v5e:1x1", "v6e:2x2",
        "v5e:16x16") by libtpu's compiler, which needs no TPU: a Report of its HBM per chip
        (and whether it fits), the compiler's roofline, FLOPs and bytes, fusions, copies,
        64-bit emulation, collectives and whether each overlaps compute, and compile seconds
        (docs/tpu.md)."""
        if not self._captured:
            raise RuntimeError("torch.tpu graphs: compile_for() of a graph that was not captured")
        arrays = [b.value() for b in self._inputs]
        return self._segment.compile_for(target, arrays, self._scalars.for_run(),
                                         tuple(bool(h) for h in self._held))

    def debug_dump(self, debug_path, platform=None):
        """Write the StableHLO of the captured step to `debug_path`: as this process runs it,
        or as it would be given to XLA on `platform` ("tpu", "cuda", "cpu"), lowered without
        that platform's devices (with collectives: the program every rank runs)."""
        arrays = [b.value() for b in self._inputs]
        if platform is not None:
            text = self._segment.export(arrays, self._scalars.for_run(), [platform])
        else:
            text = self._segment.lower(arrays, self._scalars.for_run()).as_text()
        with open(debug_path, "w") as f:
            f.write(text)


def _hyper_value(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.device.type == "cpu" and v.numel() == 1 else _Tensor
    return v


class _Tensor:
    """Stands for a tpu tensor hyperparameter: its value is read at replay, nothing to check."""


def _before_optimizer_step(optimizer, args, kwargs):
    g = _capturing
    if g is None:
        return
    for group in optimizer.param_groups:
        if group.get("capturable") is False:
            raise RuntimeError(
                f"Attempting TPU graph capture of step() for an instance of "
                f"{type(optimizer).__name__} but param_groups' capturable is False.")
        for key, value in group.items():
            value = _hyper_value(value)
            if key != "params" and value is not _Tensor:
                g._hyper.append((group, key, value, optimizer))
    g._opt_state[id(optimizer)] = len(optimizer.state)


def _after_optimizer_step(optimizer, args, kwargs):
    g = _capturing
    if g is not None and len(optimizer.state) != g._opt_state.get(id(optimizer)):
        raise RuntimeError(
            f"torch.tpu graph capture: {type(optimizer).__name__}.step() created its state "
            "during capture, so the graph would replay its first step. Run a few warm-up "
            "steps before capturing (as CUDA graphs require).")


class graph:
    """`with torch.tpu.graph(g):` captures the enclosed step into `g` (torch.cuda.graph's
    signature; `pool`, `stream` and `capture_error_mode` are accepted and change nothing)."""

    default_capture_stream = None

    def __init__(self, tpu_graph, pool=None, stream=None, capture_error_mode="global",
                 _wait=True):
        self.tpu_graph = tpu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        # (private) False: values strict ops are still compiling are read as values to come
        # (a compiled step captures right after its warm-up call, step.py).
        self._wait = _wait

    def __enter__(self):
        if self._wait:
            torch.tpu.synchronize()
        gc.collect()  # as torch.cuda.graph: unreachable tensors do not become graph outputs
        self.tpu_graph.capture_begin(self.pool, self.capture_error_mode)

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.tpu_graph.capture_end()
            return False
        self.tpu_graph._abort()
        if isinstance(exc, recording.CaptureBroken):
            raise _capture_error(exc) from exc
        return False


def install():
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    register_optimizer_step_pre_hook(_before_optimizer_step)
    register_optimizer_step_post_hook(_after_optimizer_step)


def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           pool=None):
    """torch.cuda.make_graphed_callables for tpu: each callable (a function or a module) gets
    its forward and its backward captured as two graphs; calling the result copies the inputs
    into the static ones and replays them.  Outputs alias the graph's static outputs, as with
    CUDA (the next call overwrites them)."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    result = tuple(_graphed(c, tuple(args), num_warmup_iters, allow_unused_input)
                   for c, args in zip(callables, sample_args))
    return result[0] if single else result


def _graphed(fn, sample_args, warmup, allow_unused):
    from torch.utils._pytree import tree_flatten, tree_unflatten
    module = fn if isinstance(fn, torch.nn.Module) else None
    params = tuple(module.parameters()) if module is not None else ()
    static_in = sample_args + params
    needs_grad = [t for t in static_in if t.requires_grad]

    def run():
        outs, spec = tree_flatten(fn(*sample_args))
        return outs, spec

    def grads(outs, grad_outs):
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad]
        return torch.autograd.grad([o for o, _ in pairs], needs_grad, [g for _, g in pairs],
                                   allow_unused=allow_unused)

    for _ in range(warmup):  # eager steps, as CUDA's docs require before capture
        outs, _ = run()
        if any(o.requires_grad for o in outs):
            grads(outs, [torch.ones_like(o) for o in outs])
        del outs
    fwd, bwd = TPUGraph(), TPUGraph()
    with graph(fwd):
        static_out, spec = run()
    static_grad_out = [torch.empty_like(o) if o.requires_grad else None for o in static_out]
    with graph(bwd):
        computed = grads(static_out, static_grad_out) if needs_grad else ()
    it = iter(computed)
    static_grad_in = [next(it) if t.requires_grad else None for t in static_in]

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for static, x in zip(sample_args, inputs):
                if static is not x:
                    static.copy_(x)
            fwd.replay()
            return tuple(o.detach() for o in static_out)

        @staticmethod
        def backward(ctx, *grad_out):
            for static, g in zip(static_grad_out, grad_out):
                if static is not None and g is not None and static is not g:
                    static.copy_(g)
            bwd.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_in)

    def functional(*args):
        return tree_unflatten(list(Graphed.apply(*args, *params)), spec)

    if module is None:
        return functional
    training, eager_forward = module.training, module.forward

    def forward(*args):
        # Like CUDA's: the graphs hold the mode they were captured in.
        return functional(*args) if module.training == training else eager_forward(*args)

    module.forward = forward
    return module
