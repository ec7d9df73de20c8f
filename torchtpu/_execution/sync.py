"""Waiting for asynchronously dispatched work (torch.tpu.synchronize)."""
import collections
import weakref

# Weak references to recent op outputs: holding them would keep freed tensors' memory alive.
_recent = collections.deque(maxlen=4096)


def track(array):
    _recent.append(weakref.ref(array))


def _live(array):
    # A donated array was consumed by later work (whose outputs are tracked too); an object
    # that outlives its donation, e.g. in a reference cycle, has nothing left to wait for.
    return array is not None and not array.is_deleted()


def synchronize(index=None):
    pending = [r() for r in _recent]
    _recent.clear()
    for a in pending:
        if _live(a):
            a.block_until_ready()


def pending():
    """The live outputs of recently dispatched work (what an Event waits for)."""
    return [a for a in (r() for r in _recent) if _live(a)]
