"""The lowering table: one entry per aten overload, shared by every execution path.

A lowering is a pure JAX function of the op's functional arguments in schema order: tensors
arrive as JAX arrays already read through their views, `Scalar` arguments as (traced) numbers,
everything else (sizes, dims, flags, dtypes) as static Python values.  It returns the op's
outputs.  The registry derives the in-place (`add_`) and `out=` variants from the functional
overload, so an op is written once:

    @lowering("aten::add.Tensor", promote=Promote.RESULT)
    def add(x, y, alpha=1):
        return x + alpha * y
"""
import contextlib
import dataclasses
import enum
import functools
import os
import sys
import threading
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import torch

# OpOverload -> Lowering, for every overload we run (variants share their functional's)
TABLE = {}
# Lowerings of ops this torch release does not have (e.g. aten::cholesky, gone in 2.14): the
# op cannot be called, so its lowering is simply not registered.  tests/test_lowering_table.py
# fails on any name here that is not a listed op some supported release lacks (a typo).
ABSENT = []


class Promote(enum.Enum):
    """How an op's tensor inputs are cast before its lowering runs."""
    NONE = "none"      # left as they are
    RESULT = "result"  # to the op's first result dtype (arithmetic: add, mul, where...)
    COMMON = "common"  # to torch.result_type of the first two tensors (comparisons)

    def dtype(self, result_dtypes, tensors):
        """The torch dtype the op's tensor inputs are cast to, or None: the one promotion rule
        of every path (op kernels, decompositions).  `result_dtypes`: the dtypes of the op's
        results; `tensors`: its tensor arguments in order (meta or real)."""
        if self is Promote.RESULT and result_dtypes:
            return result_dtypes[0]
        if self is Promote.COMMON and len(tensors) >= 2:
            return torch.result_type(*tensors[:2])
        return None


@dataclasses.dataclass
class Lowering:
    fn: Callable
    promote: Promote = Promote.NONE
    # Scalar-typed arguments that must be compile-time constants (their value changes the
    # program, e.g. an integer exponent); every other Scalar is a traced argument.
    static: tuple = ()
    # `float`- or `bool`-typed arguments passed as traced values instead of compile-time
    # constants (a learning rate that a scheduler changes every step, the first-step flag of
    # a fused SGD step: the step's first and later calls must be one executable).
    traced: tuple = ()
    # The op reads device values to decide its output (data-dependent shapes): it gets
    # concrete arrays and runs outside jit.
    eager: bool = False
    # Pass the PRNG key as the first argument (random ops).
    random: bool = False
    # A random fill of its in-place target: element i of the result depends only on the key,
    # the Python numbers and the i-th draw in row-major order (uniform_, normal_, ...).  Element
    # i is drawn from counter offset + i (_execution/random.py), so a fill of n elements equals
    # the first n of a fill of more: strict eager draws for a few bucketed sizes and copies
    # (op_kernel.OpKernel._bucketed_fill).  A fill's `float` parameters (bounds, mean and std,
    # p) are traced: nn.init's bounds differ with each fan-in, and as constants every value was
    # a threefry program of its own (~0.5 s of XLA:CPU compile).
    fill: bool = False
    # The program depends on torch.get_float32_matmul_precision() (matmuls, convolutions).
    precision: bool = False
    # float16/bfloat16 inputs are computed in float32 and the result rounded once, as
    # PyTorch's CPU kernels do ("opmath"); computing in the half type would round every step.
    opmath: bool = False
    # Called with the op's bound arguments (tensors and Python numbers) before it runs, in
    # every mode: raises PyTorch's error for input its kernel rejects but its meta kernel lets
    # through, without a device round trip.
    validate: Callable = None
    # The out= variant takes only an out of the result's own dtype (the CPU kernel refuses to
    # cast, e.g. neg, round); other out= variants take any dtype the result can be cast to.
    # A string: the CPU's message, formatted with {expected} and {got} (dtype names),
    # {expected_c} and {got_c} (c10's type names) and {name} (the out argument's); a dict: such
    # a message per out argument.
    exact_out: bool | str | dict = False
    # The out= variant takes a bool or uint8 out whatever the result's dtype and refuses any
    # other (all, any: "all only supports bool tensor for result").
    bool_out: bool = False
    # Its program checks element values on the device (`check`: an integer division's zero
    # divisor): it never runs over the spare elements of a padded array (_execution/padded.py).
    value_checks: bool = False
    # The exception type of the CPU's refusal of an out= the result can't be cast to (cat's
    # kernel raises TypeError, others RuntimeError).
    out_cast_error: type = RuntimeError
    # A collective of a process group (the `_c10d_functional` ops): mesh(args), from the op's
    # functional arguments, gives the jax Mesh of the group's devices (one per rank, axis
    # "ranks"), inside which every program holding the op runs (_execution/spmd.py); its
    # lowering uses `lax` collectives over that axis.
    mesh: Callable = None


def overload_of(name, missing_ok=False):
    """The OpOverload "ns::op.overload"; None if this torch release lacks it and `missing_ok`."""
    ns, rest = name.split("::")
    op, _, ov = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), ov or "default")
    except AttributeError:
        if missing_ok:
            return None
        raise


