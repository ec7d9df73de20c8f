"""The eager modes: the API to choose one, fused recording/flushing/caching, debug errors.

The other suites (tensors, ops, errors, training) run in every mode through conftest.py; this
file checks what is specific to each mode. Tests that need one mode switch to it themselves."""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import counts

import torchtpu
from torchtpu._execution import fused, modes, recording

EagerMode = torch.tpu.EagerMode
FUSED, STRICT, DEBUG = EagerMode.DEFER_AND_FUSE, EagerMode.DEFER_NEVER, EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


def test_mode_api_property_and_context_manager():
    start = torch.tpu.eager_mode
    with torch.tpu.set_eager_mode(FUSED):
        assert torch.tpu.eager_mode is FUSED
        torch.tpu.eager_mode = DEBUG
        assert torch.tpu.get_eager_mode() is DEBUG
    assert torch.tpu.eager_mode is start
    with pytest.raises(KeyError):
        with torch.tpu.set_eager_mode("DEFER_NEVER_AND_LAUNCH_BLOCKING"):
            assert torch.tpu.eager_mode is DEBUG
            raise KeyError("restored even on exceptions")
    assert torch.tpu.eager_mode is start
    torch.tpu.set_eager_mode(STRICT)  # a plain call switches too
    assert torch.tpu.eager_mode is STRICT
    torch.tpu.eager_mode = start
    with pytest.raises(ValueError, match="Unknown eager mode"):
        torch.tpu.eager_mode = "lazy"


@pytest.mark.parametrize("env, expected", [({}, "DEFER_NEVER"),
                                           ({"TORCH_TPU_DEFER_AND_FUSE": "1"}, "DEFER_AND_FUSE"),
                                           ({"TORCH_TPU_LAUNCH_BLOCKING": "1"},
                                            "DEFER_NEVER_AND_LAUNCH_BLOCKING")])
def test_mode_from_environment(env, expected):
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_TPU_")} | env
    out = subprocess.run([sys.executable, "-c", "import torch, torchtpu; print(torch.tpu.eager_mode.name)"],
                         env=full, capture_output=True, text=True, check=True).stdout
    assert out.strip() == expected


def test_fused_defers_until_a_value_is_needed():
    a = torch.randn(8, 8)
    x = a.to("tpu")
    torch.tpu.synchronize()
    with torch.tpu.set_eager_mode(FUSED):
        flushes = counts("flushes")[0]
        y = (x * 2).sin() + x
        y.t()[0].mul_(3)  # in place through a view
        assert recording.pending_ops() == 4
        assert counts("flushes")[0] == flushes
        expected = (a * 2).sin() + a
        expected.t()[0].mul_(3)
        torch.testing.assert_close(y.cpu(), expected)
        assert recording.pending_ops() == 0
        assert counts("flush::device_to_host")[0] >= 1
        s = y.sum()
        assert s.item() == pytest.approx(expected.sum().item(), rel=1e-5)
        assert counts("flush::item")[0] >= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rounds_every_op_like_eager(dtype):
    """A fused chain of half-precision ops rounds after each op, as the CPU does, instead of
    keeping the intermediates in float32: the values equal the CPU's bit for bit."""
    a = torch.randn(4096).to(dtype)
    expected = ((a * 3).exp() * a - a.sigmoid()).tanh()
    with torch.tpu.set_eager_mode(FUSED):
        x = a.to("tpu")
        got = ((x * 3).exp() * x - x.sigmoid()).tanh().cpu()
    assert torch.equal(got, expected)


def test_fused_flush_reasons():
    x = torch.randn(16, device="tpu")
    with torch.tpu.set_eager_mode(FUSED):
        torchtpu.reset_metrics()
        (x + 1).nonzero()  # data-dependent shape
        assert counts("flush::data_dependent") == (1,)
        x.add_(1)
        torch.tpu.synchronize()
        assert counts("flush::synchronize") == (1,)
        limit, recording.max_ops = recording.max_ops, 5
        try:
            for _ in range(12):
                x.add_(1)
        finally:
            recording.max_ops = limit
        assert counts("flush::max_ops") == (2,)
        p = torch.nn.Parameter(torch.ones(3, device="tpu"))
        opt = torch.optim.SGD([p], lr=0.1)
        loss = (p * 2).sum()
        pending = recording.pending_ops()
        loss.backward()  # the forward runs as a segment of its own, the backward is recorded
        assert counts("flush::backward") == (1,) and pending > 0
        assert recording.pending_ops() > 0
        opt.step()
        assert counts("flush::optimizer_step") == (1,)
        assert recording.pending_ops() == 0
        torch.testing.assert_close(p.detach().cpu(), torch.full((3,), 0.8))


