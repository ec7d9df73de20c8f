"""The CTC loss (`aten::_ctc_loss`) and its backward: the forward (alpha) recursion over the
blank-extended targets in log space; the backward from its jax.vjp, taken w.r.t. the logits
under log_softmax as PyTorch's is."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.registry import lowering


def _ctc_labels(targets, target_lengths):
    """(B, S) padded targets from either layout PyTorch accepts."""
    lengths = [int(n) for n in target_lengths]
    width = max(lengths, default=0)
    if targets.ndim == 2:
        return targets[:, :width]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    index = np.minimum(starts[:, None] + np.arange(width),
                       max(targets.shape[0] - 1, 0))
    return targets[index] if targets.shape[0] else jnp.zeros(index.shape, targets.dtype)


def _logaddexp(a, b):
    """log(exp(a) + exp(b)) whose gradient stays finite (zero) where both are -inf; JAX's
    logaddexp gives NaN there, and CTC's unreachable states are exactly that."""
    m = jnp.maximum(a, b)
    dead = jnp.isneginf(m)
    a, b, m = (jnp.where(dead, 0, v) for v in (a, b, m))
    return jnp.where(dead, -jnp.inf, m + jnp.log(jnp.exp(a - m) + jnp.exp(b - m)))


def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(negative log likelihood per batch, log_alpha (B, T, 2 * max S + 1))."""
    batched = log_probs.ndim == 3
    lp = log_probs if batched else log_probs[:, None]
    t_max, bsz, _ = lp.shape
    labels = _ctc_labels(targets, target_lengths).astype(jnp.int32)
    s_len = 2 * labels.shape[1] + 1
    ext = jnp.full((bsz, s_len), blank, jnp.int32).at[:, 1::2].set(labels)
    s_idx = jnp.arange(s_len)
    tl = jnp.asarray([int(n) for n in target_lengths], jnp.int32).reshape(bsz)
    il = jnp.asarray([int(n) for n in input_lengths], jnp.int32).reshape(bsz)
    valid_s = s_idx[None, :] <= 2 * tl[:, None]
    skip = (s_idx[None, :] >= 2) & (ext != blank) & (ext != jnp.roll(ext, 2, axis=1))
    neg = jnp.asarray(-jnp.inf, lp.dtype)

    def emit(t):  # each extended label's log probability at time t, (B, 2S+1)
        return jnp.take_along_axis(lp[t], ext, axis=1)

    first = jnp.where((s_idx[None, :] < 2) & valid_s, emit(0), neg)
    first = jnp.where((s_idx[None, :] == 1) & (tl[:, None] == 0), neg, first)

    def step(alpha, t):
        # alpha shifted right by one and two states (s_len may be 1: empty targets)
        prev1 = jnp.concatenate([jnp.full((bsz, 1), neg), alpha], axis=1)[:, :s_len]
        prev2 = jnp.concatenate([jnp.full((bsz, 2), neg), alpha], axis=1)[:, :s_len]
        prev2 = jnp.where(skip, prev2, neg)
        new = _logaddexp(_logaddexp(alpha, prev1), prev2) + emit(t)
        new = jnp.where(valid_s, new, neg)
        new = jnp.where((t < il)[:, None], new, alpha)  # past its input length: frozen
        return new, new

    last, rest = lax.scan(step, first, jnp.arange(1, t_max))
    log_alpha = jnp.concatenate([first[None], rest], axis=0).transpose(1, 0, 2)
    end = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(tl > 0, before, neg)
    nll = -_logaddexp(end, before)
    nll = jnp.where(il == 0, jnp.where(tl == 0, 0, jnp.inf), nll)
    if not batched:
        nll, log_alpha = nll[0], log_alpha[0]
    return nll, log_alpha


@lowering("aten::_ctc_loss.default")
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    nll, log_alpha = _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll, log_alpha


@lowering("aten::_ctc_loss_backward.default")
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                      blank, zero_infinity=False):
    # PyTorch's CTC gradient is taken w.r.t. the logits under log_softmax: the derivative of
    # the loss w.r.t. log_probs plus exp(log_probs), over each sequence's own input length.
    forward_nll, pullback = jax.vjp(
        lambda lp: _ctc_forward(lp, targets, input_lengths, target_lengths, blank)[0], log_probs)
    g = grad.astype(log_probs.dtype)
    d_lp = pullback(g)[0]
    probs = jnp.exp(log_probs)
    batched = log_probs.ndim == 3
    il = jnp.asarray([int(n) for n in input_lengths], jnp.int32)
    t = jnp.arange(log_probs.shape[0])
    if batched:
        live = (t[:, None] < il[None, :])[..., None]
        scaled = probs * g[None, :, None]
        bad = jnp.isinf(forward_nll)[None, :, None]
    else:
        live = (t < il[0])[:, None]
        scaled = probs * g
        bad = jnp.isinf(forward_nll)
    out = jnp.where(live, d_lp + scaled, 0)
    if zero_infinity:
        out = jnp.where(bad, 0, out)
    return out.astype(log_probs.dtype)
