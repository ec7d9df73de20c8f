"""Scaled dot-product attention: the op `torchtpu::attention` (and its backward) that
`F.scaled_dot_product_attention` runs on tpu (through the dispatcher kernel in
`_execution/composed_kernels.py`), in one of four implementations named by its
`implementation` argument:

- "xla": the whole score matrix as one XLA program (`_attention`), its backward the `jax.vjp`
  of that; memory quadratic in the sequence length, fastest for short sequences on
  accelerators;
- "blockwise": flash attention's online softmax over blocks of queries and keys in JAX loops
  (`blockwise_attention.py`); memory linear in the sequence length, on any platform;
- "pallas_flash": JAX's Pallas flash-attention kernel for TPUs; "cudnn": cuDNN's fused
  attention on NVIDIA GPUs (`accelerated_attention.py`).

`choose` picks one per call (`unsupported` says why one cannot take a call); the dispatcher
kernel counts the choice in `torchtpu.metrics()` and lets the user override it.  Unless the user
names one, the op is given "auto" and the lowering chooses for the platform its program is
built for, so that a program compiled for a TPU target has the TPU's attention. PyTorch's own
fused-attention op for out-of-tree devices (`_scaled_dot_product_fused_attention_overrideable`)
keeps its lowering, the "xla" one, for code that calls it directly."""
import contextlib
import math

import jax
import jax.numpy as jnp
import torch

from .._core import runtime
from .._core.registry import HALF_TYPES, lowering
from .._core.runtime import jax_precision as _precision
from . import accelerated_attention, blockwise_attention

IMPLEMENTATIONS = ("xla", "blockwise", "pallas_flash", "cudnn")


def _attention(q, k, v, bias, is_causal, scale, dropout=None):
    """(softmax(q kᵀ · scale + bias) v, its log-sum-exp), over the last two dims of q, k, v.

    `bias`: a boolean mask (True attends) or an additive bias, broadcast to (…, H_q, L_q, L_k).
    Keys and values may have fewer heads than the query (grouped-query attention): each of
    their heads serves H_q / H_k consecutive query heads, as `repeat_interleave` would.
    A row whose every key is masked gives zeros, as PyTorch's math kernel does (_safe_softmax).
    Half-precision inputs are computed in float32 with the unnormalised weights rounded to the
    input dtype before they meet v, as the CPU's flash kernel computes them.
    `dropout`: None or (PRNG key, p): the weights blockwise_attention.dropout_keep keeps,
    scaled by 1 / (1 - p)."""
    half = q.dtype if q.dtype in HALF_TYPES else None
    if half is not None:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        if bias is not None and bias.dtype == half:
            bias = bias.astype(jnp.float32)
    *batch, hq, lq, d = q.shape
    hk, lk = k.shape[-3], k.shape[-2]
    groups = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(*batch, hk, groups, lq, d)
    s = jnp.einsum("...hgqd,...hkd->...hgqk", qg, k, precision=_precision()) * scale
    masked = None
    if bias is not None:
        bias = jnp.broadcast_to(bias, (*batch, hq, lq, lk)).reshape(*batch, hk, groups, lq, lk)
        if bias.dtype == jnp.bool_:
            masked = ~bias
        else:
            s = s + bias.astype(s.dtype)
    if is_causal:  # the top-left aligned lower triangle, as PyTorch's is_causal
        future = jnp.triu(jnp.ones((lq, lk), bool), 1)
        masked = future if masked is None else masked | future
    if masked is not None:
        s = jnp.where(masked, -jnp.inf, s)
    m = jnp.max(s, axis=-1, keepdims=True)
    empty = jnp.isneginf(m)  # every key masked
    p = jnp.exp(s - jnp.where(empty, 0, m))
    total = jnp.sum(p, axis=-1, keepdims=True)
    if half is not None:
        p = p.astype(half).astype(jnp.float32)
    if dropout is not None:
        key, dropout_p = dropout
        full = (math.prod(batch), hk, groups, lq, lk)
        keep = blockwise_attention.dropout_keep(key, dropout_p, full, (0,) * 5, full)
        p = jnp.where(keep.reshape(p.shape), p, 0) * blockwise_attention.dropout_scale(dropout_p)
    out = jnp.einsum("...hgqk,...hkd->...hgqd", p, v, precision=_precision())
    # (1 where the row is empty, so that its gradient is 0, not 0/0)
    out = jnp.where(empty, 0, out / jnp.where(empty, 1, total))
    lse = (m + jnp.log(total))[..., 0]
    return out.reshape(*batch, hq, lq, v.shape[-1]), lse.reshape(*batch, hq, lq)


