"""The device module PyTorch installs as `torch.tpu` (the analogue of `torch.cuda`)."""
import contextlib
import enum
import os
import sys
import types

import torch

from .._core import runtime, storage
from .._core.metrics import FlushReason
from .._execution import modes as _modes
from .._execution import random as _random

manual_seed = _random.manual_seed
manual_seed_all = _random.manual_seed_all
seed = _random.seed
initial_seed = _random.initial_seed


def seed_all():
    for i in range(device_count()):
        _random.seed(i)


def get_rng_state(device="tpu"):
    return _random.get_rng_state(_index(device))


def set_rng_state(new_state, device="tpu"):
    _random.set_rng_state(new_state, _index(device))


def get_rng_state_all():
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states):
    for i, s in enumerate(new_states):
        set_rng_state(s, i)


def is_available():
    return True


def is_initialized():
    return runtime.started()


def init():
    runtime.devices()


from torchtpu_autoload import _is_in_bad_fork  # noqa: E402,F401  (a forked child of a started runtime)


def device_count():
    return runtime.device_count()


def current_device():
    return runtime.current_device()


def set_device(device):
    index = _index(device)
    if index >= 0:
        runtime.set_current_device(index)


_index = runtime.device_index


def _get_current_device_index():
    # Used by `Tensor.tpu()` and friends generated for the backend.
    return runtime.current_device()


class device:
    """Context manager that changes the current tpu device (like torch.cuda.device)."""

    def __init__(self, device):
        self.idx = _index(device) if device is not None else -1
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = runtime.current_device()
        if self.idx >= 0 and self.idx != self.prev_idx:
            runtime.set_current_device(self.idx)

    def __exit__(self, *exc):
        if self.idx >= 0:
            runtime.set_current_device(self.prev_idx)
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else -1)


def compile_for(target):
    """`with torch.tpu.compile_for("v5e:1x1") as reports:` - every program built inside
    (strict ops, fused segments, compiled graphs, captured steps) is also compiled for that TPU
    slice by libtpu's compiler, which needs no TPU, and `reports` gets one Report each: HBM per
    chip, roofline, FLOPs, bytes, fusions, copies, collectives, compile seconds (docs/tpu.md).
    `TPUGraph.compile_for(target)` does it for one captured step."""
    from .._core import tpu_compiler
    return tpu_compiler.Targeting(target)


def synchronize(device=None):
    """Run any deferred (fused) ops, then wait until every queued op on the device has finished."""
    from .._execution import fused, sync
    fused.flush(FlushReason.SYNCHRONIZE)
    sync.synchronize(None if device is None else _index(device))


def get_amp_supported_dtype():
    """Lower-precision dtypes `torch.autocast("tpu", dtype=...)` accepts."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation=True):
    return True


def get_device_name(device=None):
    d = runtime.jax_device(_index(device))
    return f"{d.device_kind} ({runtime.platform()})"


def get_device_capability(device=None):
    return (0, 0)


def get_device_properties(device=None):
    index = _index(device)
    d = runtime.jax_device(index)
    stats = _jax_memory_stats(d)
    return types.SimpleNamespace(
        name=get_device_name(index),
        platform=runtime.platform(),
        device_kind=d.device_kind,
        index=index,
        jax_device=d,
        total_memory=int(stats.get("bytes_limit", 0)),
    )


def _jax_memory_stats(d):
    try:
        return d.memory_stats() or {}
    except Exception:  # CPU devices have no allocator stats in some jaxlib versions
        return {}


# --- memory -------------------------------------------------------------------------------

def memory_allocated(device=None):
    """Bytes held by live tpu storages on the device."""
    return storage.memory_stats_for(_index(device)).allocated


def max_memory_allocated(device=None):
    return storage.memory_stats_for(_index(device)).peak


def reset_peak_memory_stats(device=None):
    s = storage.memory_stats_for(_index(device))
    s.peak = s.allocated


def reset_max_memory_allocated(device=None):
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None):
    """Zero the allocation and free counts, as `torch.cuda`'s does (current bytes stay)."""
    s = storage.memory_stats_for(_index(device))
    s.live_at_reset += s.num_alloc - s.num_free
    s.num_alloc = s.num_free = 0


