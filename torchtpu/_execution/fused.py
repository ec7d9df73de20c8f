"""Fused eager (DEFER_AND_FUSE): when the recorded ops run, and what happens when they fail.

Ops are recorded (recording.py) and run later as one compiled executable (segment.py).  The
trace is flushed when a value must exist (a host read, a data-dependent op, a CPU fallback,
`synchronize()`), at a bounded length, at `optimizer.step()` and when the mode or device
changes.  A flush runs the recording as a Segment cached by its structure (which cached op
executables ran on which values, and which results are still referenced), so a training loop
compiles each distinct segment once and then only replays it.  Intermediate values that no
live tensor holds are never materialised, and storages that the segment overwrites are donated
to it where the platform supports donation.  A segment that fails is replayed op by op, as
strict eager would have run it, to name the op that failed.
"""
import contextlib
import signal
import threading

from .._core import metrics
from .._core.metrics import FlushReason
from . import bounded, debug, modes, recording, sync
from .segment import Segment, pack_scalars, wired

_segments = bounded.segment_cache("segment_evictions")


def flush(reason, op=None):
    """Run the pending trace (if any) now; `reason` is counted in the metrics, `op` (the op
    that needs the values, when known) named in capture errors.

    Interruption (Ctrl-C) never loses a value.  While the segment compiles, nothing has been
    consumed: the trace is put back, its tensors stay pending and the next read runs it again.
    Running the executable (which may consume donated inputs) and storing its results happen
    with SIGINT held back until they are done, so every tensor then has its new value."""
    reason = FlushReason(reason)  # one of the listed reasons, never a free string
    with recording.lock:
        recorded = recording.take(reason, op)
        if recorded is None:
            return
        try:
            _run(recorded, reason)
        except BaseException:
            recording.put_back(recorded)  # (if it did not run: it runs again when next needed)
            raise


recording.flush_with(flush)
modes.before_leaving_fused(lambda: flush(FlushReason.MODE_CHANGE))


def _run(recorded, reason):
    counters = metrics.counters
    counters["fused_ops"] += len(recorded.signature)
    for kernel, _ in recorded.where:
        counters[kernel.metric_key] += 1
    counters["flushes"] += 1
    counters[f"flush::{reason}"] += 1
    outputs = recorded.output_slots()
    key = (recorded.signature, tuple(outputs), recorded.scalar_types)
    segment = _segments.lookup(key)
    if segment is None:
        segment = Segment.from_recording(recorded, "segment", outputs)
        _segments.insert(key, segment)
    packed = pack_scalars(recorded.scalars, recorded.scalar_types)
    inputs = recorded.inputs
    call = segment.prepare(inputs, packed)
    try:
        with _interrupts_held():
            try:
                with metrics.span(f"torchtpu::flush ({reason})"):
                    results, checks = segment.run(inputs, call, packed)
                failed = None
                if any(checks):
                    sync.defer(checks, segment.check_error(
                        list(recorded.where), f"a fused op; its segment ran because of {reason}"))
            except Exception as e:
                if segment.mesh is not None:
                    # Its collectives cannot run again on this rank alone.
                    recorded.fail(e)
                    raise
                failed = -1
            if failed is not None:
                _replay_and_raise(recorded, reason)
                return
            recorded.settle(results)
            if results:
                sync.track(results[0])
    finally:
        recorded.release()


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


def _replay_and_raise(recorded, reason):
    """Something in the segment failed: run its ops one at a time, as strict eager would have,
    keep the results of those before the failing op, and raise that op's error naming it and
    the line that recorded it.  Values of the failing op and everything after it are lost."""
    slots = []
    pos = 0
    for i, (compiled, wiring, n_scalars) in enumerate(recorded.signature):
        kernel, where = recorded.where[i]
        ins = wired(wiring, slots, recorded.inputs)
        try:
            outs, updated, checks = compiled.fn(*ins, *recorded.scalars[pos:pos + n_scalars])
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
            recorded.settle_slots(slots)
            recorded.fail(error, len(slots))
            raise error from e
        pos += n_scalars
        slots.extend(outs)
        slots.extend(updated)
    recorded.settle_slots(slots)


def _on_optimizer_step(optimizer, args, kwargs):
    if modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE:
        flush(FlushReason.OPTIMIZER_STEP)  # a captured step continues after optimizer.step()


def install():
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_on_optimizer_step)


def clear_cache():
    _segments.clear()