# --- the layouts of the blockwise implementation ----------------------------------------

def _padded_bias_shapes(bias, batch):
    """The bias's shape left-padded to rank len(batch) + 3, and that shape with its batch dims
    made full where they are partly broadcast (the blockwise loops slice only whole dims)."""
    rank = len(batch) + 3
    padded = (1,) * (rank - bias.ndim) + tuple(bias.shape)
    lead = padded[:len(batch)]
    if all(s == 1 for s in lead) or lead == tuple(batch):
        return padded, padded
    return padded, (*batch, *padded[len(batch):])


def _grouped(q, k, v, bias):
    """q (N, Hk, G, Lq, D), k (N, Hk, Lk, D), v (N, Hk, Lk, Dv) and the bias as rank 5 with each
    dim 1 or full, from PyTorch's (*batch, H, L, D) layouts."""
    *batch, hq, lq, d = q.shape
    hk, lk = k.shape[-3], k.shape[-2]
    n, g = math.prod(batch), hq // hk
    q5 = q.reshape(n, hk, g, lq, d)
    k4, v4 = k.reshape(n, hk, lk, d), v.reshape(n, hk, lk, v.shape[-1])
    if bias is None:
        return q5, k4, v4, None
    padded, full = _padded_bias_shapes(bias, batch)
    b = jnp.broadcast_to(bias.reshape(padded), full)
    nb = n if any(s != 1 for s in full[:len(batch)]) else 1
    heads = (hk, g) if full[-3] != 1 else (1, 1)
    return q5, k4, v4, b.reshape(nb, *heads, *full[-2:])


def _ungrouped_bias_grad(grad5, bias, batch):
    """The gradient of `bias` (its own shape) from that of its grouped rank-5 form."""
    padded, full = _padded_bias_shapes(bias, batch)
    g = grad5.reshape(full)
    axes = tuple(i for i, (a, b) in enumerate(zip(full, padded)) if a != b)
    return jnp.sum(g, axis=axes, keepdims=True).reshape(bias.shape)


# --- the implementations ------------------------------------------------------------------

def _dropout_key(seed):
    return jax.random.key(seed)


def _chosen(implementation, q, k, v, bias, dropout_p, is_causal):
    """`implementation`, or for "auto" the one `choose` gives on the platform the program is
    built for (forward and backward choose alike: same platform, same shapes)."""
    if implementation != "auto":
        return implementation
    mask_dtype = None if bias is None else jnp.dtype(bias.dtype).name
    return choose(runtime.program_platform(), q.shape, k.shape, v.shape,
                  jnp.dtype(q.dtype).name, mask_dtype, dropout_p, is_causal)


def attention_forward(q, k, v, bias, seed, dropout_p, is_causal, scale, implementation):
    """(output, log-sum-exp (*batch, Hq, Lq) float32) by `implementation`, in PyTorch's layouts.
    The accelerators' kernels give no log-sum-exp (zeros; their backward does not read it)."""
    implementation = _chosen(implementation, q, k, v, bias, dropout_p, is_causal)
    if implementation == "blockwise":
        q5, k4, v4, b5 = _grouped(q, k, v, bias)
        key = _dropout_key(seed) if dropout_p else None
        out, lse = blockwise_attention.forward(q5, k4, v4, b5, key, dropout_p, is_causal, scale)
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])
    if implementation == "xla":
        dropout = (_dropout_key(seed), dropout_p) if dropout_p else None
        return _attention(q, k, v, bias, is_causal, scale, dropout)
    with _kernel_context(implementation):
        kernel = getattr(accelerated_attention, implementation)
        out = kernel(q, k, v, bias, is_causal, scale)
    return out, jnp.zeros(q.shape[:-1], jnp.float32)


def _kernel_context(implementation):
    if implementation == "pallas_flash":
        return accelerated_attention.pallas_context()
    return contextlib.nullcontext()


