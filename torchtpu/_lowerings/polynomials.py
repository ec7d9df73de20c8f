"""Orthogonal polynomials (torch.special.*_polynomial_*): the three-term recurrences PyTorch's
kernels run, with their closed forms for large degrees and their values at the interval ends,
so results agree with the CPU's. `n` is truncated to an integer per element; n < 0 gives 0."""
import jax.numpy as jnp
from jax import lax

from .._core.registry import Promote, lowering


def _recur(x, n, p0, p1, step):
    """P_n(x) from P_0 = p0, P_1 = p1 and P_{i+1} = step(i, x, P_{i-1}, P_i), per element."""
    top = jnp.max(n, initial=1)

    def body(carry):
        i, p, q = carry
        more = i < n
        return i + 1, jnp.where(more, q, p), jnp.where(more, step(i, x, p, q), q)

    _, _, q = lax.while_loop(lambda c: c[0] < top, body, (jnp.ones((), n.dtype), p0, p1))
    return jnp.where(n < 0, 0, jnp.where(n == 0, p0, q))


def _degree(x, n):
    x, n = jnp.broadcast_arrays(x, jnp.trunc(n).astype(jnp.int64))
    return x, n


def _parity(n, even, odd):
    return jnp.where(n % 2 == 0, even, odd)


def chebyshev_t(x, n):
    x, n = _degree(x, n)
    one = jnp.ones_like(x)
    value = _recur(x, n, one, x, lambda i, x, p, q: (x + x) * q - p)
    value = jnp.where((n > 6) & (jnp.abs(x) < 1), jnp.cos(n * jnp.arccos(x)), value)
    value = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, 1, _parity(n, 1, -1)), value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def chebyshev_u(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), x + x, lambda i, x, p, q: (x + x) * q - p)
    theta = jnp.arccos(x)
    s = jnp.sin(theta)
    closed = jnp.where(s != 0, jnp.sin((n + 1) * theta) / jnp.where(s != 0, s, 1),
                       (n + 1) * jnp.cos((n + 1) * theta) / x)
    value = jnp.where((n > 8) & (jnp.abs(x) < 1), closed, value)
    value = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, n + 1, _parity(n, n + 1, -(n + 1))), value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def chebyshev_v(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), x + x - 1, lambda i, x, p, q: (x + x) * q - p)
    theta = jnp.arccos(x)
    ends = _parity(n, n + n + 1, -(n + n + 1))
    half = jnp.cos(theta / 2)
    closed = jnp.where(jnp.sin(theta / 2) != 1,
                       jnp.cos((n + 0.5) * theta) / jnp.where(half != 0, half, 1), ends)
    value = jnp.where((n > 8) & (jnp.abs(x) < 1), closed, value)
    value = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, 1, ends), value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def chebyshev_w(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), x + x + 1, lambda i, x, p, q: (x + x) * q - p)
    theta = jnp.arccos(x)
    ends = jnp.where(x > 0, n + n + 1, _parity(n, 1, -1))
    half = jnp.sin(theta / 2)
    closed = jnp.where(jnp.cos(theta / 2) != 1,
                       jnp.sin((n + 0.5) * theta) / jnp.where(half != 0, half, 1), ends)
    value = jnp.where((n > 8) & (jnp.abs(x) < 1), closed, value)
    value = jnp.where(jnp.abs(x) == 1, ends, value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def hermite_h(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), x + x, lambda i, x, p, q: (x + x) * q - (2 * i) * p)
    return value.astype(x.dtype)


def hermite_he(x, n):
    x, n = _degree(x, n)
    return _recur(x, n, jnp.ones_like(x), x, lambda i, x, p, q: x * q - i * p).astype(x.dtype)


def laguerre_l(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), 1 - x,
                   lambda i, x, p, q: (((i + i) + (1 - x)) * q - i * p) / (i + 1))
    return jnp.where((x == 0) & (n >= 0), 1, value).astype(x.dtype)


def legendre_p(x, n):
    x, n = _degree(x, n)
    value = _recur(x, n, jnp.ones_like(x), x,
                   lambda i, x, p, q: ((i + i + 1) * x * q - i * p) / (i + 1))
    value = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, 1, _parity(n, 1, -1)), value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def _shifted(base):
    return lambda x, n: base(x + x - 1, n)


_POLYNOMIALS = {
    "chebyshev_polynomial_t": chebyshev_t, "chebyshev_polynomial_u": chebyshev_u,
    "chebyshev_polynomial_v": chebyshev_v, "chebyshev_polynomial_w": chebyshev_w,
    "shifted_chebyshev_polynomial_t": _shifted(chebyshev_t),
    "shifted_chebyshev_polynomial_u": _shifted(chebyshev_u),
    "shifted_chebyshev_polynomial_v": _shifted(chebyshev_v),
    "shifted_chebyshev_polynomial_w": _shifted(chebyshev_w),
    "hermite_polynomial_h": hermite_h, "hermite_polynomial_he": hermite_he,
    "laguerre_polynomial_l": laguerre_l, "legendre_polynomial_p": legendre_p,
}

for _name, _fn in _POLYNOMIALS.items():
    lowering(f"aten::special_{_name}.default", f"aten::special_{_name}.x_scalar",
             f"aten::special_{_name}.n_scalar", promote=Promote.RESULT)(
        lambda x, n, _fn=_fn: _fn(jnp.asarray(x), jnp.asarray(n)))
