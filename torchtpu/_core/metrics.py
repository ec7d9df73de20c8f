"""Counters a user reads to see why a loop is slow (torchtpu.metrics(), metrics_report())."""
import atexit
import collections
import contextlib
import enum
import os

import torch

counters = collections.Counter()
# Per program (an op overload, a fused segment, a compiled graph): the argument signatures
# its executables were built or loaded for, so the report can say why one was built twice.
builds = collections.defaultdict(list)
_BUILDS_KEPT = 8  # signatures kept per program (the count goes on)
build_counts = collections.Counter()


class FlushReason(str, enum.Enum):
    """Why fused eager ran its pending trace (counted as `flush::<value>`)."""
    READ = "read"                      # a storage's pending value was read
    ITEM = "item"                      # .item(), bool(t): a value on the host
    DEVICE_TO_HOST = "device_to_host"  # .cpu(), printing, copies to the host
    DATA_DEPENDENT = "data_dependent"  # an op whose output shape depends on values
    CPU_FALLBACK = "cpu_fallback"      # an op without a lowering runs on the CPU
    SYNCHRONIZE = "synchronize"        # torch.tpu.synchronize(), the profiler
    EVENT = "event"                    # an event records the work before it
    COLLECTIVE = "collective"          # a collective run as a program of its own (see spmd.in_program)
    GROUP_CHANGE = "group_change"      # a collective of another process group than the trace's
    DEVICE_CHANGE = "device_change"    # an op on another device
    BACKWARD = "backward"              # the autograd engine starts a backward pass
    MAX_OPS = "max_ops"                # the trace reached TORCHTPU_FUSE_MAX_OPS
    OPTIMIZER_STEP = "optimizer_step"  # optimizer.step() finished
    MODE_CHANGE = "mode_change"        # leaving fused eager
    CAPTURE = "capture"                # torch.compile takes over the ops that follow
    GRAPH_REPLAY = "graph_replay"      # a torch.tpu graph replays (its inputs must exist)

    def __str__(self):  # f"flush::{reason}" names the value on every Python version
        return self.value


def snapshot():
    """The counters, with `ops` the total of the per-op counts (counting once per op is
    cheaper on the hot path than counting twice)."""
    result = dict(counters)
    ops = sum(v for k, v in counters.items() if k.startswith("op::"))
    if ops:
        result["ops"] = ops
    return result


def reset():
    counters.clear()
    builds.clear()
    build_counts.clear()


def note_build(name, signature):
    build_counts[name] += 1
    kept = builds[name]
    if len(kept) < _BUILDS_KEPT:
        kept.append(signature)


def rebuilt():
    """{program: (times built, [signatures...])} for programs built more than once."""
    return {name: (n, list(builds[name])) for name, n in build_counts.items() if n > 1}


