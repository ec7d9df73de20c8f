"""Tensor factories and random ops (random ops draw from the per-device generator)."""
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import torch

from .._core.dtypes import check_scalar_fits, to_jax_dtype
from .._core.runtime import program_platform
from .._core.registry import check, lowering
from .meta import c10_name, dtype_name


def check_arange(start, end, step=1, dtype=None, *rest):
    if not all(math.isfinite(v) for v in (start, end)):
        raise RuntimeError(f"unsupported range: {start:g} -> {end:g}")
    if step and (end - start) / step > 2.0 ** 63:  # the CPU kernel's bound: int64's range
        raise RuntimeError("invalid size, possible overflow?")
    if dtype is not None and (dtype.is_complex or dtype == torch.bool):
        raise NotImplementedError(f'"arange_cpu" not implemented for \'{dtype_name(dtype)}\'')


@lowering("aten::arange.start_step", "aten::arange.start_out", static=("start", "end", "step"),
          validate=check_arange)
def arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    # Boolean bounds count as integers (XLA has no boolean iota); the output takes the op's dtype.
    start, end, step = (int(v) if isinstance(v, bool) else v for v in (start, end, step))
    return jnp.arange(start, end, step)


def _check_full(size, fill_value, dtype=None, *rest):
    if dtype is None:  # PyTorch infers it from the value
        dtype = torch.tensor(fill_value).dtype if not isinstance(fill_value, float) else \
            torch.get_default_dtype()
    check_scalar_fits(fill_value, dtype, math.prod(size))


@lowering("aten::full.default", validate=_check_full)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value)


@lowering("aten::scalar_tensor.default")
def scalar_tensor(s, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s)


def _check_space(name):
    def validate(start, end, steps, *rest):
        # The CPU's words (PyTorch's reference says "linspace():" for both ops).
        dtype = next((a for a in rest if isinstance(a, torch.dtype)), None)
        if dtype is not None and not dtype.is_complex and complex in (type(start), type(end)):
            raise RuntimeError(f"torch.{name}(): inferred dtype c10::complex<float> can't be safely "
                               f"cast to passed dtype {dtype_name(dtype)}")
    return validate


@lowering("aten::linspace.default", "aten::linspace.out", static=("start", "end"),
          validate=_check_space("linspace"))
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:  # complex bounds make the default dtype's complex type
        dtype = torch.get_default_dtype()
        if complex in (type(start), type(end)):
            dtype = dtype.to_complex()
    out = to_jax_dtype(dtype)
    if steps < 2:
        return jnp.linspace(start, end, steps)
    # PyTorch's CPU kernel's formula, evaluated on the host in the output's arithmetic (double
    # for integers, whose results truncate): the first half counts up from start, the second
    # down from end (jnp.linspace rounds differently: one ulp off at some points).  Exact for
    # the kernel's scalar loop; its vectorised loop (long outputs) can differ in the last bit.
    t = np.float64 if jnp.issubdtype(out, jnp.integer) else \
        np.float32 if out in (jnp.float16, jnp.bfloat16) else np.dtype(out).type
    if jnp.issubdtype(out, jnp.integer):  # the kernel converts the bounds first (truncating)
        start, end = int(start), int(end)
    lo, hi = t(start), t(end)
    step = (hi - lo) / t(steps - 1)
    idx = np.arange(steps)
    values = np.where(idx < steps // 2, lo + step * idx.astype(t),
                      hi - step * (steps - idx - 1).astype(t))
    return jnp.asarray(values.astype(t)).astype(out)


@lowering("aten::eye.default", "aten::eye.out")
def eye(n, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n)


@lowering("aten::eye.m", "aten::eye.m_out")
def eye_m(n, m, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m)


def _floating(x):
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def _check_uniform(x, low=0.0, high=1.0, generator=None):
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low:g} > to={high:g}")
    if x.dtype.is_floating_point and high - low > torch.finfo(x.dtype).max:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{dtype_name(x.dtype)}>"
                           f"::max(), but found to={high:g} and from={low:g} which result in "
                           "to-from to exceed the limit")


