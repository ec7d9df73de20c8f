"""Parallel compilation (async_compile): strict ops whose executables are new return at once and
are queued behind their compiles; everything must behave as if each op had run at its call.

Every test uses shapes no other test uses, so that its ops' executables are new here."""
import concurrent.futures
import threading

import pytest
import torch

from conftest import assert_same, counts
import torchtpu
from torchtpu._execution import async_compile, executables


@pytest.fixture(autouse=True)
def _two_workers():
    before = async_compile._workers
    async_compile.set_workers(2)
    yield
    async_compile.set_workers(before)


def _chain(x):
    y = (x * 3 + 1).sin()
    y.mul_(2)
    z = torch.cat([y, y.exp()], 0) @ x.T.contiguous()
    return z.softmax(-1), y


def test_new_ops_are_queued_and_give_the_cpus_values():
    x = torch.randn(5, 37)
    queued, = counts("ops_queued_for_compile")
    t = _chain(x.to("tpu"))
    assert counts("ops_queued_for_compile")[0] > queued  # nothing waited for XLA at the call
    assert_same(t, _chain(x))


def test_a_training_loop_matches_compiling_on_the_calling_thread(monkeypatch):
    def losses():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(11, 29), torch.nn.GELU(), torch.nn.Linear(29, 3)).to("tpu")
        opt = torch.optim.AdamW(m.parameters(), 1e-2)
        x, y = torch.randn(6, 11, device="tpu"), torch.randint(0, 3, (6,), device="tpu")
        out = []
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out, [p.detach().cpu() for p in m.parameters()]

    async_compile.set_workers(0)
    ref_losses, ref_params = losses()
    async_compile.set_workers(2)
    torchtpu.clear_caches()
    monkeypatch.setattr(executables, "_store", None)  # build everything again, not load it
    queued, = counts("ops_queued_for_compile")
    got_losses, got_params = losses()
    assert counts("ops_queued_for_compile")[0] > queued
    assert got_losses == ref_losses
    for a, b in zip(got_params, ref_params):
        assert torch.equal(a, b)


def test_a_queued_index_error_raises_at_the_next_wait_naming_the_line():
    w = torch.zeros(3, 23, device="tpu")
    idx = torch.tensor([0, 7], device="tpu")
    y = (w + 1).index_select(0, idx)  # index 7 is out of range; noticed on the device
    with pytest.raises(IndexError, match="test_async_compile.py"):
        y.cpu()
    assert torch.equal(w.cpu(), torch.zeros(3, 23))  # the device stays usable
    assert (w + 2).sum().item() == 2 * 3 * 23


def test_lowering_errors_still_raise_at_the_call():
    a = torch.randn(4, 31, device="tpu")
    with pytest.raises(RuntimeError):
        a @ torch.randn(30, 2, device="tpu")
    assert a.shape == (4, 31)


def test_synchronize_and_events_dispatch_the_queue():
    a = torch.randn(41, 3, device="tpu")
    b = a.cos() * 2
    torch.tpu.synchronize()
    assert not async_compile._queue.ops
    c = b.tanh()
    e = torch.tpu.Event()
    e.record()
    e.synchronize()
    assert not async_compile._queue.ops
    assert_same(c, (a.cpu().cos() * 2).tanh())


def test_debug_mode_runs_the_queue_before_its_op():
    a = torch.randn(43, 2, device="tpu")
    b = a.sigmoid()
    assert async_compile._queue.ops
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        c = a + 1
        assert not async_compile._queue.ops
    assert_same(b, a.cpu().sigmoid())
    assert_same(c, a.cpu() + 1)


class _Interrupting(concurrent.futures.Future):
    """A compile that is interrupted (Ctrl-C) the first time it is waited for."""

    def __init__(self, real):
        super().__init__()
        self.real, self.interrupted = real, False

    def result(self, timeout=None):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self.real.result() if isinstance(self.real, concurrent.futures.Future) else self.real


def test_ctrl_c_while_waiting_for_a_compile_loses_nothing():
    a = torch.randn(47, 5, device="tpu")
    w = torch.ones(47, 5, device="tpu")
    w.add_(a.exp())  # queued: its new executable compiles
    op = async_compile._queue.ops[-1]
    op.executable = _Interrupting(op.executable)
    with pytest.raises(KeyboardInterrupt):
        torch.tpu.synchronize()
    assert async_compile._queue.ops  # the interrupted op is still queued, nothing lost
    assert_same(w, 1 + a.cpu().exp())


def test_an_op_that_fails_when_its_turn_comes_keeps_its_targets():
    a = torch.randn(53, 2, device="tpu")
    w = torch.full((53, 2), 5.0, device="tpu")
    w.mul_(a)
    op = async_compile._queue.ops[-1]
    broken = concurrent.futures.Future()
    broken.set_exception(RuntimeError("XLA compile failed"))
    op.executable = broken
    with pytest.raises(RuntimeError, match="XLA compile failed"):
        w.cpu()
    assert torch.equal(w.cpu(), torch.full((53, 2), 5.0))  # its old value
    assert_same(w + a, 5 + a.cpu())  # the device stays usable


