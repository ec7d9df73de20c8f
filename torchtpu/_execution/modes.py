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
    global current, fused, blocking
    mode = _coerce(mode)
    if fused and mode is not EagerMode.DEFER_AND_FUSE:
        from . import fused as fused_mode
        fused_mode.flush("mode_change")
    current = mode
    fused = mode is EagerMode.DEFER_AND_FUSE
    blocking = mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


class set_eager_mode:
    """`torch.tpu.set_eager_mode(mode)` switches at once; used as a context manager it also
    restores the previous mode on exit, exceptions included."""

    def __init__(self, mode):
        self.previous = current
        _set(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set(self.previous)
        return False