def span(name):
    """A torch profiler span when a profiler is recording, else nothing (cheap)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


_SECTIONS = [
    ("Execution", ["ops", "fused_ops", "compiles", "flushes", "segment_compiles",
                   "segment_cache_hits", "donated_buffers", "zeros_materialized", "syncs",
                   "blocking_waits",
                   "executable_evictions", "segment_evictions", "index_ops_on_host"]),
    ("torch.compile", ["graph_captures", "graph_recompiles", "graph_compiles", "graph_cache_hits",
                       "graph_eager_runs", "capture_seconds", "graph_evictions"]),
    ("torch.tpu graphs", ["tpu_graph_captures", "tpu_graph_compiles", "tpu_graph_replays",
                          "step_captures"]),
    ("Compilation", ["compile_seconds", "executables_compiled", "trace_seconds", "lower_seconds",
                     "xla_compile_seconds", "executables_loaded", "cache_load_seconds",
                     "executable_cache_misses", "executable_cache_rejected",
                     "executable_cache_unsaved", "persistent_cache_hits",
                     "persistent_cache_misses", "persistent_cache_rejected"]),
    ("Transfers", ["host_to_device", "host_to_device_bytes", "device_to_host",
                   "device_to_host_bytes"]),
    ("CPU fallback", ["cpu_fallbacks"]),
]

_EXPLAINED = {
    "ops": "ops dispatched (fused ops counted when their segment runs)",
    "fused_ops": "ops run inside fused segments",
    "compiles": "per-op executables built (op, layout and static arguments)",
    "flushes": "fused segments run",
    "segment_compiles": "fused segment structures compiled",
    "segment_cache_hits": "fused segments replayed from the cache",
    "executable_evictions": "per-op executables dropped by the cache bound (LRU)",
    "segment_evictions": "fused segments dropped by the cache bound (LRU)",
    "index_ops_on_host": "small index ops of new patterns run by PyTorch's CPU kernel",
    "donated_buffers": "input arrays consumed in place by segments/graphs",
    "zeros_materialized": "unwritten (`empty`) storages given zeros of their own to be read",
    "syncs": "data-dependent ops that waited for values",
    "blocking_waits": "times the host waited for the device (sync, .item(), .cpu(), debug mode)",
    "graph_captures": "compiled graphs captured (one per input layout)",
    "graph_recompiles": "captures of an already-captured graph for new layouts",
    "graph_compiles": "compiled-graph executables built",
    "graph_cache_hits": "compiled-graph calls that reused an executable",
    "graph_eager_runs": "compiled graphs that had to run op by op",
    "graph_evictions": "compiled-graph variants dropped by the cache bound (LRU)",
    "capture_seconds": "seconds spent capturing graphs",
    "tpu_graph_captures": "steps captured with torch.tpu.graph",
    "tpu_graph_compiles": "torch.tpu graph executables built (one per capture)",
    "tpu_graph_replays": "torch.tpu graph replays (one executable call each)",
    "step_captures": "compiled steps captured as one executable (mode=\"reduce-overhead\")",
    "compile_seconds": "seconds in first runs of segments/graphs (trace + XLA compile)",
    "executables_compiled": "executables traced, lowered and compiled by XLA (all paths)",
    "trace_seconds": "seconds tracing Python into JAX programs",
    "lower_seconds": "seconds lowering programs to StableHLO",
    "xla_compile_seconds": "seconds in the XLA compiler",
    "executables_loaded": "executables loaded from the persistent cache (no trace, no XLA)",
    "cache_load_seconds": "seconds reading and loading those",
    "executable_cache_misses": "persistent cache lookups that found no executable",
    "executable_cache_rejected": "persistent executables refused (corrupt, foreign, unloadable)",
    "executable_cache_unsaved": "executables that could not be serialized into the cache",
    "persistent_cache_hits": "JAX-level programs loaded from the persistent cache",
    "persistent_cache_rejected": "cache entries refused (corrupt, foreign or another version)",
    "persistent_cache_misses": "persistent cache lookups that missed",
}


def _format(value):
    return f"{value:.3f}" if isinstance(value, float) else f"{value:,}"


def report():
    """The counters as a readable table: totals by section, then flush reasons, CPU
    fallbacks by op, and op counts by name (most frequent first)."""
    c = snapshot()
    lines = ["TorchTPU metrics"]
    for title, keys in _SECTIONS:
        present = [k for k in keys if k in c]
        if not present:
            continue
        lines.append(f"\n{title}")
        for k in present:
            lines.append(f"  {k:26s} {_format(c[k]):>14s}  {_EXPLAINED.get(k, '')}".rstrip())
    again = rebuilt()
    if again:
        lines.append("\nExecutables built more than once (program: times, argument shapes)")
        for name, (n, signatures) in sorted(again.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:48s} {n:>10,}")
            lines.extend(f"      {s[:160]}" for s in signatures)
    for title, prefix in (("Flush reasons", "flush::"), ("CPU fallbacks by op", "cpu_fallback::"),
                          ("Attention implementations (docs/kernels.md)", "attention::"),
                          ("Ops by name", "op::")):
        items = sorted(((k[len(prefix):], v) for k, v in c.items() if k.startswith(prefix)),
                       key=lambda kv: (-kv[1], kv[0]))
        if items:
            lines.append(f"\n{title}")
            lines.extend(f"  {name:48s} {v:>10,}" for name, v in items)
    return "\n".join(lines)


if os.environ.get("TORCHTPU_METRICS", "0") not in ("", "0"):
    atexit.register(lambda: print(report()))
