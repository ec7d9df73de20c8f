"""Gather/scatter-style indexing.  JAX clamps or drops out-of-range indices; PyTorch raises,
so every index is bounds-checked: the check is computed by the op's executable and read at the
host's next wait, as CUDA's device asserts are (_execution/sync.py)."""
import functools
import warnings

import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import canonicalize_dim

from .._core.registry import user_stacklevel, check, lowering
from .._core.dtypes import check_scalar_fits, to_torch_dtype
from .meta import dtype_name


def check_index(idx, size, message="index out of range", exc_type=IndexError, negative=True):
    """`idx` lies in [-size, size), or with negative=False in [0, size): gather, scatter,
    index_select, index_add and embedding take no negative indices on the CPU (JAX would wrap)."""
    idx = jnp.asarray(idx)
    if idx.size:
        check(jnp.all((idx >= (-size if negative else 0)) & (idx < size)), message, exc_type)


def _check_scatter_index(idx, x, dim):
    # gather/scatter raise RuntimeError on the CPU (index_select & co. raise IndexError); a
    # 0-dim self has one element along its one dim.
    size = x.shape[dim] if x.ndim else 1
    check_index(idx, size, f"index is out of bounds for dimension {dim} with size {size}",
                RuntimeError, negative=False)


def _wrap(idx, size):
    return jnp.where(idx < 0, idx + size, idx)


def _check_index_select(x, dim, index):
    if x.dim() == 0 and index.numel() != 1:
        raise RuntimeError(f"index_select(): Index to scalar can have only 1 value, got "
                           f"{index.numel()} value(s)")
    if x.dim() and x.shape[dim] == 0 and index.numel() and dim % x.dim() != 1:
        raise RuntimeError("index_select(): self indexing axis dim should be positive")


@lowering("aten::index_select.default", validate=_check_index_select)
def index_select(x, dim, index):
    size = x.shape[dim] if x.ndim else 1
    if x.ndim > 1 and dim % x.ndim == 1:  # the CPU's kernel for dim 1 raises its own error
        check_index(index, size, f"INDICES element is out of DATA bounds, axis_dim={size}",
                    RuntimeError, negative=False)
    else:
        check_index(index, size, "index out of range in self", negative=False)
    if x.ndim == 0:
        return x
    return jnp.take(x, _wrap(index, size), axis=dim)


def _one_dim_index(fn):
    """PyTorch's gather/scatter kernels take a 0-dim index (and src) beside a 1-dim self as
    1-dim of one element; a gather's result keeps the index's 0-dim shape."""
    @functools.wraps(fn)
    def wrapped(x, dim, index, *rest):
        if index.ndim or x.ndim != 1:
            return fn(x, dim, index, *rest)
        rest = [r.reshape(1) if getattr(r, "ndim", None) == 0 else r for r in rest]
        out = fn(x, dim, index.reshape(1), *rest)
        return out.reshape(()) if fn is _gather else out
    return wrapped


def _gather(x, dim, index, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    if x.ndim == 0:
        _check_scatter_index(index, x, 0)
        return x.reshape(index.shape)
    dim = dim % x.ndim
    _check_scatter_index(index, x, dim)
    # take_along_axis needs matching sizes on the other dims; PyTorch allows index to be smaller
    sl = tuple(slice(0, n) if d != dim else slice(None) for d, n in enumerate(index.shape))
    return jnp.take_along_axis(x[sl], _wrap(index, x.shape[dim]), axis=dim)


gather = lowering("aten::gather.default")(_one_dim_index(_gather))


def _scatter_indices(x, dim, index):
    grids = np.ogrid[tuple(slice(0, n) for n in index.shape)]
    grids = [jnp.asarray(g) for g in grids]
    grids[dim] = _wrap(index, x.shape[dim])
    return tuple(grids)


@lowering("aten::scatter.src", "aten::scatter.value")
@_one_dim_index
def scatter(x, dim, index, src):
    if index.size == 0:  # PyTorch allows any empty index, even of another rank
        return x
    if x.ndim == 0:
        _check_scatter_index(index, x, 0)
        return jnp.asarray(src, x.dtype).reshape(()) if jnp.ndim(src) == 0 else src.reshape(())
    _check_scatter_index(index, x, dim)
    if jnp.ndim(src) > 0:
        src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_scatter_indices(x, dim, index)].set(src)


