"""CPU tensors mixed with tpu tensors where PyTorch (on CUDA) accepts them: index tensors and
boolean masks of advanced indexing, and 0-dim CPU operands (treated like scalars)."""
import pytest
import torch

from conftest import assert_same


def _both(fn, *tensors, grad=False):
    """`fn` on tpu copies and on the CPU; the results and (with `grad`) input gradients agree."""
    cpu = [t.clone().requires_grad_(grad) for t in tensors]
    dev = [t.detach().to("tpu").requires_grad_(grad) for t in tensors]
    want, got = fn(*cpu), fn(*dev)
    assert_same(got, want)
    if grad:
        want.sum().backward()
        got.sum().backward()
        for d, c in zip(dev, cpu):
            assert_same(d.grad, c.grad)


MASK = torch.tensor([True, False, True, False])
IDX = torch.tensor([2, 0, 2])


@pytest.mark.parametrize("index", [MASK, IDX, (IDX, torch.tensor([1, 1, 0])), (slice(None), torch.tensor([0, 2]))],
                         ids=["mask", "idx", "pair", "slice_idx"])
def test_cpu_index_reads(index):
    _both(lambda x: x[index] * 2, torch.randn(4, 3), grad=True)


def test_cpu_mask_and_index_writes():
    def setitem(x, v):
        y = x * 1
        y[MASK] = 1
        y[IDX] = v  # duplicates: one of the written values wins, all equal here
        y[torch.tensor([3])] += v[:1]
        return y

    _both(setitem, torch.randn(4, 3), torch.full((3, 3), 2.0), grad=True)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_with_cpu_indices(accumulate):
    idx = torch.tensor([1, 3, 1])
    _both(lambda x, v: x.index_put((idx,), v, accumulate=accumulate) if accumulate
          else x.index_put((idx[:2],), v[:2]), torch.randn(4, 2), torch.randn(3, 2), grad=True)
    x = torch.zeros(4, 2, device="tpu")
    x.index_put_((idx,), torch.ones(3, 2, device="tpu"), accumulate=True)
    assert_same(x, torch.zeros(4, 2).index_put_((idx,), torch.ones(3, 2), accumulate=True))


def test_cpu_index_out_of_range_raises_and_keeps_input():
    x = torch.arange(4.0, device="tpu")
    with pytest.raises(IndexError):
        x[torch.tensor([4])] = 1.0
        x.cpu()
    assert_same(x, torch.arange(4.0))


@pytest.mark.parametrize("op", ["index_select", "gather"])
def test_cpu_index_refused_where_cuda_refuses(op):
    # CUDA's index_select and gather check that every tensor is on self's device.
    x = torch.randn(3, 3, device="tpu")
    with pytest.raises(RuntimeError, match="same device"):
        if op == "index_select":
            x.index_select(0, torch.tensor([0]))
        else:
            x.gather(0, torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("op", ["copysign", "atan2", "add", "mul", "div", "remainder", "pow",
                                "maximum", "fmin", "hypot", "xlogy", "nextafter", "eq", "lt"])
@pytest.mark.parametrize("first", [True, False], ids=["cpu_first", "cpu_second"])
def test_zero_dim_cpu_operand(op, first):
    f = getattr(torch, op)
    c = torch.tensor(-0.75)
    differentiable = op not in ("eq", "lt", "nextafter")
    _both(lambda x: f(c, x) if first else f(x, c), torch.tensor([[-1.5, 2.0, 0.5]]),
          grad=differentiable and not (op == "xlogy" and first))


def test_zero_dim_cpu_operand_promotion_and_in_place():
    x = torch.tensor([1, -2, 3], device="tpu")
    assert_same(x + torch.tensor(0.5), torch.tensor([1, -2, 3]) + torch.tensor(0.5))
    assert_same(x * torch.tensor(2, dtype=torch.int8), torch.tensor([2, -4, 6]))
    y = torch.tensor([1.0, -2.0], device="tpu")
    y.copysign_(torch.tensor(-1.0))
    assert_same(y, torch.tensor([-1.0, -2.0]))
    with pytest.raises(RuntimeError, match="same device"):
        y + torch.tensor([1.0, 2.0])  # only 0-dim CPU tensors mix


@pytest.mark.parametrize("accumulate", [False, True])
def test_cpu_values_refused_as_on_cuda(accumulate):
    # CUDA moves CPU indices but not CPU values (PyTorch's test_invalid_device).
    x = torch.zeros(5, device="tpu")
    with pytest.raises(RuntimeError, match="same device"):
        x.index_put_((torch.tensor([0, 1]),), torch.tensor([1.0, 2.0]), accumulate=accumulate)
    assert_same(x, torch.zeros(5))
