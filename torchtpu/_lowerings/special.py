"""Special functions (torch.special.*, i0, polygamma, igamma, sinc, logit...).

Half-precision inputs are computed in float32 and rounded once, as PyTorch's CPU kernels do."""
import math

import jax.numpy as jnp
import jax.scipy.special as jss
from jax import lax

from .pointwise import digamma, xlog
from .._core.registry import Promote, lowering


def _unary(name, fn):
    lowering(f"aten::{name}.default", promote=Promote.RESULT, opmath=True)(fn)


for _name, _fn in {
    "i0": jss.i0, "special_i0e": jss.i0e, "special_i1": jss.i1, "special_i1e": jss.i1e,
    "special_ndtri": jss.ndtri, "special_log_ndtr": jss.log_ndtr, "special_ndtr": jss.ndtr,
    "special_erfcx": jss.erfcx, "special_entr": jss.entr,
}.items():
    _unary(_name, _fn)


@lowering("aten::sinc.default", promote=Promote.RESULT, opmath=True)
def sinc(x):
    px = jnp.pi * x
    safe = jnp.where(x == 0, 1, px)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


@lowering("aten::logit.default", promote=Promote.RESULT)
def logit(x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lowering("aten::special_xlog1py.default", "aten::special_xlog1py.self_scalar",
          "aten::special_xlog1py.other_scalar", promote=Promote.RESULT, opmath=True)
def xlog1py(x, y):
    return xlog(x, y, jnp.log1p)


@lowering("aten::xlogy.Scalar_Self", "aten::xlogy.Scalar_Other", promote=Promote.RESULT)
def xlogy_scalar(x, y):
    return xlog(x, y, jnp.log)


@lowering("aten::special_zeta.default", "aten::special_zeta.self_scalar",
          "aten::special_zeta.other_scalar", promote=Promote.RESULT, opmath=True)
def zeta(x, q):
    # Hurwitz zeta; PyTorch gives inf at x == 1 and nan for x < 1.
    r = jss.zeta(x, q)
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, r))


def _igamma_cases(a, x, r, lower):
    """PyTorch's special cases of calc_igamma/calc_igammac, in its order, around SciPy's value
    `r` (which gives NaN for several of them): `lower` for igamma, else igammac."""
    one, zero = (1, 0) if lower else (0, 1)
    nan = jnp.nan
    return jnp.where((x < 0) | (a < 0), nan,
           jnp.where(a == 0, jnp.where(x > 0, one, nan),
           jnp.where(x == 0, zero,
           jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, zero),
           jnp.where(jnp.isinf(x), one, r)))))


@lowering("aten::igamma.default", promote=Promote.RESULT, opmath=True)
def igamma(a, x):
    return _igamma_cases(a, x, jss.gammainc(a, x), lower=True)


@lowering("aten::igammac.default", promote=Promote.RESULT, opmath=True)
def igammac(a, x):
    return _igamma_cases(a, x, jss.gammaincc(a, x), lower=False)


@lowering("aten::mvlgamma.default", promote=Promote.RESULT, opmath=True)
def mvlgamma(x, p):
    return jss.multigammaln(x, p)


@lowering("aten::nextafter.default", promote=Promote.RESULT)
def nextafter(x, y):
    return lax.nextafter(*jnp.broadcast_arrays(x, y))


@lowering("aten::conj_physical.default", "aten::_conj_physical.default")
def conj_physical(x):
    return jnp.conj(x)


@lowering("aten::polygamma.default", promote=Promote.RESULT, opmath=True)
def polygamma(n, x):
    if n == 0:
        return digamma(x)
    # JAX's polygamma is only accurate for x > 0. Below 1, use
    # psi_n(x) = psi_n(x + 1) + (-1)^(n+1) n! / x^(n+1) until x >= 1, as PyTorch's zeta does.
    sign = (-1) ** (n + 1) * math.factorial(n)

    def low(xs):
        return (xs < 1) & jnp.isfinite(xs)

    def step(carry):
        xs, acc = carry
        below = low(xs)
        acc = acc + jnp.where(below, jnp.where(below, xs, 1.0) ** -(n + 1), 0)
        return jnp.where(below, xs + 1, xs), acc

    xs, acc = lax.while_loop(lambda c: jnp.any(low(c[0])), step, (x, jnp.zeros_like(x)))
    return jss.polygamma(n, xs) + sign * acc


@lowering("aten::angle.default")
def angle(x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    x = x.astype(jnp.result_type(x, jnp.float32)) if not jnp.issubdtype(x.dtype, jnp.floating) else x
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


@lowering("aten::frexp.Tensor")
def frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)


for _name, _fn in {
    "special_modified_bessel_i0": jss.i0, "special_modified_bessel_i1": jss.i1,
    "special_spherical_bessel_j0": lambda x: jnp.where(x == 0, 1.0, jnp.sin(x) / jnp.where(x == 0, 1.0, x)),
}.items():
    _unary(_name, _fn)

