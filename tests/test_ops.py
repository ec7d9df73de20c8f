"""Ops compared against PyTorch on the CPU: values, dtypes, shapes, strides and gradients."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same

R = lambda *s: torch.randn(*s)
P = lambda *s: torch.rand(*s) + 0.5
I = lambda hi, *s: torch.randint(0, hi, s)

torch.manual_seed(0)  # the inputs below are drawn once, at import; the same ones on every run

# name -> (fn, inputs, differentiable)
CASES = {
    "add_scalar": (lambda x: x + 2.5, [R(3, 4)], True),
    "add_alpha": (lambda x, y: torch.add(x, y, alpha=0.5), [R(3, 4), R(4)], True),
    "sub_rsub": (lambda x, y: 1 - x - y, [R(3, 4), R(3, 1)], True),
    "mul_div": (lambda x, y: x * y / (y.abs() + 1), [R(2, 3), R(2, 3)], True),
    "int_promote": (lambda x: x * 2.5, [I(10, 4)], False),
    "int_div": (lambda x, y: x / (y + 1), [I(10, 4), I(5, 4)], False),
    "floor_div": (lambda x, y: torch.div(x, y + 1, rounding_mode="floor"), [I(10, 6) - 5, I(3, 6)], False),
    "trunc_div": (lambda x, y: torch.div(x, y + 1, rounding_mode="trunc"), [I(10, 6) - 5, I(3, 6)], False),
    "remainder": (lambda x: x % 3, [I(10, 6) - 5], False),
    "pow": (lambda x: x ** 2 + x.abs() ** 0.5, [R(3, 3)], True),
    "bf16": (lambda x: (x * 3).exp(), [R(4, 4).bfloat16()], False),
    "unary": (lambda x: torch.sin(x) + torch.tanh(x) + torch.sigmoid(x) + torch.exp(x) + torch.log(x) + torch.sqrt(x) + torch.rsqrt(x), [P(3, 4)], True),
    "erf_floor": (lambda x: torch.erf(x) + torch.floor(x) + torch.ceil(x) + torch.round(x), [R(5)], False),
    "compare": (lambda x, y: torch.stack([x < y, x >= y, x == x, x != y]), [R(3, 4), R(3, 4)], False),
    "where": (lambda c, x: torch.where(c > 0, x, 0.0), [R(3, 4), R(3, 4)], True),
    "clamp": (lambda x: x.clamp(-0.5, 0.5) + x.clamp(min=0.1), [R(10)], True),
    "masked_fill": (lambda x: x.masked_fill(x > 0, -1.0), [R(4, 4)], True),
    "sum_mean": (lambda x: x.sum(1) + x.mean(1, keepdim=True).squeeze(1), [R(3, 5)], True),
    "sum_int": (lambda x: x.sum(), [I(5, 10)], False),
    "var_std": (lambda x: x.var(0) + x.std(1).sum(), [R(4, 5)], True),
    "max_min": (lambda x: x.max(1).values + x.min(1)[0] + x.amax(0).sum(), [R(4, 5)], True),
    "argmax": (lambda x: x.argmax(1) + x.argmin(), [R(4, 5)], False),
    "logsumexp": (lambda x: x.logsumexp(-1), [R(3, 6)], True),
    "cumsum": (lambda x: x.cumsum(1), [R(3, 6)], True),
    "norm": (lambda x: torch.linalg.vector_norm(x, dim=1), [R(3, 6)], True),
    "mm": (lambda a, b: a @ b, [R(5, 6), R(6, 7)], True),
    "bmm": (lambda a, b: torch.bmm(a, b), [R(2, 3, 4), R(2, 4, 5)], True),
    "matmul_bcast": (lambda a, b: torch.matmul(a, b), [R(2, 3, 4), R(4)], True),
    "linear": (lambda x, w, b: F.linear(x, w, b), [R(2, 3, 4), R(5, 4), R(5)], True),
    "addmm_t": (lambda b, x, w: torch.addmm(b, x, w.t(), beta=0.5, alpha=2), [R(3), R(2, 4), R(3, 4)], True),
    "cat_stack": (lambda a, b: torch.cat([a, b], 1) + torch.stack([a, b], 1).sum(1).repeat(1, 2), [R(2, 3), R(2, 3)], True),
    "softmax": (lambda x: F.softmax(x, -1) + F.log_softmax(x, 0), [R(3, 5)], True),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (5,), w, b), [R(2, 3, 5), R(5), R(5)], True),
    "activations": (lambda x: F.gelu(x) + F.relu(x) + F.silu(x) + F.gelu(x, approximate="tanh") + F.leaky_relu(x), [R(4, 4)], True),
    "cross_entropy": (lambda x, y: F.cross_entropy(x, y), [R(6, 5), I(5, 6)], True),
    "cross_entropy_ignore": (lambda x, y: F.cross_entropy(x, y, ignore_index=2, reduction="sum"), [R(6, 5), I(5, 6)], True),
    "nll_3d": (lambda x, y: F.nll_loss(F.log_softmax(x, 1), y), [R(2, 4, 3), I(4, 2, 3)], True),
    "mse": (lambda x, y: F.mse_loss(x, y), [R(3, 4), R(3, 4)], True),
    "embedding": (lambda w, i: F.embedding(i, w), [R(10, 4), I(10, 3, 5)], True),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [R(2, 2, 5, 4), R(2, 2, 5, 4), R(2, 2, 5, 4)], True),
    "sdpa_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0), [R(1, 2, 4, 8), R(1, 2, 6, 8), R(1, 2, 6, 8), R(4, 6)], True),
    "index_select": (lambda x, i: x.index_select(1, i), [R(3, 5), I(5, 4)], True),
    "gather": (lambda x, i: x.gather(1, i), [R(3, 5), I(5, 3, 2)], True),
    "scatter": (lambda x, i, s: x.scatter(1, i, s), [R(3, 5), torch.tensor([[0, 1], [2, 3], [4, 0]]), R(3, 2)], True),
    "scatter_add": (lambda x, i, s: x.scatter_add(0, i, s), [R(3, 5), I(3, 2, 5), R(2, 5)], True),
    "index_tensor": (lambda x, i: x[i, 1:], [R(5, 4), I(5, 3)], True),
    "index_put_acc": (lambda x, i, v: x.index_put((i,), v, accumulate=True), [R(5, 4), torch.tensor([0, 2, 0]), R(3, 4)], True),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), [R(5, 3), torch.tensor([1, 1, 4]), R(3, 3)], True),
    "tril_flip": (lambda x: x.tril() + x.triu(1).flip(0) + x.roll(1, 1), [R(4, 4)], True),
    "pad": (lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), [R(2, 3)], True),
    "sort_topk": (lambda x: x.sort(1).values + x.topk(5, 1).values, [R(3, 5)], True),
    "expand_contig": (lambda x: x.unsqueeze(0).expand(3, -1, -1).contiguous() * 2, [R(2, 3)], True),
    "transpose_arith": (lambda x: x.t() * 2 + 1, [R(3, 5)], True),
    "permute_sum": (lambda x: x.permute(2, 0, 1).sum(0), [R(2, 3, 4)], True),
    "reshape_noncontig": (lambda x: x.t().reshape(-1), [R(3, 4)], True),
    "arange_full": (lambda x: x + torch.arange(4, device=x.device) + torch.full((4,), 2.0, device=x.device), [R(3, 4)], True),
    "zeros_ones_like": (lambda x: torch.zeros_like(x) + torch.ones_like(x) * x, [R(3, 4)], True),
    "logical": (lambda x, y: (x > 0) & (y > 0) | ~(x > y), [R(3, 4), R(3, 4)], False),
    "isfinite_nan": (lambda x: torch.nan_to_num(x.log()) + x.isnan().float(), [R(6)], False),
    "to_dtype": (lambda x: x.to(torch.bfloat16).float() + x.half().float(), [R(3, 4)], True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward_match_cpu(name):
    fn, inputs, differentiable = CASES[name]
    cpu_in = [t.clone().requires_grad_(differentiable and t.is_floating_point()) for t in inputs]
    tpu_in = [t.detach().to("tpu").requires_grad_(t.requires_grad) for t in cpu_in]
    out_cpu, out_tpu = fn(*cpu_in), fn(*tpu_in)
    tol = dict(rtol=1.6e-2, atol=1e-2) if out_cpu.dtype in (torch.bfloat16, torch.float16) else dict(rtol=2e-5, atol=2e-5)
    assert_same(out_tpu, out_cpu, **tol)
    if differentiable and out_cpu.is_floating_point():
        g = torch.randn(out_cpu.shape)
        out_cpu.backward(g)
        out_tpu.backward(g.to("tpu"))
        for a, b in zip(tpu_in, cpu_in):
            if b.grad is not None:
                assert a.grad is not None and a.grad.device.type == "tpu"
                torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)


def test_inplace_variants_and_out():
    a = torch.randn(3, 4)
    t = a.to("tpu")
    for op in ["add_", "mul_", "sub_", "div_"]:
        getattr(t, op)(1.5)
        getattr(a, op)(1.5)
    t.exp_().clamp_(max=3.0)
    a.exp_().clamp_(max=3.0)
    assert torch.allclose(t.cpu(), a)
    out = torch.empty(3, 4, device="tpu")
    torch.mul(t, 2, out=out)
    assert torch.allclose(out.cpu(), a * 2)


@pytest.mark.parametrize("op", [torch.add, torch.sub, torch.mul, torch.div, torch.eq])
def test_out_of_wider_dtype_gets_the_promoted_result_rounded(op):
    # Inputs promote (registry.Promote) to out's float32, and the result is rounded to the
    # functional's bfloat16 (bool for eq) before out stores it, exactly as on the CPU.
    a, b = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    b[:8] = a[:8]
    ref = op(a, b, out=torch.empty(64))
    got = op(a.to("tpu"), b.to("tpu"), out=torch.empty(64, device="tpu"))
    assert_same(got, ref, 0, 0)


def test_foreach_ops():
    xs = [torch.randn(3), torch.randn(2, 2)]
    ts = [x.to("tpu") for x in xs]
    torch._foreach_add_(ts, 1.0)
    torch._foreach_mul_(ts, [2.0, 3.0])
    torch._foreach_addcdiv_(ts, ts, [t.abs() + 1 for t in ts], 0.5)
    torch._foreach_add_(xs, 1.0)
    torch._foreach_mul_(xs, [2.0, 3.0])
    torch._foreach_addcdiv_(xs, xs, [x.abs() + 1 for x in xs], 0.5)
    for op in (torch._foreach_mul_, torch._foreach_div_):  # by a tensor (Adam's tensor lr)
        op(ts, torch.tensor(0.25, device="tpu"))
        op(xs, torch.tensor(0.25))
    for t, x in zip(ts, xs):
        torch.testing.assert_close(t.cpu(), x)
    norms = torch._foreach_norm(ts)
    torch.testing.assert_close(torch.stack(norms).cpu(), torch.stack(torch._foreach_norm(xs)))


def test_foreach_pow_of_a_number_is_one_op_promoting_each_exponent():
    # AdamW's capturable bias corrections: pow(beta, step) for every parameter, one op (the
    # CPU's kernel loops over pow(Scalar, Tensor)); each element promoted on its own.
    import torchtpu
    cases = [(0.999, [torch.tensor([3.0], dtype=torch.bfloat16), torch.tensor(1.0)]),
             (1.5, [torch.arange(0, 5), torch.tensor([3, 4], dtype=torch.int32)]),
             (2, [torch.arange(0, 5), torch.tensor([True, False])]), (2j, [torch.tensor([0.5, -1.0])])]
    for s, xs in cases:
        before = torchtpu.metrics().get("op::aten._foreach_pow.ScalarAndTensor", 0)
        got = torch._foreach_pow(s, [x.to("tpu") for x in xs])
        for g, r in zip(got, torch._foreach_pow(s, xs)):
            assert_same(g, r)
        assert torchtpu.metrics()["op::aten._foreach_pow.ScalarAndTensor"] == before + 1


def test_foreach_over_many_tensors_sharing_storages():
    # A foreach op over hundreds of tensors, many of them views of one storage and one of them
    # listed twice: each storage is found among the call's (op_keys.Buffers) in one lookup,
    # and the shared ones must still resolve to the same input.
    base, other_base = torch.randn(400), torch.randn(400)
    xs = [torch.randn(3) for _ in range(300)] + list(base.view(100, 4).unbind(0))
    others = [torch.randn(3) for _ in range(300)] + list(other_base.view(100, 4).unbind(0))
    others[7] = others[5]
    tbase, tother_base = base.to("tpu"), other_base.to("tpu")
    ts = [x.to("tpu") for x in xs[:300]] + list(tbase.view(100, 4).unbind(0))
    tothers = [o.to("tpu") for o in others[:300]] + list(tother_base.view(100, 4).unbind(0))
    tothers[7] = tothers[5]
    torch._foreach_add_(ts, tothers, alpha=0.5)
    products = torch._foreach_mul(ts, tothers)
    torch._foreach_add_(xs, others, alpha=0.5)
    ref = torch._foreach_mul(xs, others)
    for t, x in zip(ts + list(products), xs + list(ref)):
        torch.testing.assert_close(t.cpu(), x)
    torch.testing.assert_close(tbase.cpu(), base)


def test_executables_are_cached():
    import torchtpu
    x = torch.randn(8, 8, device="tpu")
    (x * 2.0 + 1).sum()
    before = torchtpu.metrics()["compiles"]
    for s in (0.5, 1.5, 2.5):  # new scalar values reuse the executable
        (x * s + 1).sum()
    assert torchtpu.metrics()["compiles"] == before


@pytest.mark.parametrize("cls, shape", [(torch.nn.BatchNorm2d, (5, 3, 4, 6)), (torch.nn.BatchNorm1d, (5, 3, 4))])
def test_batch_norm_train_updates_running_stats_and_eval_uses_them(cls, shape):
    import copy
    bn = cls(3, momentum=0.3)
    tpu_bn = copy.deepcopy(bn).to("tpu")
    x = torch.randn(*shape, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    for _ in range(2):
        y, yt = bn(x), tpu_bn(xt)
    (y * y).sum().backward()
    (yt * yt).sum().backward()
    torch.testing.assert_close(yt.detach().cpu(), y.detach(), rtol=1e-5, atol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(tpu_bn, name).cpu(), getattr(bn, name))
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tpu_bn.weight.grad.cpu(), bn.weight.grad, rtol=1e-4, atol=1e-5)
    bn.eval()
    tpu_bn.eval()
    x2 = torch.randn(*shape)
    torch.testing.assert_close(tpu_bn(x2.to("tpu")).detach().cpu(), bn(x2).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_matches_cpu_for_the_same_random_samples(nd):
    # The op is random only through `random_samples`; given the same ones, the windows, the
    # maxima, their indices and the gradient must be PyTorch's exactly.
    op = torch.ops.aten.fractional_max_pool2d if nd == 2 else torch.ops.aten.fractional_max_pool3d
    x = torch.randn(2, 3, *([9] * nd), requires_grad=True)
    u = torch.rand(2, 3, nd)
    kernel, out = [2] * nd, [4] * nd
    values, indices = op(x, kernel, out, u)
    xt = x.detach().to("tpu").requires_grad_()
    tvalues, tindices = op(xt, kernel, out, u.to("tpu"))
    assert torch.equal(tvalues.cpu(), values.detach()) and torch.equal(tindices.cpu(), indices)
    g = torch.randn_like(values)
    values.backward(g)
    tvalues.backward(g.to("tpu"))
    assert torch.equal(xt.grad.cpu(), x.grad)


def test_rrelu_eval_matches_cpu_and_training_draws_slopes_for_non_positive_inputs():
    x = torch.randn(64)
    assert_same(F.rrelu(x.to("tpu"), 0.1, 0.3, training=False), F.rrelu(x, 0.1, 0.3, training=False))
    xt = x.to("tpu").requires_grad_()
    noise = torch.empty(64, device="tpu")
    out = torch.ops.aten.rrelu_with_noise(xt, noise, 0.1, 0.3, True)
    n, xc = noise.cpu(), x
    assert torch.all(n[xc > 0] == 1) and torch.all((n[xc <= 0] >= 0.1) & (n[xc <= 0] <= 0.3))
    torch.testing.assert_close(out.detach().cpu(), xc * n)
    out.sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), n)


# --- half precision and uint8 as PyTorch's CPU kernels compute them ---------------------------
def _tpu(*ts):
    return [t.to("tpu") if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_norms_match_cpu_values_and_statistics_dtypes(dtype):
    aten = torch.ops.aten
    x = (torch.randn(4, 6, 5) * 3).to(dtype)
    w, b = torch.randn(5).to(dtype), torch.randn(5).to(dtype)
    # Layer norm: statistics in the input's dtype (float32 with float32 parameters); a single
    # element normalised shows the CPU kernel's fused multiply-add.
    for args in ((x, [5], w, b), (x, [5], w.float(), b.float()), (x[..., :1], [1], w[:1], None)):
        assert_same(aten.native_layer_norm(*_tpu(*args), 1e-5),
                      aten.native_layer_norm(*args, 1e-5))
    gw = torch.randn(6).to(dtype)
    assert_same(aten.native_group_norm(*_tpu(x, gw, None), 4, 6, 5, 3, 1e-5),
                  aten.native_group_norm(x, gw, None, 4, 6, 5, 3, 1e-5))
    # Batch norm: the statistics rounded as the CPU kernel rounds them, the running ones too.
    for p, training in ((dtype, True), (torch.float32, True), (dtype, False)):
        c = [torch.randn(6).to(p), torch.randn(6).to(p), torch.randn(6).to(p), torch.rand(6).to(p)]
        t = _tpu(*c)
        cpu = aten.native_batch_norm(x, *c, training, -1.2, 0.5)
        assert_same(aten.native_batch_norm(x.to("tpu"), *t, training, -1.2, 0.5), cpu)
        assert_same(t[2:], c[2:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_convolutions_pooling_and_activations_match_cpu(dtype):
    x = torch.randn(2, 4, 5, 6).to(dtype)
    w, b = torch.randn(4, 3, 3, 3).to(dtype), torch.randn(3).to(dtype)
    # Accumulated in float32, or (float16; output_padding >= stride) as PyTorch's im2col
    # kernel: each kernel tap rounded, the taps summed in half precision.
    for kw in ({"stride": 2, "padding": 1},
               {"stride": (3, 2), "output_padding": (2, 3), "dilation": 4}):
        assert_same(F.conv_transpose2d(*_tpu(x, w, b), **kw), F.conv_transpose2d(x, w, b, **kw))
    v = torch.randn(2, 3, 8, 8, 6).to(dtype)  # windows summed in half precision
    assert_same(F.adaptive_avg_pool3d(v.to("tpu"), (5, 7, 4)),
                  F.adaptive_avg_pool3d(v, (5, 7, 4)))
    assert_same(F.gelu(x.to("tpu")), F.gelu(x))
    y, g = torch.softmax(torch.randn(5, 7), -1).to(dtype), torch.randn(5, 7).to(dtype)
    assert_same(torch.ops.aten._softmax_backward_data(*_tpu(g, y), -1, dtype),
                  torch.ops.aten._softmax_backward_data(g, y, -1, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_interpolation_and_grid_sampling_match_cpu(dtype):
    for mode, shape in (("linear", (2, 3, 5)), ("bicubic", (2, 3, 4, 7)),
                        ("trilinear", (2, 3, 3, 4, 5))):
        x = (torch.randn(shape) * 3).to(dtype)
        for factor, corners in ((1.7, False), (0.6, True)):
            kw = {"mode": mode, "scale_factor": factor, "align_corners": corners}
            assert_same(F.interpolate(x.to("tpu"), **kw), F.interpolate(x, **kw))
    # The CPU kernels compute grid sampling in half precision, rounding every operation.
    for nd in (2, 3):
        x = (torch.randn(2, 3, *([5, 7] if nd == 2 else [3, 4, 5])) * 3).to(dtype)
        grid = (torch.rand(2, *([4, 6] if nd == 2 else [2, 3, 4]), nd) * 3 - 1.5).to(dtype)
        for mode in ("bilinear", "nearest", "bicubic")[:5 - nd]:
            for padding in ("zeros", "border", "reflection"):
                kw = {"mode": mode, "padding_mode": padding, "align_corners": nd == 2}
                assert_same(F.grid_sample(*_tpu(x, grid), **kw), F.grid_sample(x, grid, **kw))


def test_uint8_bilinear_resizing_is_exactly_pytorchs_integer_kernel():
    x = torch.randint(0, 256, (2, 3, 13, 9), dtype=torch.uint8)
    for antialias in (False, True):
        for kw in ({"scale_factor": 0.4}, {"size": (20, 5), "align_corners": True},
                   {"size": (13, 17)}):
            kw.update(mode="bilinear", antialias=antialias)
            assert torch.equal(F.interpolate(x.to("tpu"), **kw).cpu(), F.interpolate(x, **kw))


def test_integer_power_wraps_and_scalar_bases_stay_float():
    """Integer pow uses every exponent bit and wraps as the CPU's does; an integer base with a
    float exponent is a float power."""
    e = torch.tensor([10, 63, 64, 100, -1, 0])
    for base in (2, 3, -1):
        assert torch.equal((base ** e.to("tpu")).cpu(), base ** e)
    x = torch.tensor([0.5, 1.5, -2.25])
    torch.testing.assert_close((2 ** x.to("tpu")).cpu(), 2 ** x)
