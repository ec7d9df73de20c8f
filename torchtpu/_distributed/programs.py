"""The collectives as JAX programs over a mesh of the group's devices (one device per rank).

Each program takes the group's *global* array — rank r's tensor is the r-th block along dim 0,
laid out on rank r's device — and is a `shard_map` whose body sees one block. XLA turns the
`lax` collectives into ICI/DCN transfers on TPU, NCCL on GPU and gloo on the CPU. Programs are
cached per (kind, static arguments, mesh); `jax.jit` caches the executable per shape and dtype.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "ranks"


@functools.cache
def mesh_of(device_ids):
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in device_ids]), (AXIS,))


def as_global(mesh, local):
    """Rank-local array (on this rank's device) -> the group's global array, whose dim-0 blocks
    are the ranks' arrays. The local array is used as it is: no reshape to dispatch."""
    n = mesh.devices.size
    return jax.make_array_from_single_device_arrays(
        (n * local.shape[0], *local.shape[1:]), NamedSharding(mesh, P(AXIS)), [local])


def local_block(global_array):
    return global_array.addressable_data(0)


def _reduce_rows(rows, op):
    """Reduce the stacked rows of all ranks (axis 0) with a c10d reduce op's name."""
    if rows.dtype == jnp.bool_:
        if op in ("sum", "max", "bor", "bxor"):
            return jnp.any(rows, axis=0) if op != "bxor" else jnp.bitwise_xor.reduce(rows, axis=0)
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
    if op == "band":
        return jnp.bitwise_and.reduce(rows, axis=0)
    if op == "bor":
        return jnp.bitwise_or.reduce(rows, axis=0)
    if op == "bxor":
        return jnp.bitwise_xor.reduce(rows, axis=0)
    raise ValueError(op)


def _all_reduce_row(x, op):
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


def _body(kind, static, x):
    """One rank's part of collective `kind` on its block `x` (dim 0 is the ranks' axis)."""
    if kind == "all_reduce":
        return _all_reduce_row(x, static)
    if kind == "broadcast":  # static: the root's index in the group
        return lax.all_gather(x, AXIS)[static]
    if kind == "all_gather":  # (n * k, ...): the ranks' blocks in rank order
        return lax.all_gather(x, AXIS, tiled=True)
    if kind == "reduce_scatter":  # x: (n * k, ...) -> rank j gets the reduced j-th (k, ...)
        if static in ("sum", "avg") and x.dtype != jnp.bool_:
            out = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
            return out if static == "sum" else (out / lax.axis_size(AXIS)).astype(x.dtype)
        n = lax.axis_size(AXIS)
        chunks = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        return _reduce_rows(lax.all_to_all(chunks, AXIS, 0, 0), static).astype(x.dtype)
    if kind == "all_to_all":  # x: (n * k, ...): the j-th (k, ...) goes to rank j
        return lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    raise ValueError(kind)


@functools.cache
def program(kind, static, device_ids):
    mesh = mesh_of(device_ids)
    return jax.jit(jax.shard_map(functools.partial(_body, kind, static), mesh=mesh,
                                 in_specs=P(AXIS), out_specs=P(AXIS)))