def _bool_via_int(*positions):
    """PyTorch adds, multiplies and maximises bool tensors as logical or/and; JAX's scatters
    take no bools, so they run on int32 copies of the arguments at `positions`."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapped(*args):
            if args[0].dtype != jnp.bool_:
                return fn(*args)
            args = [a.astype(jnp.int32) if i in positions else a for i, a in enumerate(args)]
            return fn(*args) != 0
        return wrapped
    return deco


@lowering("aten::scatter_add.default")
@_one_dim_index
@_bool_via_int(0, 3)
def scatter_add(x, dim, index, src):
    if index.size == 0:
        return x
    if x.ndim == 0:
        _check_scatter_index(index, x, 0)
        return x + src.reshape(())
    _check_scatter_index(index, x, dim)
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_scatter_indices(x, dim, index)].add(src)


def _check_scatter_reduce(x, dim, index, src, reduce, *rest):
    if reduce == "mean" and x.dtype == torch.bool:
        raise NotImplementedError(
            "\"scatter_gather_tensor_cpu_reduce_mean\" not implemented for 'Bool'")


@lowering("aten::scatter_reduce.two", validate=_check_scatter_reduce)
@_one_dim_index
@_bool_via_int(0, 3)
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if x.ndim == 0:
        out = scatter_reduce(x.reshape(1), 0, index.reshape(-1), jnp.reshape(src, -1), reduce,
                             include_self)
        return out.reshape(())
    _check_scatter_index(index, x, dim)
    src = src[tuple(slice(0, n) for n in index.shape)]
    idx = _scatter_indices(x, dim, index)
    if reduce == "sum":
        base = x if include_self else x.at[idx].set(0)
        return base.at[idx].add(src)
    if reduce == "prod":
        base = x if include_self else x.at[idx].set(1)
        return base.at[idx].multiply(src)
    if reduce in ("amax", "amin"):  # without self: from the reduction's identity (-inf, +inf)
        most = reduce == "amax"
        if jnp.issubdtype(x.dtype, jnp.floating):
            identity = -jnp.inf if most else jnp.inf
        else:
            identity = jnp.iinfo(x.dtype).min if most else jnp.iinfo(x.dtype).max
        base = x if include_self else x.at[idx].set(identity)
        return base.at[idx].max(src) if most else base.at[idx].min(src)
    if reduce == "mean":
        ones = jnp.ones_like(src)
        count = jnp.zeros_like(x).at[idx].add(ones) + (1 if include_self else 0)
        base = x if include_self else x.at[idx].set(0)
        total = base.at[idx].add(src)
        out = jnp.where(count > 0, total / jnp.maximum(count, 1), x)
        return out.astype(x.dtype) if not jnp.issubdtype(x.dtype, jnp.integer) else jnp.floor_divide(total, jnp.maximum(count, 1)).astype(x.dtype)
    raise NotImplementedError(f"scatter_reduce with reduce={reduce!r}")


@lowering("aten::scatter.reduce", "aten::scatter.value_reduce")
@_one_dim_index
def scatter_with_reduce(x, dim, index, src, reduce):
    if jnp.ndim(src) == 0:  # value_reduce: a Scalar
        src = jnp.full(index.shape, src, x.dtype)
    return scatter_reduce(x, dim, index, src, {"add": "sum", "multiply": "prod"}[reduce])


def _check_index_add(x, dim, index, source, alpha=1):
    # PyTorch's CPU kernel checks these (after wrapping dim); its meta kernel does not.
    canonicalize_dim(x.dim(), dim)  # IndexError first, as the CPU
    if index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"index_add_(): Expected dtype int32/int64 for index but got: "
                           f"{dtype_name(index.dtype)}")
    if source.dtype != x.dtype:
        raise RuntimeError(f"index_add_(): self ({dtype_name(x.dtype)}) and source "
                           f"({dtype_name(source.dtype)}) must have the same scalar type")
    if x.dim() == 0 or source.dim() == 0:
        if source.dim() > x.dim():
            _source_shape_mismatch(x, source)
        return
    dim %= x.dim()
    if index.numel() != source.shape[dim]:
        raise RuntimeError(f"index_add_(): Number of indices ({index.numel()}) should be equal to "
                           f"source.size(dim): ({source.shape[dim]}), for dim: {dim}")
    if source.dim() != x.dim() or any(
            source.shape[d] != x.shape[d] for d in range(x.dim()) if d != dim):
        _source_shape_mismatch(x, source)


def _source_shape_mismatch(x, source):
    raise RuntimeError(
        "source tensor shape must match self tensor shape, excluding the specified dimension. "
        f"Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}")


@lowering("aten::index_add.default", validate=_check_index_add)
@_bool_via_int(0, 3)
def index_add(x, dim, index, source, alpha=1):
    size = x.shape[dim] if x.ndim else 1
    if x.size == 0:  # the CPU kernel returns before looking at the indices
        return x
    if x.ndim <= 1:  # the CPU's one-dimensional kernel
        check_index(index, size, "index out of range in self", negative=False)
    else:
        check_index(index, size, f"index is out of bounds for dimension {dim} with size {size}",
                    RuntimeError, negative=False)
    if x.ndim == 0:
        return x + alpha * source.reshape(())
    moved = jnp.moveaxis(x, dim, 0)
    src = jnp.moveaxis(source, dim, 0) if source.ndim else source
    return jnp.moveaxis(moved.at[_wrap(index, size)].add(alpha * src), 0, dim)


def _check_index_fill(x, dim, index, value):
    canonicalize_dim(x.dim(), dim)  # IndexError first, as the CPU
    if index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    if not x.is_complex() and (value.is_complex() if isinstance(value, torch.Tensor)
                               else isinstance(value, complex)):
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not "
                           "supported")
    if not isinstance(value, torch.Tensor):
        check_scalar_fits(value, x.dtype)


@lowering("aten::index_fill.int_Scalar", "aten::index_fill.int_Tensor", validate=_check_index_fill)
def index_fill(x, dim, index, value):
    size = x.shape[dim] if x.ndim else 1
    check_index(index, size, "index out of range in self")
    if x.ndim == 0:
        return jnp.asarray(value, x.dtype) if index.size else x
    moved = jnp.moveaxis(x, dim, 0)
    return jnp.moveaxis(moved.at[_wrap(index, size)].set(jnp.asarray(value, x.dtype)), 0, dim)


def _advanced_index(x, indices):
    """PyTorch advanced indexing with a list of optional index tensors (one per leading dim)."""
    idx = []
    for d, i in enumerate(indices):
        if i is None:
            idx.append(slice(None))
        else:
            check_index(i, x.shape[d], "index out of range in self")
            idx.append(_wrap(i, x.shape[d]))
    return tuple(idx)


def _check_index(x, indices):
    # A bool/uint8 mask stands for as many dims as it has.
    dims = sum(i.dim() if i is not None and i.dtype in (torch.bool, torch.uint8) else 1
               for i in indices)
    if dims > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()} (got {dims})")
    for d, i in enumerate(indices):
        if i is not None and i.numel() and d < x.dim() and x.shape[d] == 0:
            raise IndexError("index is out of bounds for dimension with size 0")


@lowering("aten::index.Tensor", validate=_check_index)
def index(x, indices):
    return x[_advanced_index(x, indices)]


def _check_index_put(x, indices, values, *rest):
    # PyTorch's order: the index shapes broadcast together, an index into an empty dim is out
    # of bounds, the dtypes match, the values broadcast to the indexed result.
    given = [i for i in indices if i is not None]
    try:
        torch.broadcast_shapes(*(i.shape for i in given))
    except RuntimeError:
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together with "
                         "shapes " + ", ".join(str(list(i.shape)) for i in given)) from None
    _check_index(x, indices)
    if values.dtype != x.dtype:
        raise RuntimeError("Index put requires the source and destination dtypes match, got "
                           f"{dtype_name(x.dtype)} for the destination and {dtype_name(values.dtype)} "
                           "for the source.")
    meta = [None if i is None else torch.empty(i.shape, dtype=i.dtype, device="meta") for i in indices]
    result = torch.ops.aten.index.Tensor(torch.empty(x.shape, dtype=x.dtype, device="meta"), meta)
    try:
        torch.broadcast_shapes(values.shape, result.shape)
        ok = values.dim() <= result.dim() or all(n == 1 for n in values.shape[:values.dim() - result.dim()])
    except RuntimeError:
        ok = False
    if not ok:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
                           f"broadcast to indexing result of shape {list(result.shape)}")


@lowering("aten::index_put.default", validate=_check_index_put)
@_bool_via_int(0, 2)
def index_put(x, indices, values, accumulate=False, unsafe=False):
    idx = _advanced_index(x, indices)
    values = values.astype(x.dtype)
    return x.at[idx].add(values) if accumulate else x.at[idx].set(values)


lowering("aten::_index_put_impl_.default", validate=_check_index_put)(index_put)


def _check_index_copy(x, dim, index, source):
    canonicalize_dim(x.dim(), dim)  # IndexError first, as the CPU
    if source.dtype != x.dtype:
        raise RuntimeError(f"index_copy_(): self and source expected to have the same dtype, but got "
                           f"(self) {dtype_name(x.dtype)} and (source) {dtype_name(source.dtype)}")


@lowering("aten::index_copy.default", validate=_check_index_copy)
def index_copy(x, dim, index, source):
    size = x.shape[dim] if x.ndim else 1
    check_index(index, size, f"index_copy_(): index out of bounds for dimension {dim} with size "
                f"{size}", negative=False)
    if x.ndim == 0:
        return jnp.reshape(source, ())
    # (a 0-dim index or source stands for one slice, as on the CPU)
    src = jnp.moveaxis(source, dim, 0) if source.ndim else source.reshape(1)
    return jnp.moveaxis(jnp.moveaxis(x, dim, 0).at[index.reshape(-1)].set(src), 0, dim)


@lowering("aten::masked_scatter.default", eager=True)
def masked_scatter(x, mask, source):
    if mask.dtype != jnp.bool_:
        if mask.dtype == jnp.uint8:  # the CPU kernel warns, then refuses
            warnings.warn("masked_scatter_ received a mask with dtype torch.uint8, this behavior "
                          "is now deprecated,please use a mask with dtype torch.bool instead.")
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with "
                           f"dtype {dtype_name(to_torch_dtype(mask.dtype))}")
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    x, mask = jnp.broadcast_to(x, shape), jnp.broadcast_to(mask, shape)
    n = int(jnp.sum(mask))
    if n > source.size:
        raise RuntimeError("masked_scatter: expected source to have at least as many elements "
                           f"as ones in mask, but got {source.size} elements and {n} ones")
    flat = x.reshape(-1).at[jnp.nonzero(mask.reshape(-1))[0]].set(source.reshape(-1)[:n])
    return flat.reshape(x.shape)


# --- data-dependent shapes: these synchronise, exactly as on CUDA ----------------------------

@lowering("aten::nonzero.default", eager=True)
def nonzero(x):
    return jnp.stack(jnp.nonzero(x), axis=1).astype(jnp.int64) if x.ndim else \
        jnp.zeros((1 if bool(x) else 0, 0), jnp.int64)


def _check_masked_select(x, mask):
    if mask.dtype != torch.bool:
        raise RuntimeError("masked_select: expected BoolTensor for mask")


@lowering("aten::masked_select.default", eager=True, validate=_check_masked_select)
def masked_select(x, mask):
    x, mask = jnp.broadcast_arrays(x, mask)
    return x[mask]


@lowering("aten::index_reduce.default")
def index_reduce(x, dim, index, source, reduce, include_self=True):
    if x.ndim == 0:
        x, source = x.reshape(1), source.reshape(1)
        out = index_reduce(x, 0, index, source, reduce, include_self)
        return out.reshape(())
    dim = dim % x.ndim
    check_index(index, x.shape[dim], "index out of range in self", negative=False)
    idx = (slice(None),) * dim + (_wrap(index, x.shape[dim]),)
    src = source if source.ndim else source.reshape(1)
    hit = jnp.zeros(x.shape[dim], bool).at[_wrap(index, x.shape[dim])].set(True)
    hit = hit.reshape((-1,) + (1,) * (x.ndim - dim - 1))
    if reduce == "mean":
        count = jnp.zeros(x.shape[dim], x.dtype).at[_wrap(index, x.shape[dim])].add(1)
        count = count.reshape((-1,) + (1,) * (x.ndim - dim - 1))
        base = x if include_self else jnp.where(hit, 0, x)
        total = base.at[idx].add(src)
        count = count + 1 if include_self else jnp.maximum(count, 1)
        out = total / count
        if jnp.issubdtype(x.dtype, jnp.integer):
            out = jnp.floor_divide(total, count)
        return out.astype(x.dtype)
    if reduce == "prod":
        base = x if include_self else jnp.where(hit, 1, x)
        return base.at[idx].multiply(src)
    if reduce in ("amax", "amin"):
        fill = (jnp.finfo(x.dtype).min if reduce == "amax" else jnp.finfo(x.dtype).max) \
            if jnp.issubdtype(x.dtype, jnp.floating) else \
            (jnp.iinfo(x.dtype).min if reduce == "amax" else jnp.iinfo(x.dtype).max)
        base = x if include_self else jnp.where(hit, fill, x)
        return base.at[idx].max(src) if reduce == "amax" else base.at[idx].min(src)
    raise RuntimeError(f"index_reduce(): Expected reduce to be one of prod, mean, amax or "
                       f"amin but got {reduce}.")


_COPY_WARNED = set()


def _warn_copy(what, t):
    # ATen copies a non-contiguous operand of searchsorted/bucketize and says so, once per
    # program and operand (TORCH_WARN_ONCE: every time under torch.set_warn_always(True)).
    if isinstance(t, torch.Tensor) and not t.is_contiguous() and (
            what not in _COPY_WARNED or torch.is_warn_always_enabled()):
        _COPY_WARNED.add(what)
        warnings.warn(f"torch.searchsorted(): {what} tensor is non-contiguous, this will lower the "
                      "performance due to extra data copy when converting non-contiguous tensor to "
                      f"contiguous, please use contiguous {what} tensor if possible. This message "
                      "will only appear once per program.", stacklevel=user_stacklevel())


def check_searchsorted_args(seq, right=False, side=None, sorter=None):
    """ATen's searchsorted_pre_check of side and sorter, in its order and words (the sorter's
    range read on the host, as every device's kernel does)."""
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
        if right and side != "right":
            raise RuntimeError(f"torch.searchsorted(): side and right can't be set to opposites, "
                               f"got side of {side} while right was True")
    if sorter is not None:
        if sorter.shape != seq.shape:
            raise RuntimeError(f"torch.searchsorted(): boundary and sorter must have the same size, "
                               f"but got boundary tensor {list(seq.shape)}and got sorter tensor "
                               f"{list(sorter.shape)}")
        if sorter.dtype != torch.int64:
            raise RuntimeError(f"torch.searchsorted(): sorter must be a tensor of long dtype but "
                               f"got dtype {dtype_name(sorter.dtype)}")
        if sorter.numel() and (bool((sorter < 0).any()) or bool((sorter >= sorter.shape[-1]).any())):
            raise RuntimeError("torch.searchsorted(): sorter index out of range")


