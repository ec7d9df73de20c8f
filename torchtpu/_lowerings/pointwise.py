"""Elementwise math, comparisons and `where`: PyTorch's type promotion comes from the meta
kernel (inputs are cast to the result dtype before the JAX function runs)."""
import jax
import jax.numpy as jnp
import torch
from jax import lax
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .._core.dtypes import check_scalar_fits
from .._core.registry import Promote, check, lowering
from .meta import c10_name


def _not_complex(name):
    def validate(x, y, *rest):
        if x.is_complex() or (isinstance(y, torch.Tensor) and y.is_complex()):
            raise RuntimeError(f"{name} not implemented for complex tensors.")
    return validate


def _check_alpha(x, y, alpha=1):
    # ATen's alpha_check, on the dtype the op computes in (PyTorch's Python reference raises
    # another message, and the table's promotion would quietly cast the alpha).
    if alpha is None or (isinstance(alpha, int) and not isinstance(alpha, bool) and alpha == 1):
        return
    dtype = elementwise_dtypes(x, y, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
    if isinstance(alpha, bool) and dtype != torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if not (dtype.is_floating_point or dtype.is_complex or isinstance(alpha, int)):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating "
                           "point number.")
    if isinstance(alpha, complex) and not dtype.is_complex:
        raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex "
                           "number.")


@lowering("aten::add.Tensor", "aten::add.Scalar", promote=Promote.RESULT, validate=_check_alpha)
def add(x, y, alpha=1):
    return x + alpha * y


