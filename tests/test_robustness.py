"""Bounded executable caches, fused mode under threads and interruption (issue 17, items 3-4).

Tests that depend on the eager mode take it as a parameter and switch to it themselves."""
import copy
import signal
import threading
import time

import pytest
import torch

import torchtpu
from torchtpu._execution import bounded, fused, kernels, modes, recording, segment

from conftest import MODES, assert_same


def evictions():
    m = torchtpu.metrics()
    return m.get("executable_evictions", 0), m.get("segment_evictions", 0)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_executable_caches_stay_within_their_bound(mode, monkeypatch):
    torchtpu.clear_caches()
    monkeypatch.setattr(bounded.op_executables, "capacity", 8)
    monkeypatch.setattr(fused._segments, "capacity", 3)
    before = evictions()
    with torch.tpu.set_eager_mode(MODES[mode]):
        for n in range(1, 25):
            a = torch.linspace(-2, 2, n)
            assert_same((a.to("tpu") * 3 + 1).sin(), (a * 3 + 1).sin())
            assert len(bounded.op_executables) <= 8
            assert sum(len(k.cache) for k in kernels._kernels.values()) <= 8
            assert len(fused._segments) <= 3
    after = evictions()
    assert after[0] - before[0] >= 24  # every new shape pushed older executables out
    if mode == "fused":
        assert after[1] - before[1] >= 20
    assert "executable_evictions" in torchtpu.metrics_report()


def test_evicted_executables_are_rebuilt_and_still_right(monkeypatch):
    torchtpu.clear_caches()
    monkeypatch.setattr(bounded.op_executables, "capacity", 2)
    a = torch.randn(5)
    for _ in range(3):  # each op evicts the other's executable: every call rebuilds one
        assert_same(torch.exp(a.to("tpu")), torch.exp(a))
        assert_same(torch.tanh(a.to("tpu")), torch.tanh(a))


def test_executable_cache_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", raising=False)
    assert bounded.size_from_environment() == 2048
    monkeypatch.setenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", "17")
    assert bounded.size_from_environment() == 17
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", bad)
        with pytest.raises(ValueError, match="TORCHTPU_EXECUTABLE_CACHE_SIZE"):
            bounded.size_from_environment()


# --- threads -------------------------------------------------------------------------------

def _model(seed):
    # Built before the threads start: the global RNG they would share is not per thread.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(model, seed, steps, device):
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [l.cpu() for l in losses], [p.detach().cpu() for p in model.parameters()]


def _in_threads(*fns):
    """Runs each function in its own thread, all started together; their results (or the
    first exception, re-raised)."""
    barrier = threading.Barrier(len(fns))
    results = [None] * len(fns)
    errors = []

    def body(i, fn):
        try:
            barrier.wait()
            results[i] = fn()
        except BaseException as e:  # noqa: B036 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_two_threads_train_concurrently_like_the_cpu(mode):
    models = {seed: _model(seed) for seed in (1, 2)}

    def run(seed):
        with torch.tpu.set_eager_mode(MODES[mode]):
            assert torch.tpu.eager_mode is MODES[mode]
            return _train(models[seed], seed, 6, "tpu")

    tpu = _in_threads(lambda: run(1), lambda: run(2))
    for seed, (losses, params) in zip((1, 2), tpu):
        cpu_losses, cpu_params = _train(models[seed], seed, 6, "cpu")
        torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, cpu_params, rtol=1e-5, atol=1e-6)


def test_threads_share_one_tensor_in_fused_mode():
    """Threads reading and extending each other's pending values (the ops of one thread wait
    for the other's flush instead of finding a value that is not there yet)."""
    base = torch.arange(12.).reshape(3, 4)
    with torch.tpu.set_eager_mode(MODES["fused"]):
        shared = base.to("tpu") * 2  # pending

    def worker(k):
        with torch.tpu.set_eager_mode(MODES["fused"]):
            out = []
            for i in range(20):
                out.append((shared + k * i).sum(0))
            return [o.cpu() for o in out]

    a, b = _in_threads(lambda: worker(1), lambda: worker(-1))
    for k, res in ((1, a), (-1, b)):
        for i, r in enumerate(res):
            torch.testing.assert_close(r, (base * 2 + k * i).sum(0))


