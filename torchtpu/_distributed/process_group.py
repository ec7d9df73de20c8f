"""`ProcessGroupTPU`: the c10d backend "tpu", a `torch.distributed.ProcessGroup` written in Python.

Its collectives are ops of the lowering table (`collective_ops.py`: PyTorch's `_c10d_functional`
ops), called on the tensors given, below autograd (a collective library writes memory: no
autograd record and no version bump).  They therefore run in every mode as ops do: in strict
eager as a program of their own, dispatched asynchronously on the calling thread (no thread
hand-off); in fused eager, a torch.tpu graph or a compiled graph recorded into the trace, whose
program then holds them.  Before every program holding collectives, the ranks compare its
collectives through the group's store (_execution/spmd.py; with TORCHTPU_DIST_CHECK=first only
each distinct program's first run); where they differ, none of them runs, and
a RuntimeError naming each rank's side is raised at the next host wait (or at the rank's next
collective), every tensor left as it was.

`Work` follows CUDA's stream semantics: `wait()` does not block the host (later ops read the
collective's results through JAX's data dependence), `is_completed()` tells whether its
results exist, `get_future()` is completed with the output tensors.  `barrier()` blocks.  The
host's waits (`.item()`, `.cpu()`, `synchronize()`, ...) are bounded by the group's timeout
while collective programs are in flight: a peer that stalls or dies makes them raise
`DistBackendError`, and the group then refuses further work (like NCCL's watchdog abort).

CPU tensors given to a tpu group go to the group's own gloo side, so object collectives and
`"cpu:gloo,tpu:tpu"` work; so do point-to-point sends (see `send`).
"""
import collections
import concurrent.futures
import contextlib
import functools
import os

import jax
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh

from .._core import metrics, runtime
from .._execution import spmd, sync
from . import collective_ops, fsdp, launch

_F = torch.ops._c10d_functional
_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}
_AGREED_KEPT = 1 << 16  # signatures a group remembers the ranks agreed on (ProcessGroupTPU._compare)
_groups = {}  # group name -> ProcessGroupTPU
_by_mesh = {}  # mesh -> a ProcessGroupTPU over it (whose timeout bounds its programs)


@functools.cache
def mesh_of(device_ids):
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in device_ids]), (spmd.AXIS,))


def group_named(name):
    """The ProcessGroupTPU a `_c10d_functional` op names (by its group name, or the group)."""
    if isinstance(name, ProcessGroupTPU):
        return name
    group = _groups.get(str(name))
    if group is None:
        pg = name if isinstance(name, dist.ProcessGroup) else \
            dist.distributed_c10d._resolve_process_group(str(name))
        group = pg._get_backend(torch.device("tpu"))
        if not isinstance(group, ProcessGroupTPU):
            raise RuntimeError(f"process group {name!r} has no tpu backend (it uses "
                               f"{type(group).__name__}); create it with backend 'tpu'")
    return group


def _first_run_only():
    return os.environ.get("TORCHTPU_DIST_CHECK") == "first"


def _reduce_op(opts, who):
    op = opts.reduceOp
    name = _REDUCE_OPS.get(op.op if hasattr(op, "op") else op)
    if name is None:
        raise ValueError(f"ProcessGroupTPU::{who}: unsupported reduce op {op}")
    return name


# --- programs in flight and the group's timeout -------------------------------------------------
# Multi-rank programs dispatched and not known to be done, oldest first: (marker, group).  The
# marker is one of the program's outputs, ready when it has run.
_in_flight = collections.deque()
_waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchtpu-collectives")


def _dispatched(mesh, marker):
    group = _by_mesh.get(mesh)
    if group is None:
        return
    while _in_flight and _in_flight[0][0].is_ready():
        done, owner = _in_flight.popleft()
        owner._finished(done)
    _in_flight.append((marker, group))


