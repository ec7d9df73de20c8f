"""Programs that every rank of a process group runs at once: a collective op, or a fused
segment, compiled graph or torch.tpu graph that holds collectives.

JAX runs such a program multi-controller: each process calls the same kind of executable,
compiled over a Mesh of the group's devices (one per rank, axis `AXIS`), on global arrays.  A
rank's tensors are its own values, not shards of one array, so a local array becomes a global
one that JAX is told is replicated (no copy, no reshape: `to_global`), and the program is a
`shard_map` with replicated in and out specs and `check_vma=False`: the body computes on each
rank's own values, and the `lax` collectives in it combine them (a psum adds the ranks' values;
nothing assumes they are equal).  The results are the local parts of its outputs.

The ranks must issue the same collectives in the same order; the compute around them may
differ (rank-divergent code).  Before a program is dispatched, the ranks therefore compare a
small signature of its collectives (kinds, groups, dtypes, shapes) on the host, through the
group's store (the `on_exchange` hook: one write and one read of every rank's entry per
program; the host waits for its peers to reach the same program, not for any device).  Where
the signatures differ, no rank dispatches its program: each runs it with the collectives
skipped instead (they would not pair: an in-place collective leaves its target as it was, a
new result is zeros; a fused segment, only its ops before the first collective), on its own
device, and the mismatch is a deferred check (sync.defer) raised at the next host wait, naming
each rank's side.  The check is beside the program, not in it: the program the TPU compiler
schedules is the step alone, with no conditional around it.  TORCHTPU_DIST_CHECK=first compares
only each distinct program's first run (the distributed layer's ProcessGroupTPU._compare says
what that gives up), TORCHTPU_DIST_CHECK=0 leaves the check out.

The distributed layer registers `on_exchange`, `on_dispatch`, `on_failure` and `on_mismatch`
hooks: a host wait is bounded by the group's timeout while such programs are in flight, and a
failure (a lost peer) or a disagreement breaks the group.
"""
import hashlib
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import executables, sync

AXIS = "ranks"
# Signature: [collectives digest, count, then per collective (the first _SHOWN): kind, group,
# dtype, ndim, up to 4 dims] -> what a mismatch error can name.
_SHOWN = 2
_PER = 8
_LEN = 2 + _SHOWN * _PER
_on_exchange = []
_on_dispatch = []
_on_failure = []
_on_mismatch = []


def on_exchange(hook):
    """hook(mesh, payload bytes) -> every rank's payload, in the mesh's order (each rank
    gives its own for the same program), or None where `mesh` is no group's."""
    _on_exchange.append(hook)


def on_dispatch(hook):
    """hook(mesh, marker): called after every program dispatched here, with one of its
    results (ready when it has run)."""
    _on_dispatch.append(hook)


def on_failure(hook):
    """hook(mesh, exception): a program over `mesh` failed to run (raise instead of it)."""
    _on_failure.append(hook)


def on_mismatch(hook):
    """hook(mesh, sides): the ranks of `mesh` disagreed on a program's collectives."""
    _on_mismatch.append(hook)


def check_enabled():
    return os.environ.get("TORCHTPU_DIST_CHECK", "1") != "0"


def in_program():
    """Whether fused eager records collectives into its segments (else each runs as a program
    of its own, the segment cut around it): TORCHTPU_COLLECTIVES_IN_PROGRAM=1 or 0."""
    return os.environ.get("TORCHTPU_COLLECTIVES_IN_PROGRAM", "1") != "0"


def _digest(text):
    """A hash that is the same in every process (Python's `hash` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "little")


_NAMES = {}  # digest -> text, for the error message (this process's own names)


def _named(text):
    d = _digest(text)
    _NAMES[d] = text
    return d


def describe_collective(kind, group, dtype, shape):
    """One collective as a signature entry: (kind, group, dtype, shape)."""
    return (str(kind), str(group), str(dtype), tuple(int(d) for d in shape))


def signature(collectives):
    """The int64 vector the ranks compare (see the module docstring); `collectives`: the
    program's `describe_collective` entries in order."""
    sig = np.full(_LEN, -1, np.int64)
    sig[0] = _digest(re.sub(r" at 0x[0-9a-f]+", "", repr(collectives)))
    sig[1] = len(collectives)
    for i, (kind, group, dtype, shape) in enumerate(collectives[:_SHOWN]):
        row = sig[2 + i * _PER: 2 + (i + 1) * _PER]
        row[0], row[1], row[2] = _named(kind), _named(group), _named(dtype)
        row[3] = len(shape)
        row[4:4 + min(len(shape), 4)] = shape[:4]
    return sig


