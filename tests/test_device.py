import os
import subprocess
import sys
import textwrap
import time

import jax
import pytest
import torch

import torchtpu
from torchtpu._core import storage
from torchtpu._execution import recording

from conftest import xla_flags


def run_python(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_backend_is_renamed_and_module_installed():
    assert torch._C._get_privateuse1_backend_name() == "tpu"
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    assert torch.tpu.is_initialized()
    x = torch.ones(2, device="tpu")
    assert x.device == torch.device("tpu", 0)
    assert x.is_tpu and not torch.ones(1).is_tpu
    assert type(x) is torch.Tensor


def test_import_twice_is_harmless():
    import importlib
    libraries = torch.tpu._torchtpu_library
    importlib.reload(torchtpu)  # start-up again: the device module re-registered, no kernel twice
    assert torch.tpu._torchtpu_library is libraries
    assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]


def test_tensor_and_module_helpers():
    t = torch.arange(3.0).tpu()
    assert t.device.type == "tpu"
    m = torch.nn.Linear(2, 2).tpu()
    assert m.weight.device.type == "tpu" and isinstance(m.weight, torch.nn.Parameter)


def test_accelerator_reports_tpu():
    assert torch.accelerator.current_accelerator().type == "tpu"


def test_accelerator_memory_functions_answer_for_tpu():
    # PyTorch's ask a C++ caching allocator a Python backend cannot register (an internal
    # assert); accelerate >= 1.16 calls torch.accelerator.empty_cache() in Trainer.train().
    torch.accelerator.empty_cache()
    torch.accelerator.memory.empty_cache()
    x = torch.ones(1000, device="tpu")
    assert torch.accelerator.memory_allocated() == torch.tpu.memory_allocated() >= x.nbytes
    assert torch.accelerator.max_memory_allocated() == torch.tpu.max_memory_allocated()
    assert dict(torch.accelerator.memory_stats()) == torch.tpu.memory_stats()
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.tpu.memory_allocated()
    live = torch.accelerator.memory_stats()["allocation.all.current"]
    torch.accelerator.reset_accumulated_memory_stats()
    stats = torch.accelerator.memory_stats()
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 0
    assert stats["allocation.all.current"] == live
    y = torch.ones(10, device="tpu")
    del y
    stats = torch.accelerator.memory_stats()
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 1
    assert stats["allocation.all.current"] == live
    free, total = torch.accelerator.get_memory_info()
    assert total == torch.tpu.mem_get_info()[1] and 0 < free <= total  # free memory moves


def test_mem_get_info_where_the_host_reports_no_free_memory(monkeypatch):
    # macOS has no SC_AVPHYS_PAGES: free is then what tpu storages do not hold of the host's.
    import os
    if torch.tpu.get_device_properties(0).platform != "cpu":
        pytest.skip("the host's memory is the device's only on the CPU platform")
    names = {k: v for k, v in os.sysconf_names.items() if k != "SC_AVPHYS_PAGES"}
    monkeypatch.setattr(os, "sysconf_names", names)
    x = torch.ones(1000, device="tpu")
    free, total = torch.tpu.mem_get_info()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert free == total - torch.tpu.memory_allocated() and free <= total - x.nbytes


def test_device_properties_and_names():
    props = torch.tpu.get_device_properties(0)
    assert props.platform in ("cpu", "gpu", "tpu")
    assert isinstance(torch.tpu.get_device_name(), str)


def test_device_context_manager_restores():
    with torch.tpu.device(0):
        assert torch.tpu.current_device() == 0
    assert torch.tpu.current_device() == 0
    with pytest.raises(RuntimeError):
        torch.tpu.set_device(99)


