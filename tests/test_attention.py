"""F.scaled_dot_product_attention's implementations on tpu (torchtpu::attention): each against
the CPU's SDPA, values and gradients, with PyTorch's own tolerances (test_transformers.py's
fused-vs-math CPU test); the choice of implementation, its metrics and its override."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same, counts
from torchtpu._lowerings import accelerated_attention, attention, blockwise_attention

# (atol, rtol) of values and of gradients, per dtype
TOLERANCES = {torch.float32: ((1e-5, 5e-6), (1.25e-5, 5.25e-6)),
              torch.bfloat16: ((5e-2, 5e-2), (5e-2, 5e-2)),
              torch.float16: ((1e-2, 1e-2), (1e-1, 1e-1)),
              torch.float64: ((1e-7, 1e-7), (1e-7, 1e-7))}


@pytest.fixture
def implementation(request, monkeypatch):
    monkeypatch.setattr(torch.tpu, "attention_implementation", request.param)
    return request.param


def _mask(kind, q_shape, lk, dtype):
    lq = q_shape[-2]
    if kind == "bool":
        mask = torch.rand(lq, lk) > 0.4
        mask[2] = False  # a query that may attend to no key: PyTorch gives it zeros
        return mask
    if kind == "float":  # broadcast over the heads, with a gradient
        return torch.randn(q_shape[0], 1, lq, lk, dtype=dtype, requires_grad=True)
    return None


def _compare(q_shape, kv_shape, dtype=torch.float32, mask=None, v_dim=None, **kw):
    """SDPA forward and backward on tpu equal the CPU's."""
    v_shape = kv_shape if v_dim is None else (*kv_shape[:-1], v_dim)
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=True)
               for s in (q_shape, kv_shape, v_shape))
    m = _mask(mask, q_shape, kv_shape[-2], dtype)
    args = [q, k, v] + ([m] if m is not None else [])
    dev = [a.detach().to("tpu").requires_grad_(a.requires_grad) for a in args]
    (atol, rtol), (gatol, grtol) = TOLERANCES[dtype]
    want = F.scaled_dot_product_attention(*args, **kw)
    got = F.scaled_dot_product_attention(*dev, **kw)
    assert_same(got, want, atol=atol, rtol=rtol)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad.to("tpu"))
    for d, a in zip(dev, args):
        if a.requires_grad:
            assert_same(d.grad, a.grad, atol=gatol, rtol=grtol)


CASES = {
    "causal-gqa-scale": dict(q_shape=(1, 4, 6, 64), kv_shape=(1, 2, 9, 64), is_causal=True,
                             enable_gqa=True, scale=0.3),
    "causal-longer-queries": dict(q_shape=(1, 2, 9, 64), kv_shape=(1, 2, 6, 64), is_causal=True),
    "3d-value-width": dict(q_shape=(4, 5, 64), kv_shape=(4, 7, 64), v_dim=16),
    "bool-mask-and-causal": dict(q_shape=(2, 2, 5, 64), kv_shape=(2, 2, 7, 64), mask="bool",
                                 is_causal=True),
    "float-mask-grad": dict(q_shape=(2, 4, 5, 64), kv_shape=(2, 4, 7, 64), mask="float"),
    "d256-bf16": dict(q_shape=(1, 2, 5, 256), kv_shape=(1, 2, 7, 256), dtype=torch.bfloat16,
                      is_causal=True),
    "d128-fp16-float-mask": dict(q_shape=(1, 2, 5, 128), kv_shape=(1, 2, 7, 128),
                                 dtype=torch.float16, mask="float"),
    "f64": dict(q_shape=(1, 2, 5, 8), kv_shape=(1, 2, 7, 8), dtype=torch.float64),
}


# (the dense "xla" program is what small calls get: tests/test_model_ops.py covers it in every
# eager mode; here its half-precision cases)
@pytest.mark.parametrize("implementation,case",
                         [("blockwise", case) for case in CASES] +
                         [("xla", "d256-bf16"), ("xla", "d128-fp16-float-mask")],
                         indirect=["implementation"])
def test_attention_matches_the_cpu(implementation, case):
    before = counts(f"attention::{implementation}")[0]
    _compare(**CASES[case])
    assert counts(f"attention::{implementation}")[0] == before + 1