def attention_backward(grad, q, k, v, bias, seed, out, lse, dropout_p, is_causal, scale,
                       implementation, bias_grad):
    """(dq, dk, dv, dbias or None): blockwise attention's own backward, the others' the
    `jax.vjp` of their forward."""
    implementation = _chosen(implementation, q, k, v, bias, dropout_p, is_causal)
    if implementation == "blockwise":
        q5, k4, v4, b5 = _grouped(q, k, v, bias)
        key = _dropout_key(seed) if dropout_p else None
        g5 = grad.reshape(*q5.shape[:-1], grad.shape[-1])
        o5 = out.reshape(g5.shape)
        dq, dk, dv, db = blockwise_attention.backward(
            g5, q5, k4, v4, b5, key, dropout_p, is_causal, scale, o5,
            lse.reshape(q5.shape[:-1]), bias_grad)
        if db is not None:
            db = _ungrouped_bias_grad(db, bias, q.shape[:-3])
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), db

    def forward(q, k, v, bias):
        return attention_forward(q, k, v, bias, seed, dropout_p, is_causal, scale,
                                 implementation)[0]

    with _kernel_context(implementation):
        # (the forward again: the cotangent takes its result's dtype, float32 for half inputs)
        if bias_grad:
            result, vjp = jax.vjp(forward, q, k, v, bias)
            return vjp(grad.astype(result.dtype))
        result, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, bias), q, k, v)
        return (*vjp(grad.astype(result.dtype)), None)


# --- the op -----------------------------------------------------------------------------

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, Tensor? seed, "
            "float dropout_p, bool is_causal, float scale, str implementation) "
            "-> (Tensor output, Tensor logsumexp)")
_lib.define("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
            "Tensor? attn_bias, Tensor? seed, Tensor output, Tensor logsumexp, float dropout_p, "
            "bool is_causal, float scale, str implementation, bool bias_grad) "
            "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_bias)")


@torch.library.register_fake("torchtpu::attention")
def _attention_shapes(q, k, v, attn_bias, seed, dropout_p, is_causal, scale, implementation):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


@torch.library.register_fake("torchtpu::attention_backward")
def _attention_backward_shapes(grad, q, k, v, attn_bias, seed, out, lse, dropout_p, is_causal,
                               scale, implementation, bias_grad):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(attn_bias) if bias_grad else q.new_empty((0,)))


def _save_for_backward(ctx, inputs, output):
    q, k, v, bias, seed, dropout_p, is_causal, scale, implementation = inputs
    ctx.save_for_backward(q, k, v, bias, seed, *output)
    ctx.options = (dropout_p, is_causal, scale, implementation)
    ctx.bias_grad = bias is not None and bias.is_floating_point() and ctx.needs_input_grad[3]


def _backward(ctx, grad_out, grad_lse):
    # (the log-sum-exp is a by-product for the backward: nothing differentiates through it)
    q, k, v, bias, seed, out, lse = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.torchtpu.attention_backward(
        grad_out, q, k, v, bias, seed, out, lse, *ctx.options, ctx.bias_grad)
    return dq, dk, dv, dbias if ctx.bias_grad else None, None, None, None, None, None


torch.library.register_autograd("torchtpu::attention", _backward, setup_context=_save_for_backward)


@lowering("torchtpu::attention", precision=True)
def attention(q, k, v, attn_bias, seed, dropout_p, is_causal, scale, implementation):
    return attention_forward(q, k, v, attn_bias, seed, dropout_p, is_causal, scale,
                             implementation)


@lowering("torchtpu::attention_backward", precision=True)
def attention_backward_op(grad, q, k, v, attn_bias, seed, out, lse, dropout_p, is_causal, scale,
                          implementation, bias_grad):
    dq, dk, dv, dbias = attention_backward(grad, q, k, v, attn_bias, seed, out, lse, dropout_p,
                                           is_causal, scale, implementation, bias_grad)
    return dq, dk, dv, dbias if bias_grad else jnp.zeros((0,), q.dtype)


# --- which implementation takes a call --------------------------------------------------

