"""Parallel compilation: a strict-eager op whose executable is new returns at once.

Strict eager runs each op as its own cached executable.  On a miss the op is traced on the
calling thread, so that whatever the lowering refuses raises at the call as before, and
lowering to StableHLO and XLA's compile (most of a new op's cost) go to a pool of worker threads
(`TORCHTPU_COMPILE_WORKERS`, default: one per core; 0 compiles on the calling thread).  The op's
results are `Pending` values of the one queue below, as a fused op's are of its trace: their
tensors exist at once with PyTorch's shapes and strides, and later ops that read them are
queued behind it (traced on `jax.ShapeDtypeStruct`s of the values to come, so their compiles
start too).  The host so goes on dispatching while XLA compiles, and a first step costs about
its longest chain of compiles rather than their sum.

The queue runs in order, each op on its own executable, when a value it will produce is read,
when the host waits (`sync.wait`: synchronize(), .item(), an Event), in debug mode, and at a
bounded length.  An op's device-side checks are deferred as strict eager defers them, naming
the line that called it.  An op that fails when its turn comes (an XLA error) leaves its
in-place targets with their old values and its results unreadable, and raises at the read.
A `KeyboardInterrupt` while waiting leaves the op and those after it queued: every tensor
keeps either its old or its new value.
"""
import collections
import concurrent.futures
import os
import threading

import jax

from .._core import metrics, runtime, storage
from .._core.storage import Failed, Pending
from . import debug, sync
from .executables import MISS
from .op_results import defer_checks, finish, may_donate, returns


def _workers_from_environment():
    value = os.environ.get("TORCHTPU_COMPILE_WORKERS", "")
    if not value:  # one per core this process may use (macOS has no affinity call)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not value.isdigit():
        raise ValueError(f"TORCHTPU_COMPILE_WORKERS must be a number of threads (0: compile on the "
                         f"calling thread), got {value!r}")
    return int(value)


_workers = _workers_from_environment()
# What the queue needs of JAX (the values a traced program will produce, the types a compiled
# one takes); an older JAX without them compiles on the calling thread.
_SUPPORTED = (hasattr(jax, "typeof") and hasattr(jax.stages.Traced, "out_info")
              and hasattr(jax.stages.Traced, "in_avals") and hasattr(jax.stages.Compiled, "in_avals"))
_pool = None
_ahead_pool = None  # one thread for prebuild(ahead=True)
# The queue may hold this many ops; the values they read stay alive until it runs.
max_ops = 1024
_lock = threading.RLock()
_Single = jax.sharding.SingleDeviceSharding


class _Op:
    __slots__ = ("kernel", "compiled", "executable", "inputs", "scalars", "outs", "writes", "where")

    def __init__(self, kernel, compiled, executable, inputs, scalars, outs, writes, where):
        self.kernel = kernel
        self.compiled = compiled      # the op's op_programs.OpProgram
        self.executable = executable  # a jax Compiled, or a Future of one
        self.inputs = inputs          # per buffer: an array, or a Pending of an op before it
        self.scalars = scalars
        self.outs = outs              # Pending per new output
        self.writes = writes          # Pending per in-place target (index into inputs, Pending)
        self.where = where


class _Queue:
    """The `trace` of the Pending values this module hands out (storage.Pending reads them
    through `flush`)."""

    def __init__(self):
        self.ops = collections.deque()
        self.values = {}  # slot -> array (or Failed) that a queued op has yet to read
        self.uses = collections.Counter()  # slot -> how many queued ops read it
        self.avals = {}   # slot -> (shape, dtype, weak type) of the array to come
        self.slots = 0

    def flush(self, reason=None):
        drain()


_queue = _Queue()


def enabled():
    return _workers > 0 and _SUPPORTED


def set_workers(n):
    """The number of compile workers (0: compile on the calling thread); runs the queue first."""
    global _workers, _pool
    drain()
    if _pool is not None:
        _pool.shutdown(wait=True)
        _pool = None
    _workers = int(n)


def _get_pool():
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(_workers, thread_name_prefix="torchtpu-compile")
    return _pool


def prebuild(executable, args, ahead=False):
    """Build `executable` for `args` ahead of its first use: on the pool when there is one
    (the caller goes on at once), else now.  `ahead`: on a thread of its own, beside the
    pool's queue rather than behind it."""
    global _ahead_pool
    if enabled():
        if ahead and _ahead_pool is None:
            _ahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchtpu-compile-ahead")
        executable.start(args, _ahead_pool if ahead else _get_pool())
    else:
        executable.prepare(*args)


