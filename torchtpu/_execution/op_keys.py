"""What an op's executable is cached under: the kinds of its schema's arguments, and for each
call the key, the storages it reads and the numbers it passes.

    key = (static arguments, each tensor's dtype/shape/strides/aliasing, the types of the
           Python numbers, the default dtype, [matmul precision], the device)

A view's nonzero offset is not in the key but an argument of the executable (`Dynamic`), so a
loop over x[i] runs one executable; nor is the stride of a size-1 dim, which addresses no other
element (`exact` keeps those for the output layouts that follow them: op_programs.variant).
Strict eager computes a key on every call: this is its hot path, written for it.
"""
import numpy as np
import torch

from .._core import runtime
from . import async_compile, executables

# The kinds of a schema argument.
T, TOPT, TLIST, SCALAR, STATIC, DEVICE, SCALARLIST = range(7)


class Arg:
    __slots__ = ("name", "kind", "kwarg_only", "is_write", "is_out")


def classify(schema, static_scalars, traced):
    """An `Arg` per argument of `schema`: Python numbers are traced (passed to the executable)
    unless named in `static_scalars`; `float`/`bool` arguments named in `traced` are too."""
    args = []
    for a in schema.arguments:
        x = Arg()
        x.name = a.name
        x.kwarg_only = a.kwarg_only
        x.is_write = a.alias_info is not None and a.alias_info.is_write
        x.is_out = a.is_out
        t = str(a.type)
        if t == "Tensor":
            x.kind = T
        elif t == "Optional[Tensor]":
            x.kind = TOPT
        elif t in ("List[Tensor]", "List[Optional[Tensor]]"):
            x.kind = TLIST
        elif (t in ("number", "Optional[number]") and a.name not in static_scalars
              or t in ("float", "bool") and a.name in traced):
            x.kind = SCALAR
        elif t == "List[number]" and a.name not in static_scalars:
            x.kind = SCALARLIST
        elif t in ("Device", "Optional[Device]"):
            x.kind = DEVICE
        else:
            x.kind = STATIC
        args.append(x)
    return args


def device_mismatch(a, b):
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


def _hashable(v):
    """A static argument as part of an executable's key. A number keeps its type: 6 and 6.0 (and
    True and 1) are equal keys to Python, but not to PyTorch (torch.arange(0, 6.0) is float32,
    torch.arange(0, 6) int64: the second was given the first's executable)."""
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, (bool, int, float)):
        return type(v), v
    return v


_int_probe = torch.empty((), dtype=torch.int32, device="meta")


def is_wrapped_number(t):
    # PyTorch has no Python accessor for the flag; it only changes type promotion for the
    # 64-bit dtypes Python numbers become, where promotion with an int tensor reveals it.
    if t.dtype is torch.float64 or t.dtype is torch.complex128:
        return torch.result_type(_int_probe, t) is not t.dtype
    return False


class Buffers(list):
    """The distinct storages a call reads, in the order of first use, with each one's position
    (`positions`): a foreach op over a model's parameters reads hundreds, and a linear search
    per tensor made its key quadratic (more than half of a foreach AdamW step over 500
    tensors).  A DeviceBuffer hashes by identity.  No `__init__`: a Python one costs ~0.1 us
    on every op, so the maker sets `positions` (`Buffers.new`, or `key_of` inline)."""
    __slots__ = ("positions",)

    @classmethod
    def new(cls):
        buffers = cls()
        buffers.positions = {}
        return buffers

    def position(self, buf):
        """`buf`'s position, appending it if new."""
        positions = self.positions
        j = positions.get(buf)
        if j is None:
            j = positions[buf] = len(self)
            self.append(buf)
        return j


class Dynamic:
    """In a slot: the offset is the executable's `index`-th offset argument."""
    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __repr__(self):
        return f"Dynamic({self.index})"

    @staticmethod
    def resolve(offset, offsets):
        return offsets[offset.index] if isinstance(offset, Dynamic) else offset


