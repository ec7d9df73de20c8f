"""PyTorch's device-backend autoload entry point (`import torch` loads the `tpu` device).

Kept outside the package so that a broken install can only warn: `import torch` must never
fail because of torchtpu.  Set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to skip it."""
import warnings


def load():
    try:
        import torchtpu  # noqa: F401
    except Exception as e:  # pragma: no cover - exercised only by broken installs
        warnings.warn(f"torchtpu could not be loaded, device 'tpu' is unavailable: {e!r}")