def run(kernel, compiled, vals, buffers, scalars, device):
    """A strict op: run it now if its executable is ready and its inputs exist, else queue it."""
    fn = compiled.fn
    # The steady state: nothing is queued, so no input is pending; the executable built for
    # such arguments is tried once, here or below when something is queued.
    tried = not _queue.ops and fn.last is not None
    if tried:
        arrays = [b.value() for b in buffers]
        if may_donate(compiled, arrays):
            return finish(kernel, compiled, vals, compiled.donor(*arrays, *scalars), buffers, device)
        out = fn.call_built((*arrays, *scalars))
        if out is not MISS:
            return finish(kernel, compiled, vals, out, buffers, device)
    # Values of other kinds (a fused trace's) are read outside the lock: reading them may run
    # the fused trace, which holds its own lock.
    inputs = [b.peek() if queued(b.peek()) else b.value() for b in buffers]
    with _lock:
        waiting = False
        for k, b in enumerate(buffers):
            a = b.peek()
            if queued(a):
                waiting = True
                inputs[k] = a
            elif queued(inputs[k]):  # it ran since
                inputs[k] = b.value()
        args = inputs + list(scalars)
        if not (waiting or tried) and fn.last is not None:
            out = fn.call_built(args)
            if out is not MISS:
                return finish(kernel, compiled, vals, out, buffers, device)
        if not all(type(a.sharding) is _Single for a in inputs if type(a) is not Pending):
            # Sharded arrays: the values to come could not be described; run in order now.
            drain()
            return finish(kernel, compiled, vals, fn(*[b.value() for b in buffers], *scalars),
                          buffers, device)
        if waiting:
            described = [abstract(a, b) if type(a) is Pending else a for a, b in zip(inputs, buffers)]
            executable = fn.start(described + list(scalars), _get_pool())
        else:
            executable = fn.start(args, _get_pool())
            if not isinstance(executable, concurrent.futures.Future):
                return finish(kernel, compiled, vals, executable(*args), buffers, device)
        return _enqueue(kernel, compiled, executable, vals, buffers, inputs, scalars, device)


def queued(a):
    """Whether `a` is the value of an op still queued behind its compile."""
    return type(a) is Pending and a.trace is _queue


def queued_shape(a):
    """The shape of the array that the queued op will give for `a` (queued(a)), or None when
    it has run since."""
    aval = _queue.avals.get(a.slot)
    return None if aval is None else aval[0]


def abstract(pending, buf):
    """The array a queued op will give `buf`, as its executable described it."""
    shape, dtype, weak_type = _queue.avals[pending.slot]
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak_type,
                                sharding=_Single(runtime.jax_device(buf.index)))


def _pending(info):
    _queue.slots += 1
    _queue.avals[_queue.slots] = (info.shape, info.dtype, info.weak_type)
    return Pending(_queue, _queue.slots)


def _enqueue(kernel, compiled, executable, vals, buffers, inputs, scalars, device):
    out_info, updated_info, _ = executable.out_info
    outs, new = [], []
    for (shape, stride, dtype, nbytes), info in zip(compiled.wrap_specs, out_info):
        p = _pending(info)
        outs.append(p)
        new.append(storage.wrap(p, shape, stride, dtype, device, nbytes))
    writes = []
    for j, info in zip(compiled.writes, updated_info):
        b = buffers[j]
        p = _pending(info)
        b.defer(p)
        writes.append((j, p))
    for a in inputs:
        if type(a) is Pending:
            _queue.uses[a.slot] += 1
    _queue.ops.append(_Op(kernel, compiled, executable, inputs, scalars, outs, writes,
                          debug.user_frame(4)))
    metrics.counters["ops_queued_for_compile"] += 1
    if len(_queue.ops) >= max_ops:
        drain()
    return returns(compiled, vals, new)


def drain():
    """Run every queued op, in order; raise the first failure (after running the rest)."""
    if not _queue.ops:
        return
    with _lock:
        ops = _queue.ops
        error = None
        while ops:
            op = ops[0]
            try:
                executable = op.executable
                if isinstance(executable, concurrent.futures.Future):
                    executable = op.executable = executable.result()
                args = [_value(a) for a in op.inputs]
                args.extend(op.scalars)
                try:
                    outs, updated, checks = executable(*args)
                except (TypeError, ValueError):
                    # The values came out unlike their description (a weak type): build the
                    # executable for what they are.
                    metrics.counters["queued_signature_misses"] += 1
                    outs, updated, checks = op.compiled.fn(*args)
            except KeyboardInterrupt:
                raise  # this op and those after it stay queued
            except Exception as e:  # noqa: BLE001 - any failure is the op's, raised below
                ops.popleft()
                _fail(op, e)
                _release(op)
                error = error or e
                continue
            # Stored before the op leaves the queue: an interrupt in between runs it again,
            # on the same inputs, rather than losing its values.
            _set(op.outs, outs)
            _set([p for _, p in op.writes], updated)
            ops.popleft()
            _release(op)
            if checks:
                defer_checks(op.kernel, op.compiled, checks, op.where)
            if outs or updated:
                sync.track(outs[0] if outs else updated[0])
        _queue.values.clear()
        _queue.avals.clear()
        _queue.uses.clear()
        if error is not None:
            raise error


def _value(a):
    if type(a) is not Pending:
        return a
    v = _queue.values[a.slot]
    if type(v) is Failed:
        raise v.error
    return v


def _release(op):
    """`op` ran: the values it read are kept no longer than the last queued op reading them
    (a first step's activations are not all held until the queue is empty)."""
    for a in op.inputs:
        if type(a) is Pending:
            left = _queue.uses[a.slot] = _queue.uses[a.slot] - 1
            if left <= 0:
                del _queue.uses[a.slot]
                _queue.values.pop(a.slot, None)


def _set(pendings, arrays):
    for p, arr in zip(pendings, arrays):
        p.result = arr
        if p.slot in _queue.uses:  # a queued op reads it; else only its tensor holds it
            _queue.values[p.slot] = arr
        p.settle(arr)


def _fail(op, error):
    failed = Failed(error)
    _set(op.outs, [failed] * len(op.outs))
    for j, p in op.writes:  # in-place targets keep the values they had
        try:
            old = _value(op.inputs[j])
        except Exception:  # noqa: BLE001 - an input that never came: nothing to keep
            old = failed
        _set([p], [old])


sync.before_wait(drain)
