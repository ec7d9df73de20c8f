"""Neural-network ops and their backward ops (backward lowerings reuse the forward through
jax.vjp where PyTorch's formula is just the derivative)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import lowering


def _float(x):
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


@lowering("aten::relu.default")
def relu(x):
    return jnp.maximum(x, 0)


@lowering("aten::threshold.default", promote=True)
def threshold(x, threshold, value):
    return jnp.where(x <= threshold, value, x)


@lowering("aten::threshold_backward.default", promote=True)
def threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, 0, grad)


def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@lowering("aten::gelu.default")
def gelu(x, approximate="none"):
    return _gelu(x, approximate)


@lowering("aten::gelu_backward.default")
def gelu_backward(grad, x, approximate="none"):
    return jax.vjp(lambda v: _gelu(v, approximate), x)[1](grad)[0]


@lowering("aten::silu.default")
def silu(x):
    return jax.nn.silu(x)


@lowering("aten::tanh_backward.default")
def tanh_backward(grad, y):
    return grad * (1 - y * y)


@lowering("aten::sigmoid_backward.default")
def sigmoid_backward(grad, y):
    return grad * y * (1 - y)


@lowering("aten::leaky_relu.default")
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowering("aten::leaky_relu_backward.default")
def leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@lowering("aten::elu.default")
def elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, alpha * scale * jnp.expm1(x * input_scale))


@lowering("aten::hardtanh.default")
def hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val)


@lowering("aten::hardtanh_backward.default")
def hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), 0, grad)


@lowering("aten::softplus.default")
def softplus(x, beta=1, threshold=20):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


def _axis(x, dim):
    # A 0-dim tensor takes dim 0 or -1 as its only "dimension".
    return None if x.ndim == 0 else dim


@lowering("aten::_softmax.default")
def softmax(x, dim, half_to_float=False):
    x = x.astype(jnp.float32) if half_to_float else x
    if x.ndim == 0:
        return jnp.exp(x - x)  # 1, or nan for inf/nan as PyTorch computes it
    return jax.nn.softmax(x, axis=dim)


@lowering("aten::_log_softmax.default")
def log_softmax(x, dim, half_to_float=False):
    x = x.astype(jnp.float32) if half_to_float else x
    if x.ndim == 0:
        return x - x
    return jax.nn.log_softmax(x, axis=dim)


@lowering("aten::_softmax_backward_data.default")
def softmax_backward(grad, y, dim, input_dtype):
    return (grad - jnp.sum(grad * y, axis=_axis(y, dim), keepdims=True)) * y


@lowering("aten::_log_softmax_backward_data.default")
def log_softmax_backward(grad, y, dim, input_dtype):
    return grad - jnp.exp(y) * jnp.sum(grad, axis=_axis(y, dim), keepdims=True)


def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = ((xf - mean) * rstd).astype(x.dtype)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y, mean, rstd


@lowering("aten::native_layer_norm.default")
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    return _layer_norm(x, normalized_shape, weight, bias, eps)


@lowering("aten::native_layer_norm_backward.default")
def native_layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    # The saved mean/rstd (eps already folded in) give the closed-form gradient directly.
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(mean.dtype)
    xhat = (xf - mean) * rstd
    g = grad.astype(mean.dtype)
    gw = g * weight.astype(mean.dtype) if weight is not None else g
    dx = rstd * (gw - jnp.mean(gw, axis=axes, keepdims=True)
                 - xhat * jnp.mean(gw * xhat, axis=axes, keepdims=True))
    lead = tuple(range(x.ndim - len(normalized_shape)))
    dw = jnp.sum(g * xhat, axis=lead) if weight is not None and output_mask[1] else None
    db = jnp.sum(g, axis=lead) if bias is not None and output_mask[2] else None
    return (dx.astype(x.dtype) if output_mask[0] else None), dw, db


@lowering("aten::embedding.default")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    from .indexing import check_index
    check_index(indices, weight.shape[0], "index out of range in self")
    return jnp.take(weight, indices, axis=0)


@lowering("aten::embedding_dense_backward.default")
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_idx = indices.reshape(-1)
    g = grad.reshape(-1, grad.shape[-1])
    if padding_idx >= 0:
        g = jnp.where((flat_idx == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[flat_idx].add(1)
        g = g / counts[flat_idx][:, None]
    return jnp.zeros((num_weights, g.shape[-1]), g.dtype).at[flat_idx].add(g)


def _nll(x, target, weight, reduction, ignore_index):
    # x: (N, C, ...) log-probabilities; target: (N, ...)
    class_dim = 1 if x.ndim > 1 else 0
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    picked = jnp.take_along_axis(x, jnp.expand_dims(safe, class_dim), axis=class_dim)
    picked = jnp.squeeze(picked, class_dim)
    w = weight[safe] if weight is not None else jnp.ones_like(picked)
    w = jnp.where(valid, w, 0)
    loss = -picked * w
    if reduction == 0:
        return loss, jnp.zeros((), x.dtype)
    total = jnp.sum(w)
    if reduction == 1:
        return jnp.sum(loss) / total, total
    return jnp.sum(loss), total


@lowering("aten::nll_loss_forward.default")
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    from .indexing import check_index
    C = x.shape[1] if x.ndim > 1 else x.shape[0]
    check_index(jnp.where(target == ignore_index, 0, target), C, "Target out of bounds")
    return _nll(x, target, weight, reduction, ignore_index)


@lowering("aten::nll_loss2d_forward.default")
def nll_loss2d_forward(x, target, weight, reduction, ignore_index):
    return _nll(x, target, weight, reduction, ignore_index)


@lowering("aten::nll_loss_backward.default", "aten::nll_loss2d_backward.default")
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    f = lambda v: _nll(v, target, weight, reduction, ignore_index)[0]
    if reduction == 1:
        # PyTorch divides by the saved total weight, not a recomputed one.
        f = lambda v: _nll(v, target, weight, 2, ignore_index)[0] / total_weight
    return jax.vjp(f, x)[1](grad.astype(x.dtype))[0]


@lowering("aten::mse_loss.default")
def mse_loss(x, y, reduction=1):
    d = jnp.square(x - y)
    return d if reduction == 0 else jnp.mean(d) if reduction == 1 else jnp.sum(d)


@lowering("aten::mse_loss_backward.default")
def mse_loss_backward(grad, x, y, reduction):
    scale = 2.0 / x.size if reduction == 1 else 2.0
    return grad * scale * (x - y)




def _pointwise_loss_backward(grad, x, y, reduction, derivative):
    """The gradient of a pointwise loss w.r.t. its input: `derivative(x - y)` times the incoming
    gradient (a scalar unless reduction is 'none'), divided by the count for 'mean'."""
    d = derivative(x - y)
    scale = 1.0 / x.size if reduction == 1 else 1.0
    return (grad * scale * d).astype(x.dtype)


@lowering("aten::smooth_l1_loss_backward.default")
def smooth_l1_loss_backward(grad, x, y, reduction, beta):
    if beta == 0:
        return _pointwise_loss_backward(grad, x, y, reduction, jnp.sign)
    return _pointwise_loss_backward(
        grad, x, y, reduction, lambda d: jnp.where(jnp.abs(d) < beta, d / beta, jnp.sign(d)))


@lowering("aten::huber_loss_backward.default")
def huber_loss_backward(grad, x, y, reduction, delta):
    return _pointwise_loss_backward(
        grad, x, y, reduction,
        lambda d: jnp.where(jnp.abs(d) <= delta, d, delta * jnp.sign(d)))


# --- pairwise distances ----------------------------------------------------------------------
def _p_norm_of_differences(d, p):
    a = jnp.abs(d)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(d.dtype)
    if p == float("inf"):
        return jnp.max(a, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        # sqrt has an infinite slope at 0; PyTorch's gradient there is 0.
        s = jnp.sum(a * a, axis=-1)
        return jnp.where(s > 0, jnp.sqrt(jnp.where(s > 0, s, 1)), 0)
    s = jnp.sum(a ** p, axis=-1)
    return jnp.where(s > 0, jnp.where(s > 0, s, 1) ** (1.0 / p), 0)


def _cdist(x1, x2, p):
    return _p_norm_of_differences(x1[..., :, None, :] - x2[..., None, :, :], p)


def _pdist(x, p):
    i, j = np.triu_indices(x.shape[0], 1)
    return _p_norm_of_differences(x[i] - x[j], p)


@lowering("aten::_cdist_forward.default")
def cdist_forward(x1, x2, p, compute_mode=None):
    return _cdist(x1, x2, p)


@lowering("aten::_cdist_backward.default")
def cdist_backward(grad, x1, x2, p, cdist):
    # PyTorch returns the gradient of x1 expanded to the common batch shape (autograd sums it).
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    if 0 in x1.shape[-2:] + x2.shape[-2:-1] + (int(np.prod(batch)),):
        return jnp.zeros_like(x1)
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    return jax.vjp(lambda a: _cdist(a, x2, p), x1)[1](grad)[0]


@lowering("aten::_pdist_forward.default")
def pdist_forward(x, p=2.0):
    return _pdist(x, p)


@lowering("aten::_pdist_backward.default")
def pdist_backward(grad, x, p, pdist):
    return jax.vjp(lambda a: _pdist(a, p), x)[1](grad)[0]


# --- grid_sampler_3d: PyTorch's coordinate rules (unnormalise, pad, then interpolate) ----------
def _unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    distance = jnp.abs(coord - low)
    extra = jnp.fmod(distance, span)
    flips = jnp.floor(distance / span)
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _source_index(coord, size, padding_mode, align_corners):
    coord = _unnormalize(coord, size, align_corners)
    if padding_mode == 1:  # border
        coord = jnp.clip(coord, 0, size - 1)
    elif padding_mode == 2:  # reflection
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else \
            _reflect(coord, -1, 2 * size - 1)
        coord = jnp.clip(coord, 0, size - 1)
    return coord


@lowering("aten::grid_sampler_3d.default")
def grid_sampler_3d(x, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode not in (0, 1):
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    d, h, w = x.shape[2:]
    ix = _source_index(grid[..., 0], w, padding_mode, align_corners)
    iy = _source_index(grid[..., 1], h, padding_mode, align_corners)
    iz = _source_index(grid[..., 2], d, padding_mode, align_corners)

    def corner(vol, z, y, xx):  # vol: (C, D, H, W); z, y, xx: int (Do, Ho, Wo)
        ok = (z >= 0) & (z < d) & (y >= 0) & (y < h) & (xx >= 0) & (xx < w)
        v = vol[:, jnp.clip(z, 0, d - 1), jnp.clip(y, 0, h - 1), jnp.clip(xx, 0, w - 1)]
        return jnp.where(ok, v, 0)

    def sample(vol, z, y, xx):
        if interpolation_mode == 1:  # nearest (round half to even, as nearbyint does)
            return corner(vol, jnp.round(z).astype(jnp.int32), jnp.round(y).astype(jnp.int32),
                          jnp.round(xx).astype(jnp.int32))
        z0, y0, x0 = (jnp.floor(c) for c in (z, y, xx))
        out = 0
        for dz in (0, 1):
            for dy in (0, 1):
                for dx in (0, 1):
                    weight = ((1 - jnp.abs(z - (z0 + dz))) * (1 - jnp.abs(y - (y0 + dy)))
                              * (1 - jnp.abs(xx - (x0 + dx))))
                    out = out + weight * corner(vol, (z0 + dz).astype(jnp.int32),
                                                (y0 + dy).astype(jnp.int32),
                                                (x0 + dx).astype(jnp.int32))
        return out

    return jax.vmap(sample)(x, iz, iy, ix).astype(x.dtype)


# --- embedding_bag -----------------------------------------------------------------------------
@lowering("aten::_embedding_bag.default")
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    n, dim = indices.shape[0], weight.shape[1]
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bag = jnp.searchsorted(offsets[:bags], jnp.arange(n), side="right") - 1  # offset2bag
    if include_last_offset and n:
        bag = jnp.where(jnp.arange(n) >= offsets[-1], bags, bag)  # past the last bag: dropped
    valid = (indices != padding_idx) & (bag >= 0) & (bag < bags)
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    segment = jnp.where(valid, bag, bags)  # invalid positions go to a dropped extra segment
    count = jax.ops.segment_sum(valid.astype(jnp.int64), segment, bags + 1)[:bags]
    if mode == 2:
        best = jax.ops.segment_max(jnp.where(valid[:, None], rows, -jnp.inf), segment, bags + 1)
        best = best[:bags]
        at_best = valid[:, None] & (rows == best[segment.clip(0, bags - 1)])
        first = jax.ops.segment_min(jnp.where(at_best, jnp.arange(n)[:, None], n), segment,
                                    bags + 1)[:bags]
        max_indices = jnp.where(count[:, None] > 0, indices[jnp.clip(first, 0, max(n - 1, 0))], -1)
        out = jnp.where(count[:, None] > 0, best, 0)
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), segment, bags + 1)[:bags]
        if mode == 1:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    # bag_size has one entry per offset, even the closing one of include_last_offset
    bag_size = jnp.concatenate([count, jnp.zeros(offsets.shape[0] - bags, jnp.int64)])
    return (out.astype(weight.dtype).reshape(bags, dim), bag.astype(jnp.int64),
            bag_size, max_indices.astype(jnp.int64))


@lowering("aten::_embedding_bag_dense_backward.default")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                 num_weights, scale_grad_by_freq, mode, per_sample_weights=None,
                                 padding_idx=-1):
    dim = grad.shape[1]
    if mode == 2:
        filled = (bag_size[:grad.shape[0]] > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(dim), maximum_indices.shape)
        return jnp.zeros((num_weights, dim), grad.dtype).at[
            jnp.where(filled, maximum_indices, num_weights), cols].add(grad, mode="drop")
    bags = grad.shape[0]
    valid = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < bags)
    bag = jnp.clip(offset2bag, 0, max(bags - 1, 0))
    g = grad[bag]
    if mode == 1:
        g = g / jnp.maximum(bag_size[bag], 1)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        g = g * per_sample_weights[:, None].astype(g.dtype)
    if scale_grad_by_freq:
        freq = jnp.zeros(num_weights, g.dtype).at[indices].add(1)
        g = g / freq[indices][:, None]
    g = jnp.where(valid[:, None], g, 0)
    return jnp.zeros((num_weights, dim), grad.dtype).at[indices].add(g)


@lowering("aten::_embedding_bag_per_sample_weights_backward.default")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    bags = grad.shape[0]
    valid = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < bags)
    g = grad[jnp.clip(offset2bag, 0, max(bags - 1, 0))]
    return jnp.where(valid, jnp.sum(g * weight[indices], axis=1), 0).astype(grad.dtype)


@lowering("aten::_embedding_bag_backward.default")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse,
                           per_sample_weights=None, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag(sparse=True) gradients are sparse tensors, "
                                  "which the tpu device does not support")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                        num_weights, scale_grad_by_freq, mode,
                                        per_sample_weights, padding_idx)


# --- antialiased bilinear resize: PyTorch's (and PIL's) separable triangle filter --------------
def _aa_weights(in_size, out_size, align_corners, scale):
    """(out, in) float32 matrix of PyTorch's antialiasing weights along one axis."""
    f32 = np.float32
    if align_corners:
        scale = f32((in_size - 1) / (out_size - 1)) if out_size > 1 else f32(0)
    else:
        scale = f32(1.0 / scale) if scale is not None and scale > 0 else f32(in_size / out_size)
    support = f32(scale) if scale >= 1.0 else f32(1.0)  # interp_size / 2 = 1, widened by scale
    max_taps = int(np.ceil(support)) * 2 + 1
    invscale = f32(1.0 / scale) if scale >= 1.0 else f32(1.0)
    weights = np.zeros((out_size, in_size), np.float32)
    for i in range(out_size):
        center = f32(scale * (i + 0.5))
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), max_taps)
        taps = np.maximum(
            0, 1 - np.abs((np.arange(xsize, dtype=np.float32) + xmin - center + f32(0.5))
                          * invscale)).astype(np.float32)
        total = taps.sum(dtype=np.float32)
        if total != 0:
            taps = taps / total
        weights[i, xmin:xmin + xsize] = taps
    return weights


