"""Loops over new sizes: ops on 1-D tensors whose arrays have room to spare (random fills'
buckets, appends' capacities) run at the array's size, keyed on the bucket (padded.py), in
strict and debug eager; fused eager records the table's ops on the tensors' own sizes.
Every result is compared with the CPU on the same values in every mode; the spare elements are
given values that would show if any op read them (NaN, huge, out-of-range indices, zero
divisors)."""
import contextlib

import jax
import numpy as np
import pytest
import torch

from conftest import assert_same
from torchtpu._core import metrics, storage
from torchtpu._core.dtypes import to_jax_dtype


def padded(values, spare):
    """A tpu tensor of `values` (a 1-D CPU tensor) whose array holds `spare` after them."""
    host = torch.cat([values, spare.to(values.dtype)]).numpy()
    array = jax.device_put(host.astype(np.dtype(to_jax_dtype(values.dtype))))
    n = values.numel()
    return storage.wrap(array, [n], [1], values.dtype, 0, n * values.element_size())


def array_size(t):
    torch.tpu.synchronize()
    return storage.buffer_of(t).value().size


def spare_kept(eager_mode):
    """Whether ops on tensors with room to spare keep it (padded.py's path runs)."""
    return eager_mode != "fused"


def builds():
    return sum(metrics.build_counts.values())


@contextlib.contextmanager
def raises_by_sync(exc_type, match=None):
    with pytest.raises(exc_type, match=match):
        yield
        torch.tpu.synchronize()


def _index_put_loop(device, sizes):
    """PyTorch's test_index_put_accumulate_duplicate_indices, over `sizes`."""
    for i in sizes:
        delta = torch.empty(i, dtype=torch.double, device=device).uniform_(-1, 1)
        indices = delta.cumsum(0).long()
        inp = torch.randn(int(indices.abs().max()) + 1, device=device)
        values = torch.randn(indices.size(0), device=device)
        out = inp.index_put((indices,), values, accumulate=True)
        expected = inp.cpu().index_put((indices.cpu(),), values.cpu(), accumulate=True)
        assert indices.untyped_storage().nbytes() == 8 * i
        assert_same(out, expected, rtol=1e-5, atol=1e-5)


def test_a_loop_over_new_sizes_matches_the_cpu_and_compiles_per_bucket(eager_mode):
    torch.manual_seed(3)
    _index_put_loop("tpu", range(33, 36))  # the 64-element buckets' programs
    before = builds()
    _index_put_loop("tpu", range(36, 65, 3))
    if spare_kept(eager_mode):
        assert builds() - before <= 4  # index_put of new (target, index) capacity pairs at most


SPARE_F = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -0.0, 7.0, 0.0])


def test_pointwise_ops_and_scans_read_no_spare_element(eager_mode):
    a_cpu = torch.tensor([1.5, -2.0, float("nan"), 0.25, -0.0])
    b_cpu = torch.tensor([3.0, 0.5, -1.0, float("inf"), 2.0])
    a, b = padded(a_cpu, SPARE_F), padded(b_cpu, -SPARE_F)
    s = torch.tensor(2.5, device="tpu")  # a 0-dim operand beside them
    cases = [
        lambda x, y, s: x.abs(), lambda x, y, s: x.exp(), lambda x, y, s: torch.sign(x),
        lambda x, y, s: x.isnan(), lambda x, y, s: x + y * 2, lambda x, y, s: torch.maximum(x, y),
        lambda x, y, s: torch.where(x > y, x, y), lambda x, y, s: x * s,
        lambda x, y, s: x.cumsum(0), lambda x, y, s: y.cumprod(-1),
        lambda x, y, s: x.cumsum(0, dtype=torch.float64), lambda x, y, s: torch.frexp(y),
    ]
    for fn in cases:
        result, expected = fn(a, b, s), fn(a_cpu, b_cpu, s.cpu())
        assert_same(result, expected)
        first = result[0] if isinstance(result, tuple) else result
        assert first.untyped_storage().nbytes() == 5 * first.element_size()
    if spare_kept(eager_mode):  # computed over the whole array: room to spare kept
        assert array_size(a.abs()) == 12 and array_size(torch.frexp(b)[1]) == 12
    # a tensor of this size without room to spare is the table's op, as always
    assert_same(a + torch.ones(5, device="tpu"), a_cpu + 1)


