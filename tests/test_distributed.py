"""torch.distributed on tpu: the "tpu" c10d backend across real processes.

Each test launches ranks of tests/dist_worker.py the way torchrun does (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), on CPU JAX devices with gloo underneath; the worker
asserts, these tests check every rank passed and read the figures it printed.
"""
import datetime
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torchtpu
from conftest import xla_flags

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank, world, port, devices_per_process, extra):
    env = dict(os.environ, **extra, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1",
               # this checkout's torchtpu, not an installed one (the script's folder is tests/)
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    # by default one CPU device per process, as one chip per process
    env["XLA_FLAGS"] = xla_flags(devices_per_process if devices_per_process > 1 else None)
    if devices_per_process > 1:  # every process sees all devices and picks tpu:LOCAL_RANK
        env["TORCHTPU_TEST_SET_DEVICE"] = "1"
    return env


def launch(scenario, world, ranks=None, timeout=240, devices_per_process=1, env=None):
    """Run `ranks` (default: all) of a `world`-rank job; returns {rank: (returncode, output)}."""
    port = _port()
    procs = {r: subprocess.Popen([sys.executable, WORKER, scenario],
                                 env=_env(r, world, port, devices_per_process, env or {}),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (range(world) if ranks is None else ranks)}
    deadline = time.time() + timeout
    results = {}
    for r, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            out, _ = p.communicate()
            raise AssertionError(f"rank {r} of {scenario} hung:\n{out[-4000:]}") from None
        results[r] = (p.returncode, out)
    return results


def assert_passed(results, scenario, ranks=None):
    for r, (rc, out) in results.items():
        if ranks is not None and r not in ranks:
            continue
        assert rc == 0 and f"PASS {scenario} rank {r}" in out, \
            f"rank {r} of {scenario} failed (exit {rc}):\n{out[-6000:]}"


def measures(out):
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("MEASURE ")]


def test_collectives_match_gloo():
    assert_passed(launch("collectives", 4), "collectives")


def test_collectives_match_gloo_and_a_warm_executable_cache_serves_every_rank(tmp_path):
    # 2 ranks, twice: the second job loads what the first stored; each rank must get programs
    # for its own device (a rank loading another's entry, or one loaded onto every device,
    # broke here).
    env = {"TORCHTPU_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        assert_passed(launch("collectives", 2, env=env), "collectives")


def test_each_rank_on_tpu_local_rank_of_a_shared_host():
    # Processes that see every device of the host, each using torch.tpu.set_device(LOCAL_RANK).
    assert_passed(launch("dtensor", 2, devices_per_process=2), "dtensor")


@pytest.mark.parametrize("mode", ["strict", "fused", "reduce-overhead", "strict-per-parameter"])
def test_ddp_and_fsdp2_train_like_one_process(mode):
    # In every mode, with the collectives in the step's programs: a steady step builds nothing
    # and never waits; fused eager runs it as 2 executables, reduce-overhead as 1 (the
    # worker's check_steady).  Per parameter: FSDP2's all-gathers and reduce-scatters one per
    # parameter, as on a TPU mesh (_distributed/fsdp.py), with FSDP2's values.
    env = {"fused": {"TORCH_TPU_DEFER_AND_FUSE": "1"},
           "reduce-overhead": {"TORCHTPU_TEST_STEP": "onestep"},
           "strict-per-parameter": {"TORCHTPU_FSDP_PER_PARAMETER": "1"}}.get(mode, {})
    results = launch("training", 2, env=env)
    assert_passed(results, "training")
    # FSDP2 keeps about 1/N of the parameters on each rank.
    for _, out in results.values():
        (m,) = [m for m in measures(out) if m.startswith("fsdp_param_bytes")]
        full, local = (int(x) for x in re.findall(r"full=(\d+) local=(\d+)", m)[0])
        assert local <= full / 2 * 1.1, m


def test_torch_tpu_queries_before_init_process_group():
    # device_count/set_device/properties first (the usual torchrun script order), then init.
    assert_passed(launch("launch_order", 2), "launch_order")


@pytest.mark.parametrize("mode", ["strict", "fused", "debug", "strict-first-run"])
def test_a_collective_on_one_rank_only_raises_naming_both_sides(mode):
    # Every run of a program is compared (strict: ranks that split into programs compared
    # before are stopped too); with TORCHTPU_DIST_CHECK=first, its first run only.
    env = {"TORCHTPU_TEST_MODE": mode.split("-")[0]}
    if mode == "strict-first-run":
        env["TORCHTPU_DIST_CHECK"] = "first"
    assert_passed(launch("divergent", 2, timeout=120, env=env), "divergent")


def test_init_process_group_after_a_tensor_says_why():
    assert_passed(launch("tensor_before_init", 2, timeout=120), "tensor_before_init")


def test_fsdp2_as_users_set_it_up():
    # A CPU module, a meta module initialised under DTensor, activation checkpointing,
    # clip_grad_norm_, torch.compile per block (torchtitan's pattern), a DCP round trip of
    # model and optimizer, and the captured step's program for TPU.
    results = launch("fsdp_setup", 2)
    assert_passed(results, "fsdp_setup")


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_fsdp2_holds_a_few_units_unsharded_at_a_time(mode):
    assert_passed(launch("fsdp_memory", 2, env={"TORCHTPU_TEST_MODE": mode}), "fsdp_memory")


def test_hsdp_on_a_2d_mesh():
    assert_passed(launch("hsdp", 4), "hsdp")


def test_dtensor_and_distributed_checkpoint():
    assert_passed(launch("dtensor", 2), "dtensor")


def test_killed_rank_raises_instead_of_hanging():
    results = launch("rank_dies", 2, timeout=120)
    assert_passed(results, "rank_dies", ranks={0})
    assert results[1][0] == 17
    (m,) = measures(results[0][1])
    # gloo reports the closed connection at once, or (seen on a loaded machine: the peer's
    # sockets close while its context is being set up) the collective never completes and the
    # group's 20 s timeout raises; either way a DistBackendError, never a hang.
    waited = float(re.search(r"error_after=([\d.]+)s", m).group(1))
    assert "DistBackendError" in m and waited <= 25, m
    assert "did another rank exit?" in m or "timed out after 0:00:20" in m, m


def test_stalled_rank_times_out():
    start = time.time()
    results = launch("rank_stalls", 2, timeout=120)
    assert_passed(results, "rank_stalls", ranks={0})
    (m,) = measures(results[0][1])
    waited = float(re.search(r"error_after=([\d.]+)s", m).group(1))
    assert 4.5 <= waited <= 15 and "timed out" in m, m
    assert time.time() - start < 90


def test_rank_that_never_joins_fails_init_within_timeout():
    results = launch("never_joins", 2, ranks=[0], timeout=120)
    assert_passed(results, "never_joins")
    (m,) = measures(results[0][1])
    waited = float(re.search(r"error_after=([\d.]+)s", m).group(1))
    assert waited <= 20, m


def test_a_rank_that_stops_before_the_runtime_is_named_within_the_timeout():
    # JAX's coordination service would abort rank 0 (an uncatchable fatal log) instead
    results = launch("stops_before_runtime", 2, timeout=120)
    assert_passed(results, "stops_before_runtime")
    (m,) = measures(results[0][1])
    waited = float(re.search(r"error_after=([\d.]+)s", m).group(1))
    assert waited <= 20, m
    assert "DistBackendError: init_process_group('tpu'): rank(s) [1] of 2 did not reach JAX's " \
           "multi-process runtime within the group's timeout (0:00:05)" in m, m


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_torchrun_launches_unchanged_script(tmp_path):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    # (TMPDIR: torchrun leaves a torchelastic_* directory behind in it)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS=xla_flags(), TMPDIR=str(tmp_path))
    out = subprocess.run([torchrun, "--nproc-per-node", "2", "--standalone", WORKER, "dtensor"],
                         env=env, capture_output=True, text=True, timeout=240, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "PASS dtensor rank 0" in text and "PASS dtensor rank 1" in text, text[-3000:]


# --- the backend's registration -----------------------------------------------------------------
_REGISTRATION = r"""
import datetime, sys
import torch
import torch.distributed as dist
import torchtpu_autoload
calls = []
register = dist.Backend.register_backend
dist.Backend.register_backend = lambda *a, **k: (calls.append(a[0]), register(*a, **k))[1]
if sys.argv[1] == "import":
    import torchtpu  # noqa: F401
dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
t = torch.arange(4.0, device="tpu")
dist.all_reduce(t)
assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and dist.get_backend() == "tpu"
assert "torchtpu" in sys.modules
assert dist.Backend._plugins["TPU"].creator_fn is torchtpu_autoload._create_process_group
dist.destroy_process_group()
print("registrations after import torch:", calls)
"""


@pytest.mark.parametrize("first", ["import", "autoload"])
def test_the_backend_is_registered_once_whichever_comes_first(first):
    # "import": TORCH_DEVICE_BACKEND_AUTOLOAD=0 and `import torchtpu` first, whose start-up
    # registers it (step 1); "autoload": `import torch` registered it, init_process_group("tpu")
    # is the first use and loads the package, which registers nothing more.
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0" if first == "import" else "1")
    out = subprocess.run([sys.executable, "-c", _REGISTRATION, first], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    want = ["tpu"] if first == "import" else []
    assert f"registrations after import torch: {want}" in out.stdout, out.stdout + out.stderr


def test_one_place_in_the_source_registers_the_backend():
    sources = sorted(pathlib.Path(ROOT, "torchtpu").rglob("*.py")) + [
        pathlib.Path(ROOT, "torchtpu_autoload.py")]
    found = [(str(p.relative_to(ROOT)), line.strip()) for p in sources
             for line in p.read_text().splitlines()
             if "register_backend(" in line and not line.lstrip().startswith(("#", '"'))]
    assert found == [("torchtpu_autoload.py", 'dist.Backend.register_backend("tpu", '
                      '_create_process_group, extended_api=True,')], found


# --- in this process: a one-rank group ---------------------------------------------------------
@pytest.fixture
def one_rank_group():
    dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_one_rank_group_collectives_are_identities(one_rank_group):
    assert dist.get_backend() == "tpu"
    t = torch.arange(6.0, device="tpu")
    dist.all_reduce(t)
    torch.testing.assert_close(t.cpu(), torch.arange(6.0))
    out = torch.empty(6, device="tpu")
    dist.all_gather_into_tensor(out, t)
    torch.testing.assert_close(out.cpu(), torch.arange(6.0))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(t.cpu(), torch.arange(6.0))
    w = dist.all_reduce(t, async_op=True)
    assert w.wait() and w.is_completed()
    dist.barrier()
    # In-place collectives of one rank run nothing (DDP on one process: no program per bucket).
    before = torchtpu.metrics().get("ops", 0)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.reduce(t, 0, op=dist.ReduceOp.MAX)
    dist.all_reduce_coalesced([t, t], op=dist.ReduceOp.AVG)
    assert torchtpu.metrics().get("ops", 0) == before
    torch.testing.assert_close(t.cpu(), torch.arange(6.0))


def test_bad_collective_arguments_raise_and_leave_tensors_intact(one_rank_group):
    t = torch.arange(4.0, device="tpu")
    out = torch.zeros(3, device="tpu")
    with pytest.raises(ValueError, match="all_gather_into_tensor"):
        dist.all_gather_into_tensor(out, t)
    with pytest.raises(ValueError, match="reduce_scatter_tensor"):
        dist.reduce_scatter_tensor(out, t)
    with pytest.raises(ValueError, match="tensors must all be on tpu"):
        dist.all_gather([torch.zeros(4)], t)
    assert torch.equal(out.cpu(), torch.zeros(3)) and torch.equal(t.cpu(), torch.arange(4.0))
    # CPU tensors on a tpu group go to its gloo side.
    c = torch.ones(3)
    dist.all_reduce(c)
    assert torch.equal(c, torch.ones(3))


def test_a_captured_fsdp2_step_makes_its_unsharded_parameters_inside_the_program(one_rank_group):
    """FSDP2 frees each unit's unsharded parameters with resize_(0) and makes them anew with
    resize_(n): in a captured step they are the program's temporaries, so the graph reads the
    shards, gradients and AdamW states (4x the parameters' bytes), not the unsharded
    parameters too (6x before), and its replays train as eager steps do."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)]).to("tpu")
        for b in model:
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="tpu"),
                                capturable=True)
        return model, opt

    x = torch.randn(8, 64, device="tpu")

    def step(model, opt):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    model, opt = make()
    want = [step(model, opt).item() for _ in range(5)]
    model, opt = make()
    got = [step(model, opt).item() for _ in range(2)]
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = step(model, opt)
    for _ in range(3):  # (a capture records the step without running it, as CUDA's does)
        g.replay()
        got.append(out.item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    read = sum(b.nbytes for b in g.input_storages)
    assert read <= 4 * params + x.nbytes + 1024, read / params


# --- expert parallelism (issue 35) -----------------------------------------------------------
def test_expert_parallel_moe_layer_matches_the_whole_layer():
    assert_passed(launch("expert_parallel", 2), "expert_parallel")