# In a key: this tensor's (nonzero) offset is an argument.
DYNAMIC = "dynamic"


def layout_key(t, buf, buffers, offset=None, stride=None):
    """What an executable compiled for tensor `t` (on storage `buf`) depends on: its dtype,
    shape, strides and offset (`offset` and `stride`, if given, in their place), which of
    `buffers` (a `Buffers`) it reads (added if new: inputs sharing a storage alias), and lazy conj/neg
    bits.  Op executables and compiled graphs key by it."""
    j = buffers.position(buf)
    if offset is None:
        offset = t.storage_offset()
    if stride is None:
        stride = t.stride()
    dtype = t.dtype
    # Lazily negated or conjugated views (x.conj(), ...): only a complex tensor can be the latter.
    if t.is_neg() or dtype.is_complex and t.is_conj():
        return dtype, t.shape, stride, offset, j, t.is_conj(), t.is_neg()
    return dtype, t.shape, stride, offset, j


def live_strides(shape, stride):
    """The strides that place elements: those of the dims that are not size 1."""
    return tuple(s for n, s in zip(shape, stride) if n != 1)


def _size_one_strides(shape, stride):
    """`stride` with the stride of each size-1 dim set to 1."""
    return tuple(s if n != 1 else 1 for n, s in zip(shape, stride))


class Call:
    """One call's part of the key and what its executable is passed: `buffers` (the storages
    it reads), `scalars` (its Python numbers, then the offsets of its views), `exact` (the
    strides the key leaves out) and `device` (an index)."""
    __slots__ = ("key", "buffers", "scalars", "exact", "device")


def key_of(args, vals, precision):
    """The `Call` of an op whose schema arguments are `args` (`classify`) on `vals`;
    `precision`: whether the matmul precision is part of the key.  Strict eager and fused
    recording key every op: a device tensor's layout is read inline here (a function call
    per tensor, and a `Buffers.__init__`, cost ~0.3 us an op)."""
    key = []
    buffers = Buffers()
    positions = buffers.positions = {}
    scalars = []
    offsets = []
    exact = []
    device = None
    for a, v in zip(args, vals):
        kind = a.kind
        if kind == T or kind == TOPT:
            tensors = (v,)
        elif kind == TLIST:
            key.append(len(v))
            tensors = v
        elif kind == SCALAR:
            if v is None:
                key.append(None)
            else:
                key.append(type(v))
                scalars.append(v)
            continue
        elif kind == SCALARLIST:
            key.append(tuple(map(type, v)))
            scalars.extend(v)
            continue
        elif kind == DEVICE:
            if v is not None:
                v = torch.device(v)
                if v.type == "tpu" and device is None:
                    device = v.index if v.index is not None else runtime.current_device()
            key.append(v)
            continue
        else:
            key.append(_hashable(v))
            continue
        for t in tensors:
            if t is None:
                key.append(None)
                continue
            buf = getattr(t.untyped_storage(), "_tpu", None) if isinstance(t, torch.Tensor) else None
            if buf is None:  # a number, a CPU scalar, or a tensor of another device
                device = _other(t, key, scalars, device)
                continue
            index = buf.index
            if device is None:
                device = index
            elif device != index:
                raise device_mismatch(f"tpu:{device}", t.device)
            j = positions.get(buf)  # (Buffers.position, inline)
            if j is None:
                j = positions[buf] = len(buffers)
                buffers.append(buf)
            # A view's offset is an argument of the executable, not part of its key: a loop
            # over x[i], or the last token of a growing sequence, runs one executable.
            offset = t.storage_offset()
            if offset:
                offsets.append(offset)
                offset = DYNAMIC
            # Nor is the stride of a size-1 dim, which addresses no other element: the last
            # token of a growing [1, L] sequence is a [1, 1] view of strides (L, 1).  Where
            # the outputs' strides follow it (clone keeps them), `variants` gives each its own.
            shape = t.shape
            stride = t.stride()
            if 1 in shape:
                exact.append(stride)
                stride = _size_one_strides(shape, stride)
            dtype = t.dtype
            # (layout_key's tuple)
            if t.is_neg() or dtype.is_complex and t.is_conj():
                key.append((dtype, shape, stride, offset, j, t.is_conj(), t.is_neg()))
            else:
                key.append((dtype, shape, stride, offset, j))
    if device is None:
        device = runtime.current_device()
    if offsets:
        scalars += offsets  # (after the op's own numbers: run() takes them from the end)
    # The default dtype decides a factory's dtype and an integer input's or a Python
    # float's promotion (int / int, int + 2.5): an executable built under float32 must not
    # serve a call under float64.
    key.append(torch.get_default_dtype())
    if precision:
        key.append(torch.get_float32_matmul_precision())
    key.append(device)
    call = Call()
    call.key = tuple(key)
    call.buffers = buffers
    call.scalars = scalars
    call.exact = tuple(exact)
    call.device = device
    return call