def check_searchsorted_out(out, out_int32):
    if out.dtype != (torch.int32 if out_int32 else torch.int64):
        raise RuntimeError(
            "torch.searchsorted(): output tensor's dtype is wrong, it can only be Int(int32) or "
            "Long(int64) depending on whether out_int32 flag is True, but we got output tensor's "
            f"dtype {dtype_name(out.dtype)} and out_int32 flag is {out_int32}")


def _check_searchsorted(seq, values, out_int32=False, right=False, side=None, sorter=None):
    check_searchsorted_args(seq, right, side, sorter)
    _warn_copy("input value", values)
    _warn_copy("boundary", seq)
    _warn_copy("sorter", sorter)


def _check_bucketize(x, boundaries, *rest):
    _check_searchsorted(boundaries, x)


def _searchsorted(seq, values, right, side, sorter):
    side = side or ("right" if right else "left")
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    if values.size == 0:
        return jnp.zeros(values.shape, jnp.int64)
    if seq.shape[-1] == 0:
        return jnp.zeros(values.shape, jnp.int64)
    if seq.ndim <= 1:
        return jnp.searchsorted(seq, values, side=side)
    lead = seq.shape[:-1]
    find = jnp.vectorize(lambda s, v: jnp.searchsorted(s, v, side=side), signature="(n),(m)->(m)")
    return find(seq, values.reshape(lead + (-1,))).reshape(values.shape)