@functools.lru_cache(maxsize=None)
def parameters(op):
    """(name, default or None, is out=) of each of `op`'s schema arguments, for `bind`."""
    return tuple((a.name, a.default_value if a.has_default_value() else None, a.is_out)
                 for a in op._schema.arguments)


def bind(params, args, kwargs):
    """The one binder of a call to a schema: every argument's value in schema order, from the
    positional arguments, then the keywords, then the defaults.  `params`: `parameters(op)`."""
    vals = list(args)
    for name, default, _ in params[len(vals):]:
        vals.append(kwargs[name] if name in kwargs else default)
    return vals


def _arg_signature(schema, skip_out=False):
    return [(a.name, str(a.type)) for a in schema.arguments
            if not (skip_out and a.is_out)]


def variants(functional):
    """The in-place and out= overloads computing the same thing as `functional`."""
    schema = functional._schema
    base = schema.name.split("::")[1]
    ns = schema.name.split("::")[0]
    sig = _arg_signature(schema)
    found = []
    inplace_packet = getattr(getattr(torch.ops, ns), base + "_", None)
    if inplace_packet is not None and not base.endswith("_"):
        ov = getattr(inplace_packet, schema.overload_name or "default", None)
        if ov is not None and [t for _, t in _arg_signature(ov._schema)][1:] == [t for _, t in sig][1:]:
            found.append(ov)
    packet = getattr(getattr(torch.ops, ns), base)
    for name in packet.overloads():
        ov = getattr(packet, name)
        s = ov._schema
        if any(a.is_out for a in s.arguments) and _arg_signature(s, skip_out=True) == sig:
            found.append(ov)
    return found


def functional_of(overload):
    """The functional overload whose results an out= overload stores (None if not out=)."""
    schema = overload._schema
    if not any(a.is_out for a in schema.arguments):
        return None
    ns, base = schema.name.split("::")
    packet = getattr(getattr(torch.ops, ns), base)
    sig = _arg_signature(schema, skip_out=True)
    for name in packet.overloads():
        ov = getattr(packet, name)
        if not any(a.is_out for a in ov._schema.arguments) and _arg_signature(ov._schema) == sig:
            return ov
    return None


def inplace_functional_of(overload):
    """The functional overload of a single-result in-place overload (add_.Tensor -> add.Tensor)."""
    schema = overload._schema
    ns, base = schema.name.split("::")
    if not base.endswith("_") or base.startswith("_") or len(schema.returns) != 1:
        return None
    packet = getattr(getattr(torch.ops, ns), base[:-1], None)
    functional = getattr(packet, schema.overload_name or "default", None) if packet else None
    if functional is None or _arg_signature(functional._schema) != _arg_signature(schema):
        return None
    return functional


def lowering(*names, **options):
    """Register `fn` as the lowering of each named functional overload (and its variants)."""
    def deco(fn):
        low = Lowering(fn, **options)
        if not isinstance(low.promote, Promote):
            raise TypeError(f"promote= takes a registry.Promote, not {low.promote!r}")
        if low.opmath:
            low.fn = in_float32(fn)
        for name in names:
            ov = overload_of(name, missing_ok=True)
            if ov is None:
                ABSENT.append(name)
                continue
            TABLE[ov] = low
            for var in variants(ov):
                TABLE.setdefault(var, low)
        return fn
    return deco


# The half-precision floating types (JAX dtypes), which PyTorch's CPU kernels widen.
HALF_TYPES = (jnp.float16, jnp.bfloat16)


def in_float32(fn):
    """`fn` computing its half-precision array arguments in float32. Its results stay float32:
    every executor casts a lowering's results to the op's output dtype, which rounds them once."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        def up(x):
            half = isinstance(x, jax.Array) and x.dtype in HALF_TYPES
            return x.astype(jnp.float32) if half else x

        return fn(*[[up(a) for a in x] if isinstance(x, (list, tuple)) else up(x) for x in args],
                    **kwargs)
    return wrapped


_trace_state = threading.local()


@contextlib.contextmanager
def collecting_checks():
    """The checks (traced ok, exception type, message) that the lowerings traced inside ask
    for (`check`), collected into the list it gives, one per thread."""
    collected = _trace_state.checks = []
    try:
        yield collected
    finally:
        _trace_state.checks = []


def check(ok, message, exc_type=IndexError):
    """Inside a lowering: raise `exc_type(message)` from the op unless `ok` (a traced bool).

    The executable returns the predicate; the op synchronises on it before committing any
    output, so a failing op leaves every tensor unchanged (JAX itself would clamp or drop)."""
    _trace_state.checks.append((ok, exc_type, message))


def deprecated(message, validate=None):
    """A `validate` hook emitting PyTorch's once-per-process deprecation warning for an op
    (TORCH_WARN_ONCE in its CPU kernel: every time under torch.set_warn_always(True)), then
    running `validate`."""
    warned = []

    def hook(*args):
        if not warned or torch.is_warn_always_enabled():
            warned.append(True)
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())
        if validate is not None:
            validate(*args)
    return hook


_INTERNAL = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def user_stacklevel():
    """warnings.warn's stacklevel naming the innermost caller outside torch and torchtpu."""
    level, f = 2, sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_INTERNAL):
        level, f = level + 1, f.f_back
    return level
