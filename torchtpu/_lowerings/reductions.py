"""Reductions: dims/keepdim/dtype semantics follow PyTorch (output dtype from the meta kernel)."""
import jax
import jax.numpy as jnp
from jax import lax

from .._core import runtime
from .pointwise import complex_logaddexp
from .._core.registry import HALF_TYPES, check, deprecated, lowering


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(d % max(x.ndim, 1) for d in dim) if x.ndim else None


def _acc_dtype(x, dtype):
    if dtype is not None:
        from .._core.dtypes import to_jax_dtype
        return to_jax_dtype(dtype)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return jnp.int64
    return x.dtype


@lowering("aten::sum.dim_IntList")
def sum_dim(x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(x.astype(_acc_dtype(x, dtype)), axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::sum.default")
def sum_all(x, dtype=None):
    return jnp.sum(x.astype(_acc_dtype(x, dtype)))


@lowering("aten::mean.dim")
def mean_dim(x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(_acc_dtype(x, dtype))
    return jnp.mean(x, axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::mean.default")
def mean_all(x, dtype=None):
    if dtype is not None:
        x = x.astype(_acc_dtype(x, dtype))
    return jnp.mean(x)


@lowering("aten::prod.default")
def prod_all(x, dtype=None):
    return jnp.prod(x.astype(_acc_dtype(x, dtype)))


@lowering("aten::prod.dim_int")
def prod_dim(x, dim, keepdim=False, dtype=None):
    if x.ndim == 0:
        return x.astype(_acc_dtype(x, dtype))
    return jnp.prod(x.astype(_acc_dtype(x, dtype)), axis=dim, keepdims=keepdim)


def _check_extreme_of_empty(name, no_dim=RuntimeError):
    """The CPU kernels' errors for a max/min over no elements (their meta kernels raise a
    generic RuntimeError instead); `no_dim`: the type of the error without a dim."""
    def validate(x, dim=(), keepdim=False):
        if x.numel() != 0 or x.dim() == 0:
            return
        dims = [dim] if isinstance(dim, int) else list(dim or ())
        if not dims:
            raise no_dim(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                               "Specify the reduction dim with the 'dim' argument.")
        for d in dims:
            if -x.dim() <= d < x.dim() and x.shape[d] == 0:
                raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
    return validate


@lowering("aten::amax.default", validate=_check_extreme_of_empty("amax"))
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::amin.default", validate=_check_extreme_of_empty("amin"))
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_dims(x, dim), keepdims=keepdim)


def _check_aminmax(x, dim=None, keepdim=False):
    if x.numel() != 0:
        return
    if dim is None:
        raise RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as the "
                           "operation has no identity.")
    if x.dim() and -x.dim() <= dim < x.dim() and x.shape[dim] == 0:
        raise IndexError(f"aminmax: Expected reduction dim {dim % x.dim()} to have non-zero size.")


_AMINMAX_DEPRECATED = ("_aminmax is deprecated as of PyTorch 1.11 and will be removed in a future "
                       "release. Use aminmax instead. This warning will only appear once per process.")


# PyTorch warns once from each of the two overloads' kernels.
@lowering("aten::_aminmax.default", validate=deprecated(_AMINMAX_DEPRECATED, _check_aminmax))
@lowering("aten::_aminmax.dim", validate=deprecated(_AMINMAX_DEPRECATED, _check_aminmax))
@lowering("aten::aminmax.default", validate=_check_aminmax)
def aminmax(x, dim=None, keepdim=False):
    if dim is None:
        axis, keepdim = None, keepdim and x.ndim > 0
    else:
        axis = dim % x.ndim if x.ndim else None
    return (jnp.min(x, axis=axis, keepdims=keepdim), jnp.max(x, axis=axis, keepdims=keepdim))


# Whole-tensor reductions without options.
for _name, _fn in {"max": jnp.max, "min": jnp.min, "any": jnp.any, "all": jnp.all}.items():
    lowering(f"aten::{_name}.default")(_fn)


def _arg_extreme(x, dim, keepdim, pick):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = pick(x, axis=dim, keepdims=True)
    vals = jnp.take_along_axis(x, idx, axis=dim)
    if not keepdim:
        vals, idx = jnp.squeeze(vals, dim), jnp.squeeze(idx, dim)
    return vals, idx.astype(jnp.int64)


for _name, _pick in {"max": jnp.argmax, "min": jnp.argmin}.items():
    lowering(f"aten::{_name}.dim", validate=_check_extreme_of_empty(_name))(
        lambda x, dim, keepdim=False, pick=_pick: _arg_extreme(x, dim, keepdim, pick))


def _arg_reduce(pick):
    def lower(x, dim=None, keepdim=False):
        if dim is None:
            r = pick(x.reshape(-1))
            return r.reshape((1,) * x.ndim) if keepdim else r
        return pick(x, axis=dim, keepdims=keepdim) if x.ndim else jnp.zeros((), jnp.int64)
    return lower


for _name, _pick in {"argmax": jnp.argmax, "argmin": jnp.argmin}.items():
    lowering(f"aten::{_name}.default", validate=_check_extreme_of_empty(_name, IndexError))(
        _arg_reduce(_pick))


@lowering("aten::var.correction")
def var(x, dim=None, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return jnp.var(x, axis=_dims(x, dim), ddof=ddof, keepdims=keepdim)


@lowering("aten::var_mean.correction")
def var_mean(x, dim=None, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    axis = _dims(x, dim)
    return jnp.var(x, axis=axis, ddof=ddof, keepdims=keepdim), jnp.mean(x, axis=axis, keepdims=keepdim)


@lowering("aten::std.correction")
def std(x, dim=None, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return jnp.std(x, axis=_dims(x, dim), ddof=ddof, keepdims=keepdim)


@lowering("aten::any.dim", "aten::any.dims")
def any_dim(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::all.dim", "aten::all.dims")
def all_dim(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::logsumexp.default")
def logsumexp(x, dim, keepdim=False):
    from jax.scipy.special import logsumexp as lse
    if jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.float32)
    return lse(x, axis=_dims(x, dim), keepdims=keepdim)


@lowering("aten::cumsum.default", opmath=True)
def cumsum(x, dim, dtype=None):
    if x.ndim == 0:
        return x.astype(_acc_dtype(x, dtype))
    return jnp.cumsum(x.astype(_acc_dtype(x, dtype)), axis=dim)


@lowering("aten::cumprod.default", opmath=True)
def cumprod(x, dim, dtype=None):
    if x.ndim == 0:
        return x.astype(_acc_dtype(x, dtype))
    return jnp.cumprod(x.astype(_acc_dtype(x, dtype)), axis=dim)


@lowering("aten::linalg_vector_norm.default", static=("ord",))
def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(_acc_dtype(x, dtype))
    if x.dtype in HALF_TYPES:  # accumulate in float32, as PyTorch's kernels do
        return vector_norm(x.astype(jnp.float32), ord, dim, keepdim).astype(x.dtype)
    axis = _dims(x, dim)
    ax = jnp.abs(x)
    if ord == float("inf"):
        return jnp.max(ax, axis=axis, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(ax, axis=axis, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((ax != 0).astype(ax.dtype), axis=axis, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(ax, axis=axis, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(ax * ax, axis=axis, keepdims=keepdim))
    return jnp.sum(ax ** ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)


# --- running extremes and medians: NaN wins, as in PyTorch's CPU kernels ----------------------
def _running_extreme(x, dim, later_wins):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    index = lax.broadcasted_iota(jnp.int64, x.shape, dim)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = ~jnp.isnan(av) & (jnp.isnan(bv) | later_wins(bv, av))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    return lax.associative_scan(combine, (x, index), axis=dim)


@lowering("aten::cummax.default")
def cummax(x, dim):
    return _running_extreme(x, dim, jnp.greater_equal)


@lowering("aten::cummin.default")
def cummin(x, dim):
    return _running_extreme(x, dim, jnp.less_equal)


@lowering("aten::_logcumsumexp.default", opmath=True)
def logcumsumexp(x, dim):
    if x.ndim == 0:
        return x
    dim %= x.ndim
    # PyTorch's CPU kernel accumulates float32 in float64: its backward formula subtracts two
    # such scans, so float32 accumulation shows there. TPUs have no float64.
    if runtime.program_platform() != "tpu" and x.dtype in (jnp.float32, jnp.complex64):
        x = x.astype(jnp.complex128 if x.dtype == jnp.complex64 else jnp.float64)
    if jnp.iscomplexobj(x):
        return _complex_logcumsumexp(x, dim)
    return lax.cumlogsumexp(x, axis=dim)


def _complex_logcumsumexp(x, dim):
    # A sequential scan, as the CPU's: the imaginary parts depend on the combination order.
    moved = jnp.moveaxis(x, dim, 0)

    def step(acc, v):
        acc = complex_logaddexp(v, acc)
        return acc, acc

    start = jnp.full(moved.shape[1:], -jnp.inf, x.dtype)
    return jnp.moveaxis(lax.scan(step, start, moved)[1], 0, dim)


def _median(x, dim, ignore_nan):
    """Lower median along `dim` and its index. `median` returns the first NaN when there is one;
    `nanmedian` skips NaNs (NaN only when all are)."""
    order = jnp.argsort(x, axis=dim, stable=True)  # NaNs sort last
    ranked = jnp.take_along_axis(x, order, axis=dim)
    nans = jnp.isnan(x)
    if ignore_nan:
        count = jnp.sum(~nans, axis=dim, keepdims=True)
        k = jnp.maximum((count - 1) // 2, 0)
    else:
        k = jnp.full((1,) * x.ndim, (x.shape[dim] - 1) // 2)
    value = jnp.take_along_axis(ranked, k, axis=dim)
    index = jnp.take_along_axis(order, k, axis=dim)
    if not ignore_nan:
        has_nan = jnp.any(nans, axis=dim, keepdims=True)
        first_nan = jnp.argmax(nans, axis=dim, keepdims=True)
        value = jnp.where(has_nan, jnp.nan, value).astype(x.dtype)
        index = jnp.where(has_nan, first_nan, index)
    return jnp.squeeze(value, dim), jnp.squeeze(index, dim).astype(jnp.int64)


def _median_all(x, ignore_nan):
    if x.size == 0:
        return jnp.array(jnp.nan, x.dtype)
    return _median(x.reshape(-1), 0, ignore_nan)[0]


def _median_dim(x, dim, keepdim, ignore_nan):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    value, index = _median(x, dim, ignore_nan)
    if keepdim:
        value, index = jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index


@lowering("aten::median.default")
def median(x):
    return _median_all(x, ignore_nan=False)


@lowering("aten::nanmedian.default")
def nanmedian(x):
    return _median_all(x, ignore_nan=True)


@lowering("aten::median.dim", validate=_check_extreme_of_empty("median"))
def median_dim(x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=False)


@lowering("aten::nanmedian.dim", validate=_check_extreme_of_empty("nanmedian"))
def nanmedian_dim(x, dim, keepdim=False):
    return _median_dim(x, dim, keepdim, ignore_nan=True)


@lowering("aten::mode.default")
def mode(x, dim=-1, keepdim=False):
    """The most frequent value (the smallest among equally frequent ones) and the last index
    where it occurs, as PyTorch's CPU kernel sorts (value, index) pairs and scans the runs."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    order = jnp.argsort(moved, axis=-1, stable=True)
    ranked = jnp.take_along_axis(moved, order, axis=-1)
    position = lax.broadcasted_iota(jnp.int64, ranked.shape, ranked.ndim - 1)
    differs = ranked[..., 1:] != ranked[..., :-1]
    starts = jnp.concatenate([jnp.ones(ranked.shape[:-1] + (1,), bool), differs], axis=-1)
    ends = jnp.concatenate([differs, jnp.ones(ranked.shape[:-1] + (1,), bool)], axis=-1)
    run_start = lax.cummax(jnp.where(starts, position, 0), axis=ranked.ndim - 1)
    length = jnp.where(ends, position - run_start + 1, 0)
    best = jnp.argmax(length, axis=-1, keepdims=True)
    value = jnp.take_along_axis(ranked, best, axis=-1)[..., 0]
    index = jnp.take_along_axis(order, best, axis=-1)[..., 0].astype(jnp.int64)
    if keepdim:
        value, index = jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index


# --- segment_reduce: reductions over consecutive segments of one axis -------------------------
_SEGMENT_IDENTITY = {"max": -jnp.inf, "min": jnp.inf, "prod": 1.0, "sum": 0.0, "mean": 0.0}
_SEGMENT_ALIASES = {"amax": "max", "amin": "min"}  # the same reductions under PyTorch's other names


def _segment_reduce_1d(data, lengths, reduce, initial):
    """data: (L, rest...), lengths: (S,) -> (S, rest...)."""
    s = lengths.shape[0]
    ends = jnp.cumsum(lengths)
    ids = jnp.searchsorted(ends, jnp.arange(data.shape[0]), side="right")
    start = jnp.asarray(_SEGMENT_IDENTITY[reduce] if initial is None else initial, data.dtype)
    kind = "sum" if reduce == "mean" else reduce
    if kind == "prod":
        # Laid out densely (segments x longest possible segment, padded with 1s) so that the
        # product has a gradient: JAX differentiates segment_prod only for unique indices.
        where = jnp.arange(data.shape[0]) - (ends - lengths)[jnp.clip(ids, 0, s - 1)]
        dense = jnp.ones((s, data.shape[0]) + data.shape[1:], data.dtype)
        out = jnp.prod(dense.at[ids, where].set(data, mode="drop"), axis=1)
    else:
        fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max,
              "min": jax.ops.segment_min}[kind]
        out = fn(data, ids, num_segments=s)
    filled = (lengths > 0).reshape((s,) + (1,) * (data.ndim - 1))
    if kind == "sum":
        out = out + start
    elif kind == "prod":
        out = out * start
    else:
        combine = jnp.maximum if kind == "max" else jnp.minimum
        out = jnp.where(jnp.isnan(out), out, combine(out, start))
    out = jnp.where(filled, out, start)
    if reduce == "mean":
        count = lengths.reshape(filled.shape).astype(data.dtype)
        out = jnp.where(filled, out / jnp.where(filled, count, 1),
                        jnp.nan if initial is None else out)
    return out.astype(data.dtype)


def _per_row(fn, data, lengths, offsets, axis, *segmented):
    """fn(data row (L, rest...), lengths row (S,), *rows of `segmented` (S, rest...)) over the
    batch dims before `axis`."""
    if lengths is None:
        lengths = jnp.diff(offsets, axis=-1)
    axis = axis % data.ndim
    batch = data.shape[:axis]

    def rows(x):
        return x.reshape((-1,) + x.shape[axis:]) if batch else x[None]
    lens = lengths.reshape((-1, lengths.shape[-1]))
    out = jax.vmap(fn)(rows(data), lens, *map(rows, segmented))
    return out.reshape(batch + out.shape[1:])


def _segment_reduce(data, reduce, lengths, offsets, axis, initial):
    return _per_row(lambda d, n: _segment_reduce_1d(d, n, reduce, initial),
                    data, lengths, offsets, axis)


def _segment_extreme_grad_1d(data, lengths, grad, output):
    """max/min's gradient as PyTorch's kernel gives it: shared among the elements equal to
    their segment's result, a NaN result counting its NaNs (JAX's VJP gives those nothing)."""
    s = lengths.shape[0]
    ids = jnp.searchsorted(jnp.cumsum(lengths), jnp.arange(data.shape[0]), side="right")
    inside = (ids < s).reshape((-1,) + (1,) * (data.ndim - 1))
    at = jnp.clip(ids, 0, s - 1)
    result = output[at]
    hit = inside & ((data == result) | (jnp.isnan(data) & jnp.isnan(result)))
    count = jax.ops.segment_sum(hit.astype(data.dtype), ids, num_segments=s)
    return jnp.where(hit, grad[at] / jnp.maximum(count[at], 1), 0).astype(data.dtype)


def _check_segments(data, reduce, lengths=None, indices=None, offsets=None, axis=0,
                    unsafe=False, initial=None):
    """Without `unsafe`, the segments are checked on the host before the op runs, as PyTorch's
    CPU and CUDA kernels do (reading the lengths: a wait), so the error comes from the call."""
    if unsafe:
        return
    if lengths is not None:
        if bool((lengths < 0).any()):
            raise RuntimeError("lengths contains negative value!")
        if not bool((lengths.sum(-1) == data.shape[axis % data.dim()]).all()):
            raise RuntimeError("segment_reduce(): Expected all rows of lengths along axis to sum "
                               "to data.size(lengths.dim()-1) when !unsafe.")
    elif offsets is not None and bool((offsets.diff(dim=-1) < 0).any()):
        raise RuntimeError("Expected segment_length >= 0 to be true, but got false.  (Could this "
                           "error message be improved?  If so, please report an enhancement "
                           "request to PyTorch.)")


@lowering("aten::segment_reduce.default", validate=_check_segments)
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    reduce = _SEGMENT_ALIASES.get(reduce, reduce)
    return _segment_reduce(data, reduce, lengths, offsets, axis, initial)


@lowering("aten::_segment_reduce_backward.default")
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0,
                            initial=None):
    reduce = _SEGMENT_ALIASES.get(reduce, reduce)
    if reduce in ("max", "min"):
        return _per_row(_segment_extreme_grad_1d, data, lengths, offsets, axis,
                        grad.astype(data.dtype), output)
    _, pullback = jax.vjp(lambda d: _segment_reduce(d, reduce, lengths, offsets, axis, initial),
                          data)
    return pullback(grad.astype(data.dtype))[0]


@lowering("aten::kthvalue.default")
def kthvalue(x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        check(jnp.asarray(k == 1), "kthvalue(): selected number k out of range for dimension 0",
              IndexError)
        return x, jnp.zeros((), jnp.int64)
    dim = dim % x.ndim
    n = x.shape[dim]
    if not 1 <= k <= n:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    order = jnp.argsort(x, axis=dim, stable=True)  # NaN sorts last, as "largest"
    index = jnp.take(order, k - 1, axis=dim)
    value = jnp.take_along_axis(x, jnp.expand_dims(index, dim), axis=dim).squeeze(dim)
    if keepdim:
        value, index = jnp.expand_dims(value, dim), jnp.expand_dims(index, dim)
    return value, index.astype(jnp.int64)


@lowering("aten::hash_tensor.default")
def hash_tensor(x, dim=(), keepdim=False, mode=0):
    """mode 0: the xor of the elements' 64-bit patterns (floats as float64, integers as int64)."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor: mode {mode} is not supported")
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    else:
        bits = lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)
    axes = _dims(x, dim)
    return jnp.bitwise_xor.reduce(bits, axis=axes, keepdims=keepdim)

