"""Attention in blocks of queries and keys with an online softmax (flash attention's algorithm,
written in plain JAX loops): the T x T score matrix never exists, so memory grows linearly in
the sequence length. The forward keeps each query block's running maximum, normaliser and
weighted sum over the key blocks; the backward recomputes each block's probabilities from the
forward's log-sum-exp.

Why a hand-written backward rather than the `jax.vjp` of the forward: reverse mode cannot go
through the causal forward's loops at all (their trip counts depend on the query block), and
through the others it saves every iteration's carry (a query block's running sum, once per key
block): memory quadratic in T again, and slower. Measured, non-causal fwd+bwd, L = 4096, 8
heads, d 64, float32, 512-blocks, peak resident memory above the inputs: this backward 2.6 s,
161 MiB; `jax.vjp` of the forward 8.4 s, 1,541 MiB; with `jax.checkpoint`ed loop bodies 11.1 s,
309 MiB (growing as L² / block). The backward below is flash attention's and needs only the
output and its log-sum-exp.

Shapes (the callers' `group` layout): q (N, Hk, G, Lq, D), k (N, Hk, Lk, D), v (N, Hk, Lk, Dv),
where G query heads share each key/value head (grouped-query attention). `bias`: None, or an
array of rank 5 whose every dim is 1 or the full (N, Hk, G, Lq, Lk) size: boolean (True
attends) or additive. Dropout: `key` (a JAX PRNG key) and `dropout_p`; which elements drop is a
function of their position only (`dropout_keep`), so any blocking draws the same mask."""
import jax
import jax.numpy as jnp
from jax import lax

from .._core.runtime import jax_precision as _precision

# Block sizes (queries x keys): a block holds N*Hq*bq*bk float32 scores at a time. Causal
# fwd+bwd on XLA:CPU, 8 heads, d 64 (benchmarks/attention.py, two runs each): 256 x 256 took
# 0.09-0.12 s at L = 1024 and 1.1-2.5 s at 4096, 512 x 512 0.14-0.30 s and 1.4-2.6 s, with
# larger temporaries; 128 x 128 was slower at 4096 (2.3-3.5 s).
_BLOCK_Q = 256
_BLOCK_K = 256


def _block_sizes(lq, lk):
    return min(_BLOCK_Q, _round_up(lq, 8)), min(_BLOCK_K, _round_up(lk, 8))