def _failed(mesh, error):
    group = _by_mesh.get(mesh)
    if group is not None:
        group._broken = f"a collective failed on rank {group._rank}: {error}"
        raise dist.DistBackendError(
            f"ProcessGroupTPU: {group._broken} (did another rank exit?)") from error


def _exchange(mesh, payload):
    group = _by_mesh.get(mesh)
    return None if group is None else group._compare(payload)


def _disagreed(mesh, sides):
    group = _by_mesh.get(mesh)
    if group is not None and group._broken is None:
        # Their programs skipped their collectives; a rank that issued more waits for peers
        # that will not come, as after a timeout.
        group._broken = f"the ranks disagreed on their collectives ({sides})"


def _wait_in_flight():
    """Before the host waits: every collective program dispatched so far has run, or the
    group's timeout ran out (DistBackendError)."""
    while _in_flight:
        marker, group = _in_flight[0]
        if group._broken is not None and not marker.is_ready():
            # (a program of a group whose ranks disagreed: its peers may never come)
            group._check_usable()
        group._finished(marker, wait=True)
        _in_flight.popleft()
        # Where the ranks disagreed, a later program of this rank may wait for peers that
        # will not come: the disagreement is the error to raise.
        sync.raise_ready()


class _Work(dist._Work):
    """A dispatched collective (see the module docstring for what waiting means here)."""

    def __init__(self, group, result, tensors):
        super().__init__()
        self._group = group
        self._result = result
        self._tensors = tensors

    def wait(self, timeout=None):
        self._group._check_usable()
        return True

    def is_completed(self):
        from .._core.storage import Array
        arrays = [t.untyped_storage()._tpu.peek() for t in self._tensors]
        return all(type(a) is Array and a.is_ready() for a in arrays)

    def is_success(self):
        return self._group._broken is None

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class ProcessGroupTPU(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout, global_ranks=None, group_name=""):
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._name = str(group_name)
        self._broken = None
        self._programs = 0  # programs over this group's mesh compared so far (their store keys)
        self._agreed = set()  # signatures of programs the ranks compared and agreed on
        ranks = list(global_ranks) if global_ranks else list(range(size))
        if _projected:
            self._projected_on(_projected[-1], ranks)
        else:
            if not global_ranks:
                launch.refuse_if_too_late(size)  # before connecting: every rank raises alike
                launch.configure_tpu_hosts(rank, size)  # (likewise)
            self._cpu = dist.ProcessGroupGloo(
                dist.PrefixStore("torchtpu-gloo/", store), rank, size, timeout)
            if not global_ranks:  # the default (world) group starts JAX's multi-process runtime
                launch.initialize(store, rank, size, timeout)
            self._device_ids = self._exchange_devices()
            self.label = f"{self._name} (ranks {ranks})"
            # One rank's collectives are the identity: its ops need no program over a mesh.
            self.mesh = mesh_of(self._device_ids) if size > 1 else None
        collective_ops.install(group_named)
        fsdp.install(group_named)
        _groups[self._name] = self
        if self.mesh is not None:
            _by_mesh[self.mesh] = self

    def _projected_on(self, chips, ranks):
        """A group of `projected_world`: its mesh is the target's chips, and it has no peers
        (no gloo side, no JAX multi-process runtime, nothing exchanged)."""
        if max(ranks) >= len(chips):
            raise ValueError(f"a projected group of ranks {ranks[0]}..{ranks[-1]}: the TPU "
                             f"target has {len(chips)} chips")
        self._cpu = _NoPeers()
        self._device_ids = ()
        self.label = f"{self._name} (ranks {ranks}, projected)"
        self.mesh = Mesh(np.array([chips[r] for r in ranks], dtype=object), (spmd.AXIS,))

    # --- the group's devices ------------------------------------------------------------
    def _exchange_devices(self):
        mine = runtime.jax_device(runtime.current_device()).id
        if self._size == 1:
            return (mine,)
        self._store.set(f"torchtpu/device/{self._rank}", str(mine))
        ids = tuple(int(self._store.get(f"torchtpu/device/{r}")) for r in range(self._size))
        if len(set(ids)) != len(ids):
            raise RuntimeError(
                "ProcessGroupTPU: two ranks of the group use the same device "
                f"(JAX device ids by rank: {list(ids)}); give each process its own device "
                "with torch.tpu.set_device(local_rank) before init_process_group")
        return ids

    def getBackendName(self):
        return "tpu"

    def name(self):
        return "tpu"

    def size(self):
        return self._size

    def rank(self):
        return self._rank

    @property
    def group_name(self):
        return self._name

    # --- running collectives ------------------------------------------------------------
    def _compare(self, payload):
        """Every rank's `payload` (the signature of the program over this group's mesh that
        each is about to run), in rank order, through the group's store: the host waits for
        its peers to reach their next program, within the group's timeout.  Each comparison
        is a host rendezvous (0.5-0.9 ms per strict collective on this machine, where an
        unchecked one costs what JAX's psum does).  With TORCHTPU_DIST_CHECK=first, a program
        whose signature the ranks already agreed on is not compared again (None): ranks that
        split into such programs are not stopped, and where one rank's program was compared
        before and another's was not, the other waits for it until the group's timeout."""
        first_only = _first_run_only()
        if first_only and payload in self._agreed:
            return None
        metrics.counters["collective_checks"] += 1
        n = self._programs = self._programs + 1
        self._store.set(f"torchtpu/program/{n}/{self._rank}", payload)
        try:
            payloads = self._store.multi_get([f"torchtpu/program/{n}/{r}" for r in range(self._size)])
        except dist.DistError as e:
            self._broken = (f"a collective timed out after {self._timeout} on rank {self._rank} "
                            "waiting for the other ranks to reach it (another rank is gone, "
                            "stuck, or called no collective)")
            raise dist.DistBackendError(f"ProcessGroupTPU: {self._broken}") from e
        if n > 1:
            # Every peer has written its entry n, so it has read every entry n - 1.
            self._store.delete_key(f"torchtpu/program/{n - 1}/{self._rank}")
        if first_only and all(p == payload for p in payloads):
            if len(self._agreed) >= _AGREED_KEPT:  # (the same length on every rank)
                self._agreed.clear()
            self._agreed.add(payload)
        return payloads

    def _check_usable(self):
        if self._broken is not None:
            sync.raise_ready()  # a disagreement's own error first, where it is still to raise
            raise dist.DistBackendError(
                f"ProcessGroupTPU: the group is unusable after an earlier failure: {self._broken}")

    @contextlib.contextmanager
    def _calls(self, kind, tensors=()):
        """Around the ops of one c10d call: refused once the group is broken; below autograd
        (no record, no version bump)."""
        self._check_usable()
        metrics.counters[f"collective::{kind}"] += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        metrics.counters["collective_bytes"] += nbytes
        metrics.counters[f"collective_bytes::{kind}"] += nbytes
        with torch._C._AutoDispatchBelowADInplaceOrView():
            yield

    def _finished(self, marker, wait=False):
        """Raise DistBackendError (and break the group) if the program that gave `marker`
        failed, or if `wait` and it does not finish within the timeout."""
        try:
            if wait and not marker.is_ready():
                _waiter.submit(marker.block_until_ready).result(self._timeout.total_seconds())
            else:
                marker.block_until_ready()
        except concurrent.futures.TimeoutError:
            self._broken = (f"a collective timed out after {self._timeout} on rank {self._rank} "
                            "(another rank is gone, stuck, or called a different collective)")
            raise dist.DistBackendError(f"ProcessGroupTPU: {self._broken}") from None
        except Exception as e:  # the runtime's report of a lost peer
            self._broken = f"a collective failed on rank {self._rank}: {e}"
            raise dist.DistBackendError(
                f"ProcessGroupTPU: {self._broken} (did another rank exit?)") from e

    def _route(self, tensors, who):
        """'tpu' for tpu tensors, 'cpu' for CPU ones; anything else is an error."""
        types = {t.device.type for t in tensors}
        if types == {"cpu"}:
            return "cpu"
        if types != {"tpu"}:
            raise ValueError(f"ProcessGroupTPU::{who}: tensors must all be on tpu (or all on "
                             f"the CPU), got devices {sorted(types)}")
        for t in tensors:
            if t.device.index != runtime.current_device() and self._size > 1:
                raise ValueError(
                    f"ProcessGroupTPU::{who}: tensor on {t.device} but this rank's device is "
                    f"tpu:{runtime.current_device()}")
        return "tpu"

    def _work(self, result, tensors=None):
        return _Work(self, result, list(result if tensors is None else tensors))

    # --- all-reduce and friends -----------------------------------------------------------
    def allreduce(self, tensors, opts):
        if self._route(tensors, "allreduce") == "cpu":
            return self._cpu.allreduce(tensors, opts)
        op = _reduce_op(opts, "allreduce")
        with self._calls("all_reduce", tensors):
            for t in tensors:
                _F.all_reduce_(t, op, self._name)
        return self._work(tensors)

    def allreduce_coalesced(self, tensors, opts):
        if self._route(tensors, "allreduce_coalesced") == "cpu":
            return self._cpu.allreduce_coalesced(tensors, opts)
        op = _reduce_op(opts, "allreduce_coalesced")
        with self._calls("all_reduce", tensors):
            _F.all_reduce_coalesced_(tensors, op, self._name)
        return self._work(tensors)

    def reduce(self, tensors, opts):
        if self._route(tensors, "reduce") == "cpu":
            return self._cpu.reduce(tensors, opts)
        op = _reduce_op(opts, "reduce")
        (t,) = tensors
        with self._calls("reduce", tensors):
            if self._size > 1:  # (one rank's: the identity; the in-place ops' kernels say so)
                total = _F.all_reduce(t, op, self._name)
                if self._rank == opts.rootRank:
                    t.copy_(total)
        return self._work(tensors)

    def broadcast(self, tensors, opts):
        if self._route(tensors, "broadcast") == "cpu":
            return self._cpu.broadcast(tensors, opts)
        t = tensors[opts.rootTensor]
        with self._calls("broadcast", [t]):
            _F.broadcast_(t, opts.rootRank, self._name)
        return self._work(tensors, [t])

    def barrier(self, opts):
        from .._execution.transfer import value_of
        one = torch.ones(1, dtype=torch.int32, device="tpu")
        with self._calls("barrier"):
            _F.all_reduce_(one, "sum", self._name)
        sync.wait()
        self._finished(value_of(one), wait=True)
        return self._work([])

    # --- gathers ------------------------------------------------------------------------
    def _rows(self, t):
        """Every rank's `t`, stacked: (size, *t.shape)."""
        return _F.all_gather_into_tensor(t.unsqueeze(0), self._size, self._name)

    def allgather(self, output_tensors, input_tensors, opts):
        if self._route(input_tensors + [o for out in output_tensors for o in out],
                       "allgather") == "cpu":
            return self._cpu.allgather(output_tensors, input_tensors, opts)
        for outs in output_tensors:
            if len(outs) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::allgather: expected {self._size} output "
                                   f"tensors, got {len(outs)}")
        with self._calls("all_gather", input_tensors):
            for outs, t in zip(output_tensors, input_tensors):
                rows = self._rows(t)
                for r, o in enumerate(outs):
                    o.copy_(rows[r])
        return self._work(output_tensors, [o for outs in output_tensors for o in outs])

    def allgather_coalesced(self, output_lists, input_list, opts):
        return self.allgather(output_lists, input_list, opts)

    def _check_gather_sizes(self, output, input, who):
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise ValueError(
                f"ProcessGroupTPU::{who}: output tensor must have {self._size} times the "
                f"input's elements and the same dtype, got output {tuple(output.shape)} "
                f"{output.dtype} and input {tuple(input.shape)} {input.dtype}")

    def _gather_into(self, output, input):
        flat = input.reshape(-1)
        if output.is_contiguous():
            _F.all_gather_into_tensor_out(flat, self._size, self._name, out=output.view(-1))
        else:
            output.copy_(_F.all_gather_into_tensor(flat, self._size, self._name).view(output.shape))

    def all_gather_single(self, output, input, opts):
        if self._route([output, input], "all_gather_into_tensor") == "cpu":
            return self._cpu._allgather_base(output, input, opts)
        self._check_gather_sizes(output, input, "all_gather_into_tensor")
        with self._calls("all_gather", [input]):
            self._gather_into(output, input)
        return self._work([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        if self._route(outputs + inputs, "all_gather_into_tensor_coalesced") == "cpu":
            return self._cpu.allgather_into_tensor_coalesced(outputs, inputs, opts)
        for o, i in zip(outputs, inputs):
            self._check_gather_sizes(o, i, "all_gather_into_tensor_coalesced")
        with self._calls("all_gather", inputs):
            gathered = _F.all_gather_into_tensor_coalesced(
                [i.reshape(-1) for i in inputs], self._size, self._name)
            for o, g in zip(outputs, gathered):
                o.copy_(g.view(o.shape))
        return self._work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        if self._route(input_tensors + [o for out in output_tensors for o in out],
                       "gather") == "cpu":
            return self._cpu.gather(output_tensors, input_tensors, opts)
        (t,) = input_tensors
        root = self._rank == opts.rootRank
        if root and len(output_tensors[0]) != self._size:
            raise RuntimeError(f"ProcessGroupTPU::gather: expected {self._size} output "
                               f"tensors on the root, got {len(output_tensors[0])}")
        with self._calls("gather", [t]):
            rows = self._rows(t)
            if root:
                for r, o in enumerate(output_tensors[0]):
                    o.copy_(rows[r])
        return self._work(output_tensors, output_tensors[0] if root else [])

    # --- scatters -----------------------------------------------------------------------
    def _scatter_into(self, output, input, op):
        flat = input.reshape(-1)
        out_variant = getattr(_F, "reduce_scatter_tensor_out", None)
        if output.is_contiguous() and out_variant is not None:
            out_variant(flat, op, self._size, self._name, out=output.view(-1))
        else:
            output.copy_(_F.reduce_scatter_tensor(flat, op, self._size, self._name).view(output.shape))

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + [i for ins in input_tensors for i in ins],
                       "reduce_scatter") == "cpu":
            return self._cpu.reduce_scatter(output_tensors, input_tensors, opts)
        op = _reduce_op(opts, "reduce_scatter")
        for ins in input_tensors:
            if len(ins) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::reduce_scatter: expected {self._size} "
                                   f"input tensors, got {len(ins)}")
        with self._calls("reduce_scatter", [i for ins in input_tensors for i in ins]):
            for out, ins in zip(output_tensors, input_tensors):
                # Row j of the stack is this rank's contribution to rank j's result.
                self._scatter_into(out, torch.stack([i.reshape(-1) for i in ins]), op)
        return self._work(output_tensors)

    def _check_scatter_sizes(self, output, input, who):
        if input.numel() != output.numel() * self._size or output.dtype != input.dtype:
            raise ValueError(
                f"ProcessGroupTPU::{who}: input tensor must have {self._size} times the "
                f"output's elements and the same dtype, got input {tuple(input.shape)} "
                f"{input.dtype} and output {tuple(output.shape)} {output.dtype}")

    def reduce_scatter_single(self, output, input, opts):
        if self._route([output, input], "reduce_scatter_tensor") == "cpu":
            return self._cpu._reduce_scatter_base(output, input, opts)
        self._check_scatter_sizes(output, input, "reduce_scatter_tensor")
        op = _reduce_op(opts, "reduce_scatter_tensor")
        with self._calls("reduce_scatter", [input]):
            self._scatter_into(output, input, op)
        return self._work([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        if self._route(outputs + inputs, "reduce_scatter_tensor_coalesced") == "cpu":
            return self._cpu.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        for o, i in zip(outputs, inputs):
            self._check_scatter_sizes(o, i, "reduce_scatter_tensor_coalesced")
        op = _reduce_op(opts, "reduce_scatter_tensor_coalesced")
        with self._calls("reduce_scatter", inputs):
            scattered = _F.reduce_scatter_tensor_coalesced(
                [i.reshape(-1) for i in inputs], op, self._size, self._name)
            for o, s in zip(outputs, scattered):
                o.copy_(s.view(o.shape))
        return self._work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + [i for ins in input_tensors for i in ins],
                       "scatter") == "cpu":
            return self._cpu.scatter(output_tensors, input_tensors, opts)
        (out,) = output_tensors
        root = self._rank == opts.rootRank
        if root and len(input_tensors[0]) != self._size:
            raise RuntimeError(f"ProcessGroupTPU::scatter: expected {self._size} input "
                               f"tensors on the root, got {len(input_tensors[0])}")
        with self._calls("scatter", input_tensors[0] if root else []):
            if root:
                stacked = torch.stack([i.reshape(-1) for i in input_tensors[0]])
            else:
                stacked = torch.zeros(self._size, out.numel(), dtype=out.dtype, device=out.device)
            # Row j of what arrives: what rank j sent this rank.
            received = self._exchange(stacked)
            out.copy_(received[opts.rootRank].view(out.shape))
        return self._work([out])

    # --- all-to-all ---------------------------------------------------------------------
    def _exchange(self, x):
        """all_to_all of equal chunks: the j-th of x's dim-0 blocks goes to rank j."""
        k = x.shape[0] // self._size
        return _F.all_to_all_single(x, [k] * self._size, [k] * self._size, self._name)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        if self._route([output, input], "all_to_all_single") == "cpu":
            return self._cpu.alltoall_base(output, input, output_split_sizes,
                                           input_split_sizes, opts)
        n = self._size
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        if not output_split_sizes and not input_split_sizes:
            if input.shape[0] % n or output.shape != input.shape:
                raise ValueError(
                    "ProcessGroupTPU::all_to_all_single: without split sizes, input and output "
                    f"must have the same shape with dim 0 divisible by {n}, got input "
                    f"{tuple(input.shape)} and output {tuple(output.shape)}")
        elif sum(ins) != input.shape[0] or sum(outs) != output.shape[0] or len(ins) != n \
                or len(outs) != n:
            raise ValueError("ProcessGroupTPU::all_to_all_single: split sizes do not match the "
                             f"tensors: input {tuple(input.shape)} split {ins}, output "
                             f"{tuple(output.shape)} split {outs}")
        with self._calls("all_to_all", [input]):
            if len(set(ins)) == 1 and len(set(outs)) == 1 and ins == outs:
                output.copy_(self._exchange(input))
            else:
                self._uneven_all_to_all(output, input, ins, outs)
        return self._work([output])

    def _uneven_all_to_all(self, output, input, ins, outs):
        """Every rank learns every split (a host read: the sizes decide the program), pads its
        chunks to the largest one, and exchanges equal chunks; the padding is cut off."""
        n = self._size
        sizes = torch.tensor(ins, dtype=torch.int64, device=input.device)
        splits = self._rows(sizes).cpu()  # (n, n): row r is what rank r sends
        if splits[:, self._rank].tolist() != outs:
            raise RuntimeError(
                f"ProcessGroupTPU::all_to_all_single: rank {self._rank} expects chunks of "
                f"{outs} rows but the other ranks send {splits[:, self._rank].tolist()}")
        chunk = max(int(splits.max()), 1)
        rest = tuple(input.shape[1:])
        padded = input.new_zeros((n, chunk, *rest))
        for j, piece in enumerate(input.split(ins)):
            padded[j, :ins[j]] = piece
        received = self._exchange(padded.view(n * chunk, *rest))
        received = received.view(n, chunk, *rest)
        output.copy_(torch.cat([received[j, :outs[j]] for j in range(n)]))

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + input_tensors, "alltoall") == "cpu":
            return self._cpu.alltoall(output_tensors, input_tensors, opts)
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in output_tensors + input_tensors):
            raise ValueError("ProcessGroupTPU::alltoall: all tensors must have the same dtype")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype,
                               device=flat_in.device)
        self.all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensors],
                               [t.numel() for t in input_tensors], opts)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for o, piece in zip(output_tensors, flat_out.split([t.numel() for t in output_tensors])):
                o.copy_(piece.view(o.shape))
        return self._work(output_tensors)

    # --- point to point -----------------------------------------------------------------
    # JAX has no one-sided transfer between processes: a program must run on both ends, so
    # `isend` followed by `recv` on both ranks could never match. Point-to-point traffic
    # therefore goes through the group's gloo side, staged through host memory.
    def send(self, tensors, dst, tag=0):
        if self._route(tensors, "send") == "cpu":
            return self._cpu.send(tensors, dst, tag)
        host = [t.detach().cpu() for t in tensors]
        metrics.counters["collective::send"] += 1
        return self._cpu.send(host, dst, tag)

    def recv(self, tensors, src, tag=0):
        if self._route(tensors, "recv") == "cpu":
            return self._cpu.recv(tensors, src, tag)
        host = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        metrics.counters["collective::recv"] += 1
        return _ReceiveWork(self._cpu.recv(host, src, tag), host, tensors)

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError("ProcessGroupTPU does not support recv from any source; name the "
                           "source rank")