def _check_sub(x, y, alpha=1):
    # PyTorch's sub_check; a Python bool counts as a bool tensor.
    bools = [t.dtype == torch.bool if isinstance(t, torch.Tensor) else isinstance(t, bool)
             for t in (x, y)]
    if all(bools):
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")
    if any(bools):
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` "
                           "operator instead.")
    _check_alpha(x, y, alpha)


@lowering("aten::sub.Tensor", "aten::sub.Scalar", promote=Promote.RESULT, validate=_check_sub)
def sub(x, y, alpha=1):
    return x - alpha * y


@lowering("aten::rsub.Tensor", "aten::rsub.Scalar", promote=Promote.RESULT, validate=_check_sub)
def rsub(x, y, alpha=1):
    return y - alpha * x


@lowering("aten::mul.Tensor", "aten::mul.Scalar", promote=Promote.RESULT)
def mul(x, y):
    return x * y


@lowering("aten::div.Tensor", "aten::div.Scalar", promote=Promote.RESULT)
def div(x, y):
    return x / y


@lowering("aten::div.Tensor_mode", "aten::div.Scalar_mode", promote=Promote.RESULT,
          value_checks=True)
def div_mode(x, y, rounding_mode=None):
    if rounding_mode is None:
        return x / y
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
        _check_nonzero(y)
        if rounding_mode == "floor":
            return jnp.floor_divide(x, y)
        x, y = jnp.broadcast_arrays(x, jnp.asarray(y, jnp.asarray(x).dtype))
        q = lax.div(x, y)  # C division truncates
        return q
    if rounding_mode == "floor":
        return floor_divide_float(x, y)
    return jnp.trunc(x / y)


def _check_nonzero(y):
    """Integer division by zero raises on the CPU (CUDA returns garbage)."""
    check(jnp.all(jnp.asarray(y) != 0), "ZeroDivisionError", RuntimeError)


def floor_divide_float(x, y):
    """PyTorch's floating floor division: from fmod, so an infinite dividend gives NaN (not
    floor(inf / y) = inf), with the quotient rounded to the nearest integer near .5 and the
    sign of zero kept."""
    x, y = jnp.broadcast_arrays(x, jnp.asarray(y, jnp.asarray(x).dtype))
    mod = jnp.fmod(x, y)
    div = (x - mod) / y
    div = jnp.where((mod != 0) & ((y < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    quotient = x / y
    floor = jnp.where(div != 0, floor, jnp.copysign(jnp.zeros_like(div), quotient))
    return jnp.where(y == 0, quotient, floor)


@lowering("aten::floor_divide.default", "aten::floor_divide.Scalar", "aten::floor_divide_.Tensor",
          "aten::floor_divide_.Scalar", promote=Promote.RESULT, value_checks=True)
def floor_divide(x, y):
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
        return div_mode(x, y, "floor")
    return floor_divide_float(x, y)


@lowering("aten::remainder.Tensor", "aten::remainder.Scalar", promote=Promote.RESULT,
          value_checks=True)
def remainder(x, y):
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
        _check_nonzero(y)
    return jnp.remainder(x, y)


@lowering("aten::fmod.Tensor", "aten::fmod.Scalar", promote=Promote.RESULT, value_checks=True)
def fmod(x, y):
    if jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
        _check_nonzero(y)
    return jnp.fmod(x, y)


def _check_pow(x, y):
    # ATen's pow(Tensor, Scalar): an integer tensor to a negative integer power has no integer
    # result (a tensor exponent is not checked: its values are on the device).
    if (isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
            and isinstance(y, int) and y < 0):
        raise RuntimeError("Integers to negative integer powers are not allowed.")


@lowering("aten::pow.Tensor_Tensor", "aten::pow.Tensor_Scalar", "aten::pow.Scalar",
          promote=Promote.RESULT, validate=_check_pow)
def pow_(x, y):
    if all(jnp.issubdtype(jnp.asarray(v).dtype, jnp.integer) for v in (x, y)):
        return _int_pow(x, y)
    return jnp.power(x, y)


def _int_pow(x, y):
    # Square-and-multiply over every bit of the exponent, wrapping like C++ integers (JAX's
    # integer power only looks at an exponent's low bits).
    x, y = jnp.broadcast_arrays(jnp.asarray(x), jnp.asarray(y))
    y = y.astype(x.dtype)

    def body(state):
        result, base, e = state
        result = jnp.where(e & 1, result * base, result)
        return result, base * base, e >> 1

    positive = jnp.maximum(y, 0)
    result, _, _ = lax.while_loop(lambda s: jnp.any(s[2] > 0), body,
                                  (jnp.ones_like(x), x, positive))
    # x ** -n truncates to 0 except for x = 1 and x = -1, as in PyTorch's powi.
    at_negative = jnp.where(x == 1, 1, jnp.where(x == -1, jnp.where(y & 1, -1, 1), 0)).astype(x.dtype)
    return jnp.where(y < 0, at_negative, result)


@lowering("aten::neg.default", promote=Promote.RESULT)
def neg(x):
    return -x


@lowering("aten::reciprocal.default", promote=Promote.RESULT)
def reciprocal(x):
    return 1 / x


@lowering("aten::abs.default")
def abs_(x):
    return jnp.abs(x)


@lowering("aten::sign.default")
def sign(x):
    if x.dtype == jnp.bool_:
        return x
    # PyTorch's sign is (0 < x) - (x < 0): 0 for NaN.
    return jnp.where(jnp.isnan(x), 0, jnp.sign(x)) if jnp.issubdtype(x.dtype, jnp.floating) \
        else jnp.sign(x)


@lowering("aten::sgn.default")
def sgn(x):
    return sign(x)


@lowering("aten::maximum.default", promote=Promote.RESULT, validate=_not_complex("maximum"))
def maximum(x, y):
    return jnp.maximum(x, y)


@lowering("aten::minimum.default", promote=Promote.RESULT, validate=_not_complex("minimum"))
def minimum(x, y):
    return jnp.minimum(x, y)


def _check_clamp(x, lo=None, hi=None):
    if lo is None and hi is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    bounds = [b for b in (lo, hi) if b is not None]
    if x.dtype == torch.bool and all(
            isinstance(b, bool) or isinstance(b, torch.Tensor) and b.dtype == torch.bool for b in bounds):
        # Bool bounds keep the result bool, which the CPU kernels have no code for.
        name = "clamp_min_scalar_cpu" if hi is None else "clamp_max_scalar_cpu" if lo is None \
            else "clamp_scalar_cpu"
        raise NotImplementedError(f'"{name}" not implemented for \'Bool\'')


@lowering("aten::clamp.default", "aten::clamp.Tensor", promote=Promote.RESULT, validate=_check_clamp)
def clamp(x, lo=None, hi=None):
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@lowering("aten::clamp_min.default", "aten::clamp_min.Tensor", promote=Promote.RESULT)
def clamp_min(x, lo):
    return jnp.maximum(x, lo)


@lowering("aten::clamp_max.default", "aten::clamp_max.Tensor", promote=Promote.RESULT)
def clamp_max(x, hi):
    return jnp.minimum(x, hi)


@lowering("aten::addcmul.default", promote=Promote.RESULT, opmath=True)
def addcmul(x, a, b, value=1):
    if jnp.issubdtype(x.dtype, jnp.integer):  # the CPU kernel converts value to the int type
        value = jnp.asarray(value).astype(x.dtype)
    return x + value * a * b


def _check_addcdiv(x, a, b, value=1):
    if not any(t.is_floating_point() or t.is_complex() for t in (a, b)):
        raise RuntimeError(
            "Integer division with addcdiv is no longer supported, and in a future  release "
            "addcdiv will perform a true division of tensor1 and tensor2. The historic addcdiv "
            "behavior can be implemented as (input + value * torch.trunc(tensor1 / tensor2))."
            "to(input.dtype) for integer inputs and as (input + value * tensor1 / tensor2) for "
            "float inputs. The future addcdiv behavior is just the latter implementation: "
            "(input + value * tensor1 / tensor2), for all dtypes.")


@lowering("aten::addcdiv.default", promote=Promote.RESULT, opmath=True, validate=_check_addcdiv)
def addcdiv(x, a, b, value=1):
    return x + value * a / b


@lowering("aten::lerp.Scalar", "aten::lerp.Tensor", promote=Promote.RESULT, opmath=True)
def lerp(x, end, weight):
    # PyTorch's formula: exact at weight 0 and 1 from either side.
    return jnp.where(jnp.abs(weight) < 0.5, x + weight * (end - x), end - (end - x) * (1 - weight))


# --- unary float functions (integers promote to the default float dtype) -----------------

# square, isfinite, silu_backward and where's Scalar overloads are CompositeImplicitAutograd in
# PyTorch: they decompose into these, so they need no lowering of their own.
def _unary(name, fn):
    lowering(f"aten::{name}.default", promote=Promote.RESULT, opmath=True)(fn)


def digamma(x):
    # PyTorch defines digamma(+-0) = -+inf (the limits towards zero); SciPy's gives NaN.
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jax.scipy.special.digamma(x))


for _name, _fn in {
    "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2,
    "log10": jnp.log10, "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt,
    "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "asin": jnp.arcsin, "acos": jnp.arccos,
    "atan": jnp.arctan, "sinh": jnp.sinh, "cosh": jnp.cosh, "tanh": jnp.tanh,
    "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh,
    "sigmoid": jax.nn.sigmoid, "erf": jax.scipy.special.erf, "erfc": jax.scipy.special.erfc,
    "erfinv": jax.scipy.special.erfinv, "lgamma": jax.scipy.special.gammaln,
    "digamma": digamma,
    "floor": jnp.floor, "ceil": jnp.ceil, "trunc": jnp.trunc, "round": jnp.round,
    "frac": lambda x: x - jnp.trunc(x),
}.items():
    _unary(_name, _fn)


@lowering("aten::round.decimals", promote=Promote.RESULT)
def round_decimals(x, decimals=0):
    return jnp.round(x, decimals)


for _name, _fn in {"atan2": jnp.arctan2, "hypot": jnp.hypot, "fmax": jnp.fmax,
                   "fmin": jnp.fmin}.items():
    lowering(f"aten::{_name}.default", promote=Promote.RESULT)(_fn)


@lowering("aten::logaddexp.default", promote=Promote.RESULT, opmath=True)
def logaddexp(x, y):
    if jnp.iscomplexobj(x):
        return complex_logaddexp(x, y)
    return jnp.logaddexp(x, y)


def complex_logaddexp(x, y):
    """PyTorch's complex log(exp(x) + exp(y)): ordered by real part, so the imaginary part
    continues that of the larger term (jnp.logaddexp may land 2*pi away)."""
    x_smaller = jnp.real(x) < jnp.real(y)
    lo, hi = jnp.where(x_smaller, x, y), jnp.where(x_smaller, y, x)
    both_infinite = ~jnp.isfinite(jnp.real(lo)) & (jnp.real(lo) == jnp.real(hi))
    result = jnp.where(both_infinite,
                       jnp.where(jnp.real(lo) < 0, lo, jnp.log(jnp.exp(lo) + jnp.exp(hi))),
                       jnp.log1p(jnp.exp(lo - hi)) + hi)
    nan = jnp.isnan(x) | jnp.isnan(y)
    return jnp.where(nan, jnp.array(complex(jnp.nan, jnp.nan), x.dtype), result)


def xlog(x, y, log):
    """PyTorch's xlogy/xlog1py: NaN where y is NaN, else 0 where x is 0 (a NaN y with a zero x
    gives NaN, where SciPy's gives 0), else x * log(y)."""
    return jnp.where(jnp.isnan(y), jnp.nan, jnp.where(x == 0, 0, x * log(y)))


@lowering("aten::xlogy.Tensor", promote=Promote.RESULT)
def xlogy(x, y):
    return xlog(x, y, jnp.log)


# --- comparisons and logic -------------------------------------------------------------

for _name, _fn in {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
                   "gt": jnp.greater, "ge": jnp.greater_equal}.items():
    lowering(f"aten::{_name}.Tensor", f"aten::{_name}.Scalar", promote=Promote.COMMON)(_fn)


@lowering("aten::logical_not.default")
def logical_not(x):
    return jnp.logical_not(x)


@lowering("aten::logical_and.default")
def logical_and(x, y):
    return jnp.logical_and(x, y)


@lowering("aten::logical_or.default")
def logical_or(x, y):
    return jnp.logical_or(x, y)


@lowering("aten::logical_xor.default")
def logical_xor(x, y):
    return jnp.logical_xor(x, y)


def _check_heaviside(x, values):
    if x.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")


@lowering("aten::heaviside.default", validate=_check_heaviside)
def heaviside(x, values):
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


# PyTorch's shifts: a count past the width (or negative) gives 0, or the sign for a right shift
# of a negative number, as XLA's shifts do.
for _name, _fn in {"__lshift__": jnp.left_shift, "__ilshift__": jnp.left_shift,
                   "__rshift__": jnp.right_shift, "__irshift__": jnp.right_shift}.items():
    lowering(f"aten::{_name}.Tensor", f"aten::{_name}.Scalar", promote=Promote.RESULT)(_fn)
for _name, _fn in {"bitwise_left_shift": jnp.left_shift, "bitwise_right_shift": jnp.right_shift}.items():
    lowering(f"aten::{_name}.Tensor", f"aten::{_name}.Tensor_Scalar",
             f"aten::{_name}.Scalar_Tensor", promote=Promote.RESULT)(_fn)


@lowering("aten::bitwise_not.default")
def bitwise_not(x):
    return jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.bitwise_not(x)


for _name, _fn in {"bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or,
                   "bitwise_xor": jnp.bitwise_xor}.items():
    lowering(f"aten::{_name}.Tensor", f"aten::{_name}.Scalar", promote=Promote.RESULT)(_fn)


# Elementwise predicates (their dtype refusals are in refusals.py).
for _name in ("isnan", "isinf", "isposinf", "isneginf", "signbit"):
    lowering(f"aten::{_name}.default")(getattr(jnp, _name))


@lowering("aten::nan_to_num.default")
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


@lowering("aten::where.self", promote=Promote.NONE)
def where(cond, x, y):
    # A complex number beside a complex64 tensor (decompositions' `where(mask, x, 0)`) is
    # given its dtype here, as jnp.where's weak typing would give it: passed on, it is a
    # complex128 argument of jnp.where's inner program, which XLA:TPU has no type for.
    x, y = _complex64_number(x, y), _complex64_number(y, x)
    return jnp.where(cond, x, y)


def _complex64_number(v, other):
    if getattr(other, "dtype", None) == jnp.complex64 and (
            isinstance(v, complex) or getattr(v, "dtype", None) == jnp.complex128
            and getattr(getattr(v, "aval", None), "weak_type", False)):
        return jnp.asarray(v, jnp.complex64)
    return v


# --- dtype/identity ----------------------------------------------------------------------


@lowering("aten::copy.default")
def copy(self, src, non_blocking=False):
    return src


@lowering("aten::clone.default")
def clone(x, memory_format=None):
    return x


def _check_fill(x, value):
    if not isinstance(value, torch.Tensor):  # a 0-dim tensor value converts unchecked
        check_scalar_fits(value, x.dtype, x.numel())


@lowering("aten::fill.Scalar", "aten::fill.Tensor", validate=_check_fill)
def fill(x, value):
    return jnp.broadcast_to(jnp.asarray(value), x.shape)


@lowering("aten::zero.default")
def zero(x):
    return jnp.zeros_like(x)


def _check_masked_fill(x, mask, value):
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_fill_ only supports boolean masks, but got mask with dtype "
                           f"{c10_name(mask.dtype)}")
    if not isinstance(value, torch.Tensor):
        check_scalar_fits(value, x.dtype)


@lowering("aten::masked_fill.Scalar", "aten::masked_fill.Tensor", validate=_check_masked_fill)
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(x.dtype), x)


@lowering("aten::copysign.Scalar", promote=Promote.RESULT)
def copysign_scalar(a, b):
    return jnp.copysign(a, jnp.asarray(b, a.dtype))


@lowering("aten::complex.default")
def complex_(real, imag):
    return jax.lax.complex(*jnp.broadcast_arrays(real, imag))


@lowering("aten::polar.default")
def polar(magnitude, angle):
    magnitude, angle = jnp.broadcast_arrays(magnitude, angle)
    return jax.lax.complex(magnitude * jnp.cos(angle), magnitude * jnp.sin(angle))


@lowering("aten::gcd.default", promote=Promote.RESULT)
def gcd(x, y):
    return jnp.gcd(x, y)


@lowering("aten::lcm.default", promote=Promote.RESULT)
def lcm(x, y):
    return jnp.lcm(x, y)


