"""Waiting for asynchronously dispatched work (torch.tpu.synchronize), and the device-side
validity checks read when the host waits.

Deferred checks, as CUDA's device asserts: an op's checks (indices in range, ...) are booleans
its executable computes.  Strict, fused and compiled execution and graph replay queue them
(`defer`) and dispatch on, so a steady step never waits for them; they are read at the next
point where the host waits anyway (`wait`: torch.tpu.synchronize(), .item(), .cpu(), a
data-dependent op, an Event's synchronize()), and the first failure raises there, naming the
op and the user's line that called it.  Debug mode reads an op's checks at the op.

The state when it raises: the failing op's in-place and out= targets keep the values they had
(its executable selects them; a torch.tpu graph or a compiled graph keeps every storage it
overwrites, a fused segment keeps those of the failing op); its new outputs hold unspecified
values, and so does anything computed from them before the error surfaced.  Every tensor stays
usable, and the queue is empty after the raise.
"""
import collections
import threading
import weakref

import jax

from .._core import metrics

# Weak references to recent op outputs: holding them would keep freed tensors' memory alive.
_recent = collections.deque(maxlen=4096)
# (check arrays, error(host values) -> exception or None), oldest first.
_checks = collections.deque()
_failed = []  # an error found while trimming the queue, raised at the next wait
_lock = threading.Lock()
# Beyond this many, the oldest checks that are done are read (no wait) to free them, down to
# half, with one jax.device_get per batch: one call per check cost 66-99 us per op, a batch
# 37 us (3000 ready checks; most of what remains is JAX's work per array).
_MAX_CHECKS = 256
# Work queued behind compiles (async_compile.drain), run before the host waits: its checks
# must be read at this wait, and what an Event or synchronize() waits for must be dispatched.
_before_wait = []


# Run where the host blocks (wait, synchronize), after the queued work is dispatched: the
# distributed layer bounds the wait for collective programs in flight by their group's timeout.
_before_blocking = []


def before_wait(fn):
    _before_wait.append(fn)


def before_blocking(fn):
    _before_blocking.append(fn)


def _blocking():
    _dispatch_queued()
    if _before_blocking:
        # Checks already computed first: a program that raises one (ranks that disagree on
        # their collectives) may leave another waiting for a peer that never comes.
        raise_ready()
        for fn in _before_blocking:
            fn()


def raise_ready():
    """Raise the first failure among the deferred checks that are computed (no wait)."""
    with _lock:
        ready = [c for c in _checks if _ready(c[0])]
    if not ready:
        return
    try:
        values = jax.device_get([arrays for arrays, _ in ready])  # one call for the batch
    except Exception:  # noqa: BLE001 - a program that failed: the wait reports it
        return
    for (_, error), v in zip(ready, values):
        e = error(v)
        if e is not None:
            with _lock:
                _checks.clear()
                _failed.clear()
            raise e
    # They passed: read once, not again at every later call (the distributed layer calls this
    # once per collective in flight at each wait: 50 calls over 250 checks read 12,500).
    read = {id(c) for c in ready}
    with _lock:
        kept = [c for c in _checks if id(c) not in read]
        _checks.clear()
        _checks.extend(kept)


def _dispatch_queued():
    for fn in _before_wait:
        fn()


def track(array):
    _recent.append(weakref.ref(array))


def _live(array):
    # A donated array was consumed by later work (whose outputs are tracked too); an object
    # that outlives its donation, e.g. in a reference cycle, has nothing left to wait for.
    return array is not None and not array.is_deleted()


def synchronize(index=None):
    _blocking()
    pending = [r() for r in _recent]
    _recent.clear()
    for a in pending:
        if _live(a):
            a.block_until_ready()
    wait()


def pending():
    """The live outputs of recently dispatched work (what an Event waits for)."""
    _dispatch_queued()
    return [a for a in (r() for r in _recent) if _live(a)]


def defer(arrays, error):
    """Queue device-side checks: `error(host values of arrays)` is the exception to raise, or
    None when they passed."""
    with _lock:
        _checks.append((arrays, error))
        if len(_checks) <= _MAX_CHECKS:
            return
        done = []
        while len(_checks) > _MAX_CHECKS // 2 and _ready(_checks[0][0]):
            done.append(_checks.popleft())
        for (_, error), values in zip(done, jax.device_get([a for a, _ in done])):
            e = error(values)
            if e is not None and not _failed:
                _failed.append(e)


def _ready(arrays):
    return all(a.is_ready() for a in jax.tree_util.tree_leaves(arrays))


def wait():
    """The host waits here (it reads a value; counted): raise the first failed deferred check."""
    metrics.counters["blocking_waits"] += 1
    _blocking()
    if not _checks and not _failed:
        return
    with _lock:
        queued = list(_checks)
        _checks.clear()
        failed = _failed[:1]
        _failed.clear()
    if queued:
        values = jax.device_get([a for a, _ in queued])
        for (_, error), v in zip(queued, values):
            if failed:
                break
            e = error(v)
            if e is not None:
                failed.append(e)
    if failed:
        raise failed[0]
