"""An FX graph of aten ops as one jitted JAX function, built from the eager lowerings.

The graph is captured once per input layout by running it in fused mode on the real inputs:
that records, for every node, the same cached `run` function strict and fused eager use (so
there is one lowering table), which values it reads and which it produces, and PyTorch computes
every output's shape and strides on the way.  The recording becomes a jitted function of the
inputs' arrays; later calls only gather those arrays, call it, and wrap the results, with no
per-node Python work.  Inputs the graph mutates get their new values in place.
"""
import time
import warnings

import torch

from .._core import storage
from .._execution import bounded, modes, op_keys, recording, sync
from .._execution.segment import PackedScalars, Segment
from .._core import metrics
from .._core import registry

def unsupported_ops(gm):
    """(op name, stack trace) of graph nodes with no tpu kernel."""
    missing = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target.name()
        if target in registry.TABLE:
            continue
        if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in
               ("PrivateUse1", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
                "CompositeImplicitAutograd")):
            continue
        missing.append((str(target), node.meta.get("stack_trace")))
    return missing


def _host_nodes(gm):
    """Nodes that compute CPU tensors: capturing would freeze their values."""
    names = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.device.type == "cpu":
            names.append(f"{node.target} -> {val.device}")
    return names


def arguments_key(args):
    """Everything a capture depends on, for a call's arguments: each tensor's layout as an
    op's executable sees it (op_keys.layout_key: which inputs share storage included), its
    storage's size and device; other arguments by type and value."""
    key = []
    buffers = op_keys.Buffers.new()
    for a in args:
        if isinstance(a, torch.Tensor):
            buf = storage.buffer_or_none(a)
            if buf is None:
                key.append(("host", a.dtype, tuple(a.shape)))
                continue
            key.append((*op_keys.layout_key(a, buf, buffers), buf.nbytes, buf.index))
        else:
            key.append((type(a), a))
    return tuple(key), buffers