# --- the blockwise algorithm against the dense one, in small blocks ----------------------

def _jax_case(rng, n, hk, g, lq, lk, d, dv, dtype=jnp.float32, bias=None):
    q = jnp.asarray(rng.standard_normal((n, hk, g, lq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((n, hk, lk, d)), dtype)
    v = jnp.asarray(rng.standard_normal((n, hk, lk, dv)), dtype)
    if bias == "bool":
        b = rng.random((1, 1, 1, lq, lk)) > 0.3
        b[..., 3, :] = False  # an empty row
        bias = jnp.asarray(b)
    elif bias == "float":  # per batch element and head group, broadcast over queries
        bias = jnp.asarray(rng.standard_normal((n, hk, 1, 1, lk)), jnp.float32)
    return q, k, v, bias


def _dense(q, k, v, bias, is_causal, scale, dropout=None):
    """attention._attention in the grouped layout."""
    n, hk, g, lq, d = q.shape
    lk = k.shape[2]
    b = None if bias is None else jnp.broadcast_to(bias, (n, hk, g, lq, lk)).reshape(
        n, hk * g, lq, lk)
    out, lse = attention._attention(q.reshape(n, hk * g, lq, d), k, v, b, is_causal, scale,
                                    dropout)
    return out.reshape(n, hk, g, lq, -1), lse.reshape(n, hk, g, lq)


@pytest.mark.parametrize("shape,causal,bias", [
    ((2, 2, 2, 37, 53, 16, 8), False, None),
    ((1, 2, 1, 37, 53, 16, 16), True, None),
    ((1, 2, 1, 53, 37, 16, 16), True, "bool"),
    ((2, 2, 3, 40, 40, 16, 16), False, "float"),
])
def test_blockwise_equals_the_dense_program_in_small_blocks(shape, causal, bias):
    # Several blocks each way, lengths that are not multiples of them (padding), causal block
    # skipping with more keys than queries and the reverse, rows with no key, a broadcast bias
    # and its gradient, grouped heads.
    rng = np.random.default_rng(0)
    q, k, v, b = _jax_case(rng, *shape, bias=bias)
    blocks = (16, 8)
    out, lse = jax.jit(lambda *a: blockwise_attention.forward(*a, None, 0.0, causal, 0.25,
                                                              blocks))(q, k, v, b)
    want, want_lse = jax.jit(lambda *a: _dense(*a, causal, 0.25))(q, k, v, b)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    grad = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    bias_grad = b is not None and b.dtype != jnp.bool_
    got = jax.jit(lambda *a: blockwise_attention.backward(
        *a, None, 0.0, causal, 0.25, out, lse, bias_grad, blocks))(grad, q, k, v, b)

    @jax.jit
    def dense_grads(q, k, v, b):
        if bias_grad:
            return jax.vjp(lambda *a: _dense(*a, causal, 0.25)[0], q, k, v, b)[1](grad)
        return jax.vjp(lambda *a: _dense(*a, b, causal, 0.25)[0], q, k, v)[1](grad)

    for g_, w in zip(got, dense_grads(q, k, v, b)):
        np.testing.assert_allclose(g_, w, atol=2e-5, rtol=2e-5)


def test_blockwise_dropout_draws_the_dense_programs_mask():
    # Which weights drop depends on their position only: any blocking, and the dense program,
    # drop the same ones.
    rng = np.random.default_rng(1)
    q, k, v, _ = _jax_case(rng, 1, 2, 2, 21, 19, 8, 8)
    key = jax.random.key(3)
    out, lse = jax.jit(lambda *a: blockwise_attention.forward(*a, None, key, 0.3, True, 0.5,
                                                              (8, 8)))(q, k, v)
    want, _ = jax.jit(lambda *a: _dense(*a, None, True, 0.5, (key, 0.3)))(q, k, v)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    grad = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    got = jax.jit(lambda *a: blockwise_attention.backward(
        grad, *a, None, key, 0.3, True, 0.5, out, lse, False, (16, 8)))(q, k, v)
    want = jax.jit(lambda *a: jax.vjp(
        lambda *a: _dense(*a, None, True, 0.5, (key, 0.3))[0], *a)[1](grad))(q, k, v)
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_, w, atol=2e-5, rtol=2e-5)
    keep = jax.jit(lambda key: blockwise_attention.dropout_keep(
        key, 0.3, (4, 50, 60), (0, 0, 0), (4, 50, 60)))(key)
    assert 0.65 < float(keep.mean()) < 0.75


# --- dropout on tpu: the mask read back, then the CPU's math with it -----------------------

@pytest.mark.parametrize("implementation", ["xla", "blockwise"], indirect=True)
def test_attention_dropout_matches_the_cpu_given_its_mask(implementation):
    p, lq, lk = 0.3, 6, 9
    q, k = torch.randn(1, 2, lq, 8), torch.randn(1, 2, lk, 8)
    eye = torch.eye(lk).expand(1, 2, lk, lk)
    torch.manual_seed(5)
    # values = I: the output is the dropped-out attention weights themselves
    weights = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), eye.to("tpu"),
                                             dropout_p=p, is_causal=True).cpu()
    keep = weights != 0
    assert 0 < keep.sum() < torch.ones(lq, lk).tril().sum() * 2
    v = torch.randn(1, 2, lk, lk)  # (as wide as the identity: the same forward program)
    args = [x.clone().requires_grad_() for x in (q, k, v)]
    dev = [x.detach().to("tpu").requires_grad_() for x in args]
    torch.manual_seed(5)
    got = F.scaled_dot_product_attention(*dev, dropout_p=p, is_causal=True)
    causal = torch.ones(lq, lk, dtype=torch.bool).tril()
    scores = (args[0] @ args[1].mT / 8 ** 0.5).masked_fill(~causal, float("-inf"))
    want = (scores.softmax(-1) * keep / (1 - p)) @ args[2]
    assert_same(got, want, atol=1e-5, rtol=5e-6)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad.to("tpu"))
    for d, a in zip(dev, args):
        assert_same(d.grad, a.grad, atol=1.25e-5, rtol=5.25e-6)


