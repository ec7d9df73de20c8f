"""Fused eager (DEFER_AND_FUSE): ops are recorded, and run later as one compiled executable.

Recording an op does what strict eager does up to the point of running it (key, meta kernel,
the op's cached `run` function) and then only notes which values it reads and produces: each
result is a `Pending` slot of the current trace, and new tensors are created at once with
PyTorch's exact shapes/strides, so views, aliasing and autograd proceed as usual.

The trace is flushed when a value must exist (a host read, a data-dependent op, a CPU
fallback, `synchronize()`), at a bounded length, at `optimizer.step()` and when the mode or
device changes.  A flush composes the recorded `run` functions into one function, jitted and
cached by the trace's structure (which cached op executables ran on which values, and which
results are still referenced), so a training loop compiles each distinct segment once and then
only replays it.  Intermediate values that no live tensor holds are never materialised, and
storages that the segment overwrites are donated to it where the platform supports donation.
"""
import contextlib
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .._core import storage
from .._core.storage import Failed, Pending
from . import async_compile, bounded, debug, executables, modes, spmd, sync
from .op_results import returns
from .._core import metrics
from .._core.metrics import FlushReason
from .random import next_key_parts
from .._core import runtime
from .._lowerings.rounding import round_to

max_ops = int(os.environ.get("TORCHTPU_FUSE_MAX_OPS", "2048"))
# Eager rounds every op's result to its dtype; XLA by default may keep a fused chain of
# half-precision ops in float32, so fused eager would differ from strict eager (exp(3 * x) in
# bfloat16 by up to 4%).  Fused eager promises eager's values, so the rounding stays.
EAGER_ROUNDING = {"xla_allow_excess_precision": False}


def _rounded_half(values):
    """XLA:CPU keeps float16 arithmetic in float32 through a fused loop whatever that option
    says (x * y + x in float16 rounds once: measured 1,208 of 4,096 values off the CPU's), so
    on the CPU each op's float16 results are rounded explicitly (a reduce_precision, which
    nothing removes).  bfloat16 is rounded as asked; TPUs and GPUs compute float16 natively."""
    if runtime.program_platform() != "cpu":
        return values
    return [round_to(v.astype(jnp.float32), jnp.float16).astype(jnp.float16)
            if getattr(v, "dtype", None) == jnp.float16 else v for v in values]


class Trace:
    __slots__ = ("device", "signature", "where", "ext_arrays", "ext_ids", "scalars", "pendings",
                 "captured", "in_backward", "ran_backward", "ext_buffers", "ext_queued", "mesh",
                 "abstract", "unwritten", "born")

    def __init__(self, device):
        self.device = device
        self.signature = []   # per op: (its compiled executable, where its inputs come from, #scalars)
        self.where = []       # per op: (kernel, its caller: debug.user_site) for error messages
        self.ext_arrays = []  # arrays that existed before the trace, read by it
        self.ext_ids = {}
        self.scalars = []
        self.pendings = []    # per slot
        self.captured = False  # taken over by torch.compile: never flushed
        self.in_backward = False  # recording the ops of a backward pass (the autograd engine's)
        self.ran_backward = False  # it recorded one
        # torch.tpu graphs: per external array, the storage it was read from (replay reads the
        # storage's value then); inputs are told apart by storage, not by array.
        self.ext_buffers = None
        # torch.tpu graphs: external index -> the value a strict op still queued behind its
        # compile will give that storage (async_compile); its ext_arrays entry describes it.
        self.ext_queued = None
        # The mesh of the process group whose collectives it holds (None: none): the trace
        # runs on every rank of it (spmd.py); a collective of another group starts a new trace.
        self.mesh = None
        # A capture that only describes the storages nothing wrote yet (it is lowered, never
        # run: torchtpu.scaling costs a step of a model materialised without memory).
        self.abstract = False
        # External index -> (storage, weakly; (size, dtype name); the (op, input) positions
        # reading it; the shape of its zeros, or None) of each unwritten storage read
        # (_zeros_input), settled at the flush.
        self.unwritten = {}
        # torch.tpu graphs: the storages `empty` made during the capture (note_new_storage).
        # Read before anything wrote them, they are zeros made inside the program at every
        # replay, as a fused segment makes them, instead of inputs read from their storage
        # (a step's `zero_` and `fill_` of new tensors made each such storage an input, a
        # guarded output and a copy: 20 of them, 24 MB, in a Llama step).  An abstract
        # capture describes the other unwritten storages (a model materialised without
        # memory), but these too are its temporaries (FSDP2's unsharded parameters and
        # gather/scatter buffers: 21 GB of inputs per chip in an 8B Llama's step before).
        self.born = None

    def flush(self, reason):
        """Run the pending trace: a `Pending` value of this trace is being read."""
        flush(reason)

    def live_outputs(self):
        """The pending values that storages still hold: what running the trace must give."""
        live = []
        for p in self.pendings:
            owner = p.owner()
            if owner is not None and owner._array is p:
                live.append(p)
        return live

    def random_positions(self):
        """(position in `scalars`, draws) of each random op's (seed, offset) pair."""
        found, pos = [], 0
        for (compiled, _, n), (kernel, _) in zip(self.signature, self.where):
            if kernel.low.random:
                found.append((pos, compiled.draws))
            pos += n
        return found

    def release(self):
        """Drop the arrays it read.  The trace and its Pending values refer to each other, so
        only the cyclic garbage collector frees it: until then, the arrays it read would stay
        referenced, and the next program could not donate them."""
        self.ext_arrays.clear()
        self.ext_ids.clear()
        self.pendings.clear()
        self.unwritten.clear()