class _ReceiveWork(dist._Work):
    """A gloo receive into host buffers; `wait()` also moves the data into the tpu tensors."""

    def __init__(self, work, host, tensors):
        super().__init__()
        self._work, self._host, self._tensors = work, host, tensors
        self._moved = False

    def wait(self, timeout=None):
        self._work.wait() if timeout is None else self._work.wait(timeout)
        if not self._moved:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                for t, h in zip(self._tensors, self._host):
                    t.copy_(h)
            self._moved = True
        return True

    def is_completed(self):
        return self._moved or self._work.is_completed()

    def source_rank(self):
        return self._work.source_rank()

    def result(self):
        return self._tensors


class _NoPeers:
    """The CPU side of a projected group: there is no other process to talk to."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"ProcessGroupTPU::{name}: a projected group (torchtpu.scaling) "
                               "only records programs for a TPU target; it runs nothing")
        return refuse


_projected = []  # the chips of the TPU target whose world projected_world is making


@contextlib.contextmanager
def projected_world(chips):
    """The default process group as rank 0 of a world of `len(chips)` ranks, all in this
    process, whose programs are over `chips` (a TPU target's compile-only devices): a job's
    programs recorded (not run) here are those every rank of a slice would run, compiled for
    it by `Segment.compile_for` (torchtpu.scaling: the real FSDP2 step for a slice this machine
    does not have).  Nothing over the group can run; a collective called eagerly fails."""
    if dist.is_initialized():
        raise RuntimeError("projected_world: a process group is already initialized")
    _projected.append(list(chips))
    try:
        dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=len(chips))
        yield dist.group.WORLD
    finally:
        _projected.pop()
        if dist.is_initialized():
            dist.destroy_process_group()


_hooks_installed = []


def create(opts, backend_options=None):
    """The creator registered with `dist.Backend.register_backend("tpu", ..., extended_api=True)`."""
    if not _hooks_installed:
        spmd.on_exchange(_exchange)
        spmd.on_dispatch(_dispatched)
        spmd.on_failure(_failed)
        spmd.on_mismatch(_disagreed)
        sync.before_blocking(_wait_in_flight)
        _hooks_installed.append(True)
    return ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           opts.global_ranks_in_group, str(opts.group_id))
