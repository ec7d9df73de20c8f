"""Scaled dot-product attention as one program: PyTorch's fused-attention op for out-of-tree
devices (`_scaled_dot_product_fused_attention_overrideable`) and its backward, the `jax.vjp` of
the same function.  `F.scaled_dot_product_attention` reaches it through the dispatcher kernel in
`_execution/composite.py`; left to its math kernel, it would run as seven ops, each compiled
again at every new sequence length while decoding."""
import math

import jax
import jax.numpy as jnp

from .._core.registry import HALF_TYPES, lowering
from .._core.runtime import jax_precision as _precision


def _attention(q, k, v, bias, is_causal, scale):
    """(softmax(q kᵀ · scale + bias) v, its log-sum-exp), over the last two dims of q, k, v.

    `bias`: a boolean mask (True attends) or an additive bias, broadcast to (…, H_q, L_q, L_k).
    Keys and values may have fewer heads than the query (grouped-query attention): each of
    their heads serves H_q / H_k consecutive query heads, as `repeat_interleave` would.
    A row whose every key is masked gives zeros, as PyTorch's math kernel does (_safe_softmax).
    Half-precision inputs are computed in float32 with the unnormalised weights rounded to the
    input dtype before they meet v, as the CPU's flash kernel computes them."""
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
    out = jnp.einsum("...hgqk,...hkd->...hgqd", p, v, precision=_precision())
    # (1 where the row is empty, so that its gradient is 0, not 0/0)
    out = jnp.where(empty, 0, out / jnp.where(empty, 1, total))
    lse = (m + jnp.log(total))[..., 0]
    return out.reshape(*batch, hq, lq, v.shape[-1]), lse.reshape(*batch, hq, lq)


@lowering("aten::_scaled_dot_product_fused_attention_overrideable.default", precision=True)
def sdpa(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
         scale=None):
    # Dropout never reaches this op (the dispatcher kernel takes the math path for it).
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

    def forward(q, k, v, bias):
        return _attention(q, k, v, bias, is_causal, scale)[0]

    # (the forward again: the cotangent takes its result's dtype, float32 for half inputs)
    if bias_grad:
        result, vjp = jax.vjp(forward, q, k, v, attn_bias)
        return vjp(grad_out.astype(result.dtype))
    result, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, attn_bias), q, k, v)
    gq, gk, gv = vjp(grad_out.astype(result.dtype))
    return gq, gk, gv, None if attn_bias is None else jnp.zeros_like(attn_bias)
