"""Lowerings derived from PyTorch's own decompositions (`torch._decomp.decomposition_table`).

For an aten op with a decomposition but no hand-written lowering, the lowering traces the
decomposition on meta tensors of its inputs' shapes and dtypes (`make_fx`, recursively
decomposing whatever has no lowering) and evaluates the resulting aten/prims graph with the
table's own JAX lowerings, inside the op's single jitted executable.  So a decomposed op is an
ordinary table entry: one cached executable, PyTorch's meta kernel for output metadata, and the
in-place / out= variants derived as for every other op.  A decomposition that needs an op with
no lowering raises NotImplementedError naming it.

Only functional, deterministic overloads qualify, and never one that PyTorch already runs on this
device through a CompositeImplicit/Explicit kernel (unless listed in `COMPOSITE_EXPLICIT`).
`EXCLUDED` lists the decompositions the conformance sweep found wrong or unsuitable.
"""
import operator

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.utils._pytree import tree_flatten, tree_map

from .._core.dtypes import cast, to_jax_dtype, to_torch_dtype
from .._core.registry import TABLE, Promote, bind, lowering, parameters

aten = torch.ops.aten
prims = torch.ops.prims

# CompositeExplicitAutograd ops whose composite kernel calls something with no tpu kernel (the
# loss backwards' call their out= variants, which come from the functional lowering).
COMPOSITE_EXPLICIT = {aten.smooth_l1_loss_backward.default, aten.huber_loss_backward.default}

# Decompositions not used: these mutate a view of a fresh tensor (copy_ into a diagonal, a
# slice...), which a value graph cannot express, while PyTorch's own composite kernel already
# runs them on tpu.
EXCLUDED = {aten.diagonal_scatter.default, aten.select_scatter.default,
            aten.slice_scatter.default, aten.as_strided_scatter.default}

_TENSOR_TYPES = ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


# --- evaluating a traced graph with the table's lowerings ------------------------------------

