"""TorchTPU: a native PyTorch `tpu` device on JAX's PJRT runtime.

`import torchtpu` (or just `import torch`, through PyTorch's backend autoload) makes
`device="tpu"` work like `device="cuda"`.  The device module is `torch.tpu`.  The autoload only
registers the device name (torchtpu_autoload); this package, JAX and the kernels load at the first
use of the device, or here, eagerly, on `import torchtpu`.
"""
import torch

from . import _startup
from ._core import runtime as _runtime  # noqa: F401  (torchtpu._runtime.platform())
from ._core.version import VERSION as __version__

_startup.run()  # every step of making the device work, in order (torchtpu/_startup.py)

from . import pallas, profiler  # noqa: E402,F401  (imported by the start-up's last step)


def metrics():
    """Counters since start (or the last `reset_metrics()`): ops dispatched, executables
    compiled, host<->device transfers, CPU fallbacks."""
    from ._core import metrics as m
    return m.snapshot()


def metrics_report():
    """A readable table of the metrics: op counts by name, compiles and compile time, cache
    hits, transfers and bytes, CPU fallbacks by op, flush reasons. `TORCHTPU_METRICS=1` prints
    it when the process exits."""
    from ._core import metrics as m
    return m.report()


def reset_metrics():
    from ._core import metrics as m
    m.reset()


def clear_caches():
    """Forget every compiled op and fused segment (the next calls compile again)."""
    from ._execution import fused, kernels
    kernels.clear_caches()
    fused.clear_cache()


def export(model, args, kwargs=None):
    """The StableHLO text of `model(*args, **kwargs)` (tensor arguments on tpu)."""
    from ._compile.export import export as _export
    return _export(model, args, kwargs)
