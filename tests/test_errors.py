"""Bad input raises PyTorch's exception types and leaves every tensor unchanged."""
import contextlib

import pytest
import torch
import warnings

import torchtpu


def test_shape_mismatch_raises_runtime_error_and_keeps_inputs():
    a = torch.ones(3, 4, device="tpu")
    b = torch.ones(5, 4, device="tpu")
    # The type is PyTorch's; the wording comes from PyTorch's meta kernels.
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        a + b
    with pytest.raises(RuntimeError, match="must match the size|broadcast"):
        a.add_(b)
    assert torch.equal(a.cpu(), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="cannot be multiplied|same reduction dim"):
        a @ b


def test_mixing_cpu_and_tpu_raises_but_0dim_cpu_mixes():
    a = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)
    assert torch.equal((a + torch.tensor(2.0)).cpu(), torch.full((3,), 3.0))


@contextlib.contextmanager
def raises_by_sync(exc_type):
    """The error surfaces at the op (strict, debug) or when its fused segment runs (fused)."""
    with pytest.raises(exc_type) as info:
        yield info
        torch.tpu.synchronize()


def test_out_of_range_indices_raise_and_leave_tensors_intact():
    x = torch.arange(5.0, device="tpu")
    with raises_by_sync(IndexError):
        x[torch.tensor([0, 7], device="tpu")]
    with raises_by_sync(IndexError):
        x.index_put_((torch.tensor([9], device="tpu"),), torch.tensor([1.0], device="tpu"))
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    emb = torch.nn.Embedding(4, 2).to("tpu")
    with raises_by_sync(IndexError):
        emb(torch.tensor([4], device="tpu"))
    with raises_by_sync(RuntimeError) as info:
        torch.gather(x, 0, torch.tensor([5], device="tpu"))  # RuntimeError, as on the CPU
    assert "out of bounds for dimension 0 with size 5" in str(info.value)