def _other(t, key, scalars, device):
    """Key a tensor argument that is not a device tensor: PyTorch hands wrapped numbers
    (`x + 1`) to Python kernels as plain numbers, and a 0-dim CPU tensor mixes with device
    tensors (as with CUDA); both are traced.  Any other device is an error."""
    if not isinstance(t, torch.Tensor):
        key.append(type(t))
        scalars.append(t)
    elif t.dim() == 0 and t.device.type == "cpu":
        key.append(("cpu", t.dtype, is_wrapped_number(t)))
        scalars.append(t.item())
    else:
        raise device_mismatch(f"tpu:{device if device is not None else runtime.current_device()}", t.device)
    return device


# Python numbers that recur (alpha=1, an epsilon, a learning rate) are passed to executables
# as cached weakly typed device scalars: converting a number on every call costs ~1 us.
# A value is cached from its second sighting, so per-call values (a step count) stay cheap;
# zeros and NaN are never cached (-0.0 == 0.0 and NaN != NaN would confuse the lookup).
_scalar_cache = {}
_scalar_seen = set()
_scalar_kinds = set()  # (type, device) of the numbers seen: their executable is built
_INT64 = (-(1 << 63), 1 << 63)


def narrow_complex(v):
    """A Python complex as a TPU program is given it: complex64, weakly typed.  Under JAX's
    64-bit mode it would be complex128, which XLA:TPU has no type for (the compiler aborts)."""
    from .segment import as_weak
    return as_weak(np.complex64(v))


def device_scalar(v, device):
    if type(v) is complex:
        return narrow_complex(v) if runtime.platform() == "tpu" else v
    key = (type(v), v, device)
    cached = _scalar_cache.get(key)
    if cached is not None:
        return cached
    if type(v) is float:
        if not v or v != v:
            return v
    elif type(v) is not int or not v or not _INT64[0] <= v < _INT64[1]:
        return v
    if key not in _scalar_seen:
        if len(_scalar_seen) > 65536:
            _scalar_seen.clear()
        _scalar_seen.add(key)
        kind = (type(v), device)
        if kind not in _scalar_kinds:
            # The executable a second sight needs is built at the first: a compiled step's
            # only strict op with a number (backward's fill_(1.0)) sees its second at step 2,
            # which must build nothing.
            _scalar_kinds.add(kind)
            async_compile.prebuild(executables.scalar(*kind), (v,))
        return v
    if len(_scalar_cache) > 4096:
        _scalar_cache.clear()
    cached = _scalar_cache[key] = executables.scalar(type(v), device)(v)
    return cached


def device_scalars(scalars, device):
    """`scalars` as an executable is passed them outside a fused trace (`device_scalar`)."""
    return [device_scalar(v, device) for v in scalars] if scalars else scalars


def clear_scalars():
    """Forget the device copies of Python numbers (a process that changes its devices)."""
    _scalar_cache.clear()