def _round_up(n, m):
    return -(-n // m) * m


def _pad_to(x, axis, size, value=0):
    extra = size - x.shape[axis]
    if extra == 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _unpad(x, axis, size):
    return x if x.shape[axis] == size else lax.slice_in_dim(x, 0, size, axis=axis)


def _slice(x, axis, start, size):
    """x's block [start, start + size) along `axis`, or x itself where that dim broadcasts."""
    if x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def dropout_keep(key, dropout_p, shape, starts, full):
    """Which elements of the (N, Hk, G, Lq, Lk) attention weights survive dropout, for the
    block of `shape` at `starts` (its first index in each dim) of the whole `full` shape: a
    threefry hash of each element's row-major position (the counter JAX's partitionable
    `random.bits` uses), so a block draws what the whole array would hold there."""
    index = jnp.zeros(shape, jnp.uint64)
    stride = 1
    for axis in reversed(range(len(full))):
        pos = lax.broadcasted_iota(jnp.uint64, shape, axis) + jnp.asarray(starts[axis], jnp.uint64)
        index = index + pos * jnp.uint64(stride)
        stride *= full[axis]
    hi = (index >> jnp.uint64(32)).astype(jnp.uint32)
    lo = (index & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32)
    k1, k2 = jax.random.key_data(key)
    from jax.extend.random import threefry2x32_p
    b1, b2 = threefry2x32_p.bind(k1, k2, hi, lo)
    threshold = min(int(dropout_p * 2.0 ** 32), 2 ** 32 - 1)
    return (b1 ^ b2) >= jnp.uint32(threshold) if dropout_p < 1 else jnp.zeros(shape, bool)


def _plan(dtype, lq, lk, blocks):
    """(the half-precision input dtype or None, the dtype blocks compute in, the block sizes,
    the lengths padded to whole blocks, the numbers of blocks)."""
    half = dtype if dtype in (jnp.float16, jnp.bfloat16) else None
    bq, bk = blocks or _block_sizes(lq, lk)
    lqp, lkp = _round_up(lq, bq), _round_up(lk, bk)
    return half, _accumulator(dtype), (bq, bk), (lqp, lkp), (lqp // bq, lkp // bk)


def _accumulator(dtype):
    """The dtype blocks compute in: float32, float64 for float64 inputs."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _scores(qb, kb, bias_b, q0, k0, lq, lk, is_causal, scale):
    """The block's scaled scores (in the accumulator's dtype) and which of them attend."""
    ftype = _accumulator(qb.dtype)
    s = jnp.einsum("nhgqd,nhkd->nhgqk", qb, kb, precision=_precision(),
                   preferred_element_type=ftype) * scale
    bq, bk = s.shape[-2:]
    rows = q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    valid = cols < lk
    if is_causal:  # the top-left aligned lower triangle, as PyTorch's is_causal
        valid = valid & (cols <= rows)
    if bias_b is not None:
        if bias_b.dtype == jnp.bool_:
            valid = valid & bias_b
        else:
            s = s + bias_b.astype(ftype)
    return s, jnp.broadcast_to(valid, s.shape)


def _bias_block(bias, q0, bq, k0, bk):
    if bias is None:
        return None
    return _slice(_slice(bias, 3, q0, bq), 4, k0, bk)


def _causal_key_blocks(i, bq, bk, nk):
    """The number of key blocks query block i reaches under is_causal."""
    return jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk)


def forward(q, k, v, bias, key, dropout_p, is_causal, scale, blocks=None):
    """(output (N, Hk, G, Lq, Dv), log-sum-exp (N, Hk, G, Lq)), both float32. `blocks`: the
    (query, key) block sizes, by default `_block_sizes`'."""
    n, hk, g, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[-1]
    half, ftype, (bq, bk), (lqp, lkp), (nq, nk) = _plan(q.dtype, lq, lk, blocks)
    scale = float(scale)
    q, k, v = _pad_to(q, 3, lqp), _pad_to(k, 2, lkp), _pad_to(v, 2, lkp)
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 3, lqp), 4, lkp)
    full = (n, hk, g, lq, lk)

    def query_block(i, results):
        q0 = i * bq
        qb = lax.dynamic_slice_in_dim(q, q0, bq, 3)

        def step(j, carry):
            m, l, acc = carry
            k0 = j * bk
            kb = lax.dynamic_slice_in_dim(k, k0, bk, 2)
            vb = lax.dynamic_slice_in_dim(v, k0, bk, 2)
            s, valid = _scores(qb, kb, _bias_block(bias, q0, bq, k0, bk), q0, k0, lq, lk,
                               is_causal, scale)
            s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = l * alpha + jnp.sum(p, axis=-1)
            if half is not None:  # (the CPU's flash kernel rounds the weights before p @ v)
                p = p.astype(half)
            if dropout_p:
                keep = dropout_keep(key, dropout_p, p.shape, (0, 0, 0, q0, k0), full)
                p = jnp.where(keep, p, 0)
            acc = acc * alpha[..., None] + jnp.einsum(
                "nhgqk,nhkd->nhgqd", p, vb.astype(p.dtype), precision=_precision(),
                preferred_element_type=ftype)
            return m_new, l, acc

        init = (jnp.full((n, hk, g, bq), -jnp.inf, ftype),
                jnp.zeros((n, hk, g, bq), ftype),
                jnp.zeros((n, hk, g, bq, dv), ftype))
        hi = _causal_key_blocks(i, bq, bk, nk) if is_causal else nk
        m, l, acc = lax.fori_loop(0, hi, step, init)
        empty = l == 0  # every key masked: zeros, as PyTorch's math kernel gives
        out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None])
        if dropout_p:
            out = out * dropout_scale(dropout_p)
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        # (written into the whole results in place: stacking blocks, then moving their axis
        # into place, would copy them once more)
        return (lax.dynamic_update_slice_in_dim(results[0], out, q0, 3),
                lax.dynamic_update_slice_in_dim(results[1], lse, q0, 3))

    out, lse = lax.fori_loop(0, nq, query_block, (jnp.zeros((n, hk, g, lqp, dv), ftype),
                                                  jnp.zeros((n, hk, g, lqp), ftype)))
    return _unpad(out, 3, lq), _unpad(lse, 3, lq)


