"""An FX graph of aten ops as one jitted JAX function, built from the eager lowerings.

The graph is captured once per input layout by running it in fused mode on the real inputs:
that records, for every node, the same cached `run` function strict and fused eager use (so
there is one lowering table), which values it reads and which it produces, and PyTorch computes
every output's shape and strides on the way.  The recording becomes a jitted function of the
inputs' arrays; later calls only gather those arrays, call it, and wrap the results, with no
per-node Python work.  Inputs the graph mutates get their new values in place.
"""
import sys
import time
import warnings

import torch

from .._core import storage
from .._execution import bounded, debug, fused, sync
from .._core import metrics
from .._execution.random import next_key_parts
from .._core import registry

_MANUAL = {"aten::copy_", "aten::_local_scalar_dense", "aten::resize_"}


def unsupported_ops(gm):
    """(op name, stack trace) of graph nodes with no tpu kernel."""
    missing = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target.name()
        if target in registry.TABLE or target._schema.name in _MANUAL:
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


def _buffer(t):
    return getattr(t.untyped_storage(), "_tpu", None)


def layout_key(args):
    """Everything a capture depends on: each tensor's layout and which inputs share storage."""
    key = []
    buffers = []
    for a in args:
        if isinstance(a, torch.Tensor):
            buf = _buffer(a)
            if buf is None:
                key.append(("host", a.dtype, tuple(a.shape)))
                continue
            j = next((i for i, b in enumerate(buffers) if b is buf), len(buffers))
            if j == len(buffers):
                buffers.append(buf)
            key.append((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), j, buf.nbytes,
                        buf.index))
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
        for b in buffers:
            b.value()  # materialise lazily zeroed storages so they are inputs, not constants
        saved = [b._array for b in buffers]
        try:
            tr, outs = fused.capture(lambda: gm(*args), self.device)
            mutated = [(j, b._array) for j, b in enumerate(buffers)
                       if type(b._array) is storage.Pending and b._array.trace is tr]
        finally:
            for b, a in zip(buffers, saved):  # capturing commits nothing
                b._array = a
        self.name = name
        arrays = {id(a): i for i, a in enumerate(saved)}
        # Where each array the recording read comes from: an input (its buffer's position)
        # or a constant the graph holds.
        self.sources = [arrays.get(id(a), a) for a in tr.ext_arrays]
        self.signature = tuple(tr.signature)
        self.where = tr.where
        self.scalars = list(tr.scalars)
        self.scalar_types = tuple(map(type, tr.scalars))
        self.random_positions = []
        pos = 0
        for (compiled, _, n_scalars), (kernel, _) in zip(tr.signature, tr.where):
            if kernel.low.random:
                self.random_positions.append(pos)
            pos += n_scalars
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
            self.outputs.append(self._output_spec(o, args, tr, result_index))
        overwritten = {j for j, _ in self.mutations}
        self.donatable = tuple(isinstance(src, int) and src in overwritten for src in self.sources)
        self.segment = fused.Segment(self.signature, result_slots, self.scalar_types)

    @staticmethod
    def _output_spec(o, args, tr, result_index):
        if not isinstance(o, torch.Tensor):
            return ("value", o)
        for i, a in enumerate(args):
            if o is a:
                return ("arg", i)
        view = (list(o.shape), list(o.stride()), o.storage_offset())
        buf = _buffer(o)
        p = buf._array if buf is not None else None
        if type(p) is storage.Pending and p.trace is tr:
            return ("new", result_index(p.slot), *view, o.dtype, buf.nbytes)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and _buffer(a) is buf:
                return ("alias", i, *view)
        if buf is None:
            raise fused.CaptureBroken(f"the graph computes a {o.device} tensor")
        if p is None:  # a fresh `empty` tensor the graph never wrote
            return ("empty", *view, o.dtype, buf.nbytes)
        return ("constant", o)  # a tensor the graph holds

    def _arguments(self, buffers):
        inputs = [b.value() for b in buffers]
        ext = [inputs[s] if isinstance(s, int) else s for s in self.sources]
        scalars = self.scalars
        if self.random_positions:
            scalars = list(scalars)
            for pos in self.random_positions:
                scalars[pos], scalars[pos + 1] = next_key_parts(self.device)
        return inputs, ext, fused._pack_scalars(scalars, self.scalar_types)

    def stablehlo(self, buffers):
        _, ext, packed = self._arguments(buffers)
        return self.segment.lower(ext, packed).as_text()

    def _donation(self, inputs):
        """Which arguments the executable may consume: arrays of inputs the graph overwrites
        (parameters, optimizer state) that nothing but their storage refers to, once the
        graph is known to have no index checks (a failed check must leave inputs intact)."""
        if self.segment.has_checks is not False or not any(self.donatable):
            return (False,) * len(self.sources)
        # References: the storage, the `inputs` and `ext` lists, getrefcount's argument.
        return tuple(d and sys.getrefcount(inputs[s]) <= 4 for d, s in zip(self.donatable, self.sources))

    def __call__(self, args, buffers):
        with metrics.span(f"torchtpu::graph {self.name}"):
            return self._run(args, buffers)

    def _run(self, args, buffers):
        inputs, ext, packed = self._arguments(buffers)
        start = time.perf_counter()
        self.segment.learn_checks(ext, packed)
        mask = self._donation(inputs)
        del inputs
        compiling = not self.segment.has_executable(mask)
        results, checks = self.segment.run(ext, mask, packed)
        if compiling:
            metrics.counters["graph_compiles"] += 1
            metrics.counters["compile_seconds"] += time.perf_counter() - start
        else:
            metrics.counters["graph_cache_hits"] += 1
        if any(checks):
            sync.defer(checks, self._check_error)
        for j, r in self.mutations:
            buffers[j]._array = results[r]
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
                    t = storage._empty_on(self.device, shape, dtype)
                    storage.set_storage(t, st, offset, shape, stride)
                outs.append(t)
        return outs if self.returns_sequence else outs[0]

    def _check_error(self, values):
        """The deferred error of a run's checks (sync.defer): its first failed op's."""
        i = fused._first_failed_check(values)
        if i is None:
            return None
        kernel, where = self.where[i]
        return debug.failed_check(values[i], self.signature[i][0], kernel.overload, where,
                                  f"in compiled graph {self.name}")


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
        if self.eager or fused.capturing():
            # In a torch.tpu graph capture (a whole compiled step, step.py) its ops are recorded
            # into the capture's trace.
            return self.gm(*args)
        key, buffers = layout_key(args)
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
            except fused.CaptureBroken as e:
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