class Captured:
    """One graph captured for one input layout."""

    def __init__(self, gm, args, buffers, name):
        devices = {b.index for b in buffers}
        if len(devices) > 1:
            raise RuntimeError(f"torchtpu: compiled graph {name} mixes devices {sorted(devices)}")
        self.device = devices.pop() if devices else torch.tpu.current_device()
        # (value() materialises lazily zeroed storages, so they are inputs, not constants)
        saved = [b.value() for b in buffers]
        try:
            recorded, outs = recording.capture(lambda: gm(*args), self.device)
            mutated = [(j, recorded.pending_of(b)) for j, b in enumerate(buffers)
                       if recorded.pending_of(b)]
        finally:
            for b, a in zip(buffers, saved):  # capturing commits nothing
                b.array = a
        self.name = name
        arrays = {id(a): i for i, a in enumerate(saved)}
        # Where each array the recording read comes from: an input (its buffer's position)
        # or a constant the graph holds.
        self.sources = [arrays.get(id(a), a) for a in recorded.inputs]
        self.where = recorded.where
        self.scalars = PackedScalars.of(recorded)
        result_slots = []

        def result_index(slot):
            if slot not in result_slots:
                result_slots.append(slot)
            return result_slots.index(slot)

        self.mutations = [(j, result_index(p.slot)) for j, p in mutated]
        self.outputs = []
        flat = outs if isinstance(outs, (list, tuple)) else [outs]
        self.returns_sequence = isinstance(outs, (list, tuple))
        for o in flat:
            self.outputs.append(self._output_spec(o, args, recorded, result_index))
        # Inputs the graph overwrites: their storage's reference goes when the results are stored.
        overwritten = {j for j, _ in self.mutations}
        self.held = tuple(int(isinstance(src, int) and src in overwritten) for src in self.sources)
        # A failed check (read later, sync.py) leaves the storages it overwrites as they were.
        read_from = {src: k for k, src in reversed(list(enumerate(self.sources)))
                     if isinstance(src, int)}
        guarded = [(r, read_from[j]) for j, r in self.mutations if j in read_from]
        self.segment = Segment.from_recording(recorded, "graph", result_slots, guarded, baked=True)
        # (this call's input arrays would stay referenced: the first run could not donate them
        # and the second would compile an executable of its own)
        recorded.release()

    @staticmethod
    def _output_spec(o, args, recorded, result_index):
        if not isinstance(o, torch.Tensor):
            return ("value", o)
        for i, a in enumerate(args):
            if o is a:
                return ("arg", i)
        view = (list(o.shape), list(o.stride()), o.storage_offset())
        buf = storage.buffer_or_none(o)
        p = recorded.pending_of(buf) if buf is not None else None
        if p is not None:
            return ("new", result_index(p.slot), *view, o.dtype, buf.nbytes)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and storage.buffer_or_none(a) is buf:
                return ("alias", i, *view)
        if buf is None:
            raise recording.CaptureBroken(f"the graph computes a {o.device} tensor")
        if buf.unwritten:  # a fresh `empty` tensor the graph never wrote
            return ("empty", *view, o.dtype, buf.nbytes)
        return ("constant", o)  # a tensor the graph holds

    def _arguments(self, buffers):
        ext = [buffers[s].value() if isinstance(s, int) else s for s in self.sources]
        return ext, self.scalars.for_run()

    def stablehlo(self, buffers):
        return self.segment.lower(*self._arguments(buffers)).as_text()

    def __call__(self, args, buffers):
        with metrics.span(f"torchtpu::graph {self.name}"):
            return self._run(args, buffers)

    def _run(self, args, buffers):
        ext, packed = self._arguments(buffers)
        # Donated: the arrays of the inputs it overwrites (parameters, optimizer state) that
        # nothing but their storage refers to.
        call = self.segment.prepare(ext, packed, held=self.held)
        results, checks = self.segment.run(ext, call, packed)
        del ext
        if any(checks):
            sync.defer(checks, self.segment.check_error(self.where, f"in compiled graph {self.name}"))
        for j, r in self.mutations:
            buffers[j].array = results[r]
        if results:
            sync.track(results[0])
        outs = []
        storages = {}
        for spec in self.outputs:
            kind = spec[0]
            if kind == "value":
                outs.append(spec[1])
            elif kind == "arg":
                outs.append(args[spec[1]])
            elif kind == "constant":
                outs.append(spec[1])
            elif kind == "empty":
                _, shape, stride, offset, dtype, nbytes = spec
                outs.append(storage.wrap(None, shape, stride, dtype, self.device, nbytes, offset))
            elif kind == "alias":
                _, i, shape, stride, offset = spec
                outs.append(torch.as_strided(args[i], shape, stride, offset))
            else:
                _, r, shape, stride, offset, dtype, nbytes = spec
                st = storages.get(r)
                if st is None:  # outputs that are views of one result share its storage
                    t = storage.wrap(results[r], shape, stride, dtype, self.device, nbytes, offset)
                    storages[r] = t.untyped_storage()
                else:
                    t = storage.empty_on(self.device, shape, dtype)
                    storage.set_storage(t, st, offset, shape, stride)
                outs.append(t)
        return outs if self.returns_sequence else outs[0]


class CompiledGraph:
    """The callable a compiler hands back to AOTAutograd (boxed: takes a list of inputs)."""

    def __init__(self, gm, name):
        # An instance attribute, so that wrappers made with functools.wraps keep it.
        self._boxed_call = True
        self.gm = gm
        self.name = name
        self.variants = bounded.segment_cache("graph_evictions")
        self.eager = False

    def __call__(self, *args):
        # AOTAutograd calls forward graphs boxed (one list) and backward graphs unboxed.
        args = list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)
        if self.eager or modes.get_eager_mode() is modes.CAPTURE:
            # In a torch.tpu graph capture (a whole compiled step, step.py) its ops are recorded
            # into the capture's trace.
            return self.gm(*args)
        key, buffers = arguments_key(args)
        if not self.variants and _host_nodes(self.gm):
            return self._run_eagerly(args, "it computes on the host: " + ", ".join(sorted(set(_host_nodes(self.gm)))))
        captured = self.variants.lookup(key)
        if captured is None:
            if any(isinstance(k, tuple) and k and k[0] == "host" for k in key):
                return self._run_eagerly(args, "it has inputs on the host")
            metrics.counters["graph_captures"] += 1
            if self.variants:
                metrics.counters["graph_recompiles"] += 1
            start = time.perf_counter()
            try:
                captured = Captured(self.gm, args, buffers, self.name)
            except recording.CaptureBroken as e:
                return self._run_eagerly(args, str(e))
            finally:
                metrics.counters["capture_seconds"] += time.perf_counter() - start
            self.variants.insert(key, captured)
        return captured(args, buffers)

    def _run_eagerly(self, args, why):
        warnings.warn(f"torchtpu: compiled graph {self.name} runs op by op: {why}")
        metrics.counters["graph_eager_runs"] += 1
        self.eager = True
        return self.gm(*args)
