"""A fixed, representative slice of the OpInfo conformance sweep (python -m torchtpu.conformance).

Each op's first samples run on tpu and on the CPU; forward values, dtypes and shapes must agree
(and float32 gradients, and error_inputs' exception types, where marked).  Regressions in these
families show up here; the full sweep is its own command (docs/testing.md)."""
import pytest
import torch

from torchtpu import conformance

MAX_SAMPLES = 3
F32 = ("float32",)
INT = ("float32", "int64")
HALF = ("float32", "bfloat16")

# op (name or name.variant) -> (dtypes, check float32 gradients[, check error_inputs])
OPS = {
    # pointwise, promotion, integer division
    "add": (("float32", "int64", "bfloat16", "bool"), True),
    "mul": (("float32", "int32", "complex64"), True),
    "div.floor_rounding": (INT, True),
    "div.trunc_rounding": (INT, True),
    "remainder": (INT, True),
    "exp": (HALF, True),
    "sigmoid": (F32, True),
    "atan2": (F32, True),
    "where": (INT, True),
    "clamp": (INT, True),
    "nan_to_num": (F32, True),
    "special.i1": (F32, False),
    "sinc": (F32, True),
    "fmax": (F32, True),
    "copysign": (F32, True),
    "nextafter": (F32, False),
    "polar": (F32, True),
    "logspace": (F32, False),
    "polygamma.polygamma_n_2": (F32, True),
    "frexp": (F32, False),
    "angle": (F32, True),
    "normal": (F32, False),
    "special.chebyshev_polynomial_u": (F32, False),
    "special.shifted_chebyshev_polynomial_v": (F32, False),
    "special.laguerre_polynomial_l": (F32, False),
    # reductions and scans
    "sum": (INT, True),
    "mean": (F32, True),
    "var_mean": (F32, True),
    "max.reduction_with_dim": (INT, True),
    "logsumexp": (F32, True),
    "cumsum": (INT, True),
    "topk": (F32, True),
    "sort": (("float32", "int64", "bfloat16", "bool"), True),
    "addbmm": (("float32", "float16"), True),
    "addr": (("float32", "bfloat16", "bool"), True),
    "linalg.cross": (HALF, True),
    "lerp": (HALF, True),
    "__rpow__": (INT, False),
    "scatter_add": (("float32", "bool"), True),
    "cummax": (INT, True),
    "mode": (F32, True),
    "kthvalue": (F32, True),
    "_segment_reduce.lengths": (F32, True),
    "median": (F32, True),
    "nanmedian": (F32, True),
    "logcumsumexp": (("float32", "complex64"), True),
    # shapes, views, indexing
    "cat": (INT, True, False),
    "permute": (F32, True),
    "as_strided": (F32, True),
    "diagonal_scatter": (F32, True),
    "gather": (INT, True),
    "scatter_reduce.amax": (F32, True),
    "masked_scatter": (F32, True),
    "take": (F32, True, False),
    "put": (F32, True),
    "prod": (F32, True),
    "index_put": (F32, True),
    "tril": (F32, True),
    "index_reduce.amax": (F32, True),
    "searchsorted": (INT, False),
    "nonzero_static": (INT, False),
    "bucketize": (INT, False),
    "unique": (INT, False),
    "unique_consecutive": (INT, False),
    "histc": (F32, False),
    "histogram": (F32, False),
    "histogramdd": (F32, False),
    "hash_tensor": (INT, False),
    "repeat_interleave": (F32, True),
    "equal": (INT, False),
    # matmul, linalg, fft
    "addmm": (F32, True),
    "einsum": (F32, True),
    "linalg.inv": (F32, True),
    "linalg.cholesky": (F32, True),
    "linalg.lu": (F32, True),
    "cholesky_solve": (F32, True),
    "geqrf": (F32, False),
    "linalg.eig": (F32, True),
    "linalg.householder_product": (F32, True),
    "ormqr": (F32, True),
    "linalg.lstsq": (F32, True),
    "fft.rfft": (F32, False),
    # nn
    "softmax": (F32, True),
    "nn.functional.gelu": (F32, True),
    "nn.functional.conv2d": (F32, False),
    "nn.functional.avg_pool2d": (F32, True),
    "nn.functional.max_pool2d": (F32, True),
    "nn.functional.fractional_max_pool2d": (F32, True),
    "nn.functional.fractional_max_pool3d": (F32, True),
    "nn.functional.adaptive_avg_pool2d": (F32, True),
    "nn.functional.group_norm": (F32, False),
    "_batch_norm_with_update": (F32, True),
    "nn.functional.interpolate.bilinear": (F32, True),
    "nn.functional.interpolate.nearest": (F32, True),
    "_upsample_bilinear2d_aa": (F32, True),
    "nn.functional.pad.replicate": (F32, True),
    "nn.functional.multi_margin_loss": (F32, True),
    "nn.functional.softshrink": (F32, True),
    "nn.functional.rrelu": (F32, True),
    "nn.functional.cross_entropy": (F32, True),
    "nn.functional.hardswish": (F32, True),
    "nn.functional.smooth_l1_loss": (F32, True),
    "nn.functional.huber_loss": (F32, True),
    "cdist": (F32, True),
    "grid_sampler_2d": (F32, True),
    "grid_sampler_3d": (F32, True),
    "nn.functional.pdist": (F32, True),
    "nn.functional.embedding_bag": (F32, True),
    "nn.functional.ctc_loss": (F32, True),
}

