"""Ops real models reached that had no lowering: each against the CPU."""
import warnings

import pytest
import torch

from conftest import assert_same, counts


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


# --- scaled dot-product attention: one op (torchtpu::attention), its backward one more -----
# (each implementation's numerics: tests/test_attention.py)

def _sdpa_case(q_shape, kv_shape, dtype=torch.float32, mask=None, v_dim=None, **kw):
    v_shape = kv_shape if v_dim is None else (*kv_shape[:-1], v_dim)
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=True) for s in (q_shape, kv_shape, v_shape))
    args = [q, k, v] + ([mask] if mask is not None else [])
    dev = [a.detach().to("tpu").requires_grad_(a.requires_grad) for a in args]
    want = torch.nn.functional.scaled_dot_product_attention(*args, **kw)
    got = torch.nn.functional.scaled_dot_product_attention(*dev, **kw)
    tol = {} if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=2e-2)
    assert_same(got, want, **tol)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad.to("tpu"))
    for d, a in zip(dev, args):
        if a.requires_grad:
            assert_same(d.grad, a.grad, **tol)
    return got


def _fully_masked_row_mask():
    mask = torch.rand(5, 7) > 0.4
    mask[2] = False  # a query that may attend to no key: PyTorch gives it zeros
    return mask


@pytest.mark.parametrize("case", [
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8)),
    dict(q_shape=(2, 4, 6, 8), kv_shape=(2, 4, 6, 8), is_causal=True),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 2, 7, 8), enable_gqa=True),
    dict(q_shape=(4, 5, 8), kv_shape=(4, 7, 8), scale=0.3),
    # (3-d with values of another width: PyTorch's meta kernel of the fused op refuses it)
    dict(q_shape=(4, 5, 8), kv_shape=(4, 7, 8), v_dim=3),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8), mask="bool"),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8), mask="bool", is_causal=True),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8), mask="float"),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8), dtype=torch.bfloat16),
    dict(q_shape=(2, 4, 5, 8), kv_shape=(2, 4, 7, 8), dtype=torch.float64),
], ids=["plain", "causal", "gqa", "3d-scale", "3d-value-width", "bool-mask", "causal-and-mask",
                                                      "float-mask-grad", "bf16", "f64"])
def test_scaled_dot_product_attention_is_one_op_and_matches_cpu(case):
    case = dict(case)
    mask = case.pop("mask", None)
    if mask == "bool":
        case["mask"] = _fully_masked_row_mask()
    elif mask == "float":
        case["mask"] = torch.randn(2, 1, 5, 7, requires_grad=True)  # broadcast over heads
    before = counts("op::torchtpu.attention.default", "op::aten.bmm.default")
    _sdpa_case(**case)
    torch.tpu.synchronize()
    after = counts("op::torchtpu.attention.default", "op::aten.bmm.default")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


def test_scaled_dot_product_attention_without_autograd():
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            got = torch.nn.functional.scaled_dot_product_attention(
                q.to("tpu"), k.to("tpu"), v.to("tpu"), enable_gqa=True)
        assert_same(got, want)


def test_scaled_dot_product_attention_takes_the_math_kernel_where_the_fused_one_does_not_apply():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 4, 5, 8, device="tpu") for _ in range(3))
    fused_op = "op::torchtpu.attention.default"
    before = counts(fused_op)
    with sdpa_kernel([SDPBackend.MATH]):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert_same(got, torch.nn.functional.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu()))
    torch.tpu.synchronize()
    assert counts(fused_op) == before


@pytest.mark.parametrize("bad", ["dtypes", "heads", "mask-dtype", "mask-shape"])
def test_scaled_dot_product_attention_refuses_what_the_cpu_refuses(bad):
    def call(device):
        q, k, v = (torch.randn(2, 4, 5, 8, device=device) for _ in range(3))
        mask, kw = None, {}
        if bad == "mask-shape":
            mask = torch.ones(3, 5, dtype=torch.bool, device=device)
        elif bad == "dtypes":
            k = k.double()
        elif bad == "heads":
            k = torch.randn(2, 3, 5, 8, device=device)
        else:
            mask = torch.ones(5, 5, dtype=torch.int32, device=device)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)

    with pytest.raises(Exception) as cpu_error:
        call("cpu")
    with pytest.raises(type(cpu_error.value)):
        call("tpu")


def test_where_takes_a_uint8_condition_as_the_cpu_does():
    # Deprecated but accepted by the CPU kernel (nonzero is True), with a warning; PyTorch's
    # meta kernel, which the lowering's shapes come from, refuses it.
    c = torch.tensor([[1, 0, 2], [0, 3, 0]], dtype=torch.uint8)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    want = torch.where(c, x, y)
    with pytest.warns(UserWarning, match="uint8 condition"):
        got = torch.where(c.to("tpu"), x.to("tpu"), y.to("tpu"))
    assert_same(got, want)
    out = torch.empty(2, 3, device="tpu")
    with pytest.warns(UserWarning, match="uint8 condition"):
        torch.where(c.to("tpu"), x.to("tpu"), y.to("tpu"), out=out)
    assert_same(out, want)
