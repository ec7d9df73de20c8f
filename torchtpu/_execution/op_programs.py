"""Building an op's program: from a call's key, PyTorch's meta kernel and the op's lowering,
the JAX function `run` (read views -> lowering -> write back / store) and its executable.

On a miss of the op's key (op_keys), PyTorch's meta kernel gives the outputs' dtypes, shapes
and strides and PyTorch's own errors for bad input; `run` reads each tensor as its view of its
storage's array, promotes, calls the lowering, casts, and writes in-place results back into
their storages' arrays (an out= resized by PyTorch's rules first); its index checks become
booleans the executable returns.  `OpProgram` holds it all, cached in the kernel under the key.
"""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from .._core import metrics, registry, runtime, storage
from .._core.dtypes import cast, to_jax_dtype, to_torch_dtype
from .._lowerings.meta import c10_name, dtype_name
from . import bounded, debug, executables, modes, overlap, spmd, strided
from .op_keys import (DEVICE, SCALAR, SCALARLIST, STATIC, T, TLIST, TOPT, Dynamic, is_wrapped_number,
                      live_strides)
from .op_results import Number
from .random import key_from_parts

_meta_device = torch.device("meta")
_MAX_VARIANTS = 256  # output layouts kept per executable (see `variant`)
_DONATE_FROM = 1 << 18  # bytes of a storage whose partial writes reuse its buffer (`donor`)


class OutResized(Exception):
    """The meta kernel resized out= tensors (args[0]: (tensor, shape, stride, offset) of each,
    as they were): the op runs again with their new layouts in its key."""


class OpProgram:
    """An op's program for one key: `run` (the JAX function), `fn` (its executable), the
    layouts of its new outputs (`out_specs`, `wrap_specs`), the storages it writes, where each
    return comes from, its index checks' messages, how many random numbers it draws, and for a
    collective the mesh it runs over."""
    __slots__ = ("key", "fn", "run", "out_specs", "wrap_specs", "writes", "check_info", "returns",
                 "list_len", "recheck_overlap", "meta_returns", "variants", "program", "draws",
                 "mesh", "collective", "n_offsets", "donor")

    def with_outputs(self, out_specs):
        """The same executable giving its outputs other layouts (`variants`).  `program`, the
        compiled object that stands for the program in fused traces, stays the same: a
        segment is the same program whatever layouts its ops' outputs were given."""
        variant = OpProgram()
        for name in OpProgram.__slots__:
            setattr(variant, name, getattr(self, name))
        variant.out_specs = out_specs
        variant.wrap_specs = wrap_specs(out_specs)
        variant.variants = None
        return variant

    def check_error(self, checks):
        """The error of the first of this op's index checks that failed (`checks`: their
        results), or None; every path that runs the op raises it."""
        for ok, (exc_type, message) in zip(jax.device_get(checks), self.check_info):
            if not bool(ok):
                return exc_type(message)
        return None


def one_value(compiled):
    """Whether an op's outputs are one element (or none) each."""
    return all(math.prod(shape) <= 1 for shape, _, _, _ in compiled.wrap_specs)


