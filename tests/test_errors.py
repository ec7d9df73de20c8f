"""Bad input raises PyTorch's exception types and leaves every tensor unchanged."""
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


def test_out_of_range_indices_raise_and_leave_tensors_intact():
    x = torch.arange(5.0, device="tpu")
    with pytest.raises(IndexError):
        x[torch.tensor([0, 7], device="tpu")]
    with pytest.raises(IndexError):
        x.index_put_((torch.tensor([9], device="tpu"),), torch.tensor([1.0], device="tpu"))
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    emb = torch.nn.Embedding(4, 2).to("tpu")
    with pytest.raises(IndexError):
        emb(torch.tensor([4], device="tpu"))
    with pytest.raises(IndexError):
        torch.gather(x, 0, torch.tensor([5], device="tpu"))


def test_dtype_errors_match_cpu():
    i = torch.ones(3, dtype=torch.int64, device="tpu")
    with pytest.raises(RuntimeError, match="can't be cast|not possible"):
        i.add_(0.5)
    assert i.cpu().tolist() == [1, 1, 1]


def test_missing_lowering_raises_not_implemented_naming_overload():
    x = torch.randn(3, 3, device="tpu")
    with pytest.raises(NotImplementedError, match="aten::linalg_cholesky_ex"):
        torch.linalg.cholesky(x @ x.t())


def test_cpu_fallback_runs_warns_once_and_counts():
    a = torch.randn(4, 4)
    spd = a @ a.t() + 4 * torch.eye(4)
    x = spd.to("tpu")
    torch.tpu.enable_cpu_fallback = True
    try:
        before = torchtpu.metrics().get("cpu_fallbacks", 0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r1 = torch.linalg.cholesky(x)
            r2 = torch.linalg.cholesky(x)
        assert sum("cpu" in str(m.message).lower() for m in w) == 1
        assert torchtpu.metrics()["cpu_fallbacks"] >= before + 2
        assert r1.device.type == "tpu"
        torch.testing.assert_close(r2.cpu(), torch.linalg.cholesky(spd))
    finally:
        torch.tpu.enable_cpu_fallback = False


def test_process_survives_bad_calls():
    x = torch.ones(2, device="tpu")
    for bad in (lambda: x.view(3), lambda: x.reshape(-1, 4), lambda: torch.empty(-1, device="tpu")):
        with pytest.raises(RuntimeError):
            bad()
    assert (x * 2).cpu().tolist() == [2.0, 2.0]