# op -> the dtypes whose gradients are compared too: backward formulas in complex (conjugates)
# and bfloat16 (computed in float32 and rounded once, as the CPU's kernels do).
C64_BF16 = ("complex64", "bfloat16")
GRAD_OPS = {"tanh": C64_BF16, "sigmoid": C64_BF16, "matmul": C64_BF16,
            "nn.functional.gelu": ("bfloat16",), "nn.functional.mse_loss": ("bfloat16",)}


@pytest.fixture(scope="module")
def opinfos():
    ops = conformance.select_ops(list(OPS) + list(GRAD_OPS))
    return {conformance.full_name(op): op for op in ops}


@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_cpu(name, opinfos):
    dtypes, grad, errors = (OPS[name] + (True,))[:3]
    result = conformance.run_op(opinfos[name], dtypes, max_samples=MAX_SAMPLES, grad=grad,
                                errors=errors, timeout=120)
    assert not torch.tpu.enable_cpu_fallback
    failures = {d: e["first_failure"] for d, e in result["dtypes"].items() if e["status"] != "pass"}
    assert set(result["dtypes"]) == set(dtypes), result["dtypes"].keys()
    if grad:
        assert result["grad"] is not None, "no gradient was checked"
        if result["grad"]["status"] != "pass":
            failures["grad"] = result["grad"]["first_failure"]
    if result["errors"] is not None and result["errors"]["status"] != "pass":
        failures["error_inputs"] = result["errors"]["first_failure"]
    assert not failures, failures


@pytest.mark.parametrize("name", list(GRAD_OPS))
def test_op_gradients_match_cpu_in_complex64_and_bfloat16(name, opinfos):
    dtypes = GRAD_OPS[name]
    result = conformance.run_op(opinfos[name], dtypes, max_samples=MAX_SAMPLES, errors=False,
                                grad_dtypes=dtypes, timeout=120)
    assert set(result["grads"]) == set(dtypes), "no gradient was checked"
    failures = {d: e["first_failure"] for d, e in result["grads"].items() if e["status"] != "pass"}
    assert not failures, failures


def test_runner_reports_wrong_answers_and_missing_ops(opinfos, monkeypatch):
    """A mismatching sample is reported failed (never skipped), a missing op as not implemented."""
    from torchtpu._core import registry
    op = opinfos["sigmoid"]
    low = registry.TABLE[torch.ops.aten.sigmoid.default]
    monkeypatch.setattr(low, "fn", lambda x: x * 0.5)  # a deliberately wrong lowering
    from torchtpu._execution import kernels
    kernels.kernel_for(torch.ops.aten.sigmoid.default).cache.clear()
    try:
        r = conformance.run_op(op, F32, max_samples=2, grad=False, errors=False)
    finally:
        monkeypatch.undo()
        kernels.kernel_for(torch.ops.aten.sigmoid.default).cache.clear()
    assert r["dtypes"]["float32"]["status"] == "mismatch"
    assert r["dtypes"]["float32"]["samples"] == 2
    totals = conformance.summarize([r])
    assert totals["forward_float32"]["passed"] == 0


def test_tied_indices_pass_only_when_they_pick_the_same_values():
    """sort/topk/kthvalue may return any index of a tied value (as PyTorch documents), but never
    an index of a different value or the same position twice; stable=True stays exact."""
    from torch.testing._internal.opinfo.core import SampleInput
    x = torch.tensor([3., 1., 3., 2.])
    values, order = torch.sort(x)
    sample = SampleInput(x, args=(0,))
    assert conformance._ties_only("sort", sample, (values, torch.tensor([1, 3, 2, 0])), (values, order))
    assert not conformance._ties_only("sort", sample, (values, torch.tensor([1, 3, 0, 0])), (values, order))
    assert not conformance._ties_only("sort", sample, (values, torch.tensor([3, 1, 0, 2])), (values, order))
    stable = SampleInput(x, args=(0,), kwargs={"stable": True})
    assert not conformance._ties_only("sort", stable, (values, torch.tensor([1, 3, 2, 0])), (values, order))
    top = torch.topk(x, 1)
    assert conformance._ties_only("topk", SampleInput(x, args=(1,)), (top.values, torch.tensor([2])), top)
