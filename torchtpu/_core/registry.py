"""The lowering table: one entry per aten overload, shared by every execution path.

A lowering is a pure JAX function of the op's functional arguments in schema order: tensors
arrive as JAX arrays already read through their views, `Scalar` arguments as (traced) numbers,
everything else (sizes, dims, flags, dtypes) as static Python values.  It returns the op's
outputs.  The registry derives the in-place (`add_`) and `out=` variants from the functional
overload, so an op is written once:

    @lowering("aten::add.Tensor", promote=True)
    def add(x, y, alpha=1):
        return x + alpha * y
"""
import dataclasses
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


@dataclasses.dataclass
class Lowering:
    fn: Callable
    # Cast tensor inputs before calling `fn`: True = to the first output's dtype (arithmetic),
    # "common" = to torch.result_type of the inputs (comparisons), None = leave them.
    promote: object = None
    # Scalar-typed arguments that must be compile-time constants (their value changes the
    # program, e.g. an integer exponent); every other Scalar is a traced argument.
    static: tuple = ()
    # The op reads device values to decide its output (data-dependent shapes): it gets
    # concrete arrays and runs outside jit.
    eager: bool = False
    # Pass the PRNG key as the first argument (random ops).
    random: bool = False
    # The program depends on torch.get_float32_matmul_precision() (matmuls, convolutions).
    precision: bool = False
    # float16/bfloat16 inputs are computed in float32 and the result rounded once, as
    # PyTorch's CPU kernels do ("opmath"); computing in the half type would round every step.
    opmath: bool = False
    # Called with the op's bound arguments (tensors and Python numbers) before it runs, in
    # every mode: raises PyTorch's error for input its kernel rejects but its meta kernel lets
    # through, without a device round trip.
    validate: Callable = None


def overload_of(name):
    ns, rest = name.split("::")
    op, _, ov = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns), op)
    return getattr(packet, ov or "default")


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


def lowering(*names, **options):
    """Register `fn` as the lowering of each named functional overload (and its variants)."""
    def deco(fn):
        low = Lowering(fn, **options)
        if low.opmath:
            low.fn = in_float32(fn)
        for name in names:
            ov = overload_of(name)
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


def check(ok, message, exc_type=IndexError):
    """Inside a lowering: raise `exc_type(message)` from the op unless `ok` (a traced bool).

    The executable returns the predicate; the op synchronises on it before committing any
    output, so a failing op leaves every tensor unchanged (JAX itself would clamp or drop)."""
    _trace_state.checks.append((ok, exc_type, message))


def deprecated(message, validate=None):
    """A `validate` hook emitting PyTorch's once-per-process deprecation warning for an op
    (TORCH_WARN_ONCE in its CPU kernel), then running `validate`."""
    warned = []

    def hook(*args):
        if not warned:
            warned.append(True)
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())
        if validate is not None:
            validate(*args)
    return hook


_INTERNAL = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _user_stacklevel():
    """warnings.warn's stacklevel naming the innermost caller outside torch and torchtpu."""
    level, f = 2, sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_INTERNAL):
        level, f = level + 1, f.f_back
    return level
