"""Matrix products; float32 precision follows torch.get_float32_matmul_precision()."""
import jax.numpy as jnp

from .registry import lowering


def _precision():
    from .._device.module import jax_precision
    return jax_precision()


def _matmul(a, b):
    return jnp.matmul(a, b, precision=_precision())


def _scaled_sum(bias, product, beta, alpha):
    """beta * bias + alpha * product, as PyTorch's addmm family computes it: integer tensors
    take integer scalars (0.6 becomes 0), and beta == 0 ignores bias (its NaNs too)."""
    if jnp.issubdtype(bias.dtype, jnp.integer) or bias.dtype == jnp.bool_:
        beta = jnp.trunc(jnp.asarray(beta)).astype(bias.dtype)
        alpha = jnp.trunc(jnp.asarray(alpha)).astype(bias.dtype)
    return jnp.where(beta == 0, 0, beta * bias) + alpha * product


@lowering("aten::mm.default", promote=True, precision=True)
def mm(a, b):
    return _matmul(a, b)


@lowering("aten::bmm.default", promote=True, precision=True)
def bmm(a, b):
    return _matmul(a, b)


@lowering("aten::addmm.default", promote=True, precision=True)
def addmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, b), beta, alpha)


@lowering("aten::baddbmm.default", promote=True, precision=True)
def baddbmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, b), beta, alpha)


@lowering("aten::addbmm.default", promote=True, precision=True)
def addbmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, jnp.sum(_matmul(a, b), axis=0), beta, alpha)


@lowering("aten::mv.default", promote=True, precision=True)
def mv(a, v):
    return _matmul(a, v)


@lowering("aten::dot.default", promote=True, precision=True)
def dot(a, b):
    return jnp.dot(a, b, precision=_precision())


@lowering("aten::vdot.default", promote=True, precision=True)
def vdot(a, b):
    return jnp.dot(jnp.conj(a), b, precision=_precision())  # the first argument conjugated


@lowering("aten::addmv.default", promote=True, precision=True)
def addmv(bias, a, v, beta=1, alpha=1):
    return _scaled_sum(bias, _matmul(a, v), beta, alpha)