@lowering("aten::uniform_.default", random=True, fill=True, validate=_check_uniform)
def uniform_(key, x, low=0.0, high=1.0, generator=None):
    # float64 draws in float64: its bounds may be past float32's range.
    draw = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return jax.random.uniform(key, x.shape, draw, low, high).astype(x.dtype)


@lowering("aten::normal_.default", random=True, fill=True)
def normal_(key, x, mean=0.0, std=1.0, generator=None):
    return (jax.random.normal(key, x.shape, jnp.float32) * std + mean).astype(x.dtype)


def _check_random_range(x, low, high=None, generator=None):
    if high is not None and low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    if x.dtype.is_complex:
        raise RuntimeError("check_random_bounds handles only integral, floating-point and boolean types")
    # ATen's check_from_to_in_range: from and to - 1 must be values of x's dtype.
    if x.dtype.is_floating_point:
        info = torch.finfo(x.dtype)
    else:
        info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
    lo, hi = (0, 1) if info is None else (info.min, info.max)
    checked = [(v, name) for v, name in ((low, "from"), (None if high is None else high - 1, "to - 1"))
               if v is not None]
    for value, name in checked:
        if not lo <= value <= hi:
            raise RuntimeError(f"{name} is out of bounds for {c10_name(x.dtype)}")
    if x.dtype.is_floating_point:  # beyond 2**digits, not every integer is a value of the dtype
        digits = 1 - int(math.log2(torch.finfo(x.dtype).eps))
        for value, name in checked:
            if not -(2 ** digits) <= value <= 2 ** digits:
                warnings.warn(f"{name} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision "
                              f"limitations {c10_name(x.dtype)} can support discrete uniform "
                              "distribution only within this range. This warning will become an "
                              "error in version 1.7 release, please fix the code in advance")


def _check_random_to(x, high, generator=None):
    _check_random_range(x, 0, high)


@lowering("aten::random_.from", random=True, fill=True, validate=_check_random_range)
def random_from(key, x, low, high=None, generator=None):
    if high is None:  # up to the dtype's largest value (a floating type's largest exact integer)
        high = _random_default_high(x.dtype)
    return jax.random.randint(key, x.shape, low, high, jnp.int64).astype(x.dtype)


def _random_default_high(dtype):
    """One past the largest value random_() draws: [0, 2**mantissa digits] for floating types
    (every integer there is exact), [0, max] for integer types, [0, 2**63 - 1) for int64."""
    if dtype == jnp.bool_:
        return 2
    if dtype == jnp.int64:
        return 2 ** 63 - 1
    if jnp.issubdtype(dtype, jnp.integer):
        return int(jnp.iinfo(dtype).max) + 1
    return 2 ** (jnp.finfo(dtype).nmant + 1) + 1


@lowering("aten::random_.default", random=True, fill=True)
def random_default(key, x, generator=None):
    return jax.random.randint(key, x.shape, 0, _random_default_high(x.dtype), jnp.int64).astype(x.dtype)


@lowering("aten::random_.to", random=True, fill=True, validate=_check_random_to)
def random_to(key, x, high, generator=None):
    return jax.random.randint(key, x.shape, 0, high, jnp.int64).astype(x.dtype)


def _check_p(x, p=0.5, generator=None):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p:g}")


def _check_p_values(p):
    # The CPU kernel's check of the probabilities (CUDA's is a device assert).
    check(jnp.all((p >= 0) & (p <= 1)), "Expected p_in >= 0 && p_in <= 1 to be true, but got false.",
          RuntimeError)


@lowering("aten::bernoulli_.float", random=True, fill=True, validate=_check_p)
def bernoulli_float(key, x, p=0.5, generator=None):
    return jax.random.bernoulli(key, p, x.shape).astype(x.dtype)


@lowering("aten::bernoulli_.Tensor", random=True)
def bernoulli_tensor(key, x, p, generator=None):
    _check_p_values(p)
    return jax.random.bernoulli(key, jnp.broadcast_to(p, x.shape)).astype(x.dtype)


@lowering("aten::bernoulli.default", random=True)
def bernoulli(key, p, generator=None):
    _check_p_values(p)
    return jax.random.bernoulli(key, p).astype(p.dtype)


