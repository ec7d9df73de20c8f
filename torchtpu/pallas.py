"""`torch.tpu.pallas.jax_op`: a JAX (or Pallas) function as a differentiable torch op.

    @torch.tpu.pallas.jax_op
    def rms_norm(x, weight, *, eps=1e-6):          # JAX arrays in, JAX arrays out
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    y = rms_norm(x, w, eps=1e-5)                     # tpu tensors in, tpu tensors out

Positional arguments are tensors; keyword arguments are static Python literals (each distinct
set compiles once).  A function returning one array gives one tensor, otherwise a tuple.  The function becomes a `torch.library` op whose fake/meta implementation
comes from `jax.eval_shape`, whose tpu kernel is an entry of the lowering table (so it runs in
strict, fused and debug eager and inside `torch.compile(backend="tpu")` graphs with no host
copies), and whose gradient comes from `jax.vjp` of the function, or from `backward` if given:
`backward(primals, cotangents, **static)` returns one gradient (or None) per primal; `static`
holds the function's keyword defaults as well as the call's keywords, so `rms_norm(x, w)`
gives the backward its `eps=1e-6`.
"""
import ast
import functools
import inspect
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ._core.dtypes import to_jax_dtype, to_torch_dtype
from ._core import registry

_NAMESPACE = "torchtpu_jax"
_library = torch.library.Library(_NAMESPACE, "FRAGMENT")
_ids = itertools.count()


def _as_list(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _is_float(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


class JaxOp:
    def __init__(self, fn, backward=None, name=None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.backward = backward
        # The keyword defaults of `fn`: the forward of a call that left them out used them, and
        # the backward is given the same values (it may declare them without defaults).
        self.defaults = {name: p.default for name, p in inspect.signature(fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self.name = f"{re.sub(r'[^0-9a-zA-Z_]', '_', name or fn.__name__)}_{next(_ids)}"
        _library.define(f"{self.name}(Tensor[] args, str static) -> Tensor[]")
        _library.define(f"{self.name}_vjp(Tensor[] args, Tensor?[] cotangents, str static) -> Tensor[]")
        packet = getattr(torch.ops, _NAMESPACE)
        self.op = getattr(packet, self.name).default
        self.vjp_op = getattr(packet, f"{self.name}_vjp").default
        registry.lowering(f"{_NAMESPACE}::{self.name}")(self._forward)
        registry.lowering(f"{_NAMESPACE}::{self.name}_vjp")(self._vjp)
        from ._execution.kernels import kernel_for
        for op in (self.op, self.vjp_op):
            _library.impl(op._schema.name.split("::")[1], kernel_for(op), "PrivateUse1")
        torch.library.register_fake(self.op)(self._fake_forward)
        torch.library.register_fake(self.vjp_op)(self._fake_vjp)
        torch.library.register_autograd(self.op, self._autograd_backward,
                                        setup_context=self._setup_context)

    def __call__(self, *tensors, **static):
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.__name__}: positional arguments must be tensors, got "
                                f"{type(t).__name__}; pass other values as keyword arguments")
        if not all(_is_literal(v) for v in static.values()):
            raise TypeError(f"{self.__name__}: keyword arguments must be Python literals "
                            f"(numbers, strings, booleans, None, tuples), got {static!r}")
        key = repr(sorted(static.items()))
        outs = self.op(list(tensors), key)
        return outs[0] if len(outs) == 1 else tuple(outs)

    # -- the lowering table entries ---------------------------------------------------------
    def _forward(self, args, static):
        with _traced_as_in_jax(args):
            return _as_list(self.fn(*args, **_static_kwargs(static)))

    def _vjp(self, args, cotangents, static):
        with _traced_as_in_jax(args):
            return self._traced_vjp(args, cotangents, static)

    def _traced_vjp(self, args, cotangents, static):
        kwargs = _static_kwargs(static)
        diff = [i for i, a in enumerate(args) if _is_float(a.dtype)]
        primals = [args[i] for i in diff]

        def f(*values):
            full = list(args)
            for i, v in zip(diff, values):
                full[i] = v
            return _as_list(self.fn(*full, **kwargs))

        outs = jax.eval_shape(f, *primals)
        cts = [c if c is not None and _is_float(o.dtype) else
               (jnp.zeros(o.shape, o.dtype) if _is_float(o.dtype) else np.zeros(o.shape, jax.dtypes.float0))
               for c, o in zip(cotangents, outs)]
        if self.backward is not None:
            grads = _as_list(self.backward(tuple(args), tuple(cts), **{**self.defaults, **kwargs}))
            return [jnp.zeros(args[i].shape, args[i].dtype) if grads[i] is None else grads[i] for i in diff]
        _, pullback = jax.vjp(f, *primals)
        return list(pullback(cts))

    # -- PyTorch's side: shapes without running, and autograd --------------------------------
    def _fake_forward(self, args, static):
        structs = list(map(_struct, args))
        with _traced_as_in_jax(structs):
            shapes = jax.eval_shape(functools.partial(self.fn, **_static_kwargs(static)),
                                    *structs)
        return [torch.empty(s.shape, dtype=to_torch_dtype(s.dtype), device=args[0].device)
                for s in _as_list(shapes)]

    def _fake_vjp(self, args, cotangents, static):
        return [torch.empty_like(a) for a in args if a.is_floating_point() or a.is_complex()]

    @staticmethod
    def _setup_context(ctx, inputs, output):
        args, static = inputs
        ctx.save_for_backward(*args)
        ctx.static = static
        ctx.n_args = len(args)

    def _autograd_backward(self, ctx, grads):
        args = list(ctx.saved_tensors)
        diff_grads = iter(self.vjp_op(args, list(grads), ctx.static))
        return [next(diff_grads) if (a.is_floating_point() or a.is_complex()) else None
                for a in args], None


def _traced_as_in_jax(args):
    """Where a jax_op's function is traced: as plain JAX would, with 64-bit types off, unless
    one of `args` is a 64-bit array (torchtpu turns them on for PyTorch's int64 and float64,
    and with them off JAX would truncate such an input to 32 bits).  With them on, a Pallas
    kernel's index maps return int64, which Mosaic cannot compile, and `jnp.zeros(n)` is
    float64.  (Off a TPU, a Pallas kernel runs interpreted where it says `interpret=`; it is
    not forced into Pallas' TPU interpreter here: that one's callbacks hung a CPU test run.)"""
    return jax.enable_x64(any(a.dtype in _WIDE for a in args))


_WIDE = tuple(map(np.dtype, ("int64", "uint64", "float64", "complex128")))


def _is_literal(v):
    if isinstance(v, tuple):
        return all(_is_literal(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, complex, str))


@functools.lru_cache(maxsize=None)
def _static_kwargs(key):
    # The static keyword arguments travel in the op's string argument (literals only, checked
    # by the call), so nothing outside the call needs updating: Dynamo would defer such a side
    # effect past the graph's tracing.
    return dict(ast.literal_eval(key))


def _struct(t):
    return jax.ShapeDtypeStruct(tuple(t.shape), to_jax_dtype(t.dtype))


def jax_op(fn=None, *, backward=None, name=None):
    """Decorator: `fn` (JAX arrays in and out) becomes a torch op on tpu tensors."""
    if fn is None:
        return functools.partial(jax_op, backward=backward, name=name)
    return JaxOp(fn, backward=backward, name=name)