@pytest.mark.parametrize("mode", [FUSED, STRICT])
def test_steady_training_loop_compiles_nothing_after_warmup(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8, device="tpu"), torch.randint(0, 4, (32,), device="tpu")

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    with torch.tpu.set_eager_mode(mode):
        losses = [step() for _ in range(3)]  # warm-up: AdamW's first steps differ
        before = counts("compiles", "segment_compiles", "segment_cache_hits")
        losses += [step() for _ in range(4)]
        after = counts("compiles", "segment_compiles", "segment_cache_hits")
    assert after[:2] == before[:2], "a steady step compiled something"
    if mode is FUSED:
        assert after[2] - before[2] >= 4  # every step replayed a cached segment
        assert counts("donated_buffers")[0] > 0  # overwritten parameters/states are donated
    assert losses[-1] < losses[0]


def test_fused_error_names_op_and_line_and_keeps_inputs():
    x = torch.arange(5.0, device="tpu")
    with torch.tpu.set_eager_mode(FUSED):
        y = x * 2                                          # runs fine
        line = sys._getframe().f_lineno + 1
        x.index_put_((torch.tensor([9], device="tpu"),), torch.tensor([1.0], device="tpu"))
        z = y + 1                                          # recorded after the failing op
        with pytest.raises(IndexError) as info:
            torch.tpu.synchronize()
        message = str(info.value)
        assert "aten.index_put_" in message and f"test_modes.py:{line} in test_fused_error" in message
        assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert y.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        # The checks were read at the sync, after the segment ran whole: z did not depend on
        # the failing op and holds its value (sync.py documents the state).
        assert z.cpu().tolist() == [1.0, 3.0, 5.0, 7.0, 9.0]


_probe = torch.library.Library("torchtpu_test_modes", "DEF")
_probe.define("cpu_only_twice(Tensor x) -> Tensor")
_probe.impl("cpu_only_twice", lambda x: x * 2, "CPU")


def test_fused_cpu_fallback_flushes_first(monkeypatch):
    monkeypatch.setattr(torch.tpu, "enable_cpu_fallback", True)
    x = torch.randn(6, device="tpu")
    with torch.tpu.set_eager_mode(FUSED), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warned once per op and process
        before = counts("flush::cpu_fallback", "cpu_fallbacks")
        r = torch.ops.torchtpu_test_modes.cpu_only_twice(x * 3)
        assert r.device.type == "tpu"
        torch.testing.assert_close(r.cpu(), x.cpu() * 6)
        after = counts("flush::cpu_fallback", "cpu_fallbacks")
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1


def test_debug_runtime_error_names_op_inputs_and_line(monkeypatch):
    from torchtpu._execution.kernels import kernel_for
    x = torch.ones(2, 3, device="tpu")
    x + x  # compile
    kernel = kernel_for(torch.ops.aten.add.Tensor)

    def failing(*args):
        raise RuntimeError("device reported an error")

    for compiled in kernel.cache.values():
        monkeypatch.setattr(compiled, "fn", failing)
    with torch.tpu.set_eager_mode(DEBUG):
        with pytest.raises(RuntimeError) as info:
            x + x
    message = str(info.value)
    assert "device reported an error" in message
    assert "aten.add.Tensor" in message and "Tensor[2, 3] float32" in message
    assert "test_modes.py" in message


def test_debug_nan_check(monkeypatch):
    monkeypatch.setattr(modes, "check_nans", True)
    x = torch.tensor([1.0, 0.0], device="tpu")
    with torch.tpu.set_eager_mode(DEBUG):
        x * 2
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            torch.log(x)