# One trace for the process, recorded and flushed under one lock: threads in fused mode append
# to it in turn, and a thread reading a value another thread's flush is producing waits for it
# (per-thread traces would split a backward pass from its forward: the autograd engine runs
# backward ops on a thread of its own).  Reentrant: a flush can start from inside `record`.
_lock = threading.RLock()
_trace = None
_segments = bounded.segment_cache("segment_evictions")
# A backward pass starts a new segment.  The forward's index checks (embedding, the loss's
# targets) forbid donating inputs to their segment, since a failure is replayed from intact
# inputs; in a segment of its own, the backward and the optimizer step after it donate the
# parameters and optimizer state they overwrite, so that memory does not double.  XLA:CPU also
# runs the two programs about 10-15% faster than one.
_graph_task_id = torch._C._current_graph_task_id  # >= 0 while the autograd engine runs


def record(kernel, compiled, vals, buffers, scalars, device):
    global _trace
    with _lock:  # (one function, not a locked call of another: a call per op costs ~0.15 us)
        tr = _trace
        if tr is None or tr.device != device:
            if tr is not None:
                flush(FlushReason.DEVICE_CHANGE)
            tr = _trace = Trace(device)
        if (_graph_task_id() >= 0) is not tr.in_backward:
            if not tr.in_backward and tr.signature and not tr.captured:
                flush(FlushReason.BACKWARD)
                tr = _trace = Trace(device)
            tr.in_backward = not tr.in_backward
            tr.ran_backward |= tr.in_backward
        mesh = compiled.program.mesh
        if mesh is not None and tr.mesh is not mesh:
            if tr.mesh is not None:
                if tr.captured:
                    raise CaptureBroken(
                        "a captured step holds collectives of two process groups, which one "
                        "program cannot run", FlushReason.GROUP_CHANGE, kernel.overload,
                        debug.user_frame(3))
                flush(FlushReason.GROUP_CHANGE)
                in_backward = tr.in_backward
                tr = _trace = Trace(device)
                tr.in_backward = in_backward
            tr.mesh = mesh
        # An input is either a slot produced earlier in this trace (>= 0) or an external
        # array (< 0); at the flush, the zeros of an unwritten storage may become a third kind
        # (_settle_zeros).
        wiring = []
        for b in buffers:
            a = b._array
            if type(a) is Pending and a.trace is tr:
                wiring.append(a.slot)
                continue
            if a is None and b.dtype is not None and (
                    tr.ext_buffers is None or b in tr.born):
                # unwritten (a graph's capture: one it made itself, Trace.born): _settle_zeros
                wiring.append(-1 - _zeros_input(tr, b, len(tr.signature), len(wiring)))
                continue
            if tr.ext_buffers is None:
                a = b.value()
                ident = id(a)
            else:  # a capture reads storages at replay: a value still to come need not wait
                ident = id(b)
                queued = async_compile.queued(a)
                if queued:
                    a = async_compile.abstract(a, b)
                elif a is None and tr.abstract:
                    a = jax.ShapeDtypeStruct((b.nbytes // np.dtype(b.dtype).itemsize,), b.dtype)
                else:
                    a = b.value()
            k = tr.ext_ids.get(ident)
            if k is None:
                k = tr.ext_ids[ident] = len(tr.ext_arrays)
                tr.ext_arrays.append(a)
                if tr.ext_buffers is not None:
                    tr.ext_buffers.append(b)
                    if queued:
                        tr.ext_queued[k] = b._array
            wiring.append(-1 - k)
        tr.signature.append((compiled.program, tuple(wiring), len(scalars)))
        # The walk starts past the frames every recorded op passes through (this function,
        # op_runners' runner, OpKernel.call and its caller, OpKernel.__call__ or padded.py):
        # Python 3.11 makes a frame object for each frame the walk visits, ~0.3 us apiece, while
        # the user's own frame is alive across its ops and made once.
        tr.where.append((kernel, debug.user_site(5)))
        tr.scalars.extend(scalars)
        pendings = tr.pendings
        new = []
        for shape, stride, dtype, nbytes in compiled.wrap_specs:
            p = Pending(tr, len(pendings))
            pendings.append(p)
            new.append(storage.wrap(p, shape, stride, dtype, device, nbytes))
        for j in compiled.writes:
            b = buffers[j]
            p = Pending(tr, len(pendings))
            p.owner = weakref.ref(b)
            pendings.append(p)
            b._array = p
        result = returns(compiled, vals, new)
        if len(tr.signature) >= max_ops and not tr.captured:
            flush(FlushReason.MAX_OPS)
        return result


def set_mode(mode):
    """`torch.tpu.eager_mode = mode`: the process-wide default; leaving fused mode first runs
    what it deferred."""
    mode = modes._coerce(mode)
    _leaving_fused(mode)
    modes._set_default(mode)


def set_thread_mode(mode):
    """The calling thread's own mode (None: back to the default), flushing as above."""
    mode = None if mode is None else modes._coerce(mode)
    _leaving_fused(mode or modes._default)
    modes._set_own(mode)


def _leaving_fused(mode):
    if modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE and mode is not modes.EagerMode.DEFER_AND_FUSE:
        flush(FlushReason.MODE_CHANGE)


class CaptureBroken(RuntimeError):
    """Something forced the ops being captured to run (a data-dependent op, a host read, a
    CPU fallback, another device): they cannot form one function.  `reason` is the flush
    reason, `op` the op that asked (when known), `where` the user's line."""

    def __init__(self, message, reason=None, op=None, where=None):
        super().__init__(message)
        self.reason, self.op, self.where = reason, op, where


def start_capture(device, by_storage=False, abstract=False):
    """Start recording into a fresh trace that is never flushed; returns (trace, the mode to
    restore).  `by_storage`: note the storage of every external input (torch.tpu graphs);
    `abstract`: describe unwritten storages instead of reading them (see Trace.abstract)."""
    global _trace
    flush(FlushReason.CAPTURE)
    previous = modes.own_mode()
    set_thread_mode(modes.EagerMode.DEFER_AND_FUSE)
    tr = _trace = Trace(device)
    tr.captured = True
    if by_storage:
        tr.ext_buffers = []
        tr.ext_queued = {}
        tr.born = weakref.WeakSet()
    tr.abstract = abstract
    return tr, previous


def stop_capture(tr, previous):
    """End a capture; whether it stayed whole (nothing forced it to run part-way)."""
    global _trace
    intact = _trace is tr
    if intact:
        _trace = None
        if tr.unwritten:
            _settle_zeros(tr)
    set_thread_mode(previous)
    return intact


def capturing():
    return _trace is not None and _trace.captured


def note_new_storage(t):
    """`t`'s storage was just made by `empty` (unwritten): during a torch.tpu graph's capture,
    it is one the capture made (Trace.born)."""
    note_new_buffer(storage.buffer_of(t))


def note_new_buffer(buffer):
    tr = _trace
    if tr is not None and tr.born is not None:
        tr.born.add(buffer)


def replace_value(t, array):
    """Give a tensor that covers its whole storage the value `array` (None: zeros, as a fresh
    storage reads; it may hold more elements than the storage, which are never read) without
    running an op; whether it could.  Placing a model on the device or creating optimizer
    state then adds no ops to a fused trace, so the first training step's segments equal the
    later steps' instead of compiling twice.  Zeros take `t`'s shape when they are made (an
    array keeps its shape through writes, and a flat optimizer state made XLA copy it).  Not
    while ops are captured: a replay must write the value again."""
    buf = storage.buffer_of(t)
    if not (storage.covers_storage(t) and (array is None or array.dtype == buf.dtype)
            and not capturing()):
        return False
    with _lock:  # not while a flush is storing its results
        buf._array = array
        buf.from_bytes = False
        buf.shape = tuple(t.shape) if array is None else None
    return True


def capture(fn, device):
    """Record the ops `fn()` runs into a fresh trace that the caller takes over (it is not
    run here); returns (trace, fn's result)."""
    tr, previous = start_capture(device)
    try:
        result = fn()
    finally:
        intact = stop_capture(tr, previous)
    if not intact:
        raise CaptureBroken("the captured ops were forced to run part-way")
    return tr, result


def flush(reason, op=None):
    """Run the pending trace (if any) now; `reason` is counted in the metrics, `op` (the op
    that needs the values, when known) named in capture errors.

    Interruption (Ctrl-C) never loses a value.  While the segment compiles, nothing has been
    consumed: the trace is put back, its tensors stay pending and the next read runs it again.
    Running the executable (which may consume donated inputs) and storing its results happen
    with SIGINT held back until they are done, so every tensor then has its new value."""
    global _trace
    reason = FlushReason(reason)  # one of the listed reasons, never a free string
    with _lock:
        tr = _trace
        if tr is None:
            return
        _trace = None
        try:
            _flush(tr, reason, op)
        except BaseException:
            if tr.pendings and _trace is None:  # not run: it runs again when next needed
                _trace = tr
            raise


def _flush(tr, reason, op):
    if tr.captured:
        raise CaptureBroken(f"the ops being captured had to run part-way ({reason}"
                            f"{', ' + str(op) if op else ''})", reason, op, debug.user_frame(2))
    if tr.unwritten:
        _settle_zeros(tr)
    counters = metrics.counters
    counters["fused_ops"] += len(tr.signature)
    for kernel, _ in tr.where:
        counters[kernel.metric_key] += 1
    counters["flushes"] += 1
    counters[f"flush::{reason}"] += 1
    outputs = [p.slot for p in tr.live_outputs()]
    scalar_types = tuple(map(type, tr.scalars))
    key = (tuple(tr.signature), tuple(outputs), scalar_types)
    segment = _segments.lookup(key)
    if segment is None:
        segment = Segment(tr.signature, outputs, scalar_types, "segment")
        _segments.insert(key, segment)
    packed = pack_scalars(tr.scalars, scalar_types)
    call = segment.prepare(tr.ext_arrays, packed)
    try:
        with _interrupts_held():
            try:
                with metrics.span(f"torchtpu::flush ({reason})"):
                    results, checks = segment.run(tr.ext_arrays, call, packed)
                failed = None
                if any(checks):
                    sync.defer(checks, segment.check_error(
                        list(tr.where), f"a fused op; its segment ran because of {reason}"))
            except Exception as e:
                if segment.mesh is not None:
                    # Its collectives cannot run again on this rank alone.
                    _fail_all(tr, e)
                    raise
                failed = -1
            if failed is not None:
                _replay_and_raise(tr, reason)
                return
            for slot, array in zip(outputs, results):
                p = tr.pendings[slot]
                owner = p.owner()
                if owner is not None and owner._array is p:
                    owner._array = array
            if results:
                sync.track(results[0])
    finally:
        tr.release()


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT (Ctrl-C) arriving inside is handled on exit, once the block is done: a
    KeyboardInterrupt between running a segment and storing its results would lose both the
    donated inputs and the outputs.  Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # (None: a handler installed outside Python, which could not be put back)
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


# Python numbers are passed to the segment packed into one array per type (one transfer
# instead of one per number) and unpacked as weakly typed values, which is what a Python
# number passed to a jitted function becomes: `x * 0.5` keeps x's dtype.
PACKED = {float: np.float64, int: np.int64, bool: np.bool_, complex: np.complex128}


def pack_scalars(scalars, types):
    groups = {t: [] for t in PACKED}
    other = []
    for v, t in zip(scalars, types):
        (groups[t] if t in groups else other).append(v)
    packed = PACKED if runtime.platform() != "tpu" else _PACKED_FOR_TPU
    return [np.array(groups[t], dtype) for t, dtype in packed.items()], other


# XLA:TPU has no complex128 (op_keys.narrow_complex)
_PACKED_FOR_TPU = {**PACKED, complex: np.complex64}


def _packed_type(t):
    """The type of a number baked into the program being traced."""
    return (_PACKED_FOR_TPU if runtime.program_platform() == "tpu" else PACKED)[t]


def _unpack_scalars(packed, types):
    arrays, other = packed
    position = dict.fromkeys(PACKED, 0)
    columns = dict(zip(PACKED, arrays))
    values = []
    other_it = iter(other)
    for t in types:
        if t in columns:
            v = columns[t][position[t]]
            position[t] += 1
            values.append(v if t is bool else _as_weak(v))
        else:
            values.append(next(other_it))
    return values


class PackedScalars:
    """A recorded op sequence's Python numbers packed once (pack_scalars), with its random ops'
    (seed, offset) pairs, drawn anew for every run (`for_run`)."""

    __slots__ = ("arrays", "other", "random", "device")

    def __init__(self, scalars, types, random, device):
        self.arrays, self.other = pack_scalars(scalars, types)
        in_other = [i for i, t in enumerate(types) if t not in PACKED]
        self.random = [(in_other.index(pos), draws) for pos, draws in random]
        self.device = device

    def for_run(self):
        if not self.random:
            return self.arrays, self.other
        other = list(self.other)
        for i, draws in self.random:
            other[i], other[i + 1] = next_key_parts(self.device, draws)
        return self.arrays, other


def _as_weak(v):
    from jax._src.lax.lax import _convert_element_type
    return _convert_element_type(v, weak_type=True)


def structure_key(signature, outputs, scalar_types, guarded, constants=None):
    """A recorded op sequence's key in the persistent cache (None: not storable): its ops' own
    keys, their wiring, what it returns, which inputs it overwrites, and the numbers it bakes
    in."""
    ops = [(getattr(c.fn, "key", None), wiring, n) for c, wiring, n in signature]
    if any(k is None for k, _, _ in ops):
        return None
    return executables.stable((ops, outputs, [t.__name__ for t in scalar_types], tuple(guarded))
                              + ((constants,) if constants is not None else ()))


def baked(scalars, scalar_types):
    """The numbers a graph bakes into its program (Segment's `constants`): every Python number
    of the recording (None in the place of each random op's (seed, offset), drawn anew for
    every run).  A graph runs with the numbers of its capture (torch.tpu graphs, a whole step)
    or is recorded per value of them (a compiled graph: its key holds its inputs' offsets and
    its non-tensor arguments), so they are constants of its program, as they are of JAX's:
    XLA folds them, and the views' offsets among them make static slices of the storages'
    dims (strided.py) where runtime offsets made dynamic slices of flattened storages, which
    on TPU cost a relayout of the storage each (and 64-bit emulation for the offsets)."""
    return tuple(v if t in PACKED else None for v, t in zip(scalars, scalar_types))


def checks_info(signature):
    """An Executable's `traced` hooks for a recorded op sequence: its ops' index-check messages,
    learnt by tracing, are stored with the entry, and a loaded (untraced) one restores them."""
    def save():
        return [list(c.check_info) for c, _, _ in signature]

    def restore(saved):
        for (c, _, _), info in zip(signature, saved):
            if not c.check_info:
                c.check_info[:] = info
    return save, restore


class Segment:
    """One recorded op sequence (a fused segment or a compiled graph) and the rules for running
    it, the same for both: which inputs it may consume, one executable per pattern of donated
    inputs, compile/cache-hit accounting (`{kind}_compiles`, `{kind}_cache_hits`) and finding
    the op whose index check failed.  `prepare` then `run`."""

    __slots__ = ("structure", "executables", "has_checks", "kind", "key", "name", "patterns",
                 "mesh", "collectives", "orders")

    def __init__(self, signature, outputs, scalar_types, kind, guarded=(), constants=None):
        self.structure = (signature, outputs, scalar_types, tuple(guarded), constants)
        self.executables = {}
        self.orders = {}  # donation pattern -> _Order
        self.has_checks = None  # known once traced
        self.kind = kind
        self.key = structure_key(*self.structure)
        names = [c.fn.name for c, _, _ in signature[:1] + signature[-1:] if hasattr(c.fn, "name")]
        self.name = f"segment of {len(signature)} ops ({' .. '.join(names)})"
        self.patterns = None  # donation patterns built, here or by earlier processes
        # Collectives: the program runs on every rank of their group (spmd.py).
        self.mesh = next((c.mesh for c, _, _ in signature if c.mesh is not None), None)
        self.collectives = [c.collective for c, _, _ in signature if c.collective is not None]

    def learn_checks(self, ext_arrays, packed_scalars):
        """Trace the segment abstractly the first time it is seen: whether its ops check
        indices is known only from a trace, and must be known before the first executable is
        built, or that one could not donate and a second one would be compiled at once."""
        if self.has_checks is None:
            self.has_checks = executables.recall("checks", self.key)
        if self.has_checks is None:
            self.has_checks = self._trace_checks(ext_arrays, packed_scalars)
            executables.remember("checks", self.key, self.has_checks)

    def _trace_checks(self, ext_arrays, packed_scalars):
        self._make((False,) * len(ext_arrays)).eval_shape([], ext_arrays, packed_scalars)
        return any(c.check_info for c, _, _ in self.structure[0])

    def _make(self, donate):
        """The (unbuilt) executable of this donation pattern."""
        function = segment_function(*self.structure, self.order(donate))
        key = None if self.key is None else f"{self.key} donating {donate}"
        options = dict(traced=checks_info(self.structure[0]), compiler_options=EAGER_ROUNDING,
                       donate_argnums=(0,) if any(donate) else ())
        if self.mesh is not None:
            # Where the ranks disagree, the ops before the first collective only (spmd.Program)
            ops = self.structure[0]
            first = next((i for i, (c, _, _) in enumerate(ops) if c.collective is not None), len(ops))
            until = segment_function(*self.structure, self.order(donate), stop=first)
            return spmd.Program(function, self.mesh, self.collectives, key, self.name,
                                self.name, skipped=until, **options)
        return executables.Executable(function, key, self.name, **options)

    def order(self, donate):
        """The argument and result order of this donation pattern's executable (_Order)."""
        order = self.orders.get(donate)
        if order is None:
            signature, outputs, _, guarded, _ = self.structure
            order = self.orders[donate] = _Order(
                donate, guarded + _overwrites(signature, outputs), len(outputs))
        return order

    def donation(self, ext_arrays, held=None):
        """Per input array: may the segment consume it?  Only arrays nothing else refers to
        (see `unshared`), and where an index check can fail only if the program keeps the
        storages it overwrites (`guarded`: graphs); a fused segment's failure is replayed from
        intact inputs instead."""
        if self.has_checks is not False and not self.structure[3]:
            return (False,) * len(ext_arrays)
        return unshared(ext_arrays, held)

    def prebuild(self, ext_arrays, donate, packed_scalars):
        """Start building the executable of this donation pattern (traced here, so what the
        lowerings refuse raises here; compiled on a thread of its own, or loaded), before its
        first run, which waits for it."""
        start = time.perf_counter()
        fn = self._make(donate)
        with donation_warnings_ignored():
            async_compile.prebuild(fn, (*self.order(donate).split(ext_arrays), packed_scalars),
                                   ahead=True)
        self.executables[donate] = fn
        self.has_checks = any(c.check_info for c, _, _ in self.structure[0])
        metrics.counters[f"{self.kind}_compiles"] += 1
        metrics.counters["compile_seconds"] += time.perf_counter() - start

    def prepare(self, ext_arrays, packed_scalars, held=None):
        """Everything before running: learn the checks, choose the donation and compile its
        executable if new (a compile is the long part of a first run, and an interrupted one
        consumes nothing).  An error here is left to `run`, which fails the same way.
        Returns the call to hand to `run`."""
        start = time.perf_counter()
        try:
            self.learn_checks(ext_arrays, packed_scalars)
        except Exception:
            pass
        donate = self.choose(self.donation(ext_arrays, held))
        compiling = donate not in self.executables
        try:
            self.compile(ext_arrays, donate, packed_scalars)
        except Exception:
            pass
        return donate, compiling, start

    def choose(self, donate):
        """The donation pattern to run with, given what `donate` allows: itself if built (here
        or by an earlier process), else the built one donating the most of it (donating less
        is always correct, and cheaper than compiling), else itself (built now).  Which inputs
        are free to donate depends on who else holds them, which a restart can change."""
        if donate in self.executables:
            return donate
        if self.patterns is None:
            self.patterns = set(executables.recall("donations", self.key) or ())
        if donate in self.patterns:
            return donate
        usable = [p for p in self.patterns if len(p) == len(donate)
                  and all(d or not q for q, d in zip(p, donate))]
        return max(usable, key=sum) if usable else donate

    def compile(self, ext_arrays, donate, packed_scalars):
        """The executable for this donation pattern, compiled if new."""
        fn = self.executables.get(donate)
        if fn is None:
            fn = self._make(donate)
            with donation_warnings_ignored():
                fn.prepare(*self.order(donate).split(ext_arrays), packed_scalars)
            self.executables[donate] = fn
            if self.patterns is not None and donate not in self.patterns:
                # With those another process noted meanwhile (a lost race only costs a compile).
                self.patterns |= {donate, *map(tuple, executables.recall("donations", self.key) or ())}
                executables.remember("donations", self.key, sorted(self.patterns))
        return fn

    def run(self, ext_arrays, call, packed_scalars):
        """(results, checks): `checks`, the ops' device-side checks, are not read here: the
        caller queues them with sync.defer and `check_error`."""
        donate, compiling, start = call
        try:
            fn = self.compile(ext_arrays, donate, packed_scalars)
            order = self.order(donate)
            donated, kept = order.split(ext_arrays)
            with donation_warnings_ignored():
                results, checks = fn(donated, kept, packed_scalars)
            if order.back is not None:
                results = [results[p] for p in order.back]
            metrics.counters["donated_buffers"] += len(donated)
        finally:
            if compiling:
                metrics.counters[f"{self.kind}_compiles"] += 1
                metrics.counters["compile_seconds"] += time.perf_counter() - start
            else:
                metrics.counters[f"{self.kind}_cache_hits"] += 1
        return results, checks

    def check_error(self, where, note):
        """For sync.defer: error(host values of run's checks), the first failed op's error
        naming it and its line (`where`: per op, its kernel and line), or None."""
        signature = self.structure[0]

        def error(values):
            i = first_failed_check(values)
            if i is None:
                return None
            kernel, line = where[i]
            return debug.failed_check(values[i], signature[i][0], kernel.overload, line, note)
        return error

    def lower(self, ext_arrays, packed_scalars):
        return self._make((False,) * len(ext_arrays)).lower([], ext_arrays, packed_scalars)

    def compile_for(self, target, ext_arrays, packed_scalars, donate):
        """The program of this donation pattern compiled for a TPU target
        (tpu_compiler.Report), as it is built to run here."""
        return self._make(donate).compile_for(
            target, *self.order(donate).split(ext_arrays), packed_scalars)

    def export(self, ext_arrays, packed_scalars, platforms):
        """StableHLO text of the program for `platforms` (spmd.export), whose devices this
        process need not have; a segment without collectives is one device's program."""
        function = segment_function(*self.structure, self.order((False,) * len(ext_arrays)))
        args = ([], ext_arrays, packed_scalars)
        if self.mesh is not None:
            return spmd.export(function, self.mesh.devices.size, args, platforms)
        return jax.export.export(jax.jit(function), platforms=platforms)(
            *spmd.described(args)).mlir_module()


@contextlib.contextmanager
def donation_warnings_ignored():
    # Donating a freed array that no output can reuse is harmless; JAX warns anyway.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        yield


def unshared(arrays, held=None):
    """Per array: does nothing but the list `arrays` refer to it (and, where `held[k]`, the one
    storage the caller overwrites with the results)?  Such an array may be donated: its memory
    can hold a result.  References counted: the list, the loop variable, getrefcount's argument."""
    counts = [sys.getrefcount(a) for a in arrays]  # (zip would hold one more reference)
    return tuple(c <= 3 + h for c, h in zip(counts, held or (0,) * len(arrays)))


class _Order:
    """How a segment's executable takes its inputs and gives its results, for one donation
    pattern.  JAX gives a donated input's buffer to the first result of its shape and dtype,
    in order; a result that overwrites a donated input (`overwrites`: (result, input) pairs,
    a parameter's or an optimizer state's new value; `_overwrites`, and a graph's `guarded`)
    must get that input's buffer, or XLA copies the input first (where a gradient of a
    parameter's shape came first and took the parameter's buffer, it copied every parameter
    and optimizer state: 150 copies in the small GPT's whole step; given to an unrelated
    result, FSDP2's fused backward read a wrong gradient on XLA:CPU).  So those results come
    first, and their inputs first among the donated ones, in the same order.
    `inputs`: per external input, its position in (donated + kept); `results`: the segment's
    results in the executable's order; `back` (None where that is the segment's order): per
    segment result, its position among the executable's."""

    __slots__ = ("donated", "kept", "inputs", "results", "back")

    def __init__(self, donate, overwrites, n_results):
        pairs, ahead = {}, set()
        for r, k in overwrites:  # (one result per input, one input per result)
            if donate[k] and k not in pairs and r not in ahead:
                pairs[k] = r
                ahead.add(r)
        pairs = sorted(pairs.items())
        first = {k for k, _ in pairs}
        self.donated = [k for k, _ in pairs] + [k for k, d in enumerate(donate) if d and k not in first]
        self.kept = [k for k, d in enumerate(donate) if not d]
        self.inputs = [0] * len(donate)
        for p, k in enumerate(self.donated + self.kept):
            self.inputs[k] = p
        self.results = [r for _, r in pairs] + [r for r in range(n_results) if r not in ahead]
        self.back = None
        if self.results != list(range(n_results)):
            self.back = [0] * n_results
            for p, r in enumerate(self.results):
                self.back[r] = p

    def split(self, ext_arrays):
        """(donated, kept): the two argument lists of the executable."""
        return [ext_arrays[k] for k in self.donated], [ext_arrays[k] for k in self.kept]


def segment_function(signature, outputs, scalar_types, guarded, constants, order, stop=None):
    """The recorded ops as one JAX function: (donated, kept, packed scalars) -> (results, each
    op's checks), arguments and results in `order` (_Order).  `guarded`: (result, input) pairs,
    the storages a graph overwrites: where a check fails, result r is input k unchanged, so a
    failure read later changed nothing.  `constants` (`baked`, or None): the numbers that are
    constants of the program rather than read from `packed`.  `stop`: run the ops before op
    `stop` only, as strict eager would have before an op that raised: each storage a later op
    writes keeps the value it had then, one a later op makes is zeros, their checks pass; the
    function then takes the whole segment's (results, checks) shapes first (what a rank runs
    where the ranks disagree on the segment's collectives: spmd.Program)."""
    if stop is not None:
        before = _overwritten(signature)

    def segment(donated, kept, packed):
        return run(donated, kept, packed, None)

    def until(shapes, donated, kept, packed):
        return run(donated, kept, packed, shapes)

    def run(donated, kept, packed, shapes):
        given = list(donated) + list(kept)
        ext = [given[p] for p in order.inputs]
        scalars = _unpack_scalars(packed, scalar_types)
        if constants is not None:
            scalars = _with_constants(scalars, scalar_types, constants, signature)
        slots = []
        checks = []
        pos = 0
        for compiled, wiring, n_scalars in signature[:stop]:
            ins = wired(wiring, slots, ext)
            outs, updated, op_checks = compiled.run(*ins, *scalars[pos:pos + n_scalars])
            pos += n_scalars
            slots.extend(_rounded_half(outs))
            slots.extend(_rounded_half(updated))
            checks.append(op_checks)
        if stop is None:
            results = [slots[s] for s in outputs]
        else:
            wanted, checked = shapes
            if order.back is not None:
                wanted = [wanted[p] for p in order.back]
            results = [_as_of(s, slots, before, ext, w) for s, w in zip(outputs, wanted)]
            checks.extend(jax.tree_util.tree_map(lambda c: jnp.ones(c.shape, c.dtype),
                                                 checked[stop:]))
        passed = all_passed(checks)
        if guarded and passed is not None:
            for r, k in guarded:
                results[r] = jnp.where(passed.all(), results[r], ext[k])
        if order.back is not None:
            results = [results[r] for r in order.results]
        return results, checks

    return segment if stop is None else until


def _overwritten(signature):
    """Per slot: the slot or external input (< 0) whose storage it overwrites, or None."""
    before = []
    for compiled, wiring, _ in signature:
        before.extend([None] * len(compiled.wrap_specs))
        before.extend(wiring[j] if type(wiring[j]) is int else None for j in compiled.writes)
    return before


def _overwrites(signature, outputs):
    """(result, external input) pairs: the result is the new value of the input's storage
    (after one or more in-place ops), so a donated input's buffer is its own (_Order)."""
    before = _overwritten(signature)
    pairs = []
    for r, slot in enumerate(outputs):
        while slot is not None and slot >= 0:
            slot = before[slot]
        if slot is not None:
            pairs.append((r, -1 - slot))
    return tuple(pairs)


def _as_of(slot, slots, before, ext, shape):
    """The value of the storage that `slot` is a value of, as of the ops run (`slots`): the
    slot's own, or what it overwrote, back to the external input; zeros where it was made
    later."""
    while slot is not None and slot >= len(slots):
        slot = before[slot]
    zeros = jnp.zeros(shape.shape, shape.dtype)
    if slot is None:
        return zeros
    value = slots[slot] if slot >= 0 else ext[-1 - slot]
    if value.shape != shape.shape or value.dtype != shape.dtype:
        return zeros
    return value


def _with_constants(scalars, scalar_types, constants, signature):
    """`scalars` with the baked numbers in place of the packed ones: the views' offsets (the
    last `n_offsets` numbers of an op) as Python ints, so strided.py slices statically; the
    others as weakly typed constants of their packed dtype, so they promote as the packed
    values did."""
    scalars = list(scalars)
    offsets = set()
    pos = 0
    for compiled, _, n_scalars in signature:
        n = getattr(compiled, "n_offsets", 0)
        offsets.update(range(pos + n_scalars - n, pos + n_scalars))
        pos += n_scalars
    for i, (v, t) in enumerate(zip(constants, scalar_types)):
        if v is None:
            continue
        scalars[i] = int(v) if i in offsets else (
            np.asarray(v, np.bool_) if t is bool else _as_weak(np.asarray(v, _packed_type(t))))
    return scalars


def _zeros_input(tr, buf, op, position):
    """The external input standing for an unwritten storage (made by `empty` or `zeros`: it
    reads as zeros) that op `op` reads as its input `position`; what it is, _settle_zeros
    decides at the flush."""
    key = ("unwritten", id(buf))
    k = tr.ext_ids.get(key)
    entry = tr.unwritten.get(k)
    # (None: another storage, since freed, had its id, or this one's input was settled by a
    # flush that was interrupted and put the trace back)
    if entry is None or entry[0]() is not buf:
        k = tr.ext_ids[key] = len(tr.ext_arrays)
        tr.ext_arrays.append(None)
        if tr.ext_buffers is not None:  # (kept beside ext_arrays; _settle_zeros replaces it)
            tr.ext_buffers.append(buf)
        dtype = np.dtype(buf.dtype)
        tr.unwritten[k] = (weakref.ref(buf), (buf.nbytes // dtype.itemsize, dtype.name), [],
                           buf.shape, buf.made_as)
    tr.unwritten[k][2].append((op, position))
    return k


def _settle_zeros(tr):
    """The inputs that stand for unwritten storages (_zeros_input).  One that outlives the
    segment (an optimizer's state, made by zeros_like in its first step) is read as an array by
    the next run of the same code, so it is an array of zeros here too: both runs are one
    segment, compiled once.  The others (the zeros of every slice's backward, a `ones_like`'s
    fill_, `_to_copy`'s destination) are zeros made inside the segment, where XLA fuses them
    into what writes over them, instead of a program or host transfer each before it, which
    blocked the host behind the segments running (a Llama step's fused host time: 175 ms, 29 ms
    with them made inside); their input is then a placeholder of no elements.  A capture's
    (a compiled graph's) are all made inside: its storages are new at every run.  With them
    made inside, FSDP2's unsharded parameters and all-gather and reduce-scatter buffers are the
    program's temporaries, not arrays of zeros read from HBM at every step (a captured 4-layer
    GPT step read 70 MiB of them)."""
    for k, (ref, zeros, readers, shape, made_as) in tr.unwritten.items():
        if ref() is not None and not tr.captured:
            dtype = np.dtype(zeros[1])
            tr.ext_arrays[k] = storage.zeros_for(zeros[0] * dtype.itemsize, dtype, tr.device, shape)
        else:
            tr.ext_arrays[k] = _placeholder(zeros[1], tr.device)
            shape = shape or made_as
            if shape is not None and math.prod(shape) == zeros[0]:
                zeros = (tuple(shape), zeros[1])  # made in the shape of its tensor (strided.py)
            for op, position in readers:
                program, wiring, n = tr.signature[op]
                tr.signature[op] = (program, wiring[:position] + (zeros,) + wiring[position + 1:], n)
        if tr.ext_buffers is not None:
            # A torch.tpu graph reads its inputs from storages at replay: this one's is a
            # storage of its own holding that array, which no replay writes or donates.
            a = tr.ext_arrays[k]
            tr.ext_buffers[k] = storage.DeviceBuffer(a, a.nbytes, tr.device, a.dtype)
    tr.unwritten.clear()


_placeholders = {}


def _placeholder(dtype, device):
    key = (dtype, device)
    a = _placeholders.get(key)
    if a is None:
        a = _placeholders[key] = jax.device_put(np.zeros(0, dtype), runtime.jax_device(device))
    return a


def wired(wiring, slots, ext):
    """An op's inputs: an earlier op's result (slot >= 0), an external array (< 0) or zeros
    (size or shape, and dtype name: _settle_zeros)."""
    return [(slots[w] if w >= 0 else ext[-1 - w]) if type(w) is int else _zeros(*w)
            for w in wiring]


def _zeros(shape, dtype):
    return jnp.zeros(shape, dtype)


def all_passed(checks):
    """Every check of a segment's ops as one boolean vector (None: no checks), traced."""
    flat = [c for op in checks for c in op]
    return jnp.stack([jnp.asarray(c, bool).reshape(()) for c in flat]) if flat else None


def first_failed_check(checks):
    if not any(checks):
        return None
    for i, op_checks in enumerate(jax.device_get(checks)):
        if op_checks and not all(bool(c) for c in op_checks):
            return i
    return None


def _replay_and_raise(tr, reason):
    """Something in the segment failed: run its ops one at a time, as strict eager would have,
    keep the results of those before the failing op, and raise that op's error naming it and
    the line that recorded it.  Values of the failing op and everything after it are lost."""
    slots = []
    pos = 0
    for i, (compiled, wiring, n_scalars) in enumerate(tr.signature):
        kernel, where = tr.where[i]
        ins = wired(wiring, slots, tr.ext_arrays)
        try:
            outs, updated, checks = compiled.fn(*ins, *tr.scalars[pos:pos + n_scalars])
            error = compiled.check_error(checks) if checks else None
            if error is not None:
                raise error
        except Exception as e:
            error = debug.attributed(
                e, kernel.overload, debug.describe_key(compiled.key), where,
                note=f"\n  (a fused op: it ran when its segment was flushed, because of {reason})")
            # The failing op's own in-place targets keep the value they had before it (an op
            # that resized its out= ran at its call: OpKernel.__call__).
            n_out = len(compiled.wrap_specs)
            slots.extend([None] * n_out)
            slots.extend(ins[j] for j in compiled.writes)
            _commit(tr, slots)
            for p in tr.pendings[len(slots):]:
                owner = p.owner()
                if owner is not None and owner._array is p:
                    owner._array = Failed(error)
            raise error from e
        pos += n_scalars
        slots.extend(outs)
        slots.extend(updated)
    _commit(tr, slots)


def _fail_all(tr, error):
    """Every value the trace would have given is lost."""
    for p in tr.live_outputs():
        p.owner()._array = Failed(error)


def _commit(tr, slots):
    for p, array in zip(tr.pendings, slots):
        if array is None:
            continue
        owner = p.owner()
        if owner is not None and owner._array is p:
            owner._array = array


def _on_optimizer_step(optimizer, args, kwargs):
    if modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE and not capturing():
        flush(FlushReason.OPTIMIZER_STEP)  # a captured step continues after optimizer.step()


def install():
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_on_optimizer_step)


def pending_ops():
    return 0 if _trace is None else len(_trace.signature)


def current_trace():
    """The trace being recorded (None: nothing deferred)."""
    tr = _trace
    return tr if tr is not None and tr.signature else None


def clear_cache():
    _segments.clear()