# On the CPU the blockwise loops are as fast as one XLA program for short sequences and faster
# from about L = 128 on (causal fwd+bwd, 8 heads, d 64: 0.004-0.006 s against 0.005-0.006 s at
# 128, 0.012-0.014 against 0.014-0.031 at 256, 0.09 against 0.9 at 1024; benchmarks/attention.py,
# docs/kernels.md); shorter ones keep the dense program the test suite has long exercised.
CPU_BLOCKWISE_SCORES = 128 * 128
# Elsewhere the dense program is kept until its score matrix would take this many bytes (a
# memory bound, not measured for speed: no accelerator was available).
DENSE_SCORE_BYTES = 1 << 30
# On a TPU the dense program is kept for short sequences only: compiled for v5e by libtpu
# (causal fwd+bwd, bf16, 16 heads, d 64: benchmarks/attention.py --target v5e:1x1), its roofline
# is below the blockwise loops' up to L = 384 (0.023 against 0.054 ms at 128, 0.144 against
# 0.159 at 384) and above from 512 (0.241 against 0.180; 1.25 against 0.26 ms at 1024, with
# 64 MiB of temporaries against none).  Longer ones take the Pallas kernel, or the loops.
TPU_DENSE_SCORES = 384 * 384


def unsupported(implementation, platform, q_shape, k_shape, v_shape, dtype, mask_dtype,
                dropout_p, is_causal):
    """Why `implementation` cannot take this call on `platform` ("tpu", "gpu", "cpu"), or None.
    Shapes are PyTorch's, dtypes their names ("float32"); `mask_dtype`: None, "bool" or the
    additive mask's dtype."""
    if implementation not in IMPLEMENTATIONS:
        return f"there is no attention implementation {implementation!r} " \
               f"(choose from {', '.join(IMPLEMENTATIONS)})"
    args = (q_shape, k_shape, v_shape, dtype, mask_dtype, dropout_p, is_causal)
    if implementation == "pallas_flash":
        # (off a TPU it runs in Pallas' interpret mode: asked for by name only)
        return accelerated_attention.pallas_flash_unsupported(*args)
    if implementation == "cudnn":
        if platform != "gpu":
            return "cuDNN needs a CUDA GPU"
        return accelerated_attention.cudnn_unsupported(*args)
    return None


def choose(platform, q_shape, k_shape, v_shape, dtype, mask_dtype, dropout_p, is_causal):
    """The implementation a call gets unless the user says otherwise."""
    args = (q_shape, k_shape, v_shape, dtype, mask_dtype, dropout_p, is_causal)
    scores = q_shape[-2] * k_shape[-2]
    dense = math.prod(q_shape[:-2]) * scores * 4 <= DENSE_SCORE_BYTES
    if platform == "tpu":
        if dense and scores <= TPU_DENSE_SCORES:
            return "xla"
        return "blockwise" if unsupported("pallas_flash", platform, *args) else "pallas_flash"
    if platform == "gpu" and not unsupported("cudnn", platform, *args):
        return "cudnn"
    if platform == "cpu":
        return "blockwise" if scores >= CPU_BLOCKWISE_SCORES else "xla"
    return "xla" if dense else "blockwise"


# --- PyTorch's fused-attention op for out-of-tree devices ---------------------------------

@lowering("aten::_scaled_dot_product_fused_attention_overrideable.default", precision=True)
def sdpa(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
         scale=None):
    # (the dispatcher kernel runs torchtpu::attention instead; this serves direct calls)
    if dropout_p:
        raise NotImplementedError("_scaled_dot_product_fused_attention_overrideable with "
                                  "dropout on tpu: call F.scaled_dot_product_attention")
    out, lse = _attention(q, k, v, attn_bias, is_causal, scale)
    zero = jnp.zeros((), jnp.int64)
    # output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k (numbers), philox seed and offset,
    # debug mask
    return out, lse, None, None, None, None, zero, zero, None


@lowering("aten::_scaled_dot_product_fused_attention_overrideable_backward.default",
          precision=True)
def sdpa_backward(grad_out, q, k, v, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                  cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                  scale=None):
    bias_grad = (attn_bias is not None and grad_input_mask[3]
                 and jnp.issubdtype(attn_bias.dtype, jnp.floating))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    gq, gk, gv, gb = attention_backward(grad_out, q, k, v, attn_bias, None, out, logsumexp, 0.0,
                                        is_causal, scale, "xla", bias_grad)
    if attn_bias is not None and gb is None:
        gb = jnp.zeros_like(attn_bias)
    return gq, gk, gv, gb
