"""The eager execution modes (names follow upstream TorchTPU's `torch.tpu.EagerMode`).

DEFER_NEVER                      strict: every op runs at once as its own cached executable,
                                 asynchronously (the default)
DEFER_NEVER_AND_LAUNCH_BLOCKING  debug: every op also waits for its result; runtime errors name
                                 the aten op, its inputs and the user's line
DEFER_AND_FUSE                   fused: ops are recorded and run later as one cached executable

and one internal mode, CAPTURE: the ops a capture records (recording.start_capture: a torch.tpu
graph, a compiled graph, torchtpu.scaling's step), as fused eager records them but never run
before the capture ends; each runner table has its entry (op_runners.py), and code that takes
another path for recorded ops asks `recorded()`.  Users see it as DEFER_AND_FUSE.
"""
import contextvars
import enum
import os

import torch


class EagerMode(enum.Enum):
    DEFER_AND_FUSE = "fused"
    DEFER_NEVER = "strict"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"


class _Capture:
    """The CAPTURE mode (see the module docstring)."""

    name = value = "capture"

    def __repr__(self):
        return "<internal eager mode CAPTURE>"


CAPTURE = _Capture()
_RECORDED = (EagerMode.DEFER_AND_FUSE, CAPTURE)


def _from_environment():
    if os.environ.get("TORCH_TPU_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE", "0") not in ("", "0"):
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


# The process-wide default (`torch.tpu.eager_mode = ...`), and the mode a thread chose for
# itself (`torch.tpu.set_eager_mode`), which wins in that thread.  A context variable rather
# than a thread-local: PyTorch hands the context of the thread that starts a backward pass to
# the autograd engine's device thread that runs it, so backward ops run in their caller's mode.
_default = _from_environment()
_own = contextvars.ContextVar("torchtpu_eager_mode", default=None)
_graph_task_id = torch._C._current_graph_task_id  # >= 0 while the autograd engine runs
check_nans = os.environ.get("TORCHTPU_CHECK_NANS", "0") not in ("", "0")


def _coerce(mode):
    if isinstance(mode, EagerMode) or mode is CAPTURE:
        return mode
    if isinstance(mode, str):
        for m in EagerMode:
            if mode in (m.name, m.value):
                return m
    raise ValueError(f"Unknown eager mode {mode!r}; expected one of "
                     f"{', '.join('torch.tpu.EagerMode.' + m.name for m in EagerMode)}")


def get_eager_mode():
    """The calling thread's mode (read on every op)."""
    mode = _own.get()
    if mode is None and _graph_task_id() >= 0 and torch._C._is_key_in_tls("context"):
        mode = torch._C._get_obj_in_tls("context").get(_own)
    return mode or _default


def public_mode():
    """The calling thread's mode as users see it (`torch.tpu.get_eager_mode()`): a capture
    records as fused eager does."""
    mode = get_eager_mode()
    return EagerMode.DEFER_AND_FUSE if mode is CAPTURE else mode


def recorded():
    """Whether the calling thread's ops are recorded rather than run (fused eager, a capture)."""
    return get_eager_mode() in _RECORDED


def own_mode():
    """The mode the calling thread chose for itself (None: it follows the default)."""
    return _own.get()


# Run before the calling thread leaves fused mode: fused eager's flush (fused.py registers
# it), so that what the thread deferred runs in the mode it was recorded in.
_before_leaving_fused = []


def before_leaving_fused(fn):
    _before_leaving_fused.append(fn)


def _leaving(mode):
    current = get_eager_mode()
    if current in _RECORDED and mode is not current:
        for fn in _before_leaving_fused:
            fn()


def set_default(mode):
    """`torch.tpu.eager_mode = mode`: the process-wide default; the calling thread's own
    choice, if it made one, follows (it asked for this mode).  Leaving fused mode first runs
    what it deferred."""
    global _default
    mode = _coerce(mode)
    _leaving(mode)
    _default = mode
    if _own.get() not in (None, CAPTURE):
        _own.set(_default)


def set_thread_mode(mode):
    """The calling thread's own mode (None: back to the default), flushing as above."""
    mode = None if mode is None else _coerce(mode)
    if mode is EagerMode.DEFER_AND_FUSE and get_eager_mode() is CAPTURE:
        mode = CAPTURE  # fused eager inside a capture: the capture goes on recording
    _leaving(mode or _default)
    _own.set(mode)