def test_set_eager_mode_applies_to_the_calling_thread_only():
    default = torch.tpu.eager_mode
    other = MODES["fused"] if default is not MODES["fused"] else MODES["strict"]
    inside = threading.Event()
    seen = []

    def chooser():
        with torch.tpu.set_eager_mode(other):
            inside.set()
            seen.append(("chooser", torch.tpu.eager_mode))
            done.wait()

    done = threading.Event()
    t = threading.Thread(target=chooser)
    t.start()
    inside.wait()
    seen.append(("main", torch.tpu.eager_mode))
    thread_default = _in_threads(lambda: torch.tpu.eager_mode)[0]
    done.set()
    t.join()
    assert dict(seen) == {"chooser": other, "main": default}
    assert thread_default is modes._default  # a new thread starts with the process default


def test_eager_mode_assignment_is_the_process_default():
    start = modes._default
    try:
        torch.tpu.eager_mode = MODES["fused"]
        assert _in_threads(lambda: torch.tpu.eager_mode) == [MODES["fused"]]
        assert torch.tpu.eager_mode is MODES["fused"]  # and the assigning thread's own choice
    finally:
        torch.tpu.eager_mode = start


# --- interruption ----------------------------------------------------------------------------

def _fused_work():
    """A tensor overwritten in place and a new one, both pending in a fused trace; with the
    values they must end up with (the old value of `a` is `old`)."""
    old = torch.linspace(-1, 1, 7)
    a = old.to("tpu")
    torch.tpu.synchronize()
    a.mul_(3)
    b = a.exp() + 1
    return old, a, b


def _check_values(old, a, b):
    assert_same(a, old * 3)
    assert_same(b, (old * 3).exp() + 1)
    assert_same(a * b, old * 3 * ((old * 3).exp() + 1))  # later ops work
    torch.tpu.synchronize()


@pytest.fixture
def sigint_raises():
    """Python's KeyboardInterrupt handler for SIGINT during the test: a process that a shell
    without job control starts in the background (`cmd &`) inherits SIGINT ignored, and
    Python then installs no handler, so a raised SIGINT would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("how", ["exception", "signal"])
def test_ctrl_c_while_a_segment_compiles_loses_nothing(how, monkeypatch, sigint_raises):
    """Ctrl-C during the compile of a flush (a KeyboardInterrupt raised from inside it, or a
    real SIGINT arriving there): the tensors keep their pending values, and the next read runs
    the segment again."""
    fused.clear_cache()
    compile_ = segment.Segment.compile
    armed, interrupted = [], []

    def slow_compile(self, *args):
        if armed and not interrupted:
            interrupted.append(True)
            if how == "exception":
                raise KeyboardInterrupt
            signal.raise_signal(signal.SIGINT)  # handled at the next bytecode: here
            time.sleep(5)
        return compile_(self, *args)

    monkeypatch.setattr(segment.Segment, "compile", slow_compile)
    with torch.tpu.set_eager_mode(MODES["fused"]):
        old, a, b = _fused_work()
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            b.cpu()
        assert interrupted
        _check_values(old, a, b)


def test_ctrl_c_while_a_segment_runs_is_held_until_its_values_are_stored(monkeypatch, sigint_raises):
    """SIGINT while the executable runs (it may consume donated inputs) is delivered after the
    results are stored: every tensor has its new value."""
    run = segment.Segment.run

    def interrupted_run(self, *args):
        signal.raise_signal(signal.SIGINT)
        return run(self, *args)

    with torch.tpu.set_eager_mode(MODES["fused"]):
        old, a, b = _fused_work()
        monkeypatch.setattr(segment.Segment, "run", interrupted_run)
        with pytest.raises(KeyboardInterrupt):
            torch.tpu.synchronize()
        monkeypatch.setattr(segment.Segment, "run", run)
        assert recording.pending_ops() == 0
        _check_values(old, a, b)


def test_error_during_a_flush_leaves_tensors_readable(monkeypatch):
    """Any exception, not only Ctrl-C: a failing compile is replayed op by op as before."""
    def broken(self, *args):
        raise MemoryError("out of host memory while compiling")

    fused.clear_cache()
    with torch.tpu.set_eager_mode(MODES["fused"]):
        old, a, b = _fused_work()
        monkeypatch.setattr(segment.Segment, "compile", broken)
        monkeypatch.setattr(segment.Segment, "run", broken)
        torch.tpu.synchronize()  # the segment failed; its ops ran one at a time instead
        monkeypatch.undo()
        _check_values(old, a, b)
