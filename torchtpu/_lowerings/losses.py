"""Losses: negative log-likelihood, binary cross-entropy, mean squared error (CTC:
ctc_loss.py). The backward ops of the mse, smooth_l1 and huber losses are PyTorch's
decompositions (activations.py says why)."""
import jax
import jax.numpy as jnp

from .._core.registry import lowering
from .meta import dtype_name


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


@lowering("aten::nll_loss_forward.default", "aten::nll_loss2d_forward.default")
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    from .indexing import check_index
    C = x.shape[1] if x.ndim > 1 else x.shape[0]
    check_index(jnp.where(target == ignore_index, 0, target), C, "Target out of bounds",
                negative=False)
    return _nll(x, target, weight, reduction, ignore_index)


@lowering("aten::nll_loss_backward.default", "aten::nll_loss2d_backward.default")
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    f = lambda v: _nll(v, target, weight, reduction, ignore_index)[0]
    if reduction == 1:
        # PyTorch divides by the saved total weight, not a recomputed one.
        f = lambda v: _nll(v, target, weight, 2, ignore_index)[0] / total_weight
    return jax.vjp(f, x)[1](grad.astype(x.dtype))[0]


def _check_bce(x, target, *rest):
    if target.dtype != x.dtype:
        raise RuntimeError(f"Found dtype {dtype_name(target.dtype)} but expected {dtype_name(x.dtype)}")


@lowering("aten::binary_cross_entropy.default", opmath=True, validate=_check_bce)
def binary_cross_entropy(x, target, weight=None, reduction=1):
    from .._core.registry import check
    # The CPU kernel's check of the values (CUDA's is a device assert).
    check(jnp.all((x >= 0) & (x <= 1)), "all elements of input should be between 0 and 1",
          RuntimeError)
    check(jnp.all((target >= 0) & (target <= 1)),
          "all elements of target should be between 0 and 1", RuntimeError)
    # PyTorch clamps the logs at -100 so that a 0 or 1 gives a finite loss.
    loss = (target - 1) * jnp.maximum(jnp.log1p(-x), -100) - target * jnp.maximum(jnp.log(x), -100)
    if weight is not None:
        loss = loss * weight
    return loss if reduction == 0 else jnp.mean(loss) if reduction == 1 else jnp.sum(loss)


@lowering("aten::mse_loss.default")
def mse_loss(x, y, reduction=1):
    d = jnp.square(x - y)
    return d if reduction == 0 else jnp.mean(d) if reduction == 1 else jnp.sum(d)


# Hand-written: PyTorch's decomposition compares every target slot with the inputs, the unused
# ones after a -1 as well (which hold the input's first element): the CPU counts only the labels
# before the first -1. Shapes as the decomposition's (its meta kernel's): a vector or scalar
# input is one row, its unreduced loss of shape (1,).
@lowering("aten::multilabel_margin_loss_forward.default")
def multilabel_margin_loss_forward(x, target, reduction):
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    labels = target.reshape(rows.shape)
    dim = rows.shape[1]
    idx = jnp.arange(dim)
    end = jnp.min(jnp.where(labels == -1, idx, dim), axis=-1, keepdims=True)
    used = idx < end  # the target slots before the first -1
    labels = jnp.where(used, labels, 0)
    is_target = jnp.any((labels[:, :, None] == idx) & used[:, :, None], axis=1)
    u = jnp.take_along_axis(rows, labels, axis=-1)
    z = jnp.maximum(1 - u[:, :, None] + rows[:, None, :], 0) / dim
    z = jnp.where(used[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = z.sum(axis=(1, 2)).astype(x.dtype)
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2:
        loss = loss.sum()
    return loss, is_target.astype(x.dtype).reshape(target.shape)
