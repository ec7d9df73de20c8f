"""1-D tensors of new sizes, computed over the room their arrays have to spare.

A loop whose every iteration has sizes no earlier one had (PyTorch's device-generic tests:
`delta = torch.empty(i).uniform_()`, `delta.cumsum(0).long()`, `randn(m)`, `index_put`) built
an executable per op and iteration: ~5 programs of ~50-90 ms of XLA:CPU compile each, 20x the
CPU's time.  Random fills already draw for a bucketed size and keep that array (op_kernel
`_bucketed_fill`), and appends keep a power-of-two capacity (growing_sequences.py): the tensor
is PyTorch's (its storage holds n elements) and the JAX array behind it holds n + spare, never
read.

Here, ops on such tensors run at the array's size, so their programs are keyed on the bucket,
not on n:
- pointwise ops (torch.Tag.pointwise) and scans (cumsum, cumprod) of 1-D tensors: element i of
  the result depends on elements up to i alone, so the op runs over the whole array as it is
  and its result keeps the spare room (whose values are never read);
- full reductions (sum, max, all, ...): the spare elements are first replaced by the
  reduction's identity, with n an argument of that program;
- `copy_` between 1-D tensors (`.long()`, `.to(dtype)`): a cast over the whole array;
- `index_put` with one 1-D index into a 1-D tensor: the index's length and the target's size
  are arguments, the spare indices are dropped, and the bounds are checked against n, as the
  table's lowering checks them.
Where this does not apply (another shape, a tensor without room to spare beside one with it,
an op that checks element values on the device, fused eager: see _mode) the op runs as always.
"""
import functools

import jax.numpy as jnp
import numpy as np
import torch

from .._core import registry, storage
from .._core.dtypes import to_jax_dtype
from . import async_compile, debug, executables, modes, recording, sync
from .kernels import kernel_for
from .op_programs import OpProgram

aten = torch.ops.aten


def _flat(t, spare=True):
    """The written 1-D array of tpu tensor t's storage when t is 1-D, its elements come first
    in it (contiguous from offset 0, the array's own dtype) and (`spare`) the array holds more
    than them; else None.  Before every pointwise op of a 1-D tensor: the usual answer, no
    room to spare, is found first."""
    buf = getattr(t.untyped_storage(), "_tpu", None)
    if buf is None:
        return None
    array = buf.peek()
    if type(array) is storage.Array:
        shape = array.shape
    elif async_compile.queued(array):  # an op still compiling: its array's shape is known
        shape = async_compile.queued_shape(array)
        if shape is None:
            array = buf.value()
            shape = array.shape
    else:
        return None
    n = t.numel()
    if len(shape) != 1 or shape[0] < n or spare and shape[0] == n:
        return None
    if (t.dim() != 1 or t.storage_offset() != 0 or n > 1 and t.stride()[0] != 1 or t.is_conj()
            or t.is_neg()):
        return None
    array = buf.value()  # (an op of a new bucket still compiling: wait for it)
    return array if array.dtype == to_jax_dtype(t.dtype) else None


def _mode():
    """The eager mode to run in here, or None: not in fused eager, whose trace records ops on
    the tensors' own sizes (run outside it, a chain of such ops would lose its fusion: 3x the
    time per op of a fused chain on a 1-D tensor of 1000), nor while ops are captured."""
    return None if modes.recorded() else modes.get_eager_mode()


def _view(t, array):
    """A 1-D tensor over `array` whole (a new storage; `array` is not copied)."""
    return storage.wrap(array, [array.size], [1], t.dtype, t.device.index,
                        array.size * t.element_size())


def _shrunk(out, n):
    """`out` (a tensor over a whole array) as the tensor of n elements PyTorch gives, whose
    storage holds n; the array moves to it, room to spare and all."""
    array = storage.buffer_of(out).peek()  # (an op still compiling: its Pending moves too)
    return storage.wrap(array, [n], [1], out.dtype, out.device.index, n * out.element_size())


def _operands(args, kwargs):
    """(n, size) when every tpu tensor among the arguments is either 0-dim or 1-D of n
    elements over an array of `size` > n, and at least one is; else None."""
    n = size = None
    for v in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(v, torch.Tensor):
            if v.dim() == 0:
                continue
            array = _flat(v)
            if array is None:
                return None
            if n is None:
                n, size = v.numel(), array.size
            elif (v.numel(), array.size) != (n, size):
                return None
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return None
    return None if n is None else (n, size)


def _padded_args(args, kwargs):
    def view(v):
        if isinstance(v, torch.Tensor) and v.dim() == 1:
            return _view(v, storage.buffer_of(v).peek())
        return v
    return [view(v) for v in args], {k: view(v) for k, v in kwargs.items()}


