"""Matrix products; float32 precision follows torch.get_float32_matmul_precision()."""
import jax.numpy as jnp

from .registry import lowering


def _precision():
    from .._device.module import jax_precision
    return jax_precision()


def _matmul(a, b):
    return jnp.matmul(a, b, precision=_precision())


@lowering("aten::mm.default", promote=True, precision=True)
def mm(a, b):
    return _matmul(a, b)


@lowering("aten::bmm.default", promote=True, precision=True)
def bmm(a, b):
    return _matmul(a, b)


@lowering("aten::addmm.default", promote=True, precision=True)
def addmm(bias, a, b, beta=1, alpha=1):
    return beta * bias + alpha * _matmul(a, b)


@lowering("aten::baddbmm.default", promote=True, precision=True)
def baddbmm(bias, a, b, beta=1, alpha=1):
    return beta * bias + alpha * _matmul(a, b)


@lowering("aten::addbmm.default", promote=True, precision=True)
def addbmm(bias, a, b, beta=1, alpha=1):
    return beta * bias + alpha * jnp.sum(_matmul(a, b), axis=0)


@lowering("aten::mv.default", promote=True, precision=True)
def mv(a, v):
    return _matmul(a, v)


@lowering("aten::dot.default", "aten::vdot.default", promote=True, precision=True)
def dot(a, b):
    return jnp.dot(a, b, precision=_precision())


@lowering("aten::addmv.default", promote=True, precision=True)
def addmv(bias, a, v, beta=1, alpha=1):
    return beta * bias + alpha * _matmul(a, v)


