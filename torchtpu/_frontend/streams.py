"""torch.tpu.Stream / Event: what the CUDA-style stream API means on this device.

JAX runs a device's work in dispatch order and orders dependent work by data, so each device
has exactly one stream (the default, id 0): `Stream(...)` returns it, waiting on another stream
is already satisfied, and `record_stream` has nothing to protect (an array lives while any
queued executable uses it). Events are real: `record()` notes the device work dispatched so far
and the fused ops still deferred (which it does not run: FSDP2 records an event around every
collective, and a fused segment would be cut at each), `query()`/`synchronize()` run those and
test/wait for it all, and with `enable_timing=True` a watcher thread notes when it completed (a
timed event runs the deferred ops at once), so `elapsed_time` is the time between two events'
completions as the host observed them (in milliseconds, like CUDA's).  One thread notes them
all, in the order they were recorded, as the work completes in that order: a thread per event
could start late and note an earlier event after a later one (a negative elapsed time, seen
on a loaded 2-core machine).
"""
import contextlib
import queue
import threading
import time

import torch

from .._core import runtime
from .._execution import sync
from .._core.metrics import FlushReason


def _index(device):
    if device is None:
        return runtime.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else runtime.current_device()


class Stream(torch.Stream):
    """The device's one stream (see the module docstring)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls, device=torch.device("tpu", _index(device)), priority=priority)

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream):
        """Already ordered: all work of a device is one queue."""

    def wait_event(self, event):
        """Already ordered: work recorded by `event` was dispatched before anything after."""

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self):
        return Event().record(self).query()

    def synchronize(self):
        torch.tpu.synchronize(self.device_index)


def current_stream(device=None):
    return Stream(device)


default_stream = current_stream


def set_stream(stream):
    """Nothing to switch: every stream of a device is its one stream."""


@contextlib.contextmanager
def stream(s):
    yield s


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self._arrays = None
        self._trace = None  # the fused trace whose ops it also waits for, until they run
        self._done_at = None
        self._noted = None  # (timed events) set once the watcher has noted `_done_at`

    def record(self, stream=None):
        from .._execution import fused, recording, sync
        self._trace = recording.current_trace()
        if self._trace is not None and self.enable_timing:
            fused.flush(FlushReason.EVENT)
            self._trace = None
        self._arrays = sync.pending()
        self._done_at = None
        if self.enable_timing:
            self._noted = threading.Event()
            _watch(self, self._arrays, self._noted)
        return self

    def _run_deferred(self):
        """Run the fused ops recorded before this event, if they have not run yet."""
        from .._execution import fused, recording, sync
        if self._trace is not None:
            if recording.current_trace() is self._trace:
                fused.flush(FlushReason.EVENT)
            self._trace = None
            self._arrays = sync.pending()

    def query(self):
        if self._arrays is None:
            return True
        self._run_deferred()
        return all(a.is_ready() for a in self._arrays)

    def wait(self, stream=None):
        """Already ordered (see the module docstring)."""

    def synchronize(self):
        self._run_deferred()
        if self._noted is not None:
            self._noted.wait()
        for a in self._arrays or ():
            a.block_until_ready()
        sync.wait()

    def elapsed_time(self, end_event):
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._arrays is None or end_event._arrays is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        self.synchronize()
        end_event.synchronize()
        return (end_event._done_at - self._done_at) * 1e3


_timed = queue.SimpleQueue()  # timed events, in the order they were recorded
_watcher = None
_watcher_lock = threading.Lock()


def _watch(event, arrays, noted):
    global _watcher
    _timed.put((event, arrays, noted))
    with _watcher_lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_note_completions, daemon=True,
                                        name="torchtpu-event-timer")
            _watcher.start()


def _note_completions():
    while True:
        event, arrays, noted = _timed.get()
        try:
            for a in arrays:
                a.block_until_ready()
        except Exception:  # a failed computation: completed, as far as timing goes
            pass
        if event._noted is noted:  # (not recorded again since)
            event._done_at = time.perf_counter()
        noted.set()


def _record_stream(self, stream):
    pass


def register(lib):
    lib.impl(torch.ops.aten.record_stream.default, _record_stream, "PrivateUse1")
