"""The persistent compilation cache, on by default: a second process skips tracing, lowering
and XLA compiles.

Two kinds of entries share one private directory (`_core/cache_store.py`: permissions, verified
entries, atomic writes, the size bound, TORCHTPU_CACHE_DIR and TORCHTPU_CACHE_MAX_BYTES):
- TorchTPU's own executables (per-op, fused segments, compiled graphs), keyed by what they are
  built from (`_execution/executables.py`), so a hit needs neither a trace nor a lowering;
- JAX's persistent cache, for every other jitted program (collectives, Pallas kernels), with
  ours as its backend; JAX keys by the lowered module and stores compiles > 0.2 s.
`python -m torchtpu cache info` shows it, `python -m torchtpu cache clear` empties it.
"""
import os
import time

import jax

from .._core import metrics
from .._core.cache_store import (DEFAULT_MAX_BYTES, MIN_COMPILE_SECONDS, PrivateCache, directory,  # noqa: F401
                           max_bytes, open_cache, private_directory, versions)
from . import executables


def _count(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        metrics.counters["persistent_cache_hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        metrics.counters["persistent_cache_misses"] += 1


class _ForJax:
    """The store as JAX's cache backend, for the programs that are not ours (see
    executables.compiling_ours)."""

    def __init__(self, cache):
        self.cache = cache
        self._path = cache.path

    def get(self, key):
        return None if executables.compiling_ours() else self.cache.get(key)

    def put(self, key, value):
        if not executables.compiling_ours():
            self.cache.put(key, value)


def enable():
    cache = open_cache()
    if cache is None:
        return None
    # The one place JAX's globals are patched.  JAX's own file cache (jax._src.lru_cache)
    # creates files with the umask and loads whatever it finds; JAX takes any CacheInterface
    # as its backend once `_cache` is set and `_cache_initialized` is true, so ours is
    # installed there before the first compile.  jax_compilation_cache_dir must still be set:
    # JAX consults the cache only when it is.
    from jax._src import compilation_cache
    with compilation_cache._cache_initialized_mutex:
        compilation_cache._cache = _ForJax(cache)
        compilation_cache._cache_initialized = True
    jax.config.update("jax_compilation_cache_dir", cache.path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.monitoring.register_event_listener(_count)
    executables.use_store(cache)
    return cache.path


def info():
    """Lines describing the cache (for `python -m torchtpu cache info`)."""
    path = directory()
    if path is None:
        return ["compilation cache  off (TORCHTPU_CACHE_DIR is empty)"]
    lines = [f"compilation cache  {path}"]
    problem = private_directory(path) if os.path.exists(path) else None
    if problem is not None:
        return lines + [f"  not used: {problem}"]
    cache = PrivateCache(path)
    entries = cache.entries()
    total = sum(size for _, size, _ in entries)
    lines.append(f"  entries    {len(entries):,}")
    lines.append(f"  size       {total:,} bytes (cap {cache.max_size:,}, TORCHTPU_CACHE_MAX_BYTES)")
    if entries:
        lines.append(f"  last used  {time.ctime(entries[-1][0] / 1e9)}")
    return lines


def clear():
    """Remove every entry; returns how many there were."""
    cache = open_cache(warn=True)
    if cache is None:
        return 0
    n = len(cache.entries())
    cache.clear()
    return n