# --- the Pallas TPU kernel, in Pallas' interpret mode on the CPU ---------------------------

PALLAS_CASES = {
    "causal-gqa": dict(q_shape=(1, 4, 128, 64), kv_shape=(1, 2, 128, 64), is_causal=True,
                       enable_gqa=True),
    "float-mask-scale-longer-keys": dict(q_shape=(1, 2, 128, 64), kv_shape=(1, 2, 256, 64),
                                         mask="float", scale=0.2),
    "bf16-causal-d128": dict(q_shape=(1, 2, 128, 128), kv_shape=(1, 2, 128, 128),
                             dtype=torch.bfloat16, is_causal=True),
}


@pytest.mark.parametrize("implementation", ["pallas_flash"], indirect=True)
@pytest.mark.parametrize("case", list(PALLAS_CASES))
def test_pallas_flash_attention_matches_the_cpu(implementation, case):
    before = counts("attention::pallas_flash")[0]
    _compare(**PALLAS_CASES[case])
    assert counts("attention::pallas_flash")[0] == before + 1


# --- cuDNN's layouts, run by jax's XLA implementation on the CPU -------------------------

def test_cudnn_path_layouts_with_jax_xla_standing_in(monkeypatch):
    # No GPU here: the cuDNN path's layouts (PyTorch's BHLD to jax's BLHD and back, grouped
    # heads, the bias, the backward's vjp) run with jax's own "xla" implementation instead.
    monkeypatch.setattr(accelerated_attention, "CUDNN_BACKEND", "xla")
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 4, 6, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 6, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, 6, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 4, 6, 6)), jnp.float32)
    grad = jnp.asarray(rng.standard_normal((2, 4, 6, 16)), jnp.float32)
    def run(name, q, k, v, bias, grad):  # (one program: eager jax ops compile one by one)
        out, lse = attention.attention_forward(q, k, v, bias, None, 0.0, True, 0.3, name)
        grads = attention.attention_backward(grad, q, k, v, bias, None, out, lse, 0.0, True,
                                             0.3, name, True)
        return (out, *grads)

    results = {name: jax.jit(run, static_argnums=0)(name, q, k, v, bias, grad)
               for name in ("cudnn", "xla")}
    for got, want in zip(results["cudnn"], results["xla"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# --- the choice: by platform and call, counted, overridable -----------------------------

def _choose(platform, q=(1, 8, 1024, 64), k=None, dtype="float32", mask=None, dropout=0.0,
            causal=True):
    k = k or q
    return attention.choose(platform, q, k, k, dtype, mask, dropout, causal)


def test_attention_implementation_choice_by_platform():
    assert _choose("tpu") == "pallas_flash"
    # (short sequences: the dense program, whose roofline on v5e is below the loops' to 384)
    assert _choose("tpu", q=(8, 4, 128, 64)) == "xla"
    assert _choose("tpu", q=(8, 4, 384, 64), mask="bool", dropout=0.1) == "xla"
    assert _choose("tpu", q=(8, 4, 512, 64)) == "pallas_flash"
    # (longer ones the Pallas kernel cannot take: the loops)
    assert _choose("tpu", mask="bool") == "blockwise"  # (a row with no key: PyTorch's zeros)
    assert _choose("tpu", q=(1, 8, 1000, 64)) == "blockwise"  # (not a multiple of 128)
    assert _choose("tpu", q=(8, 32, 8192, 64), mask="bool") == "blockwise"  # (8 GiB of scores)
    assert _choose("tpu", dropout=0.1) == "blockwise"
    assert _choose("gpu", dtype="bfloat16") == "cudnn"
    assert _choose("gpu") == "xla"  # (cuDNN's fused attention: half precision only)
    assert _choose("gpu", dtype="float16", q=(1, 8, 5, 64), k=(1, 8, 9, 64)) == "xla"  # causal
    assert _choose("gpu", dtype="float16", causal=False, q=(1, 8, 5, 64),
                   k=(1, 8, 9, 64)) == "cudnn"
    assert _choose("cpu", q=(1, 8, 64, 64)) == "xla"
    assert _choose("cpu") == "blockwise"
    assert attention.unsupported("cudnn", "cpu", (1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8),
                                 "float16", None, 0.0, False) == "cuDNN needs a CUDA GPU"
    assert "no attention implementation" in attention.unsupported(
        "flash", "cpu", (1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 8, 8), "float16", None, 0.0, False)


def test_attention_implementation_is_counted_and_overridable(monkeypatch):
    q = torch.randn(1, 2, 8, 16, device="tpu")
    small = counts("attention::xla", "attention::blockwise")
    F.scaled_dot_product_attention(q, q, q)
    assert counts("attention::xla", "attention::blockwise") == (small[0] + 1, small[1])
    monkeypatch.setenv("TORCHTPU_ATTENTION", "blockwise")
    F.scaled_dot_product_attention(q, q, q)
    assert counts("attention::blockwise")[0] == small[1] + 1
    monkeypatch.setattr(torch.tpu, "attention_implementation", "cudnn")  # (over the env var)
    with pytest.raises(RuntimeError, match="'cudnn'.*cuDNN needs a CUDA GPU"):
        F.scaled_dot_product_attention(q, q, q)
    monkeypatch.setattr(torch.tpu, "attention_implementation", "pallas_flash")
    with pytest.raises(RuntimeError, match="'pallas_flash'.*dropout"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    monkeypatch.setattr(torch.tpu, "attention_implementation", "auto")
    monkeypatch.delenv("TORCHTPU_ATTENTION")
    F.scaled_dot_product_attention(q, q, q)
    assert counts("attention::xla")[0] == small[0] + 2


def test_attention_in_a_compiled_step_matches_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.tpu, "attention_implementation", "blockwise")

    def step(q, k, v, mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.square().sum().backward()
        return out

    q, k, v = (torch.randn(2, 4, 12, 16, requires_grad=True) for _ in range(3))
    mask = torch.randn(12, 12, requires_grad=True)
    dev = [x.detach().to("tpu").requires_grad_() for x in (q, k, v, mask)]
    want = step(q, k, v, mask)
    before = counts("attention::blockwise")[0]
    got = torch.compile(step, backend="tpu")(*dev)
    assert_same(got, want.detach(), atol=1e-5, rtol=5e-6)
    for d, a in zip(dev, (q, k, v, mask)):
        assert_same(d.grad, a.grad, atol=1.25e-5, rtol=5.25e-6)
    # (counted while Dynamo and AOTAutograd trace the graph: its replays run no Python per op)
    assert counts("attention::blockwise")[0] > before


# --- FlexAttention -------------------------------------------------------------------------

def _flex_patterns(length, device):
    """(score_mod, mask_mod) of each pattern: causal, a sliding window, documents (packed
    sequences: queries attend within their document), ALiBi's per-head linear bias."""
    documents = (torch.arange(length) * 3 // length).to(device)  # three documents

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= 16)

    def document(b, h, q, kv):
        return documents[q] == documents[kv]

    def alibi(score, b, h, q, kv):
        return score - (h + 1) * 0.125 * (q - kv).abs()

    return {"causal": (None, causal), "sliding-window": (None, sliding),
            "document": (None, document), "alibi": (alibi, causal)}


def _flex_reference(q, k, v, score_mod, mask_mod):
    """The attention written out on the CPU (its FlexAttention has no backward)."""
    B, H, L, _ = q.shape
    b, h, i, j = (torch.arange(n).reshape(shape) for n, shape in
                  ((B, (B, 1, 1, 1)), (H, (1, H, 1, 1)), (L, (1, 1, L, 1)), (L, (1, 1, 1, L))))
    s = q @ k.mT / q.shape[-1] ** 0.5
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), float("-inf"))
    return s.softmax(-1) @ v


@functools.cache
def _flex_cases(B=2, H=2, L=128, D=16):
    """Inputs and each pattern's block masks (PyTorch's create_block_mask traces each mask_mod
    with Dynamo: made once for both tests)."""
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    cpu_patterns, tpu_patterns = _flex_patterns(L, "cpu"), _flex_patterns(L, "tpu")
    cases = {}
    for name, (score_mod, mask_mod) in cpu_patterns.items():
        dev_score, dev_mask = tpu_patterns[name]
        cases[name] = (score_mod, mask_mod, create_block_mask(mask_mod, B, H, L, L, device="cpu"),
                       dev_score, create_block_mask(dev_mask, B, H, L, L, device="tpu"))
    return (q, k, v), cases


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_patterns_match_the_cpu(compiled):
    from torch.nn.attention.flex_attention import flex_attention
    (q, k, v), cases = _flex_cases()
    run = torch.compile(flex_attention, backend="tpu") if compiled else flex_attention
    for name, (score_mod, mask_mod, cpu_mask, dev_score, dev_mask) in cases.items():
        args = [x.clone().requires_grad_() for x in (q, k, v)]
        want = _flex_reference(*args, score_mod, mask_mod)
        if not compiled:  # (the reference is the CPU's own FlexAttention's forward)
            torch.testing.assert_close(flex_attention(q, k, v, score_mod, cpu_mask),
                                       want.detach(), atol=1e-5, rtol=5e-6)
        dev = [x.detach().to("tpu").requires_grad_() for x in (q, k, v)]
        got = run(*dev, dev_score, dev_mask)
        assert_same(got, want.detach(), atol=1e-5, rtol=5e-6)
        grad = torch.randn_like(want)
        want.backward(grad)
        got.backward(grad.to("tpu"))
        for d, a in zip(dev, args):
            assert_same(d.grad, a.grad, atol=1.25e-5, rtol=5.25e-6)


# --- FlexAttention through the splash kernel (Pallas interpret mode on the CPU) ------------

def _causal(b, h, q, kv):  # (at L = 256: a full, two partial and an empty 128 x 128 block)
    return q >= kv


def _sliding(b, h, q, kv):  # (a window shorter than a block: partial and empty blocks)
    return (q >= kv) & (q - kv < 96)


def _document_mask(length):
    documents = torch.arange(length) * 3 // length

    def document(b, h, q, kv):
        return documents[q] == documents[kv]
    return document


def _sdpa_reference(q, k, v, mask_mod):
    """SDPA on the CPU with mask_mod's boolean mask: values and gradients (the CPU's
    FlexAttention has no backward)."""
    L = q.shape[-2]
    mask = mask_mod(0, 0, torch.arange(L)[:, None], torch.arange(k.shape[-2])[None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("mask_mod,kv_heads,compiled", [(_causal, 2, False),
                                                        (_sliding, 1, True)],
                         ids=["causal-eager", "sliding-window-gqa-compiled"])
def test_flex_attention_splash_matches_the_cpu(monkeypatch, mask_mod, kv_heads, compiled):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setattr(torch.tpu, "flex_attention_implementation", "splash")
    L = 256
    q = torch.randn(1, 2, L, 64, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, L, 64, requires_grad=True) for _ in range(2))
    want = _sdpa_reference(q, k, v, mask_mod)
    gqa = kv_heads != 2
    dev = [x.detach().to("tpu").requires_grad_() for x in (q, k, v)]
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="tpu")
    run = torch.compile(flex_attention, backend="tpu") if compiled else flex_attention
    before = counts("flex_attention::splash", "flex_attention::dense")
    got = run(*dev, block_mask=block_mask, enable_gqa=gqa)
    assert counts("flex_attention::splash", "flex_attention::dense") == (before[0] + 1,
                                                                          before[1])
    assert_same(got, want.detach(), atol=1e-5, rtol=5e-6)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad.to("tpu"))
    for d, a in zip(dev, (q, k, v)):  # (SDPA's grouped gradients stride their 1 head oddly)
        assert_same(d.grad, a.grad, atol=1.25e-5, rtol=5.25e-6, strides=False)
        assert d.grad.is_contiguous()


