"""Strict eager: every op runs as a cached, compiled JAX executable, dispatched asynchronously.

For each registered overload a PrivateUse1 kernel turns the call into
  key   = (static args, each tensor's dtype/shape/stride/offset/aliasing, scalar types)
  miss  -> PyTorch's meta kernel gives the outputs' dtypes/shapes/strides and PyTorch's own
           errors for bad input; a `jax.jit` of  read views -> lowering -> write back / store
           is built once and cached under the key
  call  -> the jitted function on the storages' arrays; outputs become new storages, in-place
           results replace the mutated storages' arrays.
Nothing is committed before the executable returned (and its index checks passed), so a
failing op leaves every tensor as it was.
"""
import math
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from .._core import runtime, storage
from .._core.dtypes import cast, to_jax_dtype, to_torch_dtype
from .._core import registry
from .._lowerings.meta import _c10_name, dtype_name
from . import async_compile, bounded, debug, executables, fused, modes, overlap, spmd, strided, sync
from .._core import metrics
from .._core.metrics import FlushReason
from .random import draw_advance, generator, key_from_parts, next_key_parts

_T, _TOPT, _TLIST, _SCALAR, _STATIC, _DEVICE, _SCALARLIST = range(7)
_meta_device = torch.device("meta")
_FUSED, _BLOCKING = modes.EagerMode.DEFER_AND_FUSE, modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
_STRICT = modes.EagerMode.DEFER_NEVER
_MAX_VARIANTS = 256  # output layouts kept per executable (see OpKernel._variant)
_NO_KEY = np.uint64(0)  # a random op's seed and offset before they are drawn


class _Arg:
    __slots__ = ("name", "kind", "kwarg_only", "is_write", "is_out")


def _classify(schema, static_scalars, traced):
    args = []
    for a in schema.arguments:
        x = _Arg()
        x.name = a.name
        x.kwarg_only = a.kwarg_only
        x.is_write = a.alias_info is not None and a.alias_info.is_write
        x.is_out = a.is_out
        t = str(a.type)
        if t == "Tensor":
            x.kind = _T
        elif t == "Optional[Tensor]":
            x.kind = _TOPT
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            x.kind = _TLIST
        elif (t in ("number", "Optional[number]") and a.name not in static_scalars
              or t in ("float", "bool") and a.name in traced):
            x.kind = _SCALAR
        elif t == "List[number]" and a.name not in static_scalars:
            x.kind = _SCALARLIST
        elif t in ("Device", "Optional[Device]"):
            x.kind = _DEVICE
        else:
            x.kind = _STATIC
        args.append(x)
    return args


def _one_value(compiled):
    """Whether an op's outputs are one element (or none) each."""
    return all(math.prod(shape) <= 1 for shape, _, _, _ in compiled.wrap_specs)


def _hashable(v):
    """A static argument as part of an executable's key. A number keeps its type: 6 and 6.0 (and
    True and 1) are equal keys to Python, but not to PyTorch (torch.arange(0, 6.0) is float32,
    torch.arange(0, 6) int64: the second was given the first's executable)."""
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, (bool, int, float)):
        return type(v), v
    return v


class _OutResized(Exception):
    pass


class _Number:
    """A return that is a number, the same for every call of the executable (its meta kernel
    computes it from the shapes)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _Compiled:
    __slots__ = ("key", "fn", "run", "out_specs", "wrap_specs", "writes", "check_info", "returns",
                 "list_len", "recheck_overlap", "meta_returns", "variants", "program", "draws",
                 "mesh", "collective")

    def with_outputs(self, out_specs):
        """The same executable giving its outputs other layouts (`variants`).  `program`, the
        compiled object that stands for the program in fused traces, stays the same: a
        segment is the same program whatever layouts its ops' outputs were given."""
        variant = _Compiled()
        for name in _Compiled.__slots__:
            setattr(variant, name, getattr(self, name))
        variant.out_specs = out_specs
        variant.wrap_specs = _wrap_specs(out_specs)
        variant.variants = None
        return variant

    def check_error(self, checks):
        """The error of the first of this op's index checks that failed (`checks`: their
        results), or None; every path that runs the op raises it."""
        for ok, (exc_type, message) in zip(jax.device_get(checks), self.check_info):
            if not bool(ok):
                return exc_type(message)
        return None


def _device_mismatch(a, b):
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