def test_dtype_errors_match_cpu():
    i = torch.ones(3, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast|not possible"):
        i.add_(0.5)
    assert i.cpu().tolist() == [1, 1, 1]


_no_lowering = torch.library.Library("torchtpu_test_errors", "DEF")
_no_lowering.define("cpu_only.scaled(Tensor x, float scale) -> Tensor")
_no_lowering.impl("cpu_only.scaled", lambda x, scale: x * scale, "CPU")


def test_missing_lowering_raises_not_implemented_naming_overload():
    x = torch.randn(3, 3, device="tpu")
    with pytest.raises(NotImplementedError, match="torchtpu_test_errors::cpu_only.scaled"):
        torch.ops.torchtpu_test_errors.cpu_only.scaled(x, 2.0)
    assert (x.cpu() == x.cpu()).all()


def test_cpu_fallback_runs_warns_once_and_counts(eager_mode):
    # An op with only a CPU kernel, new for each mode (the warning is once per op and process).
    lib = torch.library.Library(f"torchtpu_test_fallback_{eager_mode}", "DEF")
    lib.define("scaled_cumsum(Tensor x, float scale) -> Tensor")
    lib.impl("scaled_cumsum", lambda x, scale: torch.cumsum(x, 0) * scale, "CPU")
    op = getattr(torch.ops, f"torchtpu_test_fallback_{eager_mode}").scaled_cumsum
    a = torch.randn(4, 4)
    x = a.to("tpu")
    with pytest.raises(NotImplementedError, match="scaled_cumsum"):
        op(x, 2.0)
    torch.tpu.enable_cpu_fallback = True
    try:
        before = torchtpu.metrics().get("cpu_fallbacks", 0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r1 = op(x, 2.0)
            r2 = op(x + 1, 0.5)
        assert sum("cpu" in str(m.message).lower() for m in w) == 1
        assert torchtpu.metrics()["cpu_fallbacks"] == before + 2
        assert r1.device.type == "tpu"
        torch.testing.assert_close(r1.cpu(), torch.cumsum(a, 0) * 2.0)
        torch.testing.assert_close(r2.cpu(), torch.cumsum(a + 1, 0) * 0.5)
    finally:
        torch.tpu.enable_cpu_fallback = False


def test_process_survives_bad_calls():
    x = torch.ones(2, device="tpu")
    for bad in (lambda: x.view(3), lambda: x.reshape(-1, 4), lambda: torch.empty(-1, device="tpu")):
        with pytest.raises(RuntimeError):
            bad()
    assert (x * 2).cpu().tolist() == [2.0, 2.0]


def test_overlapping_writes_raise_as_on_the_cpu():
    """A write PyTorch refuses (an expanded output, an input partly aliasing the output, any
    aliasing for gathering ops) raises its RuntimeError; full aliasing in-place still works."""
    x = torch.arange(6.0, device="tpu")
    with pytest.raises(RuntimeError, match="input tensor and the written-to tensor"):
        x[1:].add_(x[:-1])
    with pytest.raises(RuntimeError, match="input tensor and the written-to tensor"):
        torch.cat([x[:3], x[:3]], out=x)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.zeros(3, device="tpu").expand(2, 3).mul_(2)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.zeros(3, device="tpu").expand(2, 3).bernoulli_(0.5)
    assert torch.equal(x.cpu(), torch.arange(6.0))
    x.add_(x)
    torch.zeros(3, device="tpu").expand(2, 3).fill_(1)  # fill_ allows it, as on the CPU
    assert torch.equal(x.cpu(), torch.arange(6.0) * 2)


def test_multinomial_and_index_add_validate_like_the_cpu():
    with pytest.raises(RuntimeError, match="n_sample <= 0"):
        torch.multinomial(torch.ones(3, device="tpu"), 0)
    with raises_by_sync(RuntimeError):
        torch.multinomial(torch.tensor([0.5, -1.0], device="tpu"), 1)
    with pytest.raises(RuntimeError, match="source tensor shape must match"):
        torch.zeros(3, 2, device="tpu").index_add(0, torch.tensor([0], device="tpu"), torch.ones(1, 3, device="tpu"))
    with pytest.raises(RuntimeError, match="from=3 > to=-1"):
        torch.empty(3, device="tpu").uniform_(3, -1)


@pytest.mark.parametrize("case", [
    "amax_empty_dim", "amin_empty_no_dim", "aminmax_empty_dim", "aminmax_empty_all", "aminmax_out_dtype",
    "complex_out_dtype", "narrow_copy_dim", "as_strided_scatter_bounds", "amax_65_dims"])
def test_errors_the_cpu_kernels_raise_beyond_their_meta_kernels(case):
    """Bad input that PyTorch's meta kernels let through, or reject with another exception than
    the CPU's kernels: the tpu raises the CPU's exception type and message.  (The inputs are
    fresh copies; other tests check that failed calls leave tensors intact.)"""
    empty, x = torch.randn(5, 0, 5), torch.randn(4, 4)
    calls = {
        "amax_empty_dim": lambda d: empty.to(d).amax(dim=-2),
        "amin_empty_no_dim": lambda d: empty.to(d).amin(),
        "aminmax_empty_dim": lambda d: torch.aminmax(empty.to(d), dim=1),
        "aminmax_empty_all": lambda d: torch.aminmax(empty.to(d)),
        "aminmax_out_dtype": lambda d: torch.aminmax(x.to(d), dim=0, out=(
            torch.empty(4, device=d), torch.empty(4, dtype=torch.float64, device=d))),
        "complex_out_dtype": lambda d: torch.complex(x.to(d), x.to(d), out=torch.empty(
            4, 4, dtype=torch.complex128, device=d)),
        "narrow_copy_dim": lambda d: x.to(d).narrow_copy(2, 0, 1),
        "as_strided_scatter_bounds": lambda d: torch.as_strided_scatter(
            x.to(d), torch.ones(2, 2, device=d), (2, 2), (200, 200)),
        "amax_65_dims": lambda d: torch.ones([1] * 65).to(d).amax(dim=-1),
    }
    with pytest.raises(Exception) as on_cpu:
        calls[case]("cpu")
    with pytest.raises(on_cpu.type) as on_tpu:
        calls[case]("tpu")
        torch.tpu.synchronize()
    if case != "amax_65_dims":  # that message comes from PyTorch's reference implementation
        assert str(on_tpu.value) == str(on_cpu.value)


def test_tensors_with_more_dims_than_numpy_allows_cross_devices():
    x = torch.randn([1] * 64 + [3])
    t = x.to("tpu")
    assert t.shape == x.shape and torch.equal(t.cpu(), x)
    assert torch.equal((t * 2).cpu(), x * 2)
