"""Recording ops: fused eager's trace and the captures of torch.tpu graphs, `torch.compile`'s
graphs and `torchtpu.scaling`'s step.

Recording an op does what strict eager does up to the point of running it (key, meta kernel,
the op's cached `run` function) and then only notes which values it reads and produces: each
result is a `Pending` slot of the current trace, and new tensors are created at once with
PyTorch's exact shapes/strides, so views, aliasing and autograd proceed as usual.

A recording ends as a `Recording`, a value: fused eager's flush (fused.py) runs it, and a
capture's consumer (a TPUGraph, an FX graph's `Captured`, the scaling step) builds its program
from it (segment.Segment.from_recording) and restores or releases it; none of them touches the
trace.  The trace is run when one of its values is read (`Pending.trace.flush`), by the policy
that fused.py registers (`flush_with`).
"""
import math
import os
import threading
import weakref

import jax
import numpy as np
import torch

from .._core import runtime, storage
from .._core.metrics import FlushReason
from .._core.storage import Pending
from . import async_compile, debug, modes
from .op_results import returns

max_ops = int(os.environ.get("TORCHTPU_FUSE_MAX_OPS", "2048"))

# Runs the current trace now: fused eager's flush (fused.py, `flush_with`), the one policy for
# running what was recorded; a recording that must not run raises CaptureBroken there.
_flush = None


def flush_with(flush):
    global _flush
    _flush = flush


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
        _flush(reason)

    def live_outputs(self):
        """The pending values that storages still hold: what running the trace must give."""
        return [p for p in self.pendings if p.holder() is not None]

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
        if self.ext_buffers is not None:
            self.ext_buffers = []
            self.ext_queued = {}


class Recording:
    """A recorded op sequence, frozen when its recording stopped (stop_capture, or `take` for
    fused eager's flush): what a program is built from (segment.Segment.from_recording), and
    the values running it gives.

    device; `signature`: per op (its program, where its inputs come from: an earlier op's slot
    (>= 0), an input (< 0) or zeros made inside (shape, dtype), its count of Python numbers);
    `where`: per op (its kernel, the user's line); `inputs`: the arrays it read, a list that
    `release` empties (kept as the trace's own list: segment.unshared counts references to its
    arrays); `input_storages`: per input the storage it was read from (torch.tpu graphs: a
    replay reads those), else None; `scalars`, `scalar_types`: its Python numbers; `outputs`:
    the `Pending` values that storages still hold, what running it must give; `pendings`: all
    its values, by slot; `ran_backward`: it recorded a backward pass; `mesh`: the process
    group's mesh of its collectives (None: none); `intact`: nothing forced it to run part-way.
    """

    __slots__ = ("device", "signature", "where", "inputs", "input_storages", "scalars",
                 "scalar_types", "outputs", "pendings", "ran_backward", "mesh", "intact",
                 "_trace")

    def __init__(self, tr, intact=True):
        self._trace = tr
        self.device = tr.device
        self.signature = tuple(tr.signature)
        self.where = tuple(tr.where)
        self.inputs = tr.ext_arrays
        self.input_storages = None if tr.ext_buffers is None else tuple(tr.ext_buffers)
        self.scalars = tuple(tr.scalars)
        self.scalar_types = tuple(map(type, tr.scalars))
        self.outputs = tuple(tr.live_outputs())
        self.pendings = tuple(tr.pendings)
        self.ran_backward = tr.ran_backward
        self.mesh = tr.mesh
        self.intact = intact

    def output_slots(self):
        return [p.slot for p in self.outputs]

    def overwritten(self):
        """Per input (of a capture by storage): whether the recording gives its storage a new
        value, so that a run donates it, as a torch.tpu graph's replay does, and its result
        takes the input's memory."""
        written = {id(p.owner()) for p in self.outputs}
        return tuple(id(b) in written for b in self.input_storages)

    def random_positions(self):
        """(position in `scalars`, draws) of each random op's (seed, offset) pair."""
        return self._trace.random_positions()

    def pending_of(self, buffer):
        """The value it will give `buffer`'s storage (a `Pending`), or None."""
        return buffer.pending_in(self._trace)

    def settle(self, results):
        """Running it gave `results`, one per output: each storage still waiting gets its own."""
        for p, array in zip(self.outputs, results):
            p.settle(array)

    def settle_slots(self, values):
        """Values by slot (a replay of its ops one at a time, up to where it stopped; None:
        never computed): each storage still waiting for one gets it."""
        for p, array in zip(self.pendings, values):
            if array is not None:
                p.settle(array)

    def fail(self, error, first_slot=0):
        """Every value from `first_slot` on that storages still wait for is lost: reading
        one raises `error`."""
        for p in self.pendings[first_slot:]:
            p.fail(error)

    def restore(self):
        """Undo what recording did to the storages (a capture commits nothing): storages it
        wrote get back the values they had, and tensors it created read as zeros (like fresh
        memory).  Releases it."""
        tr = self._trace
        for k, b in enumerate(self.input_storages or ()):
            if b.pending_in(tr) is not None:
                queued = tr.ext_queued.get(k)
                if queued is None:
                    b.array = self.inputs[k]
                else:  # the strict op still queued, or its result if it ran during the capture
                    b.array = queued if queued.result is None else queued.result
        for p in self.pendings:
            p.settle(None)
        self.release()

    def release(self):
        """Drop the arrays it read (see Trace.release)."""
        self._trace.release()


# One trace for the process, recorded and flushed under one lock: threads in fused mode append
# to it in turn, and a thread reading a value another thread's flush is producing waits for it
# (per-thread traces would split a backward pass from its forward: the autograd engine runs