class OpKernel:
    """The PrivateUse1 kernel of one overload."""

    def __init__(self, overload, low):
        self.overload = overload
        self.low = low
        schema = overload._schema
        traced = low.traced
        if low.fill:  # (see Lowering.fill)
            traced += tuple(a.name for a in schema.arguments if str(a.type) == "float")
        self.args = _classify(schema, low.static, traced)
        self.params = registry.parameters(overload)
        self.functional_args = [i for i, a in enumerate(self.args) if not a.is_out]
        self.writes = [i for i, a in enumerate(self.args) if a.is_write]
        self.returns = schema.returns
        self.functional = registry.functional_of(overload)
        self.inplace_of = registry.inplace_functional_of(overload)
        self.cache = {}
        self.lock = threading.Lock()
        self.metric_key = f"op::{overload}"
        # An in-place random fill (uniform_, normal_, ...) of its first argument.
        self.fills = low.fill and self.writes == [0] and not self.args[0].is_out
        # This op's path for 1-D tensors with room to spare (padded.install), or None.
        self.padded = None

    # -- binding -------------------------------------------------------------------------
    def bind(self, args, kwargs):
        return registry.bind(self.params, args, kwargs)

    # -- the hot path ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.fills and args:
            done = self._bucketed_fill(args, kwargs)
            if done is not None:
                return done
        if self.padded is not None and args:
            first = args[0]
            if isinstance(first, torch.Tensor) and first.dim() == 1:
                done = self.padded(self, args, kwargs)
                if done is not None:
                    return done
        try:
            return self._call(args, kwargs)
        except _OutResized as resized:
            try:
                # Run at once and waited for, as in debug mode: a device-side check that fails
                # (an integer fmod by zero) must raise here, while the out= tensors can still
                # get their old layouts back, not at a later wait (PyTorch checks before it
                # resizes).  Only ops whose out= is resized pay this wait.
                return self._call(args, kwargs, mode=None if fused.capturing() else _BLOCKING)
            except BaseException:
                # A failing op leaves its out= as it was (PyTorch checks before resizing).
                for t, shape, stride, offset in resized.args[0]:
                    t.as_strided_(shape, stride, offset)
                raise

    def _bucketed_fill(self, args, kwargs):
        """A random fill as strict eager runs it: for a contiguous tensor whose size is not a
        bucket size (fill_bucket), fill a flat tensor of the bucketed size, whose first
        elements are the very values the fill would give (Lowering.fill).  A tensor covering
        its storage takes that array as its storage's (a fresh `torch.empty(n).uniform_()`,
        `randn(n)`, a layer's initialisation: the spare elements, at most n under 64 Ki and
        n/8 above, are never read); any other gets the first elements copied.  A random program takes ~0.5 s of XLA:CPU compile
        (threefry), a copy ~30 ms: a loop over new sizes (PyTorch's device-generic tests) or
        a model initialised on the device compiled one per shape.
        Fused eager runs fills this way too, outside its trace: in a segment every fill is a
        threefry program of its own to compile (200 randn of one shape made a segment of 85 s
        of XLA compile), while here each bucket size compiles once and the segment only records
        the copy.  Their values are strict eager's.
        None: the fill runs as it is (in a capture, or strict eager at a bucket size)."""
        if fused.capturing():
            return None
        t = args[0]
        n = t.numel()
        in_trace = modes.get_eager_mode() is _FUSED
        size = fill_bucket(n)
        if n == 0 or not t.is_contiguous() or size == n:
            return self._call(args, kwargs, mode=_STRICT) if in_trace else None
        flat = torch.empty(size, dtype=t.dtype, device=t.device)
        g = generator(storage.buffer_of(t).index)
        start = g.offset
        self(flat, *args[1:], **kwargs)  # draws with the key this call would have used
        g.offset = start + draw_advance(n)  # past this fill's n draws, not the bucket's
        if not fused.replace_value(t, storage.buffer_of(flat).value()):
            t.copy_(flat[:n].view(t.shape))
        return t

    def _call(self, args, kwargs, mode=None):
        vals = self.bind(args, kwargs)
        if self.low.validate is not None:
            self.low.validate(*[vals[i] for i in self.functional_args])
        key = []
        buffers = Buffers()
        scalars = []
        offsets = []
        exact = []  # the strides the key leaves out (see _tensor)
        device = None
        for a, v in zip(self.args, vals):
            kind = a.kind
            if kind == _T or kind == _TOPT:
                if v is None:
                    key.append(None)
                else:
                    device = self._tensor(v, key, buffers, scalars, offsets, exact, device)
            elif kind == _TLIST:
                key.append(len(v))
                for t in v:
                    if t is None:
                        key.append(None)
                    else:
                        device = self._tensor(t, key, buffers, scalars, offsets, exact, device)
            elif kind == _SCALAR:
                if v is None:
                    key.append(None)
                else:
                    key.append(type(v))
                    scalars.append(v)
            elif kind == _SCALARLIST:
                key.append(tuple(map(type, v)))
                scalars.extend(v)
            elif kind == _DEVICE:
                if v is not None:
                    v = torch.device(v)
                    if v.type == "tpu" and device is None:
                        device = v.index if v.index is not None else runtime.current_device()
                key.append(v)
            else:
                key.append(_hashable(v))
        if device is None:
            device = runtime.current_device()
        scalars += offsets  # (after the op's own numbers: run() takes them from the end)
        # The default dtype decides a factory's dtype and an integer input's or a Python
        # float's promotion (int / int, int + 2.5): an executable built under float32 must not
        # serve a call under float64.
        key.append(torch.get_default_dtype())
        if mode is None:
            mode = modes.get_eager_mode()
        fused_mode = mode is _FUSED
        if scalars and not fused_mode:
            scalars = [_device_scalar(v, device) for v in scalars]
        if self.low.random:  # (seed, offset): drawn below, once the op's size is known
            scalars = [_NO_KEY, _NO_KEY] + scalars
        if self.low.precision:
            key.append(torch.get_float32_matmul_precision())
        key.append(device)
        key = tuple(key)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self._compile(key, vals, buffers, scalars, device, tuple(exact))
        else:
            bounded.op_executables.lookup(compiled)  # marks it recently used
            if compiled.recheck_overlap:
                overlap.check(self, vals, resized=False)
                overlap.check(self, vals, resized=True)
        if compiled.variants is not None:
            compiled = self._variant(compiled, vals, tuple(exact), buffers, scalars, device)
        if self.low.random:
            scalars[0], scalars[1] = next_key_parts(device, compiled.draws)
        if fused_mode and not (buffers or self.low.random) and _one_value(compiled) \
                and not fused.capturing():
            # A single value made from Python numbers runs at once, outside the trace: code
            # that creates such state lazily on its first call (GradScaler's scale and growth
            # tracker) would otherwise make the first step's segment differ from the later ones.
            fused_mode = False
            scalars = [_device_scalar(v, device) for v in scalars]
        if fused_mode and compiled.mesh is not None and not spmd.in_program() \
                and not fused.capturing():
            fused.flush(FlushReason.COLLECTIVE, self.overload)  # a program of its own
            fused_mode, mode = False, _STRICT
        if fused_mode:
            if not self.low.eager:
                return fused.record(self, compiled, vals, buffers, scalars, device)
            fused.flush(FlushReason.DATA_DEPENDENT, self.overload)
        if mode is _STRICT and async_compile.enabled() and not self.low.eager \
                and compiled.mesh is None:
            metrics.counters[self.metric_key] += 1
            return async_compile.run(self, compiled, vals, buffers, scalars, device)
        if mode is _BLOCKING:
            async_compile.drain()  # debug mode runs every op in order, at its call
        arrays = [b.value() for b in buffers]
        if self.low.eager:
            return self._run_eager(compiled, vals, arrays, buffers, scalars, device)
        metrics.counters[self.metric_key] += 1
        if mode is _BLOCKING:
            outs, updated, checks = self._run_blocking(compiled, vals, arrays, scalars)
            if checks:
                self._raise_failed_checks(compiled, checks)
            return self._commit(compiled, vals, outs, updated, buffers, device)
        return self.finish(compiled, vals, compiled.fn(*arrays, *scalars), buffers, device)

    def finish(self, compiled, vals, results, buffers, device):
        """Defer the checks of a strict op that ran, and give its results their tensors."""
        outs, updated, checks = results
        if checks:
            self._defer_checks(compiled, checks)
        return self._commit(compiled, vals, outs, updated, buffers, device)

    def _defer_checks(self, compiled, checks, where=None):
        """Read `checks` at the next wait of the host, not now (sync.defer)."""
        if where is None:
            where = debug.user_frame(3)
        sync.defer(checks, lambda values: debug.failed_check(
            values, compiled, self.overload, where, "its in-place targets kept their values"))

    def _run_blocking(self, compiled, vals, arrays, scalars):
        """Debug eager: wait for the op, and name it, its inputs and the caller on failure."""
        metrics.counters["blocking_waits"] += 1
        try:
            outs, updated, checks = compiled.fn(*arrays, *scalars)
            jax.block_until_ready((outs, updated))
        except Exception as e:
            raise debug.attributed(e, self.overload, debug.describe_inputs(vals),
                                   debug.user_frame(3)) from e
        if compiled.mesh is not None:
            sync.wait()  # (a collective: whether the ranks agreed on it, read at it)
        if modes.check_nans and not checks:
            bad = debug.first_non_finite(list(outs) + list(updated))
            if bad is not None:
                raise RuntimeError(
                    f"{self.overload} produced NaN or Inf (TORCHTPU_CHECK_NANS=1); inputs: "
                    f"{debug.describe_inputs(vals)}; called from "
                    f"{debug.format_where(debug.user_frame(3))}")
        return outs, updated, checks

    def _tensor(self, t, key, buffers, scalars, offsets, exact, device):
        if not isinstance(t, torch.Tensor):
            # PyTorch hands wrapped numbers (`x + 1`) to Python kernels as plain numbers.
            key.append(type(t))
            scalars.append(t)
            return device
        buf = getattr(t.untyped_storage(), "_tpu", None)
        if buf is not None:
            index = buf.index
            if device is None:
                device = index
            elif device != index:
                raise _device_mismatch(f"tpu:{device}", t.device)
            # A view's offset is an argument of the executable, not part of its key: a loop
            # over x[i], or the last token of a growing sequence, runs one executable.
            offset = t.storage_offset()
            if offset:
                offsets.append(offset)
                offset = DYNAMIC
            # Nor is the stride of a size-1 dim, which addresses no other element: the last
            # token of a growing [1, L] sequence is a [1, 1] view of strides (L, 1).  Where
            # the outputs' strides follow it (clone keeps them), `variants` gives each its own.
            stride = t.stride()
            if 1 in t.shape:
                exact.append(stride)
                stride = _size_one_strides(t.shape, stride)
            key.append(layout_key(t, buf, buffers, offset, stride))
        elif t.dim() == 0 and t.device.type == "cpu":
            # A 0-dim CPU tensor mixes with device tensors (as with CUDA): its value is traced.
            key.append(("cpu", t.dtype, _is_wrapped_number(t)))
            scalars.append(t.item())
        else:
            raise _device_mismatch(f"tpu:{device if device is not None else runtime.current_device()}", t.device)
        return device

    def _raise_failed_checks(self, compiled, checks):
        error = compiled.check_error(checks)
        if error is not None:
            raise error

    def _commit(self, compiled, vals, outs, updated, buffers, device):
        for j, arr in zip(compiled.writes, updated):
            buffers[j].array = arr
        new = [storage.wrap(arr, shape, stride, dtype, device, nbytes)
               for arr, (shape, stride, dtype, nbytes) in zip(outs, compiled.wrap_specs)]
        if outs:
            sync.track(outs[0])
        elif updated:
            sync.track(updated[0])
        return self._returns(compiled, vals, new)

    def _returns(self, compiled, vals, new):
        results = []
        it = iter(new)
        for source in compiled.returns:
            if source is None:
                results.append(next(it))
            elif source == "none":
                results.append(None)
            elif isinstance(source, _Number):
                results.append(source.value)
            elif source == "list":
                results.append([next(it) for _ in range(compiled.list_len)])
            else:
                results.append(vals[source])
        if not results:
            return None
        return results[0] if len(results) == 1 else tuple(results)

    # -- building an executable ------------------------------------------------------------
    def _meta_args(self, vals):
        metas = {}

        def meta_of(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.device.type != "tpu":
                # A 0-dim CPU operand is a traced scalar here (see _tensor); some meta kernels
                # (Python refs) refuse to mix devices, so their computation sees a meta one.
                # Wrapped numbers stay CPU tensors: a meta copy would lose their promotion rule.
                cpu_scalar = t.dim() == 0 and t.device.type == "cpu" and not _is_wrapped_number(t)
                return torch.empty((), dtype=t.dtype, device="meta") if cpu_scalar else t
            st = t.untyped_storage()
            base = metas.get(id(st))
            if base is None:
                base = metas[id(st)] = torch.empty(st.nbytes(), dtype=torch.uint8, device="meta")
            itemsize = t.dtype.itemsize
            usable = base[: (base.numel() // itemsize) * itemsize]
            return usable.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

        pos, kw = [], {}
        for a, v in zip(self.args, vals):
            if a.kind in (_T, _TOPT) and v is not None:
                v = meta_of(v)
            elif a.kind == _TLIST:
                v = [None if t is None else meta_of(t) for t in v]
            elif a.kind == _DEVICE and v is not None and torch.device(v).type == "tpu":
                v = _meta_device
            if a.kwarg_only:
                kw[a.name] = v
            else:
                pos.append(v)
        return pos, kw

    def _compile(self, key, vals, buffers, scalars, device, exact):
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                return compiled
            compiled = self._executable(key, vals, buffers, scalars, device)
            if exact and compiled.out_specs and not self.low.eager:
                compiled.variants = {exact: compiled}
            if not self.low.eager:  # eager ops run un-jitted and are rebuilt per call
                self.cache[key] = compiled
                bounded.op_executables.insert(compiled, self.cache)
            return compiled

    def _executable(self, key, vals, buffers, scalars, device):
        with metrics.span(f"torchtpu::compile {self.overload}"):
            compiled = self._build(vals, buffers, scalars, device)
        compiled.key = key
        if compiled.mesh is not None:  # a collective: run on every rank of its group
            compiled.fn = spmd.Program(
                compiled.run, compiled.mesh, [compiled.collective],
                self._persistent_key(key), str(self.overload), str(self.overload),
                traced=(lambda: list(compiled.check_info), _restorer(compiled.check_info)))
            metrics.counters["compiles"] += 1
        elif not self.low.eager:
            compiled.fn = executables.Executable(
                compiled.run, self._persistent_key(key), str(self.overload),
                describe=lambda: debug.describe_key(key),
                traced=(lambda: list(compiled.check_info), _restorer(compiled.check_info)))
            metrics.counters["compiles"] += 1
        return compiled

    def _variant(self, compiled, vals, exact, buffers, scalars, device):
        """`compiled` giving its outputs the layouts PyTorch gives them for these inputs (the
        meta kernel asked once per pattern of size-1 strides: clone keeps them, and they can
        tip a 4-D layout into channels-last): the same program where the outputs' elements lie
        in the same order (their strides differ only in size-1 dims), else one of their own."""
        variant = compiled.variants.get(exact)
        if variant is None:
            if len(compiled.variants) >= _MAX_VARIANTS:  # a sequence growing without end
                compiled.variants.clear()
            pos, kw = self._meta_args(vals)
            out_specs = self._out_specs(self.overload(*pos, **kw), compiled.meta_returns)
            if all(_live_strides(shape, stride) == _live_strides(old_shape, old_stride)
                   for (shape, stride, _), (old_shape, old_stride, _) in zip(out_specs, compiled.out_specs)):
                variant = compiled.with_outputs(out_specs)
            else:
                variant = self._executable(compiled.key + (exact,), vals, buffers, scalars, device)
            compiled.variants[exact] = variant
        return variant

    def _out_specs(self, meta_out, returns):
        return [(tuple(m.shape), _dense_strides(m), m.dtype)
                for m in self._fresh_meta_outputs(meta_out, returns)]

    def _persistent_key(self, key):
        """The key of this op's executable across processes, or None to keep it in memory
        only: a lowering from outside torchtpu, torch and jax (a user's jax_op, a custom op)
        can change between runs without any version saying so (torch's decompositions and
        jnp functions are covered by their versions, ours by the source digest)."""
        module = getattr(self.low.fn, "__module__", None) or ""
        if (self.overload.namespace not in ("aten", "prims")
                or not module.startswith(("torchtpu.", "torch.", "jax."))):
            return None
        return executables.stable((str(self.overload), key))

    def _build(self, vals, buffers, scalars, device):
        overlap.check(self, vals, resized=False)
        compiled = _Compiled()
        compiled.program = compiled
        pos, kw = self._meta_args(vals)
        if self.low.eager:
            meta_out = None
        else:
            self._check_out_dtypes(vals, pos, kw)
            try:
                meta_out = self.overload(*pos, **kw)
            except (AssertionError, TypeError, ValueError, ZeroDivisionError) as e:
                # Some of PyTorch's Python meta kernels assert (or trip over their own checks,
                # or divide by a zero stride) where its C++ kernels raise RuntimeError.
                raise RuntimeError(str(e)) from e
            self._resize_outs(vals, pos, kw)
            overlap.check(self, vals, resized=True)

        # Where each return comes from: a fresh output (None) or a mutated argument (its index).
        returns = [self._aliased_input(r) if r.alias_info is not None and r.alias_info.is_write
                   else None for r in self.returns]
        if isinstance(meta_out, (tuple, list)) and not self._returns_list():
            # Outputs the op leaves undefined (e.g. convolution_backward's masked-off grads),
            # and integers its meta kernel fixes (the fused attention's max_q and max_k).
            returns = ["none" if r is None and m is None
                       else _Number(m) if r is None and isinstance(m, (int, torch.SymInt)) else r
                       for r, m in zip(returns, meta_out)]
        compiled.returns = compiled.meta_returns = returns
        compiled.variants = None
        out_specs = [] if meta_out is None else self._out_specs(meta_out, returns)
        for shape, stride, dtype in out_specs:
            storage.check_allocation(shape, stride, dtype, device)
        compiled.out_specs = out_specs
        compiled.wrap_specs = _wrap_specs(out_specs)
        # How many elements a random op draws: none of its samplers draws more than its largest
        # operand or result holds (random.py: the offset moves past them).
        compiled.draws = max([math.prod(shape) for shape, _, _ in out_specs]
                             + [m.numel() for m in tree_flatten((pos, kw))[0]
                                if isinstance(m, torch.Tensor)], default=0)
        compiled.mesh = compiled.collective = None
        if self.low.mesh is not None:
            compiled.mesh, group = self.low.mesh(*[vals[i] for i in self.functional_args])
            compiled.collective = _collective_entry(self.overload, group, tree_flatten((pos, kw))[0])
        compiled.list_len = len(out_specs) if returns == [None] and self._returns_list() else 0
        if compiled.list_len:
            compiled.returns = ["list"]

        # Tensor slots as the lowering sees them, in schema order.
        slots, write_targets, n_offsets = self._slots(vals, buffers)
        compiled.writes = sorted({j for j, *_ in write_targets})
        # Whether a written tensor and another argument overlap depends on their offsets, which
        # the key leaves out: a call whose written storage another argument shares checks again.
        used = [s[0] for v in slots.values() for s in (v if isinstance(v, list) else [v])
                if s is not None and isinstance(s[0], int)]
        compiled.recheck_overlap = bool(n_offsets) and any(used.count(j) > 1 for j in compiled.writes)
        low, fargs_idx, argdefs = self.low, self.functional_args, self.args
        # An out= op computes its functional's results, rounded to their dtypes, and casts them
        # to out's dtype (tanh(bfloat16, out=float32) rounds to bfloat16 first, as PyTorch).
        result_dtypes = self._functional_dtypes(pos, kw) if write_targets and self.functional else None
        # Promotion goes to the dtype of the first result, or of the first written argument:
        # self of an in-place op, out of an out= op (computing bfloat16 inputs in out's float32
        # and rounding to the functional's dtype matches the CPU; computing in bfloat16 would
        # let XLA:CPU skip that rounding).
        if out_specs:
            promoted_to = [out_specs[0][2]]
        else:
            promoted_to = [vals[self.writes[0]].dtype] if write_targets and argdefs[self.writes[0]].kind == _T else []
        tensors = [m for m in tree_flatten((pos, kw))[0] if isinstance(m, torch.Tensor)]
        promote_dtype = low.promote.dtype(promoted_to, tensors)
        promote_dtype = None if promote_dtype is None else to_jax_dtype(promote_dtype)
        # An integer result is computed in its own dtype, whatever out's dtype (fmod(int, int,
        # out=float) divides as integers and raises on zero, as on the CPU).
        if (result_dtypes and low.promote is registry.Promote.RESULT
                and np.dtype(result_dtypes[0]).kind in "biu"):
            promote_dtype = result_dtypes[0]
        n_buf = len(buffers)
        # Only plain values may be captured: a captured tensor would never be freed.
        consts = {}
        for i in fargs_idx:
            kind = argdefs[i].kind
            if kind == _SCALAR:
                consts[i] = vals[i] is None
            elif kind == _SCALARLIST:
                consts[i] = len(vals[i])
            elif kind in (_STATIC, _DEVICE):
                consts[i] = vals[i]
        specs = [(shape, stride, to_jax_dtype(dtype)) for shape, stride, dtype in out_specs]
        check_info = []

        def run(*dyn):
            arrays = dyn[:n_buf]
            offsets = dyn[len(dyn) - n_offsets:]
            scalar_it = iter(dyn[n_buf:len(dyn) - n_offsets])
            if low.random:
                args = [key_from_parts(next(scalar_it), next(scalar_it))]
            else:
                args = []
            for i in fargs_idx:
                a = argdefs[i]
                if a.kind in (_T, _TOPT):
                    args.append(_read(slots[i], arrays, scalar_it, offsets, promote_dtype))
                elif a.kind == _TLIST:
                    args.append([_read(s, arrays, scalar_it, offsets, promote_dtype)
                                 for s in slots[i]])
                elif a.kind == _SCALAR:
                    args.append(None if consts[i] else next(scalar_it))
                elif a.kind == _SCALARLIST:
                    args.append([next(scalar_it) for _ in range(consts[i])])
                else:
                    args.append(consts[i])
            registry._trace_state.checks = []
            try:
                result = low.fn(*args)
            except _TORCH_ERRORS:
                raise
            except Exception as e:
                if isinstance(e, IndexError) and not _raised_by_jax(e):
                    raise
                raise _as_torch_error(e, self.overload) from e
            checks = registry._trace_state.checks
            registry._trace_state.checks = []
            check_info[:] = [(exc, msg) for _, exc, msg in checks]
            flat = [r for r in tree_flatten(result)[0] if r is not None]
            new_arrays = list(arrays)
            outs = []
            if write_targets:  # in-place / out=: the results are the mutated arguments' values
                flat_updates, flat = flat, []
                for k, ((j, shape, stride, offset, dtype, conj, neg), value) in enumerate(
                        zip(write_targets, flat_updates)):
                    if result_dtypes:
                        value = cast(value, result_dtypes[min(k, len(result_dtypes) - 1)])
                    value = _unapply_bits(jnp.broadcast_to(jnp.asarray(value), shape), conj, neg)
                    new_arrays[j] = strided.write(new_arrays[j], shape, stride,
                                                  Dynamic.resolve(offset, offsets), dtype, value)
            if low.eager and not specs:  # data-dependent shapes: the values define them
                outs = [jnp.asarray(v) for v in flat]
            for (shape, stride, dtype), value in zip(specs, flat):
                value = jnp.broadcast_to(cast(value, dtype), shape)
                outs.append(strided.store(value, stride))
            if checks and write_targets:
                # Checks are read later (sync.defer): a failing op keeps its targets' values.
                ok = jnp.all(jnp.stack([jnp.asarray(c, bool).reshape(()) for c, _, _ in checks]))
                for j, *_ in write_targets:
                    new_arrays[j] = jnp.where(ok, new_arrays[j], arrays[j])
            return outs, [new_arrays[j] for j in compiled.writes], [c for c, _, _ in checks]

        compiled.run = run
        compiled.fn = run  # jitted by _compile once the key is known, eager ops stay as they are
        if (modes.fused and not low.eager and write_targets and low.mesh is None
                and all(b.dtype is not None for b in buffers)):
            # Fused mode traces an op when its segment runs; an in-place or out= op is traced
            # abstractly here once, so that an input JAX refuses raises at the call, before the
            # op's targets (an out= resized by PyTorch's rules) are committed.
            jax.eval_shape(run, *[jax.ShapeDtypeStruct((b.nbytes // jnp.dtype(b.dtype).itemsize,),
                                                        b.dtype) for b in buffers], *scalars)
        compiled.check_info = check_info
        return compiled

    def _check_out_dtypes(self, vals, pos, kw):
        """PyTorch's rules for an out= of another dtype than the result's, which the meta
        kernels do not all apply (JAX would cast anything)."""
        if self.inplace_of is not None:  # add_ and the like: self takes the result
            try:
                dtype = self.inplace_of(*pos, **kw).dtype
            except Exception:  # noqa: BLE001 - the meta kernel raises PyTorch's error just after
                return
            if not torch.can_cast(dtype, vals[0].dtype):
                raise RuntimeError(f"result type {dtype_name(dtype)} can't be cast to the desired "
                                   f"output type {dtype_name(vals[0].dtype)}")
            return
        if self.functional is None:
            return
        try:
            results = self._functional_dtypes(pos, kw)
        except Exception:  # noqa: BLE001 - the meta kernel raises PyTorch's error just after
            return
        outs = [t for a, v in zip(self.args, vals) if a.is_out and v is not None
                for t in (v if isinstance(v, (list, tuple)) else [v])]
        out_names = [a.name for a, v in zip(self.args, vals) if a.is_out and v is not None]
        for out, dtype, name in zip(outs, results, out_names + [""] * len(outs)):
            dtype = to_torch_dtype(dtype)
            if self.low.bool_out:
                if out.dtype not in (torch.bool, torch.uint8):
                    raise RuntimeError(f"{self.overload._schema.name.split('::')[1]} only supports "
                                       f"bool tensor for result, got: {dtype_name(out.dtype)}")
                continue
            if self.low.exact_out and out.dtype != dtype:
                message = self.low.exact_out
                if isinstance(message, dict):  # one message per out argument
                    message = message[name]
                if not isinstance(message, str):
                    message = "Found dtype {got} but expected {expected}"
                raise RuntimeError(message.format(
                    expected=dtype_name(dtype), got=dtype_name(out.dtype), name=name,
                    expected_c=_c10_name(dtype), got_c=_c10_name(out.dtype)))
            if not torch.can_cast(dtype, out.dtype):
                raise self.low.out_cast_error(
                    f"result type {dtype_name(dtype)} can't be cast to the desired output type "
                    f"{dtype_name(out.dtype)}")

    def _functional_dtypes(self, pos, kw):
        """Dtypes of the functional overload's results (out= arguments are keyword-only)."""
        outs = {a.name for a in self.args if a.is_out}
        meta = self.functional(*pos, **{k: v for k, v in kw.items() if k not in outs})
        metas = meta if isinstance(meta, (tuple, list)) else [meta]
        return [to_jax_dtype(m.dtype) for m in metas if isinstance(m, torch.Tensor)]

    def _resize_outs(self, vals, pos, kw):
        # The meta kernel resized the meta `out=` tensors as PyTorch would; do the same to the
        # real ones, then run again with their new shapes in the key.
        resized = []
        for i, a in enumerate(self.args):
            if not a.is_out or vals[i] is None:
                continue
            metas = kw[a.name] if a.kwarg_only else pos[i]
            reals = vals[i]
            if not isinstance(reals, (list, tuple)):  # `Tensor(a!)[] out` is a list
                metas, reals = [metas], [reals]
            for meta, real in zip(metas, reals):
                if tuple(meta.shape) != tuple(real.shape) or meta.stride() != real.stride():
                    resized.append((real, tuple(real.shape), real.stride(), real.storage_offset()))
                    real.resize_(meta.shape)
                    if meta.stride() != real.stride():
                        real.as_strided_(meta.shape, meta.stride())
        if resized:
            raise _OutResized(resized)

    def _returns_list(self):
        return len(self.returns) == 1 and isinstance(self.returns[0].type, torch.ListType)

    def _aliased_input(self, ret):
        # The i-th write-annotated return aliases the i-th mutated argument with the same set.
        alias = ret.alias_info
        for i in self.writes:
            ai = self.overload._schema.arguments[i].alias_info
            if ai is not None and ai.before_set == alias.before_set:
                return i
        return None

    def _fresh_meta_outputs(self, meta_out, returns):
        if returns and all(r is not None for r in returns):
            return []
        if isinstance(meta_out, (tuple, list)):
            if self._returns_list():
                return list(meta_out)
            return [m for m, r in zip(meta_out, returns) if r is None and m is not None]
        return [meta_out] if isinstance(meta_out, torch.Tensor) else []

    def _slots(self, vals, buffers):
        """{argument index: its tensor's slot, or a list of them}, and the slots of the written
        tensors: (buffer, shape, strides, offset, dtype, conj, neg).  A nonzero offset is a
        `Dynamic`: the executable's k-th offset argument (in `_tensor`'s order)."""
        slots = {}
        n_offsets = 0

        def slot_of(t):
            nonlocal n_offsets
            if t is None:
                return None
            if not isinstance(t, torch.Tensor):
                return ("num",)
            if t.device.type != "tpu":
                return ("cpu", to_jax_dtype(t.dtype))
            j = buffers.positions[t.untyped_storage()._tpu]
            offset = t.storage_offset()
            if offset:
                offset = Dynamic(n_offsets)
                n_offsets += 1
            return (j, tuple(t.shape), t.stride(), offset, to_jax_dtype(t.dtype),
                    t.is_conj(), t.is_neg())

        for i, (a, v) in enumerate(zip(self.args, vals)):
            if a.kind in (_T, _TOPT):
                slots[i] = slot_of(v)
            elif a.kind == _TLIST:
                slots[i] = [slot_of(t) for t in v]
        targets = [t for i in self.writes
                   for t in (slots[i] if isinstance(slots[i], list) else [slots[i]])]
        return slots, targets, n_offsets

    def _run_eager(self, compiled, vals, arrays, buffers, scalars, device):
        metrics.counters[self.metric_key] += 1
        metrics.counters["syncs"] += 1
        sync.wait()  # its values decide its outputs' shapes
        outs, updated, checks = compiled.fn(*arrays, *scalars)
        if checks:
            self._raise_failed_checks(compiled, checks)
        if not compiled.out_specs:
            compiled.out_specs = [
                (tuple(o.shape), storage.contiguous_strides(o.shape), to_torch_dtype(o.dtype))
                for o in outs]
            compiled.wrap_specs = _wrap_specs(compiled.out_specs)
        return self._commit(compiled, vals, outs, updated, buffers, device)


def _collective_entry(overload, group, args):
    """A collective op's entry in its programs' signature (spmd.signature): its kind (an
    in-place or out= variant is the same collective), group, dtype and shape."""
    kind = overload._schema.name.split("::")[1]
    kind = kind[:-len("_out")] if kind.endswith("_out") else kind.rstrip("_")
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    first = tensors[0] if tensors else None
    if len(tensors) > 1 and "coalesced" in kind:
        kind = f"{kind} of {len(tensors)}"
    return spmd.describe_collective(kind, group, None if first is None else first.dtype,
                                    () if first is None else first.shape)


def _restorer(check_info):
    def restore(saved):
        check_info[:] = saved
    return restore


# Errors the lowerings raise as PyTorch does; anything else a lowering raises comes from JAX
# refusing the input (a dtype, a shape, an empty axis) and becomes the type PyTorch would raise.
_TORCH_ERRORS = (RuntimeError, NotImplementedError)


def _raised_by_jax(e):
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}jax{os.sep}" in tb.tb_frame.f_code.co_filename


def _as_torch_error(e, overload):
    if isinstance(e, TypeError) and "dtype" in str(e):
        # PyTorch raises NotImplementedError for a dtype its kernel has no code for.
        return NotImplementedError(f"{overload}: not implemented for this dtype ({e})")
    return RuntimeError(f"{overload}: {e}")


_int_probe = torch.empty((), dtype=torch.int32, device="meta")


def _is_wrapped_number(t):
    # PyTorch has no Python accessor for the flag; it only changes type promotion for the
    # 64-bit dtypes Python numbers become, where promotion with an int tensor reveals it.
    if t.dtype is torch.float64 or t.dtype is torch.complex128:
        return torch.result_type(_int_probe, t) is not t.dtype
    return False


def fill_bucket(n):
    """The size a random fill of n elements draws for: a power of two up to 64 Ki elements
    (small draws cost nothing), then 8 sizes per octave (at most 1/8 drawn in vain)."""
    if n <= 1 << 16:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def layout_key(t, buf, buffers, offset=None, stride=None):
    """What an executable compiled for tensor `t` (on storage `buf`) depends on: its dtype,
    shape, strides and offset (`offset` and `stride`, if given, in their place), which of
    `buffers` (a `Buffers`) it reads (added if new: inputs sharing a storage alias), and lazy conj/neg
    bits.  Op executables and compiled graphs key by it."""
    j = buffers.position(buf)
    if offset is None:
        offset = t.storage_offset()
    if stride is None:
        stride = t.stride()
    if t.is_conj() or t.is_neg():  # lazily conjugated/negated views (x.conj(), ...)
        return t.dtype, t.shape, stride, offset, j, t.is_conj(), t.is_neg()
    return t.dtype, t.shape, stride, offset, j


def _live_strides(shape, stride):
    """The strides that place elements: those of the dims that are not size 1."""
    return tuple(s for n, s in zip(shape, stride) if n != 1)


def _size_one_strides(shape, stride):
    """`stride` with the stride of each size-1 dim set to 1."""
    return tuple(s if n != 1 else 1 for n, s in zip(shape, stride))


class Buffers(list):
    """The distinct storages a call reads, in the order of first use, with each one's position:
    a foreach op over a model's parameters reads hundreds, and a linear search per tensor made
    its key quadratic (more than half of a foreach AdamW step over 500 tensors).  A
    DeviceBuffer hashes by identity."""
    __slots__ = ("positions",)

    def __init__(self):  # (an empty list needs no list.__init__: ~0.3 us on every op)
        self.positions = {}

    def position(self, buf):
        """`buf`'s position, appending it if new."""
        positions = self.positions
        j = positions.get(buf)
        if j is None:
            j = positions[buf] = len(self)
            self.append(buf)
        return j


class Dynamic:
    """In a slot: the offset is the executable's `index`-th offset argument."""
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __repr__(self):
        return f"Dynamic({self.index})"

    @staticmethod
    def resolve(offset, offsets):
        return offsets[offset.index] if isinstance(offset, Dynamic) else offset


# In a key: this tensor's (nonzero) offset is an argument.
DYNAMIC = "dynamic"


def _read(slot, arrays, scalar_it, offsets, promote_dtype):
    if slot is None:
        return None
    if slot[0] == "num":
        value = next(scalar_it)
        return value if promote_dtype is None else jnp.asarray(value, promote_dtype)
    if slot[0] == "cpu":
        value = jnp.asarray(next(scalar_it), dtype=slot[1])
    else:
        j, shape, stride, offset, dtype, conj, neg = slot
        value = _unapply_bits(strided.read(arrays[j], shape, stride,
                                           Dynamic.resolve(offset, offsets), dtype), conj, neg)
    if promote_dtype is not None and value.dtype != promote_dtype:
        value = value.astype(promote_dtype)
    return value


# Python numbers that recur (alpha=1, an epsilon, a learning rate) are passed to executables
# as cached weakly typed device scalars: converting a number on every call costs ~1 us.
# A value is cached from its second sighting, so per-call values (a step count) stay cheap;
# zeros and NaN are never cached (-0.0 == 0.0 and NaN != NaN would confuse the lookup).
_scalar_cache = {}
_scalar_seen = set()
_scalar_kinds = set()  # (type, device) of the numbers seen: their executable is built
_INT64 = (-(1 << 63), 1 << 63)


def _device_scalar(v, device):
    key = (type(v), v, device)
    cached = _scalar_cache.get(key)
    if cached is not None:
        return cached
    if type(v) is float:
        if not v or v != v:
            return v
    elif type(v) is not int or not v or not _INT64[0] <= v < _INT64[1]:
        return v
    if key not in _scalar_seen:
        if len(_scalar_seen) > 65536:
            _scalar_seen.clear()
        _scalar_seen.add(key)
        kind = (type(v), device)
        if kind not in _scalar_kinds:
            # The executable a second sight needs is built at the first: a compiled step's
            # only strict op with a number (backward's fill_(1.0)) sees its second at step 2,
            # which must build nothing.
            _scalar_kinds.add(kind)
            async_compile.prebuild(executables.scalar(*kind), (v,))
        return v
    if len(_scalar_cache) > 4096:
        _scalar_cache.clear()
    cached = _scalar_cache[key] = executables.scalar(type(v), device)(v)
    return cached


def _unapply_bits(value, conj, neg):
    """A conj/neg-bit view's logical value from its storage's (and, the same involution, the
    storage value to write for a logical value)."""
    if conj:
        value = jnp.conj(value)
    if neg:
        value = -value
    return value


def _wrap_specs(out_specs):
    return [(list(shape), list(stride), dtype,
             storage.storage_numel(shape, stride) * dtype.itemsize)
            for shape, stride, dtype in out_specs]


def _dense_strides(m):
    """Meta's strides when they describe a dense layout (any dim order), else contiguous."""
    shape, stride = tuple(m.shape), m.stride()
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(dims):
        if stride[d] != expected:
            return storage.contiguous_strides(shape)
        expected *= shape[d]
    return stride
