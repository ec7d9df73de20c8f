"""Pairwise distances: `cdist` and `pdist` (p-norms of differences), their backward ops the
jax.vjp of their forward."""
import jax
import jax.numpy as jnp
import numpy as np

from .._core.registry import lowering


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