lock = threading.RLock()
_trace = None
# A backward pass starts a new segment.  The forward's index checks (embedding, the loss's
# targets) forbid donating inputs to their segment, since a failure is replayed from intact
# inputs; in a segment of its own, the backward and the optimizer step after it donate the
# parameters and optimizer state they overwrite, so that memory does not double.  XLA:CPU also
# runs the two programs about 10-15% faster than one.
_graph_task_id = torch._C._current_graph_task_id  # >= 0 while the autograd engine runs


def record(kernel, compiled, vals, buffers, scalars, device):
    global _trace
    with lock:  # (one function, not a locked call of another: a call per op costs ~0.15 us)
        tr = _trace
        if tr is None or tr.device != device:
            if tr is not None:
                _flush(FlushReason.DEVICE_CHANGE)
            tr = _trace = Trace(device)
        if (_graph_task_id() >= 0) is not tr.in_backward:
            if not tr.in_backward and tr.signature and not tr.captured:
                _flush(FlushReason.BACKWARD)
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
                _flush(FlushReason.GROUP_CHANGE)
                in_backward = tr.in_backward
                tr = _trace = Trace(device)
                tr.in_backward = in_backward
            tr.mesh = mesh
        # An input is either a slot produced earlier in this trace (>= 0) or an external
        # array (< 0); at the flush, the zeros of an unwritten storage may become a third kind
        # (_settle_zeros).
        wiring = []
        for b in buffers:
            a = b.peek()
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
                elif a is None and tr.abstract:  # (the shape its zeros would take)
                    n = b.nbytes // np.dtype(b.dtype).itemsize
                    a = jax.ShapeDtypeStruct(storage.zeros_array_shape(n, b.zeros_shape), b.dtype)
                else:
                    a = b.value()
            k = tr.ext_ids.get(ident)
            if k is None:
                k = tr.ext_ids[ident] = len(tr.ext_arrays)
                tr.ext_arrays.append(a)
                if tr.ext_buffers is not None:
                    tr.ext_buffers.append(b)
                    if queued:
                        tr.ext_queued[k] = b.peek()
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
            pendings.append(p)
            b.defer(p)
        result = returns(compiled, vals, new)
        if len(tr.signature) >= max_ops and not tr.captured:
            _flush(FlushReason.MAX_OPS)
        return result


class CaptureBroken(RuntimeError):
    """Something forced the ops being captured to run (a data-dependent op, a host read, a
    CPU fallback, another device): they cannot form one function.  `reason` is the flush
    reason, `op` the op that asked (when known), `where` the user's line."""

    def __init__(self, message, reason=None, op=None, where=None):
        super().__init__(message)
        self.reason, self.op, self.where = reason, op, where


def start_capture(device, by_storage=False, abstract=False):
    """Start recording into a fresh trace that is never flushed; returns (a handle for
    stop_capture, the mode to restore).  `by_storage`: note the storage of every external
    input (torch.tpu graphs); `abstract`: describe unwritten storages instead of reading them
    (see Trace.abstract)."""
    global _trace
    _flush(FlushReason.CAPTURE)
    previous = modes.own_mode()
    modes.set_thread_mode(modes.CAPTURE)
    tr = _trace = Trace(device)
    tr.captured = True
    if by_storage:
        tr.ext_buffers = []
        tr.ext_queued = {}
        tr.born = weakref.WeakSet()
    tr.abstract = abstract
    return tr, previous


def stop_capture(tr, previous):
    """End a capture: its Recording, whose `intact` says whether it stayed whole (nothing
    forced it to run part-way)."""
    global _trace
    intact = _trace is tr
    if intact:
        _trace = None
        if tr.unwritten:
            _settle_zeros(tr)
    modes.set_thread_mode(previous)
    return Recording(tr, intact)


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
    with lock:  # not while a flush is storing its results
        buf.array = array
        buf.from_bytes = False
        buf.shape = tuple(t.shape) if array is None else None
    return True


def capture(fn, device):
    """Record the ops `fn()` runs into a fresh trace that the caller takes over (it is not
    run here); returns (its Recording, fn's result)."""
    tr, previous = start_capture(device)
    try:
        result = fn()
    finally:
        recorded = stop_capture(tr, previous)
    if not recorded.intact:
        raise CaptureBroken("the captured ops were forced to run part-way")
    return recorded, result


def take(reason, op=None):
    """Stop recording the current trace to run it (fused eager's flush, under `lock`): its
    Recording, or None when nothing is recorded.  A capture's trace must not run part-way:
    CaptureBroken, naming `reason` and `op` (the op that needs the values, when known)."""
    global _trace
    tr = _trace
    if tr is None:
        return None
    if tr.captured:
        if not tr.pendings:
            _trace = None
        raise CaptureBroken(f"the ops being captured had to run part-way ({reason}"
                            f"{', ' + str(op) if op else ''})", reason, op, debug.user_frame(3))
    _trace = None
    if tr.unwritten:
        _settle_zeros(tr)
    return Recording(tr)


def put_back(recorded):
    """A taken recording that did not run (its compile failed or was interrupted: nothing was
    consumed) is the current trace again, run when next needed."""
    global _trace
    tr = recorded._trace
    if tr.pendings and _trace is None:  # (a trace that ran was released: no pendings)
        _trace = tr


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
        shape = shape or made_as
        if ref() is not None and not tr.captured:
            dtype = np.dtype(zeros[1])
            tr.ext_arrays[k] = storage.zeros_for(zeros[0] * dtype.itemsize, dtype, tr.device, shape)
        else:
            tr.ext_arrays[k] = _placeholder(zeros[1], tr.device)
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


def pending_ops():
    return 0 if _trace is None else len(_trace.signature)


def current_trace():
    """The trace being recorded (None: nothing deferred)."""
    tr = _trace
    return tr if tr is not None and tr.signature else None