def test_rng_seeding_is_reproducible():
    torch.manual_seed(123)
    a = torch.randn(5, device="tpu").cpu()
    torch.tpu.manual_seed(123)
    b = torch.randn(5, device="tpu").cpu()
    assert torch.equal(a, b)
    state = torch.tpu.get_rng_state()
    c = torch.rand(4, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    d = torch.rand(4, device="tpu").cpu()
    assert torch.equal(c, d)
    assert torch.tpu.initial_seed() == 123
    assert not torch.equal(torch.rand(4, device="tpu").cpu(), d)


def test_rng_state_is_philox_seed_and_offset_and_draws_are_offset_addressed():
    # CUDA's layout (16 bytes: seed, offset), which DTensor's random-op tracker reads and
    # writes; a draw of n elements moves the offset by n rounded up to 4, and element i comes
    # from counter offset + i, so draws at consecutive offsets are the parts of one draw.
    torch.manual_seed(7)
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.shape == (16,)
    assert state.view(torch.int64).tolist() == [7, 0]
    whole = torch.empty(2, 50, device="tpu").uniform_().cpu()
    assert torch.tpu.get_rng_state().view(torch.int64).tolist() == [7, 100]
    parts = []
    for start in (0, 52):  # a shard of 48 elements at offset 52 (a multiple of 4, as DTensor's)
        torch.tpu.set_rng_state(torch.tensor([7, start]).view(torch.uint8))
        parts.append(torch.empty(48, device="tpu").normal_().cpu())
    torch.tpu.set_rng_state(torch.tensor([7, 0]).view(torch.uint8))
    assert torch.equal(torch.empty(100, device="tpu").normal_().cpu()[52:], parts[1])
    assert not torch.equal(parts[0], parts[1])
    torch.manual_seed(7)
    assert torch.equal(torch.empty(100, device="tpu").uniform_().cpu(), whole.reshape(-1))
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.tpu.set_rng_state(torch.zeros(24, dtype=torch.uint8))


def test_random_distributions_are_plausible():
    x = torch.randn(20000, device="tpu").cpu()
    assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05
    u = torch.rand(20000, device="tpu").cpu()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    r = torch.randint(3, 7, (1000,), device="tpu").cpu()
    assert r.dtype == torch.int64 and r.min() == 3 and r.max() == 6
    b = torch.bernoulli(torch.full((20000,), 0.3, device="tpu")).cpu()
    assert abs(b.mean() - 0.3) < 0.02


# In-place random fills: (method, arguments, dtype).
FILLS = [("uniform_", (-2.0, 3.0), torch.float32), ("uniform_", (), torch.bfloat16),
         ("normal_", (1.0, 2.0), torch.float32), ("normal_", (), torch.float64),
         ("random_", (0, 100), torch.int64), ("random_", (50,), torch.int32),
         ("bernoulli_", (0.3,), torch.float32), ("exponential_", (2.0,), torch.float32),
         ("cauchy_", (), torch.float32), ("log_normal_", (), torch.float64),
         ("geometric_", (0.2,), torch.float32)]


@pytest.mark.parametrize("name,args,dtype", FILLS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_random_fills_drawn_for_a_bucketed_size_give_the_same_values(name, args, dtype, monkeypatch):
    """Strict eager fills a tensor of a new size by drawing for a bucketed flat size and
    copying the first elements: the values must be exactly those of drawing for the tensor
    itself (as strict eager did without buckets, and as fused mode does)."""
    from torchtpu._execution import op_kernel

    def fill(t, mode="strict"):
        torch.manual_seed(5)
        with torch.tpu.set_eager_mode(mode):
            getattr(t, name)(*args)
        return t.cpu()

    shapes = [(37,), (2, 3, 7)] + ([(70000,)] if dtype == torch.float32 and name == "normal_" else [])
    bucketed = [fill(torch.empty(s, dtype=dtype, device="tpu")) for s in shapes]
    fused = [fill(torch.empty(s, dtype=dtype, device="tpu"), "fused") for s in shapes]
    # A view is filled in place, with the values of a fresh tensor of its size; nothing else
    # of its base changes.
    base = torch.zeros(4, 21, dtype=dtype, device="tpu")
    view = fill(base[1:3])
    monkeypatch.setattr(op_kernel, "fill_bucket", lambda n: n)  # every fill at its own size
    exact = [fill(torch.empty(s, dtype=dtype, device="tpu")) for s in shapes]
    for s, b, e in zip(shapes, bucketed, exact):
        assert b.shape == s and b.dtype == dtype
        assert torch.equal(b, e), (name, s)
    for s, f, e in zip(shapes, fused, exact):  # fused eager fills as strict eager does
        assert torch.equal(f, e), (name, s)
    assert torch.equal(view, exact[1].reshape(2, 21))
    assert not base[0].cpu().any() and not base[3].cpu().any()


def test_a_loop_over_new_sizes_compiles_a_random_program_per_bucket_only():
    from torchtpu._core import metrics
    with torch.tpu.set_eager_mode("strict"):
        before = metrics.build_counts["aten.normal_.default"]
        for n in range(33, 64):  # one bucket: 64
            torch.randn(n, device="tpu")
        torch.tpu.synchronize()
        assert metrics.build_counts["aten.normal_.default"] - before <= 1


def test_a_fill_s_parameters_are_arguments_not_part_of_its_key():
    # nn.init's bounds differ with each fan-in: keyed by value, each was a threefry program.
    from torchtpu._core import metrics
    x = torch.empty(64, device="tpu")
    with torch.tpu.set_eager_mode("strict"):
        before = {name: metrics.build_counts[f"aten.{name}.default"] for name in ("uniform_", "normal_")}
        for k in range(1, 8):
            bound = 1.0 / k
            u = x.uniform_(-bound, bound).cpu()
            assert u.abs().max() <= bound and u.min() < 0 < u.max()
            n = x.normal_(10.0 * k, 1e-3).cpu()
            assert (n - 10.0 * k).abs().max() < 0.01
        torch.tpu.synchronize()
        for name, count in before.items():
            assert metrics.build_counts[f"aten.{name}.default"] - count <= 1, name


def test_fused_eager_fills_compile_a_random_program_per_bucket_not_per_fill(monkeypatch):
    # A model initialised on the device in fused eager: each fill ran as a threefry program
    # inside the segment, ~0.5 s of XLA:CPU compile per fill.  Fills run as strict eager runs
    # them (one program per bucket size, a copy recorded in the trace), with strict's values,
    # also on a tensor the trace is still computing.
    from torchtpu._core import metrics
    recorded = []
    record = recording.record

    def noting(kernel, *args):
        recorded.append(str(kernel.overload))
        return record(kernel, *args)

    monkeypatch.setattr(recording, "record", noting)

    def init(mode):
        torch.manual_seed(3)
        with torch.tpu.set_eager_mode(mode):
            params = [torch.empty(n, 3, device="tpu").normal_(0.0, 0.02) for n in range(11, 41)]
            pending = params[0] * 2
            pending.uniform_(-1.0, 1.0)
            params[1][2:5].normal_(0.0, 0.02)  # a view: its storage keeps the other elements
            total = sum(p.sum() for p in params)
        return [p.cpu() for p in params] + [pending.cpu(), total.cpu()]

    strict = init("strict")
    before = metrics.build_counts["aten.normal_.default"]
    fused = init("fused")
    assert metrics.build_counts["aten.normal_.default"] - before == 0  # strict's buckets serve
    for a, b in zip(strict, fused):
        assert torch.equal(a, b)
    assert not fused[-2].eq(strict[0] * 2).all()  # the pending tensor was filled
    # only the view's fill copies: the others take the drawn array as their storage's
    assert recorded.count("aten.copy_.default") == 1 and "aten.mul.Tensor" in recorded
    assert not [name for name in recorded if "normal_" in name or "uniform_" in name]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_fills_of_new_sizes_compile_nothing_once_their_bucket_is_drawn(mode):
    # A loop over new sizes (PyTorch's device-generic tests): a fresh tensor's fill keeps the
    # drawn bucket as its storage's array (no copy per size) and reading it on the host
    # slices on the host (no slicing program per size).  Its values are the first elements
    # of a fill of the bucket's size.
    from torchtpu._core import metrics
    from torchtpu._execution import transfer
    with torch.tpu.set_eager_mode(mode):
        torch.manual_seed(5)
        bucket = torch.randn(64, device="tpu").cpu()
        torch.empty(64, dtype=torch.float64, device="tpu").uniform_(-1, 1).cpu()
        before, readers = sum(metrics.build_counts.values()), transfer._reader.cache_info().misses
        for n in range(33, 64, 3):
            torch.manual_seed(5)
            x = torch.randn(n, device="tpu")
            y = torch.empty(n, dtype=torch.float64, device="tpu").uniform_(-1, 1)
            assert x.untyped_storage().nbytes() == 4 * n
            assert torch.equal(x.cpu(), bucket[:n])
            assert y.cpu().shape == (n,) and y.cpu().abs().max() <= 1
        assert sum(metrics.build_counts.values()) == before
        assert transfer._reader.cache_info().misses == readers
        # the spare elements are never read: ops on the tensor see its n elements
        x = torch.randn(40, device="tpu")
        host = x.cpu()
        torch.testing.assert_close((x * 2 + x.sum()).cpu(), host * 2 + host.sum())
        x.add_(1)
        assert torch.equal(x.cpu(), host + 1)


def test_memory_is_released_when_tensors_die():
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    x = torch.empty(1024, 1024, device="tpu")
    assert torch.tpu.memory_allocated() >= base + 4 * 1024 * 1024
    del x
    assert torch.tpu.memory_allocated() == base
    for _ in range(10000):
        y = torch.ones(256, device="tpu") * 2
    del y
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() >= base + 4 * 1024 * 1024
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    torch.tpu.empty_cache()


def test_views_keep_storage_alive():
    base = torch.tpu.memory_allocated()
    v = torch.arange(10.0, device="tpu")[2:5]
    assert torch.tpu.memory_allocated() == base + 40
    assert v.cpu().tolist() == [2.0, 3.0, 4.0]
    del v
    assert torch.tpu.memory_allocated() == base


def test_precision_follows_torch_setting():
    assert torch.tpu.get_precision() == torch.tpu.Precision.HIGHEST
    a = torch.randn(64, 64)
    with torch.tpu.precision(torch.tpu.Precision.HIGH):
        assert torch.get_float32_matmul_precision() == "high"
        (a.tpu() @ a.tpu()).cpu()
    assert torch.get_float32_matmul_precision() == "highest"
    torch.testing.assert_close((a.tpu() @ a.tpu()).cpu(), a @ a, rtol=1e-5, atol=1e-4)


def _ready(t):
    """The tensor's value is computed: not deferred (fused), not still running (async)."""
    a = storage.buffer_of(t).peek()
    return isinstance(a, jax.Array) and a.is_ready()


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
@pytest.mark.parametrize("device", [None, 0])
def test_synchronize_waits(mode, device):
    with torch.tpu.set_eager_mode(mode):
        x = torch.randn(256, 256, device="tpu")
        for _ in range(10):
            x = x @ x / 256
        torch.tpu.synchronize(device)
        assert recording.pending_ops() == 0 and _ready(x)


def test_info_command():
    out = run_python("import runpy, sys; sys.argv=['torchtpu','info']; runpy.run_module('torchtpu', run_name='__main__')")
    assert "platform" in out and "tpu:0" in out and "eager mode  DEFER_NEVER" in out


def test_multiple_devices_and_cross_device_copies():
    out = run_python("""
        import torch, torchtpu
        assert torch.tpu.device_count() == 4, torch.tpu.device_count()
        a = torch.arange(6.0).reshape(2, 3).to("tpu:2")
        assert a.device == torch.device("tpu", 2)
        b = (a * 2).to("tpu:3")
        assert b.device.index == 3 and b.cpu().tolist() == [[0, 2, 4], [6, 8, 10]]
        from torchtpu._core import storage
        with torch.tpu.device(1):
            c = torch.ones(2, device="tpu")
            assert c.device.index == 1
            # its array on that device too, also where the fill reads nothing of its input
            # (a whole storage: its program's results were placed on the default device)
            for t in (c, torch.ones(3, 5, device="tpu"), torch.full((4, 4), 2.0, device="tpu")):
                assert storage.buffer_or_none(t).value().devices() == {torchtpu._core.runtime.jax_device(1)}
            with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
                f = torch.empty(3, 5, device="tpu").fill_(2.0)
                torch.tpu.synchronize()
                assert storage.buffer_or_none(f).value().devices() == {torchtpu._core.runtime.jax_device(1)}
        try:
            a + b
        except RuntimeError as e:
            assert "same device" in str(e)
        else:
            raise AssertionError("no error")
        with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):  # one trace per device
            d = a * 3
            e = (b + 1).to("tpu:2") + d
            assert torchtpu.metrics()["flush::device_change"] >= 1
            assert e.device.index == 2 and e.cpu().tolist() == [[1, 6, 11], [16, 21, 26]]
        print("ok")
    """, env={"XLA_FLAGS": xla_flags(4)})
    assert "ok" in out


def test_autoload_through_plain_import_torch():
    out = run_python("""
        import torch
        x = torch.ones(2, device="tpu")
        print(x.device)
    """)
    assert "tpu:0" in out


def test_autoload_can_be_disabled():
    out = run_python("""
        import torch
        print(torch._C._get_privateuse1_backend_name())
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "privateuseone" in out


def test_platform_choice_env():
    out = run_python("import torch, torchtpu; print(torchtpu._runtime.platform())",
                     env={"TORCHTPU_PLATFORM": "cpu"})
    assert out.strip() == "cpu"


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_streams_and_events(mode):
    s = torch.tpu.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0)
    assert s == torch.tpu.current_stream() == torch.tpu.default_stream()  # one stream per device
    with torch.tpu.set_eager_mode(mode):
        x = torch.randn(256, 256, device="tpu")
        start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(5):
            x = x @ x / 256
        end.record(s)  # runs what fused eager deferred, then waits for it on synchronize()
        assert recording.pending_ops() == 0
        end.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        assert _ready(x) and end.query()
        # The measured span covers the matmuls: positive, and within the wall time around it.
        assert 0.0 < start.elapsed_time(end) <= wall_ms
        # Events are noted in the order they were recorded: a watcher thread per event noted
        # 2.5% of such pairs the wrong way round on a loaded 2-core machine.
        for _ in range(50):
            start.record()
            y = x @ x
            end.record()
            assert start.elapsed_time(end) > 0.0
        with torch.tpu.stream(torch.tpu.Stream()) as other:
            y = x + 1
        other.wait_stream(s)
        y.record_stream(other)
        other.synchronize()
        assert other.query() and _ready(y)
        torch.testing.assert_close(y.cpu(), x.cpu() + 1)
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.tpu.Event().elapsed_time(end)


def test_views_at_other_offsets_share_one_executable():
    # A view's offset is an argument of the op's executable: a loop over x[i] (or the last
    # token of a growing sequence) compiles once, not once per i.
    from torchtpu._core import metrics
    x = torch.randn(16, 6)
    d = x.to("tpu")
    before = metrics.build_counts["aten.mul.Tensor"], metrics.build_counts["aten.add_.Tensor"]
    for i in range(1, 16):
        assert torch.equal((d[i] * 2).cpu(), x[i] * 2)
        assert torch.equal((d[:, i % 6] * 2).cpu(), x[:, i % 6] * 2)
        d[i].add_(1.0)
        x[i].add_(1.0)
    assert torch.equal(d.cpu(), x)
    torch.tpu.synchronize()
    built = (metrics.build_counts["aten.mul.Tensor"] - before[0],
             metrics.build_counts["aten.add_.Tensor"] - before[1])
    # mul: a row and a column layout, each at offset 0 and at any other offset
    assert built[0] <= 4 and built[1] <= 1, built


def test_views_differing_only_in_size_one_strides_share_one_executable():
    # The last token of a growing [1, L] sequence is a [1, 1] view of strides (L, 1): the
    # stride of a size-1 dim is not part of the key.  Outputs keep PyTorch's strides (clone
    # keeps the input's, elementwise ops give their own).
    from torchtpu._core import metrics
    x = torch.arange(64.0)
    d = x.to("tpu")
    names = ("aten.clone.default", "aten.mul.Tensor", "aten.sum.dim_IntList")
    before = [metrics.build_counts[n] for n in names]
    for n in range(6, 16):
        for fn in (lambda t: t[:n].view(1, n)[:, -1:].clone(),
                   lambda t: t[:n].view(1, n)[:, -2:] * 2,
                   lambda t: t[:n].view(1, n)[:, 1:3].sum(1, keepdim=True),
                   lambda t: t[:n].view(n, 1)[2:5].clone()):
            got, want = fn(d), fn(x)
            assert got.stride() == want.stride() and got.shape == want.shape
            assert torch.equal(got.cpu(), want)
    built = [metrics.build_counts[n] - b for n, b in zip(names, before)]
    assert built[0] <= 2 and built[1] <= 1 and built[2] <= 1, built


def test_a_size_one_stride_that_tips_the_layout_gets_its_own_program():
    # avg_pool2d of a [2, 3, 1, 2] input is channels-last when the size-1 dim's stride is 6
    # and contiguous otherwise: the outputs' elements lie in another order, so the executable
    # built for one cannot serve the other (the key leaves that stride out).
    base = torch.randn(64)
    d = base.to("tpu")
    for s in (1, 6, 2, 6, 100, 1):
        x, xt = (b.as_strided((2, 3, 1, 2), (6, 1, s, 3)) for b in (base, d))
        got, want = torch.nn.functional.avg_pool2d(xt, 1), torch.nn.functional.avg_pool2d(x, 1)
        assert got.stride() == want.stride(), (s, got.stride(), want.stride())
        assert torch.equal(got.cpu(), want)
        got, want = xt.clone(), x.clone()
        assert got.stride() == want.stride() and torch.equal(got.cpu(), want)


def test_checks_read_before_a_wait_are_read_once_and_a_failed_one_raises(monkeypatch):
    """Strict eager: sync.raise_ready (which the distributed layer calls per collective in
    flight at each wait) reads the computed checks in one batch, forgets those that passed,
    and raises a failed one's error with every tensor intact."""
    from torchtpu._execution import sync
    torch.tpu.synchronize()
    x = torch.arange(5.0, device="tpu")
    for i in range(20):
        x[torch.tensor([i % 5], device="tpu")]  # (built: the runs below only dispatch)
    torch.tpu.synchronize()
    reads = []
    device_get = jax.device_get

    def counted(a):  # (check_error passes host values through device_get too: not a read)
        if any(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(a)):
            reads.append(len(a))
        return device_get(a)
    monkeypatch.setattr(sync.jax, "device_get", counted)
    for i in range(20):
        x[torch.tensor([i % 5], device="tpu")]  # an index check per op, deferred
    for a in list(sync._checks):
        jax.block_until_ready(a[0])
    queued = len(sync._checks)
    assert queued >= 1
    for _ in range(5):
        sync.raise_ready()
    assert reads == [queued]  # one batch, then nothing left to read
    assert not sync._checks
    x[torch.tensor([7], device="tpu")]  # fails its check
    for a in list(sync._checks):
        jax.block_until_ready(a[0])
    with pytest.raises(IndexError, match="out of bounds|out of range"):
        sync.raise_ready()
    assert not sync._checks
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