def _describe(row):
    n = int(row[1])
    parts = []
    for i in range(min(n, _SHOWN)):
        entry = row[2 + i * _PER: 2 + (i + 1) * _PER]
        kind, group, dtype = (_NAMES.get(int(v), "?") for v in entry[:3])
        ndim = int(entry[3])
        dims = [str(int(d)) for d in entry[4:4 + min(ndim, 4)]] + (["..."] if ndim > 4 else [])
        shape = f"({', '.join(dims)}{',' if ndim == 1 else ''})"
        parts.append(f"{kind.split('::')[-1]} of shape {shape} {dtype.replace('torch.', '')}"
                     f" in group {group}")
    if n > _SHOWN:
        parts.append(f"{n - _SHOWN} more")
    return f"{n} collective{'s' if n != 1 else ''}" + (": " + ", ".join(parts) if parts else "")


def _mismatch_error(what, mesh, rows):
    """The error of ranks whose signatures (`rows`, in rank order) differ; the group is
    broken at once (on_mismatch), so that a rank's next collective is refused rather than
    waiting for peers that went on."""
    sides = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
    for hook in _on_mismatch:
        hook(mesh, sides)
    return RuntimeError(
        f"ProcessGroupTPU: ranks disagree on the collectives of {what} ({sides}); every "
        "rank must call the same collectives in the same order with tensors of the same "
        "shape and dtype. Nothing ran: every tensor kept its value.")


def compared(mesh, sig):
    """Every rank's signature of the program about to run over `mesh` (rows in rank order),
    read from the group's store, or None where there is nothing to compare with."""
    for hook in _on_exchange:
        payloads = hook(mesh, sig.tobytes())
        if payloads is not None:
            return np.stack([np.frombuffer(p, np.int64) for p in payloads])
    return None


def _marker(inline_below):
    """An output that exists once the program has run (what the host's bounded wait watches).
    XLA:CPU runs a program its cost analysis finds cheap (fewer than 1000 flops) inline on the
    calling thread, and a small collective is cheap: it would block the caller until every
    peer joined (a stalled peer forever).  On the CPU the marker is a computation above that
    bound (~1 us, on the rank's index so that it cannot be folded), which makes XLA dispatch
    the program asynchronously, as TPU and GPU do anyway."""
    index = lax.axis_index(AXIS).astype(jnp.float32)
    if not inline_below:
        return index
    return jnp.sum(jnp.broadcast_to(index, (inline_below,)) * jnp.arange(inline_below, dtype=jnp.float32))


_skip = threading.local()


def skipping():
    """Whether a collective lowering is traced for what a rank runs where the ranks disagree:
    it then does not communicate (an in-place one leaves its target as it was, a new result
    is zeros)."""
    return getattr(_skip, "on", False)


def _without_collectives(fn):
    def skip(a):
        _skip.on = True
        try:
            return fn(*a)
        finally:
            _skip.on = False
    return skip


def program(fn, inline_below=0):
    """The body of a program over a group's mesh: `fn(*args)` (the per-rank computation,
    collectives over AXIS included).  Its first argument is the previous such program's
    marker, unused but kept (see Program).  Returns fn's outputs and a marker (see _marker)."""
    def body(after, *args):
        return fn(*args), _marker(inline_below)
    return body


def export(fn, size, args, platforms):
    """The StableHLO text of per-rank function `fn` as the program every rank of a `size`-rank
    group runs on `platforms` (e.g. ["tpu"]), lowered by jax.export without their devices:
    what XLA there would be given (its collectives inside the one program, beside the compute
    its latency-hiding scheduler can overlap them with)."""
    mesh = jax.sharding.AbstractMesh((size,), (AXIS,))
    body = jax.shard_map(program(fn), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    after = jax.ShapeDtypeStruct((), jnp.float32)
    return jax.export.export(jax.jit(body), platforms=platforms)(
        after, *described(args)).mlir_module()


def described(args):
    """`args` (a pytree of arrays and Python numbers) as what jax.export takes: shapes and
    dtypes, the numbers weakly typed as when they are passed."""
    def one(a):
        if isinstance(a, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(a.shape, a.dtype)
        value = jnp.asarray(a)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, weak_type=True)
    return jax.tree_util.tree_map(one, args)


def _replicated(mesh):
    sharding = _shardings.get(mesh)
    if sharding is None:
        sharding = _shardings[mesh] = NamedSharding(mesh, P())
    return sharding


def _over(body, mesh):
    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def _target_mesh(chips, n):
    """A mesh of a TPU target's first `n` chips, one per rank (Executable.compile_for: the
    program's own shard_map names this process's devices)."""
    if n > len(chips):
        raise ValueError(f"the program runs on {n} ranks; the TPU target has {len(chips)} chips")
    return jax.sharding.Mesh(np.array(chips[:n], dtype=object), (AXIS,))


_shardings = {}
try:  # the global array over a local one without JAX's checks (12 us -> 3 us per array)
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # pragma: no cover
    _ArrayImpl = None


def to_global(a, sharding):
    if isinstance(a, jax.ShapeDtypeStruct):  # a value still being computed (async_compile)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding, weak_type=a.weak_type)
    if not isinstance(a, jax.Array):
        return a  # host numbers and numpy arrays: each rank passes its own
    if _ArrayImpl is not None:
        return _ArrayImpl(a.aval, sharding, [a], committed=True, _skip_checks=True)
    return jax.make_array_from_single_device_arrays(a.shape, sharding, [a])


def _as_described(a):
    """A device array as its shape and dtype (host values, passed by each rank, unchanged)."""
    if isinstance(a, jax.Array):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)
    return a


