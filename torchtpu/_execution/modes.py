"""The eager execution modes (names follow upstream TorchTPU's `torch.tpu.EagerMode`).

DEFER_NEVER                      strict: every op runs at once as its own cached executable,
                                 asynchronously (the default)
DEFER_NEVER_AND_LAUNCH_BLOCKING  debug: every op also waits for its result; runtime errors name
                                 the aten op, its inputs and the user's line
DEFER_AND_FUSE                   fused: ops are recorded and run later as one cached executable
"""
import enum
import os


class EagerMode(enum.Enum):
    DEFER_AND_FUSE = "fused"
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"


def _from_environment():
    if os.environ.get("TORCH_TPU_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE", "0") not in ("", "0"):
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


# Read on every op, so kept as plain module-level values.
current = _from_environment()
fused = current is EagerMode.DEFER_AND_FUSE
blocking = current is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
check_nans = os.environ.get("TORCHTPU_CHECK_NANS", "0") not in ("", "0")


def _coerce(mode):
    if isinstance(mode, EagerMode):
        return mode
    if isinstance(mode, str):
        for m in EagerMode:
            if mode in (m.name, m.value):
                return m
    raise ValueError(f"Unknown eager mode {mode!r}; expected one of "
                     f"{', '.join('torch.tpu.EagerMode.' + m.name for m in EagerMode)}")


def get_eager_mode():
    return current


def _set(mode):
    """Switch the mode; leaving fused mode must flush its trace first (torch.tpu.set_eager_mode
    does)."""
    global current, fused, blocking
    current = mode = _coerce(mode)
    fused = mode is EagerMode.DEFER_AND_FUSE
    blocking = mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