def elementwise(kernel, args, kwargs):
    """A pointwise op or a scan along the one dim of 1-D tensors with room to spare."""
    mode = _mode()
    found = None if mode is None else _operands(args, kwargs)
    if found is None:
        return None
    n, size = found
    pos, kw = _padded_args(args, kwargs)
    out = kernel.call(pos, kw, mode=mode)
    if isinstance(out, torch.Tensor):
        return _shrunk(out, n) if out.shape == (size,) else out
    return type(out)(_shrunk(o, n) if isinstance(o, torch.Tensor) and o.shape == (size,) else o
                     for o in out)


# --- reductions ------------------------------------------------------------------------------

def _identity(name, dtype):
    """The value the reduction `name` ignores, in `dtype` (None: none, e.g. max of complex)."""
    if dtype.is_complex:
        return {"sum": complex(-0.0, -0.0), "prod": 1}.get(name)
    if dtype is torch.bool:
        return {"sum": False, "prod": True, "max": False, "min": True, "any": False,
                "all": True}[name]
    if dtype.is_floating_point:
        if dtype.itemsize == 1:
            return None  # (float8 types: some have no infinity to ignore)
        return {"sum": -0.0, "prod": 1.0, "max": -np.inf, "min": np.inf, "any": 0.0,
                "all": 1.0}[name]
    info = torch.iinfo(dtype)
    return {"sum": 0, "prod": 1, "max": info.min, "min": info.max, "any": 0, "all": 1}[name]


@functools.lru_cache(maxsize=256)
def _masked_program(size, dtype, fill):
    jdtype = jnp.dtype(dtype)

    def masked(array, n):
        return jnp.where(jnp.arange(size) < n, array, jnp.asarray(fill, jdtype))

    return executables.Executable(masked, executables.stable(("masked", size, dtype, repr(fill))),
                                  "masked")


def reduction(name):
    """A reduction of a whole 1-D tensor with room to spare: the spare elements become the
    reduction's identity (n an argument), then the op runs over the whole array."""
    def reduce(kernel, args, kwargs):
        t = args[0]
        mode = _mode()
        array = None if mode is None else _flat(t)
        if array is None or t.numel() == 0:
            return None
        if any(isinstance(v, torch.Tensor) for v in (*args[1:], *kwargs.values())):
            return None
        fill = _identity(name, t.dtype)
        if fill is None:
            return None
        masked = _masked_program(array.size, jnp.dtype(array.dtype).name, fill)(array, t.numel())
        return kernel.call([_view(t, masked), *args[1:]], kwargs, mode=mode)
    return reduce


# --- index_put -------------------------------------------------------------------------------

def _one_value(t):
    """The array of a 0-dim tpu tensor alone in its storage, else None."""
    array = storage.buffer_of(t).value()
    if t.storage_offset() or array.size != 1 or array.dtype != to_jax_dtype(t.dtype):
        return None
    return array


def _index_check(key):
    """What debug.failed_check reads of an op's executable (its key and its checks' errors),
    for the bounds check of _index_put_program."""
    compiled = OpProgram()
    compiled.key = key
    compiled.check_info = [(IndexError, "index out of range in self")]
    return compiled


@functools.lru_cache(maxsize=256)
def _index_put_program(x_size, x_dtype, i_size, i_dtype, v_size, accumulate):
    jdtype = jnp.dtype(x_dtype)

    def put(x, index, values, m, n):
        valid = jnp.arange(i_size) < n
        ok = jnp.all(~valid | ((index >= -m) & (index < m)))
        at = jnp.where(valid, jnp.where(index < 0, index + m, index), x_size)  # x_size: dropped
        if v_size is None:  # one value for every index
            values = jnp.broadcast_to(values.reshape(()), (i_size,))
        else:
            values = values[jnp.minimum(jnp.arange(i_size), v_size - 1)]
        values = values.astype(jdtype)
        out = x.at[at].add(values, mode="drop") if accumulate else x.at[at].set(values, mode="drop")
        return jnp.where(ok, out, x), ok  # (a failing index_put_ keeps its target's values)

    key = ("index_put", x_size, x_dtype, i_size, i_dtype, v_size, accumulate)
    return executables.Executable(put, executables.stable(key), "index_put")