def _meta_args(kernel, vals):
    metas = {}

    def meta_of(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.device.type != "tpu":
            # A 0-dim CPU operand is a traced scalar here (see op_keys); some meta kernels
            # (Python refs) refuse to mix devices, so their computation sees a meta one.
            # Wrapped numbers stay CPU tensors: a meta copy would lose their promotion rule.
            cpu_scalar = t.dim() == 0 and t.device.type == "cpu" and not is_wrapped_number(t)
            return torch.empty((), dtype=t.dtype, device="meta") if cpu_scalar else t
        st = t.untyped_storage()
        base = metas.get(id(st))
        if base is None:
            base = metas[id(st)] = torch.empty(st.nbytes(), dtype=torch.uint8, device="meta")
        itemsize = t.dtype.itemsize
        usable = base[: (base.numel() // itemsize) * itemsize]
        return usable.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    pos, kw = [], {}
    for a, v in zip(kernel.args, vals):
        if a.kind in (T, TOPT) and v is not None:
            v = meta_of(v)
        elif a.kind == TLIST:
            v = [None if t is None else meta_of(t) for t in v]
        elif a.kind == DEVICE and v is not None and torch.device(v).type == "tpu":
            v = _meta_device
        if a.kwarg_only:
            kw[a.name] = v
        else:
            pos.append(v)
    return pos, kw


def build_cached(kernel, call, vals, scalars):
    """The program of `call` (an op_keys.Call) on `vals`: built (unless another thread built it
    meanwhile) and kept in the kernel's cache under the call's key; `scalars`: what the
    executable is passed."""
    key = call.key
    with kernel.lock:
        compiled = kernel.cache.get(key)
        if compiled is not None:
            return compiled
        compiled = executable(kernel, key, vals, call.buffers, scalars, call.device)
        if call.exact and compiled.out_specs and not kernel.low.eager:
            compiled.variants = {call.exact: compiled}
        if not kernel.low.eager:  # eager ops run un-jitted and are rebuilt per call
            kernel.cache[key] = compiled
            bounded.op_executables.insert(compiled, kernel.cache)
        return compiled


def executable(kernel, key, vals, buffers, scalars, device):
    with metrics.span(f"torchtpu::compile {kernel.overload}"):
        compiled = build(kernel, vals, buffers, scalars, device)
    compiled.key = key
    partial_writes, compiled.donor = compiled.donor, None  # (make_run's finding)
    if compiled.mesh is not None:  # a collective: run on every rank of its group
        compiled.fn = spmd.Program(
            compiled.run, compiled.mesh, [compiled.collective],
            _persistent_key(kernel, key), str(kernel.overload), str(kernel.overload),
            traced=(lambda: list(compiled.check_info), _restorer(compiled.check_info)))
        metrics.counters["compiles"] += 1
    elif not kernel.low.eager:
        # A factory (no tensor argument) places its results on its device: a program reading
        # no array of one would put them on the default device (`torch.full(..., device=
        # "tpu:1")` made an array on tpu:0's chip).
        placed = {} if buffers else {
            "out_shardings": jax.sharding.SingleDeviceSharding(runtime.jax_device(device))}
        compiled.fn = executables.Executable(
            compiled.run, _persistent_key(kernel, key), str(kernel.overload),
            describe=lambda: debug.describe_key(key),
            traced=(lambda: list(compiled.check_info), _restorer(compiled.check_info)), **placed)
        metrics.counters["compiles"] += 1
        if partial_writes:
            key = compiled.fn.key
            compiled.donor = executables.Executable(
                compiled.run, None if key is None else executables.stable((key, "donating")),
                str(kernel.overload), donate_argnums=tuple(compiled.writes), **placed)
    return compiled


def variant(kernel, compiled, vals, call, scalars):
    """`compiled` giving its outputs the layouts PyTorch gives them for these inputs (the
    meta kernel asked once per pattern of size-1 strides: clone keeps them, and they can
    tip a 4-D layout into channels-last): the same program where the outputs' elements lie
    in the same order (their strides differ only in size-1 dims), else one of their own."""
    exact = call.exact
    variant = compiled.variants.get(exact)
    if variant is None:
        if len(compiled.variants) >= _MAX_VARIANTS:  # a sequence growing without end
            compiled.variants.clear()
        pos, kw = _meta_args(kernel, vals)
        out_specs = _out_specs(kernel, kernel.overload(*pos, **kw), compiled.meta_returns)
        if all(live_strides(shape, stride) == live_strides(old_shape, old_stride)
               for (shape, stride, _), (old_shape, old_stride, _) in zip(out_specs, compiled.out_specs)):
            variant = compiled.with_outputs(out_specs)
        else:
            variant = executable(kernel, compiled.key + (exact,), vals, call.buffers, scalars,
                                 call.device)
        compiled.variants[exact] = variant
    return variant


def _out_specs(kernel, meta_out, returns):
    return [(tuple(m.shape), _dense_strides(m), m.dtype)
            for m in _fresh_meta_outputs(kernel, meta_out, returns)]


def _persistent_key(kernel, key):
    """The key of this op's executable across processes, or None to keep it in memory
    only: a lowering from outside torchtpu, torch and jax (a user's jax_op, a custom op)
    can change between runs without any version saying so (torch's decompositions and
    jnp functions are covered by their versions, ours by the source digest).  torchtpu's
    own ops (`torchtpu::attention`, which every SDPA runs, `grouped_mm`, ...) are ours; a
    user's jax_op lives in `torchtpu_jax`, not kept."""
    module = getattr(kernel.low.fn, "__module__", None) or ""
    if (kernel.overload.namespace not in ("aten", "prims", "torchtpu")
            or not module.startswith(("torchtpu.", "torch.", "jax."))):
        return None
    return executables.stable((str(kernel.overload), key))


def _broadcast_error(self_shape, shape):
    return RuntimeError(f"output with shape {list(self_shape)} doesn't match the broadcast shape "
                        f"{list(shape)}")


def _inplace_meta(kernel, vals, pos, kw):
    """An in-place op's meta kernel, which must not change self's shape: some of PyTorch's (the
    refs of atan2_, fmod_, lt_...) resize it as an out= with a warning, where ATen's kernels
    refuse; others refuse in their own words. ATen's error either way."""
    import warnings
    self_shape = tuple(vals[0].shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            meta_out = kernel.overload(*pos, **kw)
        except RuntimeError as e:
            if "doesn't match the broadcast shape" in str(e):
                broadcast = torch.broadcast_shapes(*[v.shape for v in vals
                                                     if isinstance(v, torch.Tensor)])
                raise _broadcast_error(self_shape, broadcast) from None
            raise
    if isinstance(pos[0], torch.Tensor) and tuple(pos[0].shape) != self_shape:
        raise _broadcast_error(self_shape, pos[0].shape)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return meta_out


def build(kernel, vals, buffers, scalars, device):
    """The OpProgram of `kernel` on `vals` (its key not yet set): the outputs PyTorch's meta
    kernel describes, then the JAX function computing them."""
    overlap.check(kernel, vals, resized=False)
    compiled = OpProgram()
    compiled.program = compiled
    pos, kw = describe_outputs(compiled, kernel, vals, device)
    make_run(compiled, kernel, vals, buffers, scalars, pos, kw)
    return compiled


def describe_outputs(compiled, kernel, vals, device):
    """Fill in what PyTorch's meta kernel says of the op's results (after its checks and out=
    resizes): where each return comes from, the new outputs' layouts, how many random numbers
    it draws, a collective's mesh.  Returns the meta arguments (pos, kw)."""
    pos, kw = _meta_args(kernel, vals)
    if kernel.low.eager:
        meta_out = None
    else:
        _check_out_dtypes(kernel, vals, pos, kw)
        try:
            if kernel.inplace_of is None:
                meta_out = kernel.overload(*pos, **kw)
            else:
                meta_out = _inplace_meta(kernel, vals, pos, kw)
        except (AssertionError, TypeError, ValueError, ZeroDivisionError) as e:
            # Some of PyTorch's Python meta kernels assert (or trip over their own checks,
            # or divide by a zero stride) where its C++ kernels raise RuntimeError.
            raise RuntimeError(str(e)) from e
        _resize_outs(kernel, vals, pos, kw)
        overlap.check(kernel, vals, resized=True)

    # Where each return comes from: a fresh output (None) or a mutated argument (its index).
    returns = [_aliased_input(kernel, r) if r.alias_info is not None and r.alias_info.is_write
               else None for r in kernel.returns]
    if isinstance(meta_out, (tuple, list)) and not _returns_list(kernel):
        # Outputs the op leaves undefined (e.g. convolution_backward's masked-off grads),
        # and integers its meta kernel fixes (the fused attention's max_q and max_k).
        returns = ["none" if r is None and m is None
                   else Number(m) if r is None and isinstance(m, (int, torch.SymInt)) else r
                   for r, m in zip(returns, meta_out)]
    compiled.returns = compiled.meta_returns = returns
    compiled.variants = None
    out_specs = [] if meta_out is None else _out_specs(kernel, meta_out, returns)
    for shape, stride, dtype in out_specs:
        storage.check_allocation(shape, stride, dtype, device)
    compiled.out_specs = out_specs
    compiled.wrap_specs = wrap_specs(out_specs)
    # How many elements a random op draws: none of its samplers draws more than its largest
    # operand or result holds (random.py: the offset moves past them).
    compiled.draws = max([math.prod(shape) for shape, _, _ in out_specs]
                         + [m.numel() for m in tree_flatten((pos, kw))[0]
                            if isinstance(m, torch.Tensor)], default=0)
    compiled.mesh = compiled.collective = None
    if kernel.low.mesh is not None:
        compiled.mesh, group = kernel.low.mesh(*[vals[i] for i in kernel.functional_args])
        compiled.collective = _collective_entry(kernel.overload, group, tree_flatten((pos, kw))[0])
    compiled.list_len = len(out_specs) if returns == [None] and _returns_list(kernel) else 0
    if compiled.list_len:
        compiled.returns = ["list"]
    return pos, kw


def make_run(compiled, kernel, vals, buffers, scalars, pos, kw):
    """Fill in the op's JAX function (`run`, also `fn` until `executable` jits it): the
    lowering on the arguments' storages, writing its in-place and out= targets, with its index
    checks; and what a fused segment needs of it (the storages it writes, its view offsets)."""
    out_specs = compiled.out_specs
    # Tensor slots as the lowering sees them, in schema order.
    slots, write_targets, n_offsets = _slots(kernel, vals, buffers)
    compiled.n_offsets = n_offsets  # `run`'s last arguments (a graph bakes them in: segment.baked_numbers)
    compiled.writes = sorted({j for j, *_ in write_targets})
    # A write to a small part of a large storage (DDP's gradient bucket, a KV cache's rows)
    # copies the whole storage unless the program may reuse its buffer (strict eager: `donor`,
    # which `executable` makes where this is true).
    compiled.donor = any(
        buffers[j].nbytes >= _DONATE_FROM
        and 2 * math.prod(shape) * np.dtype(dtype).itemsize <= buffers[j].nbytes
        for j, shape, _, _, dtype, *_ in write_targets)
    # Whether a written tensor and another argument overlap depends on their offsets, which
    # the key leaves out: a call whose written storage another argument shares checks again.
    used = [s[0] for v in slots.values() for s in (v if isinstance(v, list) else [v])
            if s is not None and isinstance(s[0], int)]
    compiled.recheck_overlap = bool(n_offsets) and any(used.count(j) > 1 for j in compiled.writes)
    low, fargs_idx, argdefs = kernel.low, kernel.functional_args, kernel.args
    # An out= op computes its functional's results, rounded to their dtypes, and casts them
    # to out's dtype (tanh(bfloat16, out=float32) rounds to bfloat16 first, as PyTorch).
    result_dtypes = _functional_dtypes(kernel, pos, kw) if write_targets and kernel.functional else None
    # Promotion goes to the dtype of the first result, or of the first written argument:
    # self of an in-place op, out of an out= op (computing bfloat16 inputs in out's float32
    # and rounding to the functional's dtype matches the CPU; computing in bfloat16 would
    # let XLA:CPU skip that rounding).
    if out_specs:
        promoted_to = [out_specs[0][2]]
    else:
        promoted_to = [vals[kernel.writes[0]].dtype] if write_targets and argdefs[kernel.writes[0]].kind == T else []
    tensors = [m for m in tree_flatten((pos, kw))[0] if isinstance(m, torch.Tensor)]
    promote_dtype = low.promote.dtype(promoted_to, tensors)
    promote_dtype = None if promote_dtype is None else to_jax_dtype(promote_dtype)
    # An integer result is computed in its own dtype, whatever out's dtype (fmod(int, int,
    # out=float) divides as integers and raises on zero, as on the CPU).
    if (result_dtypes and low.promote is registry.Promote.RESULT
            and np.dtype(result_dtypes[0]).kind in "biu"):
        promote_dtype = result_dtypes[0]
    n_buf = len(buffers)
    # Only plain values may be captured: a captured tensor would never be freed.
    consts = {}
    for i in fargs_idx:
        kind = argdefs[i].kind
        if kind == SCALAR:
            consts[i] = vals[i] is None
        elif kind == SCALARLIST:
            consts[i] = len(vals[i])
        elif kind in (STATIC, DEVICE):
            consts[i] = vals[i]
    specs = [(shape, stride, to_jax_dtype(dtype)) for shape, stride, dtype in out_specs]
    check_info = []

    def run(*dyn):
        arrays = dyn[:n_buf]
        offsets = dyn[len(dyn) - n_offsets:]
        scalar_it = iter(dyn[n_buf:len(dyn) - n_offsets])
        if low.random:
            args = [key_from_parts(next(scalar_it), next(scalar_it))]
        else:
            args = []
        for i in fargs_idx:
            a = argdefs[i]
            if a.kind in (T, TOPT):
                args.append(_read(slots[i], arrays, scalar_it, offsets, promote_dtype))
            elif a.kind == TLIST:
                args.append([_read(s, arrays, scalar_it, offsets, promote_dtype)
                             for s in slots[i]])
            elif a.kind == SCALAR:
                args.append(None if consts[i] else next(scalar_it))
            elif a.kind == SCALARLIST:
                args.append([next(scalar_it) for _ in range(consts[i])])
            else:
                args.append(consts[i])
        with registry.collecting_checks() as checks:
            try:
                result = low.fn(*args)
            except _TORCH_ERRORS:
                raise
            except Exception as e:
                if isinstance(e, IndexError) and not _raised_by_jax(e):
                    raise
                raise _as_torch_error(e, kernel.overload) from e
        check_info[:] = [(exc, msg) for _, exc, msg in checks]
        flat = [r for r in tree_flatten(result)[0] if r is not None]
        new_arrays = list(arrays)
        outs = []
        if write_targets:  # in-place / out=: the results are the mutated arguments' values
            flat_updates, flat = flat, []
            for k, ((j, shape, stride, offset, dtype, conj, neg), value) in enumerate(
                    zip(write_targets, flat_updates)):
                if result_dtypes:
                    value = cast(value, result_dtypes[min(k, len(result_dtypes) - 1)])
                value = _unapply_bits(jnp.broadcast_to(jnp.asarray(value), shape), conj, neg)
                new_arrays[j] = strided.write(new_arrays[j], shape, stride,
                                              Dynamic.resolve(offset, offsets), dtype, value)
        if low.eager and not specs:  # data-dependent shapes: the values define them
            outs = [jnp.asarray(v) for v in flat]
        for (shape, stride, dtype), value in zip(specs, flat):
            value = jnp.broadcast_to(cast(value, dtype), shape)
            outs.append(strided.store(value, stride))
        if checks and write_targets:
            # Checks are read later (sync.defer): a failing op keeps its targets' values.
            ok = jnp.all(jnp.stack([jnp.asarray(c, bool).reshape(()) for c, _, _ in checks]))
            for j, *_ in write_targets:
                new_arrays[j] = jnp.where(ok, new_arrays[j], arrays[j])
        return outs, [new_arrays[j] for j in compiled.writes], [c for c, _, _ in checks]

    compiled.run = run
    compiled.fn = run  # jitted by `executable` once the key is known, eager ops stay as they are
    if (modes.recorded() and not low.eager and write_targets and low.mesh is None
            and all(b.dtype is not None for b in buffers)):
        # Fused mode traces an op when its segment runs; an in-place or out= op is traced
        # abstractly here once, so that an input JAX refuses raises at the call, before the
        # op's targets (an out= resized by PyTorch's rules) are committed.
        jax.eval_shape(run, *[jax.ShapeDtypeStruct((b.nbytes // jnp.dtype(b.dtype).itemsize,),
                                                    b.dtype) for b in buffers], *scalars)
    compiled.check_info = check_info
    return compiled


def _check_out_dtypes(kernel, vals, pos, kw):
    """PyTorch's rules for an out= of another dtype than the result's, which the meta
    kernels do not all apply (JAX would cast anything)."""
    if kernel.inplace_of is not None:  # add_ and the like: self takes the result
        try:
            dtype = kernel.inplace_of(*pos, **kw).dtype
        except Exception:  # noqa: BLE001 - the meta kernel raises PyTorch's error just after
            return
        if not torch.can_cast(dtype, vals[0].dtype):
            raise RuntimeError(f"result type {dtype_name(dtype)} can't be cast to the desired "
                               f"output type {dtype_name(vals[0].dtype)}")
        return
    if kernel.functional is None:
        return
    try:
        results = _functional_dtypes(kernel, pos, kw)
    except Exception:  # noqa: BLE001 - the meta kernel raises PyTorch's error just after
        return
    outs = [t for a, v in zip(kernel.args, vals) if a.is_out and v is not None
            for t in (v if isinstance(v, (list, tuple)) else [v])]
    out_names = [a.name for a, v in zip(kernel.args, vals) if a.is_out and v is not None]
    for out, dtype, name in zip(outs, results, out_names + [""] * len(outs)):
        dtype = to_torch_dtype(dtype)
        if kernel.low.bool_out:
            if out.dtype not in (torch.bool, torch.uint8):
                raise RuntimeError(f"{kernel.overload._schema.name.split('::')[1]} only supports "
                                   f"bool tensor for result, got: {dtype_name(out.dtype)}")
            continue
        if kernel.low.exact_out and out.dtype != dtype:
            message = kernel.low.exact_out
            if isinstance(message, dict):  # one message per out argument
                message = message[name]
            if not isinstance(message, str):
                message = "Found dtype {got} but expected {expected}"
            raise RuntimeError(message.format(
                expected=dtype_name(dtype), got=dtype_name(out.dtype), name=name,
                expected_c=c10_name(dtype), got_c=c10_name(out.dtype)))
        if not torch.can_cast(dtype, out.dtype):
            raise kernel.low.out_cast_error(
                f"result type {dtype_name(dtype)} can't be cast to the desired output type "
                f"{dtype_name(out.dtype)}")


def _functional_dtypes(kernel, pos, kw):
    """Dtypes of the functional overload's results (out= arguments are keyword-only)."""
    outs = {a.name for a in kernel.args if a.is_out}
    meta = kernel.functional(*pos, **{k: v for k, v in kw.items() if k not in outs})
    metas = meta if isinstance(meta, (tuple, list)) else [meta]
    return [to_jax_dtype(m.dtype) for m in metas if isinstance(m, torch.Tensor)]


def _resize_outs(kernel, vals, pos, kw):
    # The meta kernel resized the meta `out=` tensors as PyTorch would; do the same to the
    # real ones, then run again with their new shapes in the key.
    resized = []
    for i, a in enumerate(kernel.args):
        if not a.is_out or vals[i] is None:
            continue
        metas = kw[a.name] if a.kwarg_only else pos[i]
        reals = vals[i]
        if not isinstance(reals, (list, tuple)):  # `Tensor(a!)[] out` is a list
            metas, reals = [metas], [reals]
        for meta, real in zip(metas, reals):
            if tuple(meta.shape) != tuple(real.shape) or meta.stride() != real.stride():
                resized.append((real, tuple(real.shape), real.stride(), real.storage_offset()))
                real.resize_(meta.shape)
                if meta.stride() != real.stride():
                    real.as_strided_(meta.shape, meta.stride())
    if resized:
        raise OutResized(resized)


def _returns_list(kernel):
    return len(kernel.returns) == 1 and isinstance(kernel.returns[0].type, torch.ListType)


def _aliased_input(kernel, ret):
    # The i-th write-annotated return aliases the i-th mutated argument with the same set.
    alias = ret.alias_info
    for i in kernel.writes:
        ai = kernel.overload._schema.arguments[i].alias_info
        if ai is not None and ai.before_set == alias.before_set:
            return i
    return None


def _fresh_meta_outputs(kernel, meta_out, returns):
    if returns and all(r is not None for r in returns):
        return []
    if isinstance(meta_out, (tuple, list)):
        if _returns_list(kernel):
            return list(meta_out)
        return [m for m, r in zip(meta_out, returns) if r is None and m is not None]
    return [meta_out] if isinstance(meta_out, torch.Tensor) else []


def _slots(kernel, vals, buffers):
    """{argument index: its tensor's slot, or a list of them}, and the slots of the written
    tensors: (buffer, shape, strides, offset, dtype, conj, neg).  A nonzero offset is a
    `Dynamic`: the executable's k-th offset argument (in op_keys.key_of's order)."""
    slots = {}
    n_offsets = 0

    def slot_of(t):
        nonlocal n_offsets
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            return ("num",)
        if t.device.type != "tpu":
            return ("cpu", to_jax_dtype(t.dtype))
        j = buffers.positions[t.untyped_storage()._tpu]
        offset = t.storage_offset()
        if offset:
            offset = Dynamic(n_offsets)
            n_offsets += 1
        return (j, tuple(t.shape), t.stride(), offset, to_jax_dtype(t.dtype),
                t.is_conj(), t.is_neg())

    for i, (a, v) in enumerate(zip(kernel.args, vals)):
        if a.kind in (T, TOPT):
            slots[i] = slot_of(v)
        elif a.kind == TLIST:
            slots[i] = [slot_of(t) for t in v]
    targets = [t for i in kernel.writes
               for t in (slots[i] if isinstance(slots[i], list) else [slots[i]])]
    return slots, targets, n_offsets


def _collective_entry(overload, group, args):
    """A collective op's entry in its programs' signature (spmd.signature): its kind (an
    in-place or out= variant is the same collective), group, dtype and shape."""
    kind = overload._schema.name.split("::")[1]
    kind = kind[:-len("_out")] if kind.endswith("_out") else kind.rstrip("_")
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    first = tensors[0] if tensors else None
    if len(tensors) > 1 and "coalesced" in kind:
        kind = f"{kind} of {len(tensors)}"
    return spmd.describe_collective(kind, group, None if first is None else first.dtype,
                                    () if first is None else first.shape)


def _restorer(check_info):
    def restore(saved):
        check_info[:] = saved
    return restore


# Errors the lowerings raise as PyTorch does; anything else a lowering raises comes from JAX
# refusing the input (a dtype, a shape, an empty axis) and becomes the type PyTorch would raise.
_TORCH_ERRORS = (RuntimeError, NotImplementedError)


def _raised_by_jax(e):
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{os.sep}jax{os.sep}" in tb.tb_frame.f_code.co_filename


def _as_torch_error(e, overload):
    if isinstance(e, TypeError) and "dtype" in str(e):
        # PyTorch raises NotImplementedError for a dtype its kernel has no code for.
        return NotImplementedError(f"{overload}: not implemented for this dtype ({e})")
    return RuntimeError(f"{overload}: {e}")


def _read(slot, arrays, scalar_it, offsets, promote_dtype):
    if slot is None:
        return None
    if slot[0] == "num":
        value = next(scalar_it)
        return value if promote_dtype is None else jnp.asarray(value, promote_dtype)
    if slot[0] == "cpu":
        value = jnp.asarray(next(scalar_it), dtype=slot[1])
    else:
        j, shape, stride, offset, dtype, conj, neg = slot
        value = _unapply_bits(strided.read(arrays[j], shape, stride,
                                           Dynamic.resolve(offset, offsets), dtype), conj, neg)
    if promote_dtype is not None and value.dtype != promote_dtype:
        value = value.astype(promote_dtype)
    return value


def _unapply_bits(value, conj, neg):
    """A conj/neg-bit view's logical value from its storage's (and, the same involution, the
    storage value to write for a logical value)."""
    if conj:
        value = jnp.conj(value)
    if neg:
        value = -value
    return value


def wrap_specs(out_specs):
    return [(list(shape), list(stride), dtype,
             storage.storage_numel(shape, stride) * dtype.itemsize)
            for shape, stride, dtype in out_specs]


def _dense_strides(m):
    """Meta's strides when they describe a dense layout (any dim order), else contiguous."""
    shape, stride = tuple(m.shape), m.stride()
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])
    expected = 1
    for d in reversed(dims):
        if stride[d] != expected:
            return storage.contiguous_strides(shape)
        expected *= shape[d]
    return stride