def test_flex_attention_implementation_choice(monkeypatch):
    # The choice on each call's operator arguments (traced mask_mod / score_mod graphs), by
    # platform and setting; nothing runs.
    from torchtpu._execution import flex_attention_kernels as flex
    trace = torch.fx.symbolic_trace
    q = torch.empty(1, 2, 256, 64)

    def choose(mask_mod=_causal, score_mod=lambda s, b, h, i, j: s, q=q, k=q, platform="tpu",
               **options):
        block_mask = (None,) * 16 + (trace(mask_mod),)
        return flex.implementation(q, k, k, trace(score_mod), block_mask, options, (), (),
                                   platform)[0]

    assert choose() == "splash"
    assert choose(_sliding) == "splash"
    assert choose(lambda b, h, q, kv: (q >= kv) | (h == 1)) == "splash"  # (per head)
    assert choose(platform="cpu") == "dense"  # (the kernel would run in interpret mode)
    assert choose(score_mod=lambda s, b, h, i, j: s * 2) == "dense"
    assert choose(_document_mask(256)) == "dense"  # (a tensor the mask reads: data)
    assert choose(lambda b, h, q, kv: q > kv) == "dense"  # (query 0 attends to no key)
    assert choose(q=torch.empty(1, 2, 200, 64), k=torch.empty(1, 2, 200, 64)) == "dense"
    assert choose(q=q.half(), k=q.half()) == "dense"
    assert choose(OUTPUT_MAX=True) == "dense"
    monkeypatch.setattr(torch.tpu, "flex_attention_implementation", "splash")
    assert choose(platform="cpu") == "splash"
    with pytest.raises(RuntimeError, match="'splash'.*does not take this call: a score_mod"):
        choose(score_mod=lambda s, b, h, i, j: s * 2)
    monkeypatch.setattr(torch.tpu, "flex_attention_implementation", "dense")
    assert choose() == "dense"
    monkeypatch.setattr(torch.tpu, "flex_attention_implementation", "flash")
    with pytest.raises(RuntimeError, match="no implementation 'flash'"):
        choose()


def test_flex_attention_with_a_score_mod_falls_back_to_dense_on_tpus(monkeypatch):
    # On the TPU platform (stood in for: the dense path runs no Pallas kernel) a call with a
    # score_mod (ALiBi's) runs the dense implementation, counted as such, with the CPU's values.
    import types
    from torch.nn.attention.flex_attention import flex_attention
    from torchtpu._execution import flex_attention_kernels as flex
    monkeypatch.setattr(flex, "runtime", types.SimpleNamespace(platform=lambda: "tpu"))
    (q, k, v), cases = _flex_cases()  # (its calls traced by Dynamo once, for both tests)
    score_mod, mask_mod, _, dev_score, dev_mask = cases["alibi"]
    before = counts("flex_attention::splash", "flex_attention::dense")
    got = flex_attention(*(x.to("tpu") for x in (q, k, v)), dev_score, dev_mask)
    assert counts("flex_attention::splash", "flex_attention::dense") == (before[0],
                                                                          before[1] + 1)
    assert_same(got, _flex_reference(q, k, v, score_mod, mask_mod), atol=1e-5, rtol=5e-6)
