"""The collectives as ops of the lowering table: PyTorch's `_c10d_functional` ops (what Dynamo
traces and DTensor calls), which ProcessGroupTPU's c10d methods call too.

Each lowering is the per-rank JAX computation over the group's mesh axis (`spmd.AXIS`): `lax`
collectives on this rank's values.  Being ops of the table, they run in every mode the way any
op does: in strict eager as a program of their own, dispatched asynchronously on the calling
thread; in fused eager, torch.tpu graphs and compiled graphs recorded into the trace, so that a
segment holding them is one program in which XLA schedules them among the compute.  Any program
holding one runs on every rank of the group (`Lowering.mesh`: the group's devices; see
_execution/spmd.py for how, and for the check that the ranks issue the same collectives).

`wait_tensor` returns its argument: a collective's results are the program's outputs, which
later ops read through JAX's data dependence, as CUDA streams order NCCL's work.
"""
import jax.numpy as jnp
import torch
from jax import lax

from .._core import runtime
from .._core.registry import TABLE, lowering
from .._execution.kernels import kernel_for
from .._execution.spmd import AXIS, skipping

_library = None
_group = None  # group name -> its ProcessGroupTPU (process_group.group_named, given to install)


def _mesh(*args):
    """The mesh and label of the op's group (its last functional argument is the group)."""
    group = _group(args[-1])
    return group.mesh, group.label


def _size(name):
    return _group(name).size()


# --- reductions --------------------------------------------------------------------------------
def _reduce_rows(rows, op):
    """Reduce the stacked rows of all ranks (axis 0) with a c10d reduce op's name."""
    if rows.dtype == jnp.bool_:
        if op in ("sum", "max", "bor"):
            return jnp.any(rows, axis=0)
        if op == "bxor":
            return jnp.bitwise_xor.reduce(rows, axis=0)
        return jnp.all(rows, axis=0)  # product, min, band
    if op == "sum":
        return jnp.sum(rows, axis=0, dtype=rows.dtype)
    if op == "avg":
        return jnp.sum(rows, axis=0, dtype=rows.dtype) / rows.shape[0]
    if op == "product":
        return jnp.prod(rows, axis=0, dtype=rows.dtype)
    if op == "max":
        return jnp.max(rows, axis=0)
    if op == "min":
        return jnp.min(rows, axis=0)
    if op in ("band", "bor", "bxor"):
        return getattr(jnp, "bitwise_" + op[1:]).reduce(rows, axis=0)
    raise ValueError(f"ProcessGroupTPU: unsupported reduce op {op!r}")


def _all_reduce(x, op):
    if x.dtype != jnp.bool_:
        if op == "sum":
            return lax.psum(x, AXIS)
        if op == "avg":
            return (lax.psum(x, AXIS) / lax.axis_size(AXIS)).astype(x.dtype)
        if op == "max":
            return lax.pmax(x, AXIS)
        if op == "min":
            return lax.pmin(x, AXIS)
    return _reduce_rows(lax.all_gather(x, AXIS), op).astype(x.dtype)