def backward(grad, q, k, v, bias, key, dropout_p, is_causal, scale, out, lse, bias_grad,
             blocks=None):
    """(dq, dk, dv, dbias or None) in float32 (float64 for float64 inputs); dbias has `bias`'s
    (broadcast) shape."""
    n, hk, g, lq, d = q.shape
    lk, dv_dim = k.shape[2], v.shape[-1]
    half, ftype, (bq, bk), (lqp, lkp), (nq, nk) = _plan(q.dtype, lq, lk, blocks)
    scale = float(scale)
    grad = grad.astype(ftype)
    # D_i = rowsum(dO * O): the softmax's backward term, dropout included
    delta = jnp.sum(grad * out.astype(ftype), axis=-1)
    q, grad = _pad_to(q, 3, lqp), _pad_to(grad, 3, lqp)
    k, v = _pad_to(k, 2, lkp), _pad_to(v, 2, lkp)
    lse, delta = _pad_to(lse, 3, lqp, -jnp.inf), _pad_to(delta, 3, lqp)
    if bias is not None:
        bias_shape = bias.shape
        bias = _pad_to(_pad_to(bias, 3, lqp), 4, lkp)
    full = (n, hk, g, lq, lk)
    drop_scale = dropout_scale(dropout_p)

    def key_block(j, carry):
        k0 = j * bk
        kb = lax.dynamic_slice_in_dim(k, k0, bk, 2)
        vb = lax.dynamic_slice_in_dim(v, k0, bk, 2)

        def step(i, inner):
            dq, dbias, dk, dv = inner
            q0 = i * bq
            qb = lax.dynamic_slice_in_dim(q, q0, bq, 3)
            gb = lax.dynamic_slice_in_dim(grad, q0, bq, 3)
            lse_b = lax.dynamic_slice_in_dim(lse, q0, bq, 3)
            delta_b = lax.dynamic_slice_in_dim(delta, q0, bq, 3)
            s, valid = _scores(qb, kb, _bias_block(bias, q0, bq, k0, bk), q0, k0, lq, lk,
                               is_causal, scale)
            finite = ~jnp.isneginf(lse_b)[..., None]
            p = jnp.where(valid & finite, jnp.exp(s - jnp.where(finite, lse_b[..., None], 0.0)),
                          0.0)
            pd = p.astype(half).astype(ftype) if half is not None else p
            dp = jnp.einsum("nhgqd,nhkd->nhgqk", gb, vb, precision=_precision(),
                            preferred_element_type=ftype)
            if dropout_p:
                keep = dropout_keep(key, dropout_p, p.shape, (0, 0, 0, q0, k0), full)
                pd = jnp.where(keep, pd, 0.0) * drop_scale
                dp = jnp.where(keep, dp, 0.0) * drop_scale
            dv = dv + jnp.einsum("nhgqk,nhgqd->nhkd", pd, gb, precision=_precision())
            ds = p * (dp - delta_b[..., None])
            dk = dk + jnp.einsum("nhgqk,nhgqd->nhkd", ds, qb, precision=_precision(),
                                 preferred_element_type=ftype) * scale
            dq_b = jnp.einsum("nhgqk,nhkd->nhgqd", ds, kb, precision=_precision(),
                              preferred_element_type=ftype) * scale
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, q0, bq, 3) + dq_b, q0, 3)
            if dbias is not None:
                dbias = _add_bias_block(dbias, ds, q0, k0)
            return dq, dbias, dk, dv

        dq, dbias, dk_all, dv_all = carry
        lo = (k0 // bq) if is_causal else 0  # (query blocks wholly above the diagonal: none)
        dk = jnp.zeros((n, hk, bk, d), ftype)
        dv = jnp.zeros((n, hk, bk, dv_dim), ftype)
        dq, dbias, dk, dv = lax.fori_loop(lo, nq, step, (dq, dbias, dk, dv))
        return (dq, dbias, lax.dynamic_update_slice_in_dim(dk_all, dk, k0, 2),
                lax.dynamic_update_slice_in_dim(dv_all, dv, k0, 2))

    init = (jnp.zeros((n, hk, g, lqp, d), ftype),
            jnp.zeros(bias.shape, ftype) if bias_grad else None,
            jnp.zeros((n, hk, lkp, d), ftype), jnp.zeros((n, hk, lkp, dv_dim), ftype))
    dq, dbias, dk, dv = lax.fori_loop(0, nk, key_block, init)
    if dbias is not None:
        dbias = dbias[tuple(slice(0, s) for s in bias_shape)]
    return _unpad(dq, 3, lq), _unpad(dk, 2, lk), _unpad(dv, 2, lk), dbias


def _add_bias_block(dbias, ds, q0, k0):
    """dbias[..., q0:q0+bq, k0:k0+bk] += ds summed over the dims where the bias broadcasts."""
    sum_axes = tuple(a for a in range(5) if dbias.shape[a] == 1 and ds.shape[a] != 1)
    ds = jnp.sum(ds, axis=sum_axes, keepdims=True)
    starts = [0, 0, 0, q0 if dbias.shape[3] != 1 else 0, k0 if dbias.shape[4] != 1 else 0]
    current = lax.dynamic_slice(dbias, starts, ds.shape)
    return lax.dynamic_update_slice(dbias, current + ds, starts)


def dropout_scale(dropout_p):
    """What kept weights are multiplied by (all are dropped at p = 1)."""
    return 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0