def test_fused_donates_only_arrays_nothing_else_holds():
    from torchtpu._core import storage
    x = torch.ones(4, device="tpu")
    y = torch.ones(4, device="tpu")
    fused.clear_cache()
    torchtpu.reset_metrics()
    with torch.tpu.set_eager_mode(FUSED):
        for _ in range(3):
            held = storage.buffer_of(y).array  # someone else still refers to y's array
            before = counts("donated_buffers")[0]
            x.add_(1)
            y.add_(1)
            torch.tpu.synchronize()
            assert counts("donated_buffers")[0] == before + 1  # x's old array only
    # The segment is traced before its first executable is built, so that one already donates.
    assert counts("segment_compiles", "segment_cache_hits") == (1, 2)
    assert not held.is_deleted() and held.tolist() == [3.0] * 4
    assert x.cpu().tolist() == [4.0] * 4 and y.cpu().tolist() == [4.0] * 4


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_zeroed_storages_take_the_shape_of_the_tensor_that_zeroed_them(mode):
    """An optimizer's state is `zeros_like(param)`: an unwritten storage whose zeros, made at
    its first read, have the parameter's shape (a flat array of them made XLA copy the state in
    every fused step of the Llama model), on the host's path (small) and the executable's
    (large); views of other shapes read and write it as PyTorch does."""
    from torchtpu._core import storage
    with torch.tpu.set_eager_mode(mode):
        for shape in [(6, 4), (300, 100)]:  # 96 B and 120 KB: host zeros, a zeros executable
            p_cpu = torch.randn(shape)
            p = p_cpu.to("tpu")
            state = torch.zeros_like(p, memory_format=torch.preserve_format)
            for _ in range(2):
                state.mul_(0.9).add_(p)
            torch.tpu.synchronize()
            assert storage.buffer_of(state).value().shape == shape
            torch.testing.assert_close(state.cpu(), p_cpu * 1.9)
            other = torch.zeros_like(p)
            other.view(-1)[3:5] += 1.0  # a view of another shape writes into the zeros
            expected = torch.zeros(shape)
            expected.view(-1)[3:5] = 1.0
            torch.testing.assert_close(other.cpu(), expected)
            assert storage.buffer_of(other).value().shape == shape
        flat = torch.empty(12, device="tpu").view(3, 4)  # never zeroed: read as flat zeros
        assert flat.cpu().tolist() == [[0.0] * 4] * 3
        assert storage.buffer_of(flat).value().shape == (12,)


def test_fused_segment_makes_the_zeros_of_unwritten_storages_itself():
    """`zeros` is an unwritten storage (`empty`, read as zeros).  An op of a segment that reads
    one that is gone by the flush (a slice's copy_ into it, as every slice's backward does;
    `ones`'s fill_) gets zeros made inside the segment, not a transfer or program of their own
    before it; one still held then (an optimizer's state) is an array of zeros, as it is an
    array when the same code runs again: both runs are one segment."""
    a = torch.randn(3, 4)
    y, three = a.to("tpu"), torch.tensor(3.0).to("tpu")

    def padded():
        z = torch.zeros(5, 4, device="tpu")
        z[1:4] = y
        return z * 2 + torch.ones(5, 4, device="tpu")

    torch.tpu.synchronize()
    expected = torch.zeros(5, 4)
    expected[1:4] = a
    with torch.tpu.set_eager_mode(FUSED):
        before = counts("zeros_materialized", "flushes")
        out = padded()
        # The slice's backward is zeros and a copy_ into them, which the next op's backward
        # reads (a leaf's gradient would be those zeros, kept).
        grad, = torch.autograd.grad((y.requires_grad_() * 1.0)[:, 1:].sum(), y, three)
        y.requires_grad_(False)
        torch.tpu.synchronize()
        assert counts("zeros_materialized", "flushes") == (before[0], before[1] + 2)
        torch.testing.assert_close(out.cpu(), expected * 2 + 1)
        torch.testing.assert_close(grad.cpu(), torch.tensor([[0.0, 3, 3, 3]] * 3))

        fused.clear_cache()
        before = counts("zeros_materialized", "segment_compiles", "segment_cache_hits")
        state = None
        for _ in range(2):
            if state is None:
                state = torch.zeros(3, 4, device="tpu")  # kept, as an optimizer keeps its state
            state.mul_(0.5).add_(y)
            torch.tpu.synchronize()
        assert counts("zeros_materialized", "segment_compiles", "segment_cache_hits") == (
            before[0] + 1, before[1] + 1, before[2] + 1)
        torch.testing.assert_close(state.cpu(), a * 1.5)
    torch.tpu.synchronize()
    before = counts("zeros_materialized")[0]
    empty = torch.empty(6, device="tpu")  # read outside a segment: zeros of its own
    assert empty.cpu().tolist() == [0.0] * 6 and counts("zeros_materialized")[0] == before + 1


def test_fused_training_step_donates_parameters_and_optimizer_state():
    """The forward's index checks (embedding, the loss's targets) keep its segment from donating
    its inputs; the backward starts a segment of its own, which with the optimizer step donates
    the parameters and optimizer state it overwrites, so their memory does not double."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    idx, tgt = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
    results = {}
    for mode in (STRICT, FUSED):
        m = copy.deepcopy(model).to("tpu")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        with torch.tpu.set_eager_mode(mode):
            for _ in range(3):
                before = counts("donated_buffers")[0]
                loss = F.cross_entropy(m(idx.to("tpu")).flatten(0, 1), tgt.to("tpu").flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                torch.tpu.synchronize()
        results[mode] = ([p.detach().cpu() for p in m.parameters()], counts("donated_buffers")[0] - before)
    params, donated = results[FUSED]
    assert donated >= 3 * 2  # at least each parameter and its two AdamW moments
    for a, b in zip(params, results[STRICT][0]):
        torch.testing.assert_close(a, b)