def _reduce_scatter(x, op):
    """x: (n * k, ...) -> this rank's reduced k rows; rank j gets the j-th block."""
    if op in ("sum", "avg") and x.dtype != jnp.bool_:
        out = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
        return out if op == "sum" else (out / lax.axis_size(AXIS)).astype(x.dtype)
    n = lax.axis_size(AXIS)
    chunks = x.reshape(n, x.shape[0] // n, *x.shape[1:])
    return _reduce_rows(lax.all_to_all(chunks, AXIS, 0, 0), op).astype(x.dtype)


# --- the ops --------------------------------------------------------------------------------------
@lowering("_c10d_functional::all_reduce", mesh=_mesh)
def all_reduce(x, reduce_op, group_name):
    return x if _size(group_name) == 1 or skipping() else _all_reduce(x, reduce_op)


@lowering("_c10d_functional::all_reduce_coalesced", mesh=_mesh)
def all_reduce_coalesced(xs, reduce_op, group_name):
    return [all_reduce(x, reduce_op, group_name) for x in xs]


# XLA:TPU lays a 1-D array out in tiles of 1024 elements, and compiles an all-gather whose
# per-rank part is not a whole number of them as a dynamic-update-slice into the whole buffer
# plus an all-reduce of it (measured, libtpu 0.0.42: twice the bytes, a temporary of the whole,
# never overlapped).  FSDP2 gathers the concatenation of a unit's padded shards, of any length.
_TPU_TILE = 1024


def _all_gather(x):
    if x.size % _TPU_TILE == 0 or runtime.program_platform() != "tpu":
        return lax.all_gather(x, AXIS, tiled=True)
    flat = x.reshape(-1)
    rows = lax.all_gather(jnp.pad(flat, (0, -flat.size % _TPU_TILE)), AXIS)  # (ranks, whole tiles)
    return rows[:, :flat.size].reshape(-1, *x.shape[1:])


# (The `_out` ops are ops of their own, not out= overloads the table derives.)
@lowering("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out",
          mesh=_mesh)
def all_gather_into_tensor(x, group_size, group_name):
    if skipping():
        return jnp.zeros((group_size * x.shape[0], *x.shape[1:]), x.dtype)
    return x if group_size == 1 else _all_gather(x)


@lowering("_c10d_functional::all_gather_into_tensor_coalesced", mesh=_mesh)
def all_gather_into_tensor_coalesced(xs, group_size, group_name):
    return [all_gather_into_tensor(x, group_size, group_name) for x in xs]


@lowering("_c10d_functional::reduce_scatter_tensor", "_c10d_functional::reduce_scatter_tensor_out",
          mesh=_mesh)
def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    if skipping():
        return jnp.zeros((x.shape[0] // group_size, *x.shape[1:]), x.dtype)
    return x if group_size == 1 else _reduce_scatter(x, reduce_op)


@lowering("_c10d_functional::reduce_scatter_tensor_coalesced", mesh=_mesh)
def reduce_scatter_tensor_coalesced(xs, reduce_op, group_size, group_name):
    return [reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in xs]


@lowering("_c10d_functional::broadcast", mesh=_mesh)
def broadcast(x, src, group_name):
    if _size(group_name) == 1 or skipping():
        return x
    mine = lax.axis_index(AXIS) == src
    if x.dtype == jnp.bool_:
        return lax.psum(jnp.where(mine, x, False).astype(jnp.int32), AXIS) > 0
    return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), AXIS)


def _check_even_splits(x, output_split_sizes, input_split_sizes, group_name):
    n = _size(group_name)
    rows = x.shape[0] if x.dim() else 0
    if not _even(output_split_sizes, input_split_sizes):
        raise NotImplementedError(
            "_c10d_functional.all_to_all_single with uneven split sizes in a compiled graph on "
            "tpu: call it outside the graph (eagerly it exchanges the sizes first, as "
            "dist.all_to_all_single does)")
    if rows % n:
        raise RuntimeError(f"all_to_all_single: dim 0 of size {rows} is not divisible by the "
                           f"group size {n}")


@lowering("_c10d_functional::all_to_all_single", mesh=_mesh, validate=_check_even_splits)
def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    if skipping():
        return jnp.zeros_like(x)
    return x if _size(group_name) == 1 else lax.all_to_all(x, AXIS, 0, 0, tiled=True)


def _even(*split_lists):
    return all(not splits or len(set(splits)) == 1 for splits in split_lists)


def _all_to_all_single_kernel(table_kernel):
    """The eager kernel: even splits are the table's op; uneven ones (expert parallelism's
    tokens per rank, through funcol.all_to_all_single(_autograd)) take the group's exchange,
    which reads every rank's splits on the host and pads the chunks to the largest (the
    sizes decide the program's shapes)."""
    def run(x, output_split_sizes, input_split_sizes, group_name):
        if output_split_sizes is None or _even(output_split_sizes, input_split_sizes):
            return table_kernel(x, output_split_sizes, input_split_sizes, group_name)
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        _group(group_name).all_to_all_single(out, x, list(output_split_sizes),
                                             list(input_split_sizes or ()), None)
        return out
    return run


def _one_rank_identity(table_kernel):
    """An in-place collective's eager kernel: on a group of one rank the identity, which runs
    nothing (DDP on one process: no program per bucket); on more, the table's op."""
    def run(*args):
        return args[0] if _size(args[-1]) == 1 else table_kernel(*args)
    return run


def install(group_named):
    """Give the `_c10d_functional` ops their tpu kernels (once, when the first tpu group is
    made: their meta kernels come with torch.distributed._functional_collectives);
    `group_named(name)` finds the group an op names."""
    global _library, _group
    _group = group_named
    if _library is not None:
        return
    import torch.distributed._functional_collectives  # noqa: F401  (the ops' meta kernels)
    _library = torch.library.Library("_c10d_functional", "IMPL")
    for overload in list(TABLE):
        if overload.namespace == "_c10d_functional":
            kernel = kernel_for(overload)
            if overload.name() == "_c10d_functional::all_to_all_single":
                kernel = _all_to_all_single_kernel(kernel)
            elif overload.name().endswith("_"):  # all_reduce_, all_reduce_coalesced_, broadcast_
                kernel = _one_rank_identity(kernel)
            _library.impl(overload, kernel, "PrivateUse1")
    _library.impl("wait_tensor", lambda t: t, "PrivateUse1")
