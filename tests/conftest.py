import atexit
import os
import shutil
import tempfile

import jaxlib  # (its version only: jax starts later)

# The suite's own persistent executable cache, empty at the start: what the user's cache
# directory holds (earlier runs, other versions) must not change what a test sees.  Tests of
# the cache itself give their processes directories of their own.
if "TORCHTPU_CACHE_DIR" not in os.environ:
    os.environ["TORCHTPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchtpu-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TORCHTPU_CACHE_DIR"], True)

# Compiling is most of the suite's time (80 of the 110 s each rank of the fused FSDP scenario
# spends), and most of compiling is LLVM optimising the machine code of XLA:CPU's programs:
# the suite compiles them at LLVM's level 1 of XLA's default 3 (2.4x faster to compile a GPT
# step). XLA's HLO passes (fusion, layouts, the programs tests inspect) are the same; only
# the machine code is slower and may round differently where LLVM would fuse a multiply-add,
# which no test compares across settings. Level 1, not 0: at 0 XLA:CPU's attention with a
# -inf mask gives NaN where levels 1 and 3 give PyTorch's values (jax.nn.dot_product_attention
# alone does it). XLA_FLAGS naming the level (=3) runs the suite as users run their programs.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=1",)
# XLA:CPU's fusions through its older loop emitters instead of the MLIR fusion emitters: 40%
# less XLA time for a fused GPT step at level 1 (2.1 -> 1.3 s), 24% for strict eager's per-op
# programs. What XLA fuses may differ a little (14 fusions for 16 in a small MLP step); every
# test passes either way. A flag XLA does not know aborts the process: only on the jaxlib it
# was measured with and later ones.
if tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) >= (0, 10):
    SUITE_XLA_FLAGS += ("--xla_cpu_use_fusion_emitters=false",)


def xla_flags(devices=None):
    """XLA_FLAGS for a process the suite starts: the suite's, with `devices` CPU devices (or
    XLA's one)."""
    flags = [f for f in os.environ["XLA_FLAGS"].split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


_given = os.environ.get("XLA_FLAGS", "")  # (the flags it names win)
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in SUITE_XLA_FLAGS if f.split("=")[0] not in _given]).strip()

# Small index ops with ready inputs would run on the host by PyTorch's CPU kernel
# (advanced_indexing.py), whether a test's inputs are ready or not depending on timing: the
# suite tests the index lowerings, which every step on the device runs;
# tests/test_index_patterns.py turns it on.
os.environ.setdefault("TORCHTPU_INDEX_HOST_SECONDS", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402

# The suites that must pass in every eager mode. The default run covers strict and fused;
# TORCHTPU_TEST_MODES=strict,fused,debug (or =debug) selects others.
MODE_MODULES = {"test_tensors", "test_ops", "test_errors", "test_training", "test_conformance",
                "test_mixed_devices", "test_recurrent", "test_model_ops", "test_new_sizes",
                "test_index_patterns"}
MODES = {"strict": torch.tpu.EagerMode.DEFER_NEVER,
         "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
         "debug": torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING}
SELECTED = os.environ.get("TORCHTPU_TEST_MODES", "strict,fused").split(",")


# The tests that start several processes each, the longest of the suite, run first: with two
# workers (-n 2 --dist worksteal) one starts on them while the other takes the rest, and the
# two end together instead of one waiting on a long test that started late.
FIRST = ("test_distributed.py",)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # (a stable sort)


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rsplit(".", 1)[-1] in MODE_MODULES:
        metafunc.parametrize("eager_mode", SELECTED, indirect=True)


@pytest.fixture(autouse=True)
def eager_mode(request):
    """Runs the test under the mode it was parametrised with (strict elsewhere)."""
    name = getattr(request, "param", "strict")
    with torch.tpu.set_eager_mode(MODES[name]):
        yield name


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def assert_same(tpu, cpu, rtol=None, atol=None, strides=True):
    """A tpu result (a tensor or a sequence of them) equals the CPU reference: device, dtype,
    shape, strides (unless `strides=False`) and values, within assert_close's tolerance for
    the dtype unless `rtol`/`atol` are given (exact for integers)."""
    if isinstance(tpu, (tuple, list)):
        assert isinstance(cpu, (tuple, list)) and len(tpu) == len(cpu), (len(tpu), cpu)
        for t, c in zip(tpu, cpu):
            assert_same(t, c, rtol, atol, strides)
        return
    assert tpu.device.type == "tpu", tpu.device
    assert tpu.dtype == cpu.dtype, (tpu.dtype, cpu.dtype)
    assert tpu.shape == cpu.shape, (tpu.shape, cpu.shape)
    if strides:
        assert tpu.stride() == cpu.stride(), (tpu.stride(), cpu.stride())
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=rtol, atol=atol, equal_nan=True)


def counts(*names):
    """The metrics counters `names` (0 when never counted)."""
    m = torchtpu.metrics()
    return tuple(m.get(n, 0) for n in names)


def backward_and_step(loss, opt, scaler=None):
    """loss.backward() then opt.step(), through `scaler` (a GradScaler) when one is given."""
    if scaler:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
