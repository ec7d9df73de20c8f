"""Bounds on the in-memory executable caches: the least recently used entries are evicted.

TORCHTPU_EXECUTABLE_CACHE_SIZE (default 2048) caps the per-op executables of strict eager;
fused segments and each compiled graph's layout variants, far larger programs, are capped at a
quarter of it (512 by default).  Why 2048: a per-op executable holds about 0.8 MB of host
memory on XLA:CPU (2,000 new shapes made 4,001 executables, 3.2 GB, before this bound), so
the cap keeps that under ~1.6 GB, while a training step of the GPT in benchmarks/train_step.py
uses 83 per-op executables and decoding ~14 per new sequence length: models cycling through a
few shapes never evict.  An evicted executable is loaded again from the persistent cache on its
next use; evictions are counted in `torchtpu.metrics()`, so a cap
too small for a model shows up as a steady count.
"""
import collections
import os

from .._core import metrics

_DEFAULT_SIZE = 2048


def size_from_environment():
    value = os.environ.get("TORCHTPU_EXECUTABLE_CACHE_SIZE", "")
    if not value:
        return _DEFAULT_SIZE
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"TORCHTPU_EXECUTABLE_CACHE_SIZE must be a positive integer, got {value!r}")
    return size


class LRU(collections.OrderedDict):
    """A mapping that keeps at most `capacity` entries, evicting the least recently looked up
    (or inserted) one; each eviction is counted under `counter` and passed to `on_evict`."""

    def __init__(self, capacity, counter, on_evict=None):
        super().__init__()
        self.capacity = capacity
        self.counter = counter
        self.on_evict = on_evict

    def lookup(self, key):
        value = self.get(key)
        if value is not None:
            try:
                self.move_to_end(key)
            except KeyError:  # evicted meanwhile by another thread
                pass
        return value

    def insert(self, key, value):
        self[key] = value
        while len(self) > self.capacity:
            try:
                old = self.popitem(last=False)
            except KeyError:  # emptied meanwhile by another thread
                break
            metrics.counters[self.counter] += 1
            if self.on_evict is not None:
                self.on_evict(*old)


SIZE = size_from_environment()


def _drop_op_executable(compiled, cache):
    cache.pop(compiled.key, None)


# Per-op executables live in their kernel's own dict (looked up by the op's key on the hot
# path); this orders them by use across all kernels: compiled executable -> its kernel's dict.
op_executables = LRU(SIZE, "executable_evictions", _drop_op_executable)


def segment_cache(counter):
    return LRU(max(1, SIZE // 4), counter)