def _aa_resize(x, output_size, align_corners, scales_h, scales_w):
    wh = _aa_weights(x.shape[-2], output_size[0], align_corners, scales_h)
    ww = _aa_weights(x.shape[-1], output_size[1], align_corners, scales_w)
    horizontal = jnp.einsum("...hw,ow->...ho", x.astype(jnp.float32), ww,
                            precision=lax.Precision.HIGHEST)
    out = jnp.einsum("...hw,oh->...ow", horizontal, wh, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


@lowering("aten::_upsample_bilinear2d_aa.default")
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    return _aa_resize(x, output_size, align_corners, scales_h, scales_w)


@lowering("aten::_upsample_bilinear2d_aa_backward.default")
def upsample_bilinear2d_aa_backward(grad, output_size, input_size, align_corners, scales_h=None,
                                    scales_w=None):
    x = jnp.zeros(tuple(input_size), grad.dtype)
    _, pullback = jax.vjp(lambda a: _aa_resize(a, output_size, align_corners, scales_h,
                                               scales_w), x)
    return pullback(grad)[0]


# --- CTC loss ----------------------------------------------------------------------------------
def _ctc_labels(targets, target_lengths):
    """(B, S) padded targets from either layout PyTorch accepts."""
    lengths = [int(n) for n in target_lengths]
    width = max(lengths, default=0)
    if targets.ndim == 2:
        return targets[:, :max(width, 1)] if width else jnp.zeros((len(lengths), 1), targets.dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    index = np.minimum(starts[:, None] + np.arange(max(width, 1)),
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
        prev1 = jnp.concatenate([jnp.full((bsz, 1), neg), alpha[:, :-1]], axis=1)
        prev2 = jnp.concatenate([jnp.full((bsz, 2), neg), alpha[:, :-2]], axis=1)
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