@lowering("aten::native_dropout.default", random=True)
def native_dropout(key, x, p, train=None):
    if not train or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p == 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / (1.0 - p), 0).astype(x.dtype), keep


def _check_parameter(op, name, ok):
    """The CPU's check of a random fill's parameter (before its dtype's): shape inference runs
    once per shape and dtype, so a meta kernel's check would not see the next call's values."""
    def check_value(x, value):
        if not ok(value):
            raise RuntimeError(f"{op}_ expects {name}, but {'got' if op == 'geometric' else 'found'}"
                               f" {name.split()[0]}={value:g}")
    return check_value


def _check_floating(distribution, type_name):
    def check_dtype(x):
        if not x.dtype.is_floating_point:
            raise RuntimeError(f"{distribution} distribution is a continuous probability "
                               f"distribution. dtype must be a floating point but you specified "
                               f"{type_name(x.dtype)}")
    return check_dtype


_check_lambda = _check_parameter("exponential", "lambda > 0.0", lambda v: v > 0)
_check_sigma = _check_parameter("cauchy", "sigma > 0.0", lambda v: v > 0)
_check_std_positive = _check_parameter("log_normal", "std > 0.0", lambda v: v > 0)
_check_p_open = _check_parameter("geometric", "p to be in (0, 1)", lambda v: 0 < v < 1)
_check_exponential_dtype = _check_floating("Exponential", dtype_name)
_check_cauchy_dtype = _check_floating("Cauchy", c10_name)


def _check_exponential(x, lambd=1.0, generator=None):
    _check_lambda(x, lambd)
    _check_exponential_dtype(x)


@lowering("aten::exponential_.default", random=True, fill=True, validate=_check_exponential)
def exponential_(key, x, lambd=1.0, generator=None):
    return (jax.random.exponential(key, x.shape, jnp.float32) / lambd).astype(x.dtype)


def _check_multinomial(probs, num_samples, replacement=False, generator=None):
    if not probs.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                           f"{dtype_name(probs.dtype)}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    categories = probs.shape[-1] if probs.dim() else 1
    if not replacement and num_samples > categories:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if categories > 2 ** 24:
        raise RuntimeError("number of categories cannot exceed 2^24")


@lowering("aten::multinomial.default", random=True, validate=_check_multinomial)
def multinomial(key, probs, num_samples, replacement=False, generator=None):
    probs = probs.astype(jnp.float32)
    # The CPU kernel's checks of the values (CUDA's are device asserts).
    check(jnp.all(jnp.isfinite(probs) & (probs >= 0)),
          "probability tensor contains either `inf`, `nan` or element < 0", RuntimeError)
    check(jnp.all(jnp.sum(probs, axis=-1) > 0),
          "invalid multinomial distribution (sum of probabilities <= 0)", RuntimeError)
    logits = jnp.log(probs)
    if replacement:
        keys = jax.random.split(key, num_samples)
        draws = jax.vmap(lambda k: jax.random.categorical(k, logits, axis=-1))(keys)
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    gumbel = jax.random.gumbel(key, logits.shape)
    return jnp.argsort(-(logits + gumbel), axis=-1)[..., :num_samples].astype(jnp.int64)


# randperm(n), its generator and out variants all come here (their composite kernels); the
# check of n against the out's dtype is in _execution/composed_kernels.py.
@lowering("aten::randperm.generator_out", random=True)
def randperm(key, n, generator=None):  # (the out's dtype is the result's)
    # One sort of 64-bit random keys (ties, which would favour the original order, have a
    # chance of n^2 / 2^65): jax.random.permutation sorts in several 32-bit rounds, 2.7x the
    # time for n = 2^24 on XLA:CPU (19 s against 7 s).
    bits = jax.random.bits(key, (n,), jnp.uint64)
    return lax.sort_key_val(bits, jnp.arange(n, dtype=jnp.int64))[1]


def _check_std(mean, std, generator=None):
    # PyTorch's CHECK_NORMAL_TENSOR_STD reads the std's values on every device (a wait).
    if isinstance(std, torch.Tensor) and std.numel() and bool((std < 0).any()):
        raise RuntimeError("normal expects all elements of std >= 0.0")