def test_casts_keep_the_room_to_spare(eager_mode):
    x_cpu = torch.tensor([1.7, -2.5, 300.0, -0.4, 5.0, 9.9])
    x = padded(x_cpu, SPARE_F)
    for dtype in (torch.int64, torch.int32, torch.float64, torch.float16, torch.bool, torch.uint8):
        y = x.to(dtype)
        assert_same(y, x_cpu.to(dtype))
        assert y.untyped_storage().nbytes() == 6 * y.element_size()
        assert array_size(y) == (13 if spare_kept(eager_mode) else 6)
    assert_same(x.long().abs(), x_cpu.long().abs())
    out = torch.empty(6, dtype=torch.int64, device="tpu")
    out.copy_(x)
    assert_same(out, x_cpu.long())
    base, base_cpu = torch.zeros(12, dtype=torch.int64, device="tpu"), torch.zeros(12, dtype=torch.int64)
    base[3:9].copy_(x)  # not covering its storage: the table's copy_, which writes 6 elements
    base_cpu[3:9].copy_(x_cpu)
    assert_same(base, base_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.float16])
def test_reductions_ignore_the_spare_elements(eager_mode, dtype):
    if dtype is torch.bool:
        x_cpu, spare = torch.tensor([True, False, True]), torch.tensor([False, True] * 3)
    elif dtype.is_floating_point:
        x_cpu, spare = torch.tensor([-3.0, 2.0, 0.5], dtype=dtype), SPARE_F.to(dtype)
    else:
        info = torch.iinfo(dtype)
        x_cpu, spare = torch.tensor([-3, 2, 5]), torch.tensor([info.max, info.min, 0, 0, 1])
    x = padded(x_cpu, spare)
    for name in ("sum", "prod", "max", "min", "amax", "amin", "any", "all"):
        if dtype is torch.bool and name in ("amax", "amin"):
            continue  # (the CPU refuses them for bool as well; covered by op_db)
        assert_same(getattr(x, name)(), getattr(x_cpu, name)())
    assert_same(x.sum(dtype=torch.float64), x_cpu.sum(dtype=torch.float64))
    if dtype.is_floating_point:
        with_nan = padded(torch.tensor([1.0, float("nan"), 2.0], dtype=dtype), spare)
        assert_same(with_nan.max(), torch.tensor(float("nan"), dtype=dtype))
        neg_zero = padded(torch.tensor([-0.0, -0.0], dtype=dtype), spare)
        assert_same(neg_zero.sum(), torch.tensor([-0.0, -0.0], dtype=dtype).sum())


def test_index_put_checks_bounds_against_the_size_not_the_capacity(eager_mode):
    x_cpu = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    idx_cpu = torch.tensor([0, -1, 4, 4, -5, 2])
    v_cpu = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    x = padded(x_cpu, SPARE_F)  # capacity 12: an index of 5..11 must still be refused
    idx = padded(idx_cpu, torch.tensor([99, -99, 7]))  # spare indices out of any range
    v = padded(v_cpu, SPARE_F)
    for accumulate in (True, False):
        result = x.index_put((idx,), v, accumulate=accumulate)
        expected = x_cpu.index_put((idx_cpu,), v_cpu, accumulate=accumulate)
        if accumulate:
            assert_same(result, expected)
        else:  # duplicate indices: which write wins is unspecified, as on the CPU
            assert_same(result[[1, 3]], expected[[1, 3]])
    assert_same(x.index_put((idx,), torch.tensor(0.5, device="tpu"), accumulate=True),
                x_cpu.index_put((idx_cpu,), torch.tensor(0.5), accumulate=True))
    for bad in (5, 7, -6):
        with raises_by_sync(IndexError, "out of range"):
            x.index_put((padded(torch.tensor([0, bad]), torch.tensor([0, 0])),), v[:2].clone())
    with raises_by_sync(IndexError, "out of range"):
        x.index_put_((padded(torch.tensor([1, 2, 9]), torch.tensor([0])),),
                     padded(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0])), accumulate=True)
    assert_same(x, x_cpu)  # a failing in-place index_put_ leaves its target as it was
    x.index_put_((idx,), v, accumulate=True)
    assert_same(x, x_cpu.index_put((idx_cpu,), v_cpu, accumulate=True))
    with pytest.raises(RuntimeError, match="dtypes match"):
        x.index_put((idx,), v.double())


def test_integer_division_checks_only_the_real_divisors(eager_mode):
    a_cpu, b_cpu = torch.tensor([7, -9, 12]), torch.tensor([2, 4, -5])
    a, b = padded(a_cpu, torch.tensor([1, 1, 1, 1, 1])), padded(b_cpu, torch.zeros(5))
    assert_same(a // b, a_cpu // b_cpu)
    assert_same(torch.remainder(a, b), torch.remainder(a_cpu, b_cpu))
    with raises_by_sync(RuntimeError, "ZeroDivisionError"):
        a // padded(torch.tensor([1, 0, 1]), torch.ones(5))


def test_gradients_through_tensors_with_room_to_spare(eager_mode):
    x_cpu = torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0], requires_grad=True)
    x = padded(x_cpu.detach(), SPARE_F).requires_grad_()
    (x.exp() * 2 + x.cumsum(0)).sum().backward()
    (x_cpu.exp() * 2 + x_cpu.cumsum(0)).sum().backward()
    assert_same(x.grad, x_cpu.grad)