def test_two_threads_dispatch_new_ops_at_once():
    xs = [torch.randn(59 + i, 7) for i in range(2)]
    results = [None, None]

    def work(i):
        results[i] = _chain(xs[i].to("tpu"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert_same(results[i], _chain(xs[i]))


def test_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHTPU_COMPILE_WORKERS", "0")
    assert async_compile._workers_from_environment() == 0
    monkeypatch.setenv("TORCHTPU_COMPILE_WORKERS", "3")
    assert async_compile._workers_from_environment() == 3
    monkeypatch.delenv("TORCHTPU_COMPILE_WORKERS")
    assert async_compile._workers_from_environment() >= 1
    monkeypatch.setenv("TORCHTPU_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="TORCHTPU_COMPILE_WORKERS"):
        async_compile._workers_from_environment()


def test_with_no_workers_new_ops_run_at_their_call():
    async_compile.set_workers(0)
    queued, = counts("ops_queued_for_compile")
    x = torch.randn(3, 61)
    assert_same(_chain(x.to("tpu")), _chain(x))
    assert counts("ops_queued_for_compile")[0] == queued


def test_a_capture_reads_queued_values_without_waiting_and_restores_them():
    # A compiled step (mode="reduce-overhead") captures right after its warm-up call, whose
    # ops may still be queued behind their compiles: the capture describes those values
    # instead of running them, leaves them as they were, and its replay reads them.
    from torchtpu._core import storage
    from torchtpu._execution import tpu_graphs
    x = torch.randn(7, 41)
    w = x.to("tpu") * 3  # queued: a new executable
    assert async_compile.queued(storage.buffer_of(w).peek())
    g = torch.tpu.TPUGraph()
    with tpu_graphs.graph(g, _wait=False):
        out = (w + 1).exp()
        w.mul_(2)
    assert async_compile._queue.ops  # the capture ran nothing that was queued
    assert torch.equal(w.cpu(), x * 3)  # as before the capture
    g.replay()
    assert_same(out, (x * 3 + 1).exp())
    assert_same(w, x * 6)
    g.replay()
    assert_same(w, x * 12)


def test_a_queued_value_that_runs_during_a_capture_is_the_storage_value_after_it():
    # The queue may run while a capture records (FSDP2 resizing a storage reads a value): the
    # result then reaches the storage once the capture gives it back, not the stale pending.
    from torchtpu._core import storage
    from torchtpu._execution import tpu_graphs
    x = torch.randn(5, 43)
    w = x.to("tpu") * 5  # queued: a new executable
    assert async_compile.queued(storage.buffer_of(w).peek())
    g = torch.tpu.TPUGraph()
    with tpu_graphs.graph(g, _wait=False):
        w.mul_(2)
        async_compile.drain()
    assert not async_compile.queued(storage.buffer_of(w).peek())
    assert torch.equal(w.cpu(), x * 5)
    g.replay()
    assert_same(w, x * 10)


def _buffer_pointer(t):
    from torchtpu._core import storage
    return storage.buffer_of(t).value().unsafe_buffer_pointer()


def test_writes_to_a_small_part_of_a_large_storage_reuse_its_buffer():
    # DDP's gradient bucket, a KV cache's rows: a strict write copied the whole storage.
    torch.tpu.synchronize()
    cpu = torch.zeros(3 * 2**16 + 11)
    bucket = cpu.to("tpu")
    views = [(bucket[i * 1000: i * 1000 + 300].view(20, 15), cpu[i * 1000: i * 1000 + 300].view(20, 15))
             for i in range(4)]
    grads = [torch.randn(20, 15) for _ in views]
    for rep in range(3):
        for (v, c), g in zip(views, grads):
            torch.mul(g.to("tpu"), 0.5 + rep, out=v)
            torch.mul(g, 0.5 + rep, out=c)
        if rep == 1:
            torch.tpu.synchronize()
            before = _buffer_pointer(bucket)
    torch.tpu.synchronize()
    assert _buffer_pointer(bucket) == before  # written in place, no copy of the storage
    assert_same(bucket, cpu)
    # Another holder of the storage's array keeps its values: no buffer reused under it.
    from torchtpu._core import storage
    held = storage.buffer_of(bucket).value()
    kept = held.copy()
    torch.mul(grads[0].to("tpu"), 9.0, out=views[0][0])
    torch.mul(grads[0], 9.0, out=views[0][1])
    assert_same(bucket, cpu)
    assert (held == kept).all() and not held.is_deleted()
    # A failing index check leaves the target as it was.
    index = torch.tensor([0, 500], device="tpu")
    views[1][0].view(-1).index_put_((index,), torch.ones(2, device="tpu"))
    with pytest.raises(IndexError):
        torch.tpu.synchronize()
    assert_same(bucket, cpu)


def test_ops_alternating_between_two_signatures_take_the_fast_path():
    # Views of one shape in storages of two sizes: one op key, two executables; each call
    # is run by the one built for its arguments, with no refused call of the other first.
    a, b = torch.zeros(4000, device="tpu"), torch.zeros(5000, device="tpu")
    g = torch.ones(10, 10, device="tpu")
    for _ in range(3):
        a[:100].view(10, 10).add_(g)
        b[100:200].view(10, 10).add_(g)
        torch.tpu.synchronize()
    from torchtpu._execution import executables as ex
    calls = []
    original = ex.signature
    ex.signature = lambda args: calls.append(1) or original(args)
    try:
        for _ in range(5):
            a[:100].view(10, 10).add_(g)
            b[100:200].view(10, 10).add_(g)
        torch.tpu.synchronize()
    finally:
        ex.signature = original
    assert a[:100].sum().item() == 800 and b[100:200].sum().item() == 800
    assert calls == []  # no signature computed: each call found its executable by shapes