def _meta_of(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _conform(value, meta):
    if isinstance(meta, torch.Tensor):
        v = jnp.asarray(value).astype(to_jax_dtype(meta.dtype))
        return jnp.broadcast_to(v, tuple(meta.shape))
    return value


def _shape(node):
    return tuple(_meta_of(node).shape)


def _dtype(node):
    return to_jax_dtype(_meta_of(node).dtype)


def _reshape_to_meta(node, x, *rest, **kw):
    return jnp.reshape(x, _shape(node))


def _slice(node, x, dim=0, start=None, end=None, step=1):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


def _select(node, x, dim, index):
    return jnp.take(x, index % x.shape[dim] if index < 0 else index, axis=dim)


def _as_strided(node, x, size, stride, storage_offset=None):
    src = _meta_of(node.args[0])
    if src is None or not src.is_contiguous() or src.storage_offset() != 0:
        raise NotImplementedError("as_strided of a non-contiguous value inside a decomposition")
    flat = jnp.reshape(x, (-1,))
    idx = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return flat[idx] if idx.size else jnp.zeros(tuple(size), x.dtype)


def _split(node, x, split_size, dim=0):
    outs = _meta_of(node)
    bounds = np.cumsum([o.shape[dim] for o in outs])[:-1]
    return jnp.split(x, bounds, axis=dim)


def _unbind(node, x, dim=0):
    return [jnp.take(x, i, axis=dim) for i in range(x.shape[dim])]


def _unfold(node, x, dim, size, step):
    if x.ndim == 0:
        return jnp.reshape(x, (1,))
    n = (x.shape[dim] - size) // step + 1
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    out = jnp.take(x, idx, axis=dim)  # (..., n, size, ...)
    return jnp.moveaxis(out, dim + 1, -1)


def _broadcast_in_dim(node, x, shape, broadcast_dimensions):
    expanded = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        expanded[d] = x.shape[i]
    return jnp.broadcast_to(jnp.reshape(x, expanded), tuple(shape))


def _zeros(node, *args, **kwargs):
    return jnp.zeros(_shape(node), _dtype(node))


def _ones(node, *args, **kwargs):
    return jnp.ones(_shape(node), _dtype(node))


def _full_like(node, x, fill_value, *args, **kwargs):
    return jnp.full(_shape(node), fill_value, _dtype(node))


def _new_full(node, x, size, fill_value, *args, **kwargs):
    return jnp.full(_shape(node), fill_value, _dtype(node))


def _convert(node, x, *args, **kwargs):
    return cast(x, _dtype(node))


def _identity(node, x, *args, **kwargs):
    return x


def _permute(node, x, dims):
    return jnp.transpose(x, [d % max(x.ndim, 1) for d in dims]) if x.ndim else x


def _transpose(node, x, d0=0, d1=1):
    return jnp.swapaxes(x, d0, d1) if x.ndim > 1 else x


def _diagonal(node, x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim1 % x.ndim, dim2 % x.ndim)


def _view_as_real(node, x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


def _view_as_complex(node, x):
    return lax.complex(x[..., 0], x[..., 1])


# Views and factories are not table entries (views are metadata kernels over shared storage on
# the device); inside a graph they are plain functions of values.
SPECIAL = {
    aten.view.default: _reshape_to_meta, aten._unsafe_view.default: _reshape_to_meta,
    aten.reshape.default: _reshape_to_meta, aten._reshape_alias.default: _reshape_to_meta,
    aten.unsqueeze.default: _reshape_to_meta, aten.squeeze.default: _reshape_to_meta,
    aten.squeeze.dim: _reshape_to_meta, aten.squeeze.dims: _reshape_to_meta,
    aten.flatten.using_ints: _reshape_to_meta,
    aten.expand.default: lambda node, x, size, implicit=False: jnp.broadcast_to(x, _shape(node)),
    aten.permute.default: _permute, aten.t.default: _transpose, aten.transpose.int: _transpose,
    aten.slice.Tensor: _slice, aten.select.int: _select, aten.as_strided.default: _as_strided,
    aten.diagonal.default: _diagonal, aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split, aten.unbind.int: _unbind, aten.unfold.default: _unfold,
    aten.alias.default: _identity, aten.detach.default: _identity, aten.lift_fresh.default: _identity,
    aten.lift_fresh_copy.default: _identity, aten.view_as_real.default: _view_as_real,
    aten.view_as_complex.default: _view_as_complex,
    aten._to_copy.default: _convert, aten.to.dtype: _convert,
    aten.empty.memory_format: _zeros, aten.empty_like.default: _zeros, aten.new_empty.default: _zeros,
    aten.empty_strided.default: _zeros, aten.new_empty_strided.default: _zeros,
    aten.zeros.default: _zeros, aten.zeros_like.default: _zeros, aten.new_zeros.default: _zeros,
    aten.ones.default: _ones, aten.ones_like.default: _ones, aten.new_ones.default: _ones,
    aten.full_like.default: _full_like, aten.new_full.default: _new_full,
    prims.convert_element_type.default: _convert, prims.view_of.default: _identity,
    prims.squeeze.default: _reshape_to_meta, prims.split_dim.default: _reshape_to_meta,
    prims.collapse_view.default: _reshape_to_meta, prims.reshape.default: _reshape_to_meta,
    prims.collapse.default: _reshape_to_meta, prims.broadcast_in_dim.default: _broadcast_in_dim,
    prims.transpose.default: _permute,
}


def _table_entry(target):
    """The lowering evaluating `target` (prims elementwise ops use their aten namesake's)."""
    low = TABLE.get(target)
    if low is None and target.namespace == "prims":
        packet = getattr(aten, target._schema.name.split("::")[1], None)
        for ov in ("default", "Tensor", "self"):
            cand = getattr(packet, ov, None) if packet is not None else None
            if cand is not None and cand in TABLE:
                return TABLE[cand], cand
    return low, target


def _call_lowering(node, target, args, kwargs):
    low, resolved = _table_entry(target)
    if low is None or low.random or low.eager or target._schema.is_mutable:
        raise NotImplementedError(f"no tpu lowering for {target} (needed by a decomposition)")
    schema = resolved._schema if resolved is not target else target._schema
    params = parameters(target)
    vals = [v for v, (_, _, is_out) in zip(bind(params, args, kwargs), params) if not is_out]
    kinds = [str(a.type) for a in schema.arguments if not a.is_out]
    out_meta = _meta_of(node)
    promote = low.promote if target.namespace == "aten" else Promote.NONE
    first = out_meta[0] if isinstance(out_meta, (tuple, list)) else out_meta
    results = [first.dtype] if isinstance(first, torch.Tensor) else []
    # Plain meta stand-ins (the graph's values belong to its own fake mode).
    metas = [torch.empty((1,) if m.dim() else (), dtype=m.dtype, device="meta")
             for m in (_meta_of(a) for a in tree_flatten((node.args, node.kwargs))[0])
             if isinstance(m, torch.Tensor)] if promote is Promote.COMMON else []
    dtype = promote.dtype(results, metas)
    dtype = None if dtype is None else to_jax_dtype(dtype)

    def cast(v):
        if dtype is None or v is None:
            return v
        return jnp.asarray(v).astype(dtype)

    for k, kind in enumerate(kinds[: len(vals)]):
        if kind in ("Tensor", "Optional[Tensor]"):
            vals[k] = cast(vals[k])
        elif kind.startswith("List[") and "Tensor" in kind:
            vals[k] = [cast(v) for v in vals[k]]
    result = low.fn(*vals)
    if isinstance(out_meta, (tuple, list)):
        flat = [r for r in tree_flatten(result)[0] if r is not None] if not isinstance(result, (tuple, list)) else list(result)
        return type(out_meta)(_conform(r, m) for r, m in zip(flat, out_meta))
    return _conform(result, out_meta)


def evaluate(gm, inputs):
    """Run the FX graph `gm` (aten/prims ops with meta values) on JAX arrays."""
    env = {}
    it = iter(inputs)

    def load(a):
        return env[a] if isinstance(a, torch.fx.Node) else a

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "call_function":
            args = tree_map(load, node.args)
            kwargs = tree_map(load, node.kwargs)
            target = node.target
            if target is operator.getitem:
                env[node] = args[0][args[1]]
            elif isinstance(target, type) and issubclass(target, tuple):  # return_types
                env[node] = tuple(args[0]) if len(args) == 1 and not kwargs else tuple(args)
            elif target in SPECIAL:
                env[node] = _conform_any(SPECIAL[target](node, *args, **kwargs), _meta_of(node))
            elif isinstance(target, torch._ops.OpOverload):
                env[node] = _call_lowering(node, target, args, kwargs)
            else:
                raise NotImplementedError(f"decomposition uses {target}")
        elif node.op == "output":
            return tree_map(load, node.args[0])
        else:
            raise NotImplementedError(f"decomposition graph has a {node.op} node")


def _conform_any(value, meta):
    if isinstance(meta, (list, tuple)):
        return [_conform(v, m) for v, m in zip(value, meta)]
    return _conform(value, meta)


# --- tracing a decomposition ----------------------------------------------------------------

_trace_table = None


def _decompositions_for_tracing():
    """Decompositions applied while tracing: those of every op the table cannot evaluate."""
    global _trace_table
    if _trace_table is None:
        from torch._decomp import decomposition_table
        _trace_table = {op: fn for op, fn in decomposition_table.items()
                        if op not in TABLE and op not in SPECIAL and op not in _registered
                        and op not in EXCLUDED}
    return _trace_table


def _to_meta(v):
    if isinstance(v, (jnp.ndarray, np.ndarray)) or hasattr(v, "aval"):
        return torch.empty(tuple(v.shape), dtype=to_torch_dtype(jnp.asarray(v).dtype), device="meta")
    return v


def make_lowering(op, decomp):
    schema = op._schema
    functional = [a for a in schema.arguments if not a.is_out]

    def lower(*vals):
        from torch.fx.experimental.proxy_tensor import make_fx
        tensor_pos = []
        metas = []
        for k, (a, v) in enumerate(zip(functional, vals)):
            if str(a.type) in _TENSOR_TYPES and v is not None:
                if isinstance(v, (list, tuple)):
                    tensor_pos.append((k, len(v)))
                    metas.extend(_to_meta(t) for t in v)
                else:
                    tensor_pos.append((k, None))
                    metas.append(_to_meta(v))
        flat_inputs = [t for t in tree_flatten([vals[k] for k, _ in tensor_pos])[0] if t is not None]

        def rebuild(*tensors, fn=decomp):
            full = list(vals)
            it = iter(tensors)
            for k, n in tensor_pos:
                full[k] = next(it) if n is None else [next(it) for _ in range(n)]
            pos, kw = [], {}
            for a, v in zip(functional, full):
                if a.kwarg_only:
                    kw[a.name] = v
                else:
                    pos.append(v)
            out = fn(*pos, **kw)
            if out is NotImplemented:
                raise NotImplementedError(
                    f"PyTorch's decomposition of {op} does not cover these arguments")
            return out

        if any(m.numel() == 0 for m in metas if isinstance(m, torch.Tensor)):
            # Results without elements have no values to compute (and decompositions often
            # reshape with a -1, which an empty tensor leaves ambiguous: max_pool2d of an
            # empty batch): their shapes and dtypes are the meta kernel's.
            with torch.no_grad():
                results = rebuild(*metas, fn=op)
            flat = tree_flatten(results)[0]
            if all(isinstance(r, torch.Tensor) and r.numel() == 0 for r in flat):
                return tree_map(lambda r: jnp.zeros(tuple(r.shape), to_jax_dtype(r.dtype)), results)
        with torch.no_grad():
            gm = make_fx(rebuild, decomposition_table=_decompositions_for_tracing(),
                         tracing_mode="real")(*metas)
        return evaluate(gm, flat_inputs)

    return lower


_registered = set()


def _random(op):
    s = op._schema
    return (any("Generator" in str(a.type) for a in s.arguments)
            or torch.Tag.nondeterministic_seeded in op.tags)


def _qualifies(op):
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return False
    if op in TABLE or op in SPECIAL or op in EXCLUDED or _random(op):
        return False
    s = op._schema
    if s.is_mutable or any(a.is_out for a in s.arguments) or any(r.alias_info for r in s.returns):
        return False
    if not s.returns:
        return False
    name = op.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if has(name, "CompositeImplicitAutograd") or has(name, "PrivateUse1"):
        return False
    if has(name, "CompositeExplicitAutograd") and op not in COMPOSITE_EXPLICIT:
        return False
    return True


def _numbers(op):
    return tuple(a.name for a in op._schema.arguments
                 if str(a.type) in ("number", "Optional[number]", "List[number]"))


def register_all():
    """Add a decomposition-based lowering for every qualifying op (call after the hand-written
    lowerings are registered: they always take precedence)."""
    from torch._decomp import decomposition_table
    chosen = [(op, fn) for op, fn in decomposition_table.items() if _qualifies(op)]
    _registered.update(op for op, _ in chosen)
    for op, fn in chosen:
        # Scalars are compile-time constants: the decomposition is traced with their values.
        lowering(f"{op._schema.name}.{op._schema.overload_name or 'default'}",
                 static=_numbers(op), precision=True)(make_lowering(op, fn))
    return [op for op, _ in chosen]
