"""JAX's persistent compilation cache, on by default, so a second process skips XLA compiles.

TORCHTPU_CACHE_DIR picks the directory (default: ~/.cache/torchtpu/xla, or under
$XDG_CACHE_HOME); TORCHTPU_CACHE_DIR="" turns it off.  Only executables that took a while to
compile (fused segments, compiled graphs) are written; hits are counted in the metrics."""
import os

import jax

from .._core import metrics

# Per-op executables compile in milliseconds; storing each would cost more than it saves.
MIN_COMPILE_SECONDS = 0.2


def default_directory():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def directory():
    """The cache directory in use, or None when disabled."""
    configured = os.environ.get("TORCHTPU_CACHE_DIR")
    if configured is None:
        return default_directory()
    return configured or None


def _count(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        metrics.counters["persistent_cache_hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        metrics.counters["persistent_cache_misses"] += 1


def enable():
    path = directory()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # an unwritable home directory must not break `import torchtpu`
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.monitoring.register_event_listener(_count)
    return path