def index_put(kernel, args, kwargs):
    """`x.index_put((index,), values, accumulate)` of 1-D tensors, one of them with room to
    spare: the index's length n and x's size m are arguments of one program per capacity."""
    vals = kernel.bind(args, kwargs)
    x, indices, values = vals[0], vals[1], vals[2]
    accumulate = bool(vals[3]) if len(vals) > 3 else False
    mode = _mode()
    if mode is None or len(indices) != 1 or indices[0] is None:
        return None
    index = indices[0]
    if not (isinstance(index, torch.Tensor) and index.device.type == "tpu"
            and index.dtype in (torch.int64, torch.int32) and x.device.type == "tpu"
            and values.device.type == "tpu" and x.dtype not in (torch.bool, torch.uint8)
            and x.dtype == values.dtype and not x.requires_grad and not values.requires_grad):
        return None
    x_array, i_array = _flat(x, spare=False), _flat(index, spare=False)
    v_array = _flat(values, spare=False) if values.dim() else _one_value(values)
    if x_array is None or i_array is None or v_array is None:
        return None
    if values.dim() and values.numel() != index.numel() or x.numel() == 0 or index.numel() == 0:
        return None
    if all(a.size == t.numel() for a, t in ((x_array, x), (i_array, index), (v_array, values))):
        return None  # nothing to spare: the table's op, keyed on these sizes
    if kernel.writes and (not storage.covers_storage(x)
                          or storage.shares_storage(x, (index, values))):
        # index_put_ of a tensor not covering its storage, or one whose storage another
        # operand shares (PyTorch refuses the overlap: the table's op checks it)
        return None
    kernel.low.validate(x, indices, values)  # PyTorch's errors for bad dtypes and shapes
    program = _index_put_program(x_array.size, jnp.dtype(x_array.dtype).name, i_array.size,
                                 jnp.dtype(i_array.dtype).name,
                                 v_array.size if values.dim() else None, accumulate)
    out, ok = program(x_array, i_array, v_array, x.numel(), index.numel())
    key = (x.dtype, tuple(x.shape), x.stride(), 0, 0), (index.dtype, tuple(index.shape),
                                                         index.stride(), 0, 1)
    where = debug.user_frame(3)
    error = functools.partial(debug.failed_check, compiled=_index_check(key),
                              op_name=kernel.overload, where=where,
                              note="its in-place targets kept their values")
    if mode is modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
        e = error([np.asarray(ok)])
        if e is not None:
            raise e
    else:
        sync.defer([ok], error)
    sync.track(out)
    if kernel.writes:  # index_put_: x takes the result (it covers its storage)
        recording.replace_value(x, out)
        return x
    return storage.wrap(out, [x.numel()], [1], x.dtype, x.device.index, x.numel() * x.element_size())


# --- copy_ -----------------------------------------------------------------------------------

def copy(dst, src):
    """`dst.copy_(src)` of 1-D tensors on one device, src with room to spare and dst covering
    its storage (`.long()`, `.to(dtype)`): dst takes a cast of src's whole array.  Whether it
    did."""
    mode = _mode()
    if mode is None or dst.dim() != 1 or src.dim() != 1 or dst.numel() != src.numel():
        return False
    array = _flat(src)
    if array is None or src.requires_grad:
        return False
    buf = storage.buffer_of(dst)
    if not (storage.covers_storage(dst) and buf.dtype == to_jax_dtype(dst.dtype)
            and not dst.is_conj() and not dst.is_neg()):
        return False
    target = storage.wrap(None, [array.size], [1], dst.dtype, dst.device.index)
    kernel_for(aten.copy_.default).call([target, _view(src, array)], {}, mode=mode)
    return recording.replace_value(dst, storage.buffer_of(target).value())


# --- which ops -------------------------------------------------------------------------------

_REDUCTIONS = {
    "sum": ("aten::sum.default",), "prod": ("aten::prod.default",),
    "max": ("aten::max.default", "aten::amax.default"),
    "min": ("aten::min.default", "aten::amin.default"),
    "any": ("aten::any.default",), "all": ("aten::all.default",),
}
_SCANS = ("aten::cumsum.default", "aten::cumprod.default")
_INDEX_PUT = ("aten::index_put.default", "aten::index_put_.default",
              "aten::_index_put_impl_.default")


def _elementwise_ops():
    """The functional pointwise overloads of the table that run as one executable, draw no
    random numbers and check no element values (an integer division's zero divisor).  Not
    those lowered through PyTorch's decompositions: what they call is only known once traced."""
    from .._lowerings.decomposed import _registered as decomposed
    for op, low in registry.TABLE.items():
        if (torch.Tag.pointwise in op.tags and op not in decomposed and not low.eager and not low.random
                and not low.value_checks and not any(a.alias_info is not None and a.alias_info.is_write
                                                     for a in op._schema.arguments)):
            yield op


def install():
    """Give the table's kernels of these ops their padded path (OpKernel.padded: called with
    the op's arguments when the first is a 1-D tensor; None means the op runs as always)."""
    for op in _elementwise_ops():
        kernel_for(op).padded = elementwise
    for name in _SCANS:
        op = registry.overload_of(name, missing_ok=True)
        if op is not None and op in registry.TABLE:
            kernel_for(op).padded = elementwise
    for name, ops in _REDUCTIONS.items():
        handler = reduction(name)
        for op_name in ops:
            op = registry.overload_of(op_name, missing_ok=True)
            if op is not None and op in registry.TABLE:
                kernel_for(op).padded = handler
    for op_name in _INDEX_PUT:
        op = registry.overload_of(op_name, missing_ok=True)
        if op is not None and op in registry.TABLE:
            kernel_for(op).padded = index_put
