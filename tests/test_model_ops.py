"""Ops real models reached that had no lowering: each against the CPU."""
import warnings

import pytest
import torch

from conftest import assert_same


def test_aminmax_private_alias():
    x = torch.randn(3, 4)
    d = x.to("tpu")
    for got, want in [(torch._aminmax(d), torch._aminmax(x)),
                      (torch._aminmax(d, 1, True), torch._aminmax(x, 1, True))]:
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    with pytest.raises(RuntimeError, match="empty dimension"):
        torch._aminmax(torch.empty(0, device="tpu"))


@pytest.mark.parametrize("reduce", ["add", "multiply"])
@pytest.mark.parametrize("src", ["tensor", "value"])
def test_scatter_with_reduce_and_out(reduce, src):
    index = torch.tensor([[0, 1, 0], [0, 0, 1]])
    x = torch.rand(2, 3) + 1
    s = torch.rand(2, 3) + 1 if src == "tensor" else 1.5
    want = torch.scatter(x, 0, index, s, reduce=reduce)
    dev_s = s.to("tpu") if src == "tensor" else s
    assert_same(torch.scatter(x.to("tpu"), 0, index.to("tpu"), dev_s, reduce=reduce), want)
    out = torch.empty(0, device="tpu")
    torch.scatter(x.to("tpu"), 0, index.to("tpu"), dev_s, reduce=reduce, out=out)
    assert_same(out, want)
    y = x.to("tpu")
    y.scatter_(0, index.to("tpu"), dev_s, reduce=reduce)
    assert_same(y, want)
    with pytest.raises(RuntimeError, match="add or multiply"):
        torch.scatter(x.to("tpu"), 0, index.to("tpu"), dev_s, reduce="max")


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_embedding_bag_forward_only(mode):
    weight = torch.randn(10, 3)
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 3, 6])
    want = torch.ops.aten._embedding_bag_forward_only(weight, indices, offsets, False, mode)
    got = torch.ops.aten._embedding_bag_forward_only(weight.to("tpu"), indices.to("tpu"),
                                                     offsets.to("tpu"), False, mode)
    assert_same(got[0], want[0])
    if mode == 2:
        # The rest is scratch for the backward: the CPU leaves offset2bag and bag_size empty or
        # zero in sum mode and gives an empty bag's max index as 0 (CUDA, like us: -1).
        filled = want[2] > 0
        assert_same(got[3][filled], want[3][filled])
    with torch.no_grad():  # F.embedding_bag takes the forward-only path without autograd
        assert_same(torch.nn.functional.embedding_bag(indices.to("tpu"), weight.to("tpu"),
                                                      offsets.to("tpu"), mode=["sum", "mean", "max"][mode]),
                    torch.nn.functional.embedding_bag(indices, weight, offsets,
                                                      mode=["sum", "mean", "max"][mode]))


def test_linalg_eigvals():
    a = torch.tensor([[2.0, -1.0, 0.5], [1.0, 3.0, 0.0], [0.0, 1.0, 1.0]])
    got = torch.linalg.eigvals(a.to("tpu"))
    want = torch.linalg.eigvals(a)
    assert got.dtype == want.dtype
    # No order is promised; sort by (real, imag) to compare.
    key = lambda v: sorted(v.tolist(), key=lambda z: (round(z.real, 4), round(z.imag, 4)))
    torch.testing.assert_close(torch.tensor(key(got.cpu())), torch.tensor(key(want)))
    x = a.to("tpu").requires_grad_()
    torch.linalg.eigvals(x).abs().sum().backward()  # through linalg_eig when grads are needed
    y = a.clone().requires_grad_()
    torch.linalg.eigvals(y).abs().sum().backward()
    assert_same(x.grad, y.grad, rtol=1.3e-6, atol=1e-4)