def mem_get_info(device=None):
    """(free, total) bytes of the device: PJRT's allocator limit where it reports one (TPU,
    GPU); the host's physical memory for the CPU platform, which reports none (free: what the
    host has available; on macOS, which does not say, what tpu storages do not hold)."""
    stats = _jax_memory_stats(runtime.jax_device(_index(device)))
    if "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return total - int(stats.get("bytes_in_use", 0)), total
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    if "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * page, total
    return total - memory_allocated(device), total


def memory_reserved(device=None):
    return int(_jax_memory_stats(runtime.jax_device(_index(device))).get("bytes_reserved", memory_allocated(device)))


def memory_stats(device=None):
    index = _index(device)
    s = storage.memory_stats_for(index)
    out = {
        "allocated_bytes.all.current": s.allocated,
        "allocated_bytes.all.peak": s.peak,
        "allocation.all.allocated": s.num_alloc,
        "allocation.all.freed": s.num_free,
        "allocation.all.current": s.live_at_reset + s.num_alloc - s.num_free,
    }
    for k, v in _jax_memory_stats(runtime.jax_device(index)).items():
        out[f"pjrt.{k}"] = v
    return out


def empty_cache():
    """Storages free their device memory as soon as their last tensor dies; this only drops
    compiled-executable caches' references to freed buffers by running the garbage collector."""
    import gc
    gc.collect()


# --- float32 matmul precision ---------------------------------------------------------------

class Precision(enum.Enum):
    """How float32 matmuls/convolutions run: HIGHEST is full fp32 (matches the CPU), HIGH and
    DEFAULT allow the faster bf16 passes of the TPU's matrix units."""
    HIGHEST = "highest"
    HIGH = "high"
    DEFAULT = "medium"


def get_precision():
    return Precision(torch.get_float32_matmul_precision())


@contextlib.contextmanager
def precision(p):
    """Temporarily set the float32 matmul precision (a `Precision` or "highest"/"high"/"medium")."""
    value = p.value if isinstance(p, Precision) else str(p)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


jax_precision = runtime.jax_precision


# --- fallback ------------------------------------------------------------------------------

enable_cpu_fallback = False

# --- attention ------------------------------------------------------------------------------

# The implementation F.scaled_dot_product_attention runs: None (or "auto") lets each call
# choose; "xla", "blockwise", "pallas_flash" or "cudnn" asks for one, and a call it cannot take
# raises.  None defers to the environment's TORCHTPU_ATTENTION.  See docs/kernels.md.
attention_implementation = None
# The same for torch.nn.attention.flex_attention: "splash" or "dense"; None defers to the
# environment's TORCHTPU_FLEX_ATTENTION.
flex_attention_implementation = None


# --- streams and events ---------------------------------------------------------------------

from .streams import Event, Stream, current_stream, default_stream, set_stream, stream  # noqa: E402,F401

# --- graphs -------------------------------------------------------------------------------

from .._execution.tpu_graphs import (TPUGraph, graph, graph_pool_handle,  # noqa: E402,F401
                                 is_current_stream_capturing, make_graphed_callables)

# --- execution modes -----------------------------------------------------------------------

EagerMode = _modes.EagerMode
get_eager_mode = _modes.public_mode


class set_eager_mode:
    """`torch.tpu.set_eager_mode(mode)` switches the calling thread at once (other threads keep
    theirs, or the default `torch.tpu.eager_mode`); used as a context manager it also restores
    the thread's previous mode on exit, exceptions included."""

    def __init__(self, mode):
        self.previous = _modes.own_mode()
        _modes.set_thread_mode(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _modes.set_thread_mode(self.previous)
        return False


class _DeviceModule(types.ModuleType):
    """Lets `torch.tpu.eager_mode` be read and assigned like an attribute: reading gives the
    calling thread's mode, assigning sets the process-wide default."""

    @property
    def eager_mode(self):
        return _modes.public_mode()

    @eager_mode.setter
    def eager_mode(self, mode):
        _modes.set_default(mode)


def use_device_module_class():
    """torch.tpu.eager_mode reads and assigns like an attribute (patches.PATCHES)."""
    sys.modules[__name__].__class__ = _DeviceModule


use_device_module_class()