def _local(x):
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


_previous = {}  # device -> the marker of the last program dispatched there


class Program:
    """An `executables.Executable` of a per-rank function run on every rank of `mesh`:
    called, built and prepared with this rank's local arrays, it returns fn's local results.
    `collectives`: the signature entries (describe_collective) of what it holds; `what`: how
    the mismatch error names it.

    Each program takes the previous one's marker as an argument (kept though unused), so a
    device runs its collective programs one after another in dispatch order, as one CUDA
    stream runs NCCL's work: dispatched asynchronously, two programs that do not depend on
    each other could otherwise run at once (XLA:CPU does), and gloo, pairing collectives by
    order, then paired one rank's first with another's second."""

    __slots__ = ("executable", "sharding", "mesh", "what", "sig", "fn", "skipped", "instead",
                 "projected")

    def __init__(self, fn, mesh, collectives, key, name, what, skipped=None, **options):
        self.mesh = mesh
        self.sharding = _replicated(mesh)
        self.what = what
        self.sig = signature(collectives) if check_enabled() else None
        self.fn, self.skipped, self.instead = fn, skipped, None
        # Over a TPU target's compile-only chips (a projected world): compiled for it, never run.
        # (not cached: a process joining a multi-process runtime has new devices)
        self.projected = mesh.devices.flat[0] not in jax.devices()
        cpu = mesh.devices.flat[0].platform == "cpu"
        body = program(fn, inline_below=1024 if cpu else 0)
        spmd = _over(body, mesh)
        if key is not None:
            key = f"spmd over {[d.id for d in mesh.devices.flat]}: {key}"
        # fn's arguments come after the previous program's marker.
        options["donate_argnums"] = tuple(i + 1 for i in options.get("donate_argnums", ()))
        self.executable = executables.Executable(
            spmd, key, name, keep_unused=True,
            retarget=lambda chips: _over(body, _target_mesh(chips, mesh.devices.size)), **options)

    @property
    def last(self):  # (async_compile's fast path is not taken for these programs)
        return None

    @property
    def jitted(self):
        return self.executable.jitted

    def _global(self, args):
        """(the previous program's marker, *args), as global arrays."""
        sharding = self.sharding
        if self.projected:  # its values described (ProcessGroupTPU's projected world)
            return jax.tree_util.tree_map(
                lambda a: to_global(_as_described(a), sharding),
                (jax.ShapeDtypeStruct((), np.float32), *args))
        leaves = jax.tree_util.tree_leaves(args)
        device = next((next(iter(a.devices())) for a in leaves if isinstance(a, jax.Array)),
                      None)
        after = _previous.get(device)
        if after is None:
            after = _previous[device] = jax.device_put(np.float32(0), device)
        return jax.tree_util.tree_map(lambda a: to_global(a, sharding), (after, *args))

    def prepare(self, *args):
        return self.executable.prepare(*self._global(args))

    def compile_for(self, target, *args):
        return self.executable.compile_for(target, *self._global(args))

    def start(self, args, pool):
        return self.executable.start(self._global(args), pool)

    def has(self, *args):
        return self.executable.has(*self._global(args))

    def lower(self, *args):
        return self.executable.lower(*self._global(args))

    def eval_shape(self, *args):
        return self.executable.eval_shape(*self._global(args))

    def __call__(self, *args):
        if self.sig is not None:
            rows = compared(self.mesh, self.sig)
            if rows is not None and not (rows == rows[0]).all():
                error = _mismatch_error(self.what, self.mesh, rows)
                sync.defer((), lambda _: error)
                return self._skipping_collectives(args)
        try:
            out, marker = self.executable(*self._global(args))
        except Exception as e:
            for hook in _on_failure:
                hook(self.mesh, e)
            raise
        out = jax.tree_util.tree_map(_local, out)
        marker = marker.addressable_data(0)
        _previous[next(iter(marker.devices()))] = marker
        for hook in _on_dispatch:
            hook(self.mesh, marker)
        return out

    def _skipping_collectives(self, args):
        """What this rank runs where the ranks disagree, on its own device: fn with its
        collectives skipped, or `skipped` (its ops before the first collective), given fn's
        result shapes (the program's, as over the group's mesh)."""
        if self.instead is None:
            if self.skipped is None:
                self.instead = jax.jit(lambda *a: _without_collectives(self.fn)(a))
            else:
                shapes, _ = self.executable.eval_shape(*self._global(args))
                self.instead = jax.jit(lambda *a: self.skipped(shapes, *a))
        return self.instead(*args)