@lowering("aten::normal.Tensor_Tensor", random=True, validate=_check_std)
def normal_tensor_tensor(key, mean, std, generator=None):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return jax.random.normal(key, shape, jnp.float32) * std + mean


@lowering("aten::normal.Tensor_float", random=True)
def normal_tensor_float(key, mean, std=1.0, generator=None):
    return jax.random.normal(key, mean.shape, jnp.float32) * std + mean


@lowering("aten::normal.float_Tensor", random=True, validate=_check_std)
def normal_float_tensor(key, mean, std, generator=None):
    return jax.random.normal(key, std.shape, jnp.float32) * std + mean


def _check_cauchy(x, median=0.0, sigma=1.0, generator=None):
    _check_sigma(x, sigma)
    _check_cauchy_dtype(x)


@lowering("aten::cauchy_.default", random=True, fill=True, validate=_check_cauchy)
def cauchy_(key, x, median=0.0, sigma=1.0, generator=None):
    return (jax.random.cauchy(key, x.shape, jnp.float32) * sigma + median).astype(x.dtype)


def _check_kernel_dtype(kernel, x, ok):
    # AT_DISPATCH's refusal, in the CPU kernel's name
    if not ok(x.dtype):
        raise NotImplementedError(f'"{kernel}_cpu" not implemented for {dtype_name(x.dtype)!r}')


def _check_log_normal(x, mean=1.0, std=2.0, generator=None):
    _check_std_positive(x, std)
    _check_kernel_dtype("log_normal", x, lambda t: t.is_floating_point)


def _check_geometric(x, p, generator=None):
    _check_p_open(x, p)
    _check_kernel_dtype("geometric", x, lambda t: not t.is_complex and t != torch.bool)


@lowering("aten::log_normal_.default", random=True, fill=True, validate=_check_log_normal)
def log_normal_(key, x, mean=1.0, std=2.0, generator=None):
    return jnp.exp(jax.random.normal(key, x.shape, jnp.float32) * std + mean).astype(x.dtype)


@lowering("aten::geometric_.default", random=True, fill=True, validate=_check_geometric)
def geometric_(key, x, p, generator=None):
    # The number of Bernoulli(p) trials up to the first success: ceil(log(U) / log(1 - p)).
    u = jax.random.uniform(key, x.shape, jnp.float32, jnp.finfo(jnp.float32).tiny, 1.0)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-p)), 1).astype(x.dtype)


@lowering("aten::logspace.default", "aten::logspace.out", static=("start", "end", "base"),
          validate=_check_space("logspace"))
def logspace(start, end, steps, base=10.0, dtype=None, layout=None, device=None,
             pin_memory=None):
    # Like PyTorch: the exponents are evenly spaced, then base ** exponent (in float64 here
    # so that integer outputs truncate the exact powers).
    complex_out = complex in (type(start), type(end)) or (
        dtype is not None and dtype.is_complex)
    if dtype is not None and not dtype.is_floating_point and not dtype.is_complex:
        start, end = int(start), int(end)  # the kernel converts the bounds first (truncating)
    if complex_out and program_platform() == "tpu":  # XLA:TPU has no complex128
        start, end = np.complex64(start), np.complex64(end)
        return jnp.power(jnp.float32(base), jnp.linspace(start, end, steps, dtype=jnp.complex64))
    exponents = jnp.linspace(start, end, steps, dtype=jnp.complex128 if complex_out else jnp.float64)
    return jnp.power(jnp.float64(base), exponents)


@lowering("aten::_efficientzerotensor.default")
def efficient_zero_tensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size))


def _triangle_indices(np_fn):
    def lower(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
        # Sizes are static: the (2, N) row-major coordinates are constants of the program
        # (the output cast gives them the requested dtype).
        return jnp.asarray(np.stack(np_fn(row, offset, col)).reshape(2, -1), jnp.int64)
    return lower


lowering("aten::tril_indices.default")(_triangle_indices(np.tril_indices))
lowering("aten::triu_indices.default")(_triangle_indices(np.triu_indices))