@lowering("aten::searchsorted.Tensor", validate=_check_searchsorted)
def searchsorted(seq, values, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(seq, values, right, side, sorter)


def _check_searchsorted_scalar(seq, value, out_int32=False, right=False, side=None, sorter=None):
    check_searchsorted_args(seq, right, side, sorter)
    if seq.dim() != 1:  # (PyTorch's meta kernel fails on the scalar instead)
        raise RuntimeError(
            "torch.searchsorted(): input value can be a scalar only when boundaries tensor "
            f"dimension is 1, but we got boundaries tensor dim({seq.dim()}) and input value's "
            "dim(0) numel(1)")
    _check_searchsorted(seq, value, out_int32, right, side, sorter)


@lowering("aten::searchsorted.Scalar", validate=_check_searchsorted_scalar)
def searchsorted_scalar(seq, value, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(seq, jnp.asarray(value, seq.dtype), right, side, sorter)


@lowering("aten::nonzero_static.default")
def nonzero_static(x, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if x.size == 0:  # JAX would pad with zeros here
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    found = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(found, axis=1).astype(jnp.int64)


def _check_put(x, index, source, accumulate=False):
    if index.dtype != torch.int64:
        raise RuntimeError(f"put_(): Expected a long tensor for index, but got {dtype_name(index.dtype)}")
    if source.numel() != index.numel():
        raise IndexError("put_(): Expected source and index to have the same number of elements, "
                         f"but got source.numel() = {source.numel()}, index.numel() = {index.numel()}")
    if x.numel() == 0 and index.numel():
        raise IndexError("put_(): Tried to put elements into an empty tensor")


@lowering("aten::put.default", validate=_check_put)
@_bool_via_int(0, 2)
def put(x, index, source, accumulate=False):
    check_index(index, max(x.size, 1), "out of range: tried to access index")
    flat = x.reshape(-1)
    idx = _wrap(index.reshape(-1), x.size)
    src = jnp.reshape(source, -1).astype(x.dtype)
    flat = flat.at[idx].add(src) if accumulate else flat.at[idx].set(src)
    return flat.reshape(x.shape)


@lowering("aten::take.default")
def take(x, index):
    check_index(index, max(x.size, 1) if x.size else 0, "out of range: tried to access index")
    if x.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    return x.reshape(-1)[_wrap(index, x.size)]


@lowering("aten::bucketize.Tensor", validate=_check_bucketize)
def bucketize(x, boundaries, out_int32=False, right=False):
    if boundaries.ndim != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.ndim})")
    return _searchsorted(boundaries, x, right, None, None)


@lowering("aten::bucketize.Scalar")
def bucketize_scalar(x, boundaries, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(x, boundaries.dtype), right, None, None)


@lowering("aten::histc.default")
def histc(x, bins=100, min=0, max=0):
    x = x.reshape(-1)
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    # min == max means: the data's own range (and a unit-wide one if that is empty, too)
    data = lo == hi
    lo = jnp.where(data, jnp.min(x, initial=jnp.inf) if x.size else 0, lo)
    hi = jnp.where(data, jnp.max(x, initial=-jnp.inf) if x.size else 0, hi)
    lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    pos = ((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.clip(jnp.where(x == hi, bins - 1, pos), 0, bins - 1)
    return jnp.zeros(bins, x.dtype).at[pos].add(inside.astype(x.dtype))


def _check_repeats(repeats, output_size=None):
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if repeats.dtype not in (torch.int32, torch.int64):
        raise NotImplementedError(
            f'"repeat_interleave_cpu" not implemented for \'{dtype_name(repeats.dtype)}\'')


@lowering("aten::repeat_interleave.Tensor", eager=True, validate=_check_repeats)
def repeat_interleave(repeats, output_size=None):
    if repeats.size and bool(jnp.any(repeats < 0)):
        raise RuntimeError("repeats can not be negative")
    total = int(jnp.sum(repeats)) if output_size is None else output_size
    return jnp.repeat(jnp.arange(repeats.size, dtype=jnp.int64), repeats,
                      total_repeat_length=total)


# repeat_interleave with its output size given needs no value on the host: a program of its
# own (what `aten::repeat_interleave.Tensor` runs then, _execution/composed_kernels.py), whose
# checks of the repeats are read at the next wait.
_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("repeat_interleave_sized(Tensor repeats, SymInt output_size) -> Tensor")


@torch.library.register_fake("torchtpu::repeat_interleave_sized")
def _repeat_interleave_sized_shape(repeats, output_size):
    return repeats.new_empty((output_size,))


@lowering("torchtpu::repeat_interleave_sized", validate=_check_repeats)
def repeat_interleave_sized(repeats, output_size):
    check(jnp.all(repeats >= 0), "repeats can not be negative", RuntimeError)
    check(jnp.sum(repeats) == output_size, "allocated size does not match required size",
          RuntimeError)
    return jnp.repeat(jnp.arange(repeats.size, dtype=repeats.dtype), repeats,
                      total_repeat_length=output_size)


def _check_bincount(x, weights=None, minlength=0):
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise NotImplementedError(f'"bincount_cpu" not implemented for \'{dtype_name(x.dtype)}\'')
    if x.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != x.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")


# Its length is max(minlength, the largest value + 1): a value on the host, as on CUDA (which
# synchronises too). A routing with a fixed number of bins stays on the device through
# histc(bins=E, min=0, max=E) or scatter_add_.
@lowering("aten::bincount.default", eager=True, validate=_check_bincount)
def bincount(x, weights=None, minlength=0):
    low, high = (int(v) for v in jnp.stack([jnp.min(x), jnp.max(x)])) if x.size else (0, -1)
    if low < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = max(minlength, high + 1)
    if weights is None:
        return jnp.zeros(length, jnp.int64).at[x].add(1)
    dtype = weights.dtype if weights.dtype in (jnp.float32, jnp.float64) else jnp.float64
    return jnp.zeros(length, dtype).at[x].add(weights.astype(dtype))


_NONE = np.zeros((0,), np.int64)


@lowering("aten::_unique2.default", eager=True)
def unique(x, sorted=True, return_inverse=False, return_counts=False):
    # Sorted either way, as PyTorch's CPU kernel does; unrequested outputs are empty. Each NaN
    # is a value of its own, as on the CPU.
    values, inverse, counts = jnp.unique(x.reshape(-1), return_inverse=True, return_counts=True,
                                         equal_nan=False)
    return (values, inverse.reshape(x.shape).astype(jnp.int64) if return_inverse else _NONE,
            counts.astype(jnp.int64) if return_counts else _NONE)


@lowering("aten::unique_consecutive.default", eager=True)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    if dim is None:
        rows, shape = x.reshape(-1, 1), x.shape
    else:
        dim = dim % max(x.ndim, 1)
        moved = jnp.moveaxis(x, dim, 0) if x.ndim else x.reshape(1)
        rows = moved.reshape(moved.shape[0], int(np.prod(moved.shape[1:], dtype=np.int64)))
        shape = (moved.shape[0],) if x.ndim else ()
    n = rows.shape[0]
    starts = jnp.concatenate([jnp.ones((min(n, 1),), bool), jnp.any(rows[1:] != rows[:-1], axis=1)])
    first = jnp.nonzero(starts)[0]
    if dim is None:
        values = rows[first, 0]
    else:
        values = jnp.moveaxis(moved[first], 0, dim)
    inverse = (jnp.cumsum(starts) - 1).astype(jnp.int64).reshape(shape)
    counts = jnp.diff(jnp.concatenate([first, jnp.array([n])])).astype(jnp.int64)
    return (values, inverse if return_inverse else _NONE, counts if return_counts else _NONE)


@lowering("aten::unique_dim.default", eager=True)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    dim = dim % max(x.ndim, 1)
    moved = jnp.moveaxis(x, dim, 0)
    rows = moved.reshape(moved.shape[0], int(np.prod(moved.shape[1:], dtype=np.int64)))
    if rows.shape[0] == 0:
        return x, jnp.zeros((0,), jnp.int64), jnp.zeros((0,), jnp.int64)
    # Rows in lexicographic order, as PyTorch's unique_dim sorts them.
    _, first, inverse, counts = jnp.unique(rows, axis=0, return_index=True,
                                           return_inverse=True, return_counts=True)
    values = jnp.moveaxis(moved[first], 0, dim)
    return (values, jnp.asarray(inverse.reshape(-1), jnp.int64) if return_inverse else _NONE,
            jnp.asarray(counts, jnp.int64) if return_counts else _NONE)


def _histogram(x, edges, weight, density):
    """The one-dimensional histogram: histogramdd of the flattened values as points."""
    return _histogramdd(x.reshape(-1, 1), [edges], weight, density), edges


def _bin_edges(points, bins, range):
    """Per dimension of `points` (N, D): `bins[d] + 1` evenly spaced edges over `range` (pairs,
    flattened) or the data's extent (widened by 0.5 when it is one point, [0, 1] when empty)."""
    edges = []
    for d, n in enumerate(bins):
        if range is not None:
            lo, hi = (jnp.asarray(v, points.dtype) for v in range[2 * d:2 * d + 2])
        elif points.shape[0]:
            lo, hi = jnp.min(points[:, d]), jnp.max(points[:, d])
        else:
            lo, hi = jnp.asarray(0, points.dtype), jnp.asarray(1, points.dtype)
        lo, hi = jnp.where(lo == hi, lo - 0.5, lo), jnp.where(lo == hi, hi + 0.5, hi)
        edges.append(jnp.linspace(lo, hi, n + 1, dtype=points.dtype))
    return edges


def _histogramdd(points, edges, weight, density):
    flat = jnp.zeros((), jnp.int64)
    inside = jnp.ones(points.shape[0], bool)
    sizes = [e.shape[0] - 1 for e in edges]
    for d, e in enumerate(edges):
        x = points[:, d]
        pos = jnp.searchsorted(e, x, side="right") - 1
        pos = jnp.clip(jnp.where(x == e[-1], sizes[d] - 1, pos), 0, max(sizes[d] - 1, 0))
        inside = inside & (x >= e[0]) & (x <= e[-1])
        flat = flat * sizes[d] + pos
    w = jnp.ones(points.shape[0], points.dtype) if weight is None else \
        weight.reshape(-1).astype(points.dtype)
    hist = jnp.zeros(int(np.prod(sizes)), points.dtype).at[flat].add(jnp.where(inside, w, 0))
    hist = hist.reshape(sizes)
    if density:
        widths = jnp.ones(sizes, points.dtype)
        for d, e in enumerate(edges):
            widths = widths * jnp.diff(e).reshape([-1 if i == d else 1 for i in range(len(sizes))])
        hist = hist / (jnp.sum(hist) * widths)
    return hist


@lowering("aten::histogram.bin_ct")
def histogram(x, bins=100, range=None, weight=None, density=False):
    (edges,) = _bin_edges(x.reshape(-1, 1), [bins], range)
    return _histogram(x, edges, weight, density)


def _points(x):
    return x.reshape(-1, x.shape[-1])


@lowering("aten::_histogramdd_bin_edges.default")
def histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _bin_edges(_points(x), bins, range)


@lowering("aten::_histogramdd_from_bin_cts.default")
def histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    points = _points(x)
    return _histogramdd(points, _bin_edges(points, bins, range), weight, density)


@lowering("aten::_histogramdd_from_bin_tensors.default")
def histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    points = _points(x)
    return _histogramdd(points, [b.astype(points.dtype) for b in bins], weight, density)


@lowering("aten::histogram.bins_tensor")
def histogram_edges(x, bins, weight=None, density=False):
    return _histogram(x, bins.astype(x.dtype), weight, density)


@lowering("aten::_unique.default", eager=True)
def unique_legacy(x, sorted=True, return_inverse=False):
    values, inverse, _ = unique(x, sorted, return_inverse, False)
    return values, inverse
