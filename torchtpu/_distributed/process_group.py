"""`ProcessGroupTPU`: the c10d backend "tpu", a `torch.distributed.ProcessGroup` written in Python.

Each collective takes the JAX arrays of its tpu tensors, makes them one global array over the
group's devices (one per rank), runs the cached collective program (`programs.py`) and writes the
results back into the output tensors. CPU tensors given to a tpu group go to the group's own
gloo side, so object collectives and `"cpu:gloo,tpu:tpu"` work; so do point-to-point sends (see
`send`).

Collectives are matched by call order, as in PyTorch. Before the data moves, the ranks compare a
small signature of the call (collective, reduce op, root, dtype, shape): a rank that calls a
different collective or passes another shape gets a RuntimeError instead of the runtime's abort.
A collective that does not finish within the group's timeout raises `DistBackendError`, and the
group refuses further work (a peer is gone or stuck; like NCCL's watchdog abort).
"""
import concurrent.futures
import datetime
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from .._core import runtime, storage
from .._core.dtypes import to_jax_dtype
from .._execution import fused
from .._core import metrics
from .._core.metrics import FlushReason
from .._execution.transfer import value_of
from . import launch, programs

_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}
_KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
          "gather", "scatter", "barrier", "all_to_all_uneven")

# XLA runs a CPU collective inside the dispatching call; a dedicated thread runs every program
# so the caller can stop waiting after the timeout. One thread keeps this process's order.
_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchtpu-collectives")


def _check_enabled():
    return os.environ.get("TORCHTPU_DIST_CHECK", "1") != "0"


def _reduce_op(opts, who):
    op = opts.reduceOp
    name = _REDUCE_OPS.get(op.op if hasattr(op, "op") else op)
    if name is None:
        raise ValueError(f"ProcessGroupTPU::{who}: unsupported reduce op {op}")
    return name


class _Work(dist._Work):
    """A finished (or running) collective: `wait()` blocks until the results exist."""

    def __init__(self, result, arrays, timeout):
        super().__init__()
        self._result = result
        self._arrays = arrays
        self._timeout = timeout

    def wait(self, timeout=None):
        limit = self._timeout
        if timeout is not None and timeout != datetime.timedelta(0):
            limit = timeout
        _block(self._arrays, limit)
        return True

    def is_completed(self):
        return all(a.is_ready() for a in self._arrays)

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _block(arrays, timeout):
    if not arrays or all(a.is_ready() for a in arrays):
        return
    waiting = _executor.submit(lambda: [a.block_until_ready() for a in arrays])
    try:
        waiting.result(timeout.total_seconds())
    except concurrent.futures.TimeoutError:
        raise dist.DistBackendError(
            f"ProcessGroupTPU: a collective did not finish within the timeout ({timeout})") from None


def _assign(out, array):
    """Write `array` (out's shape) into tensor `out` the way a collective library does: no
    autograd record and no version bump."""
    buf = storage.buffer_of(out)
    jdtype = to_jax_dtype(out.dtype)
    if array.dtype != jdtype:
        array = array.astype(jdtype)
    if array.shape != tuple(out.shape):
        array = array.reshape(out.shape)
    if (out.storage_offset() == 0 and out.is_contiguous() and buf.dtype == jdtype
            and buf.nbytes == out.numel() * out.element_size() and not buf.from_bytes):
        buf.array = array
        return
    src = storage.wrap(array, tuple(out.shape),
                       storage.contiguous_strides(out.shape), out.dtype, out.device.index)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        out.copy_(src)


def _digest(value):
    """A hash that is the same in every process (Python's `hash` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=6).digest(), "little")


def _signature(kind, static, dtype, shape):
    sig = np.full(12, -1, np.int64)
    sig[0] = _KINDS.index(kind)
    sig[1] = _digest(static)
    sig[2] = _digest(str(dtype))
    sig[3] = len(shape)
    sig[4:10][:min(len(shape), 6)] = list(shape)[:6]
    sig[10] = _digest(tuple(shape))
    return sig


def _describe(sig):
    kind = _KINDS[int(sig[0])] if 0 <= sig[0] < len(_KINDS) else "?"
    ndim = int(sig[3])
    dims = [int(d) for d in sig[4:4 + min(ndim, 6)]] + (["..."] if ndim > 6 else [])
    return f"{kind} of shape ({', '.join(map(str, dims))}{',' if ndim == 1 else ''})"


class ProcessGroupTPU(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout, global_ranks=None, group_name=""):
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._name = group_name
        self._broken = None
        self._signatures = {}
        self._expected = None
        self._cpu = dist.ProcessGroupGloo(
            dist.PrefixStore("torchtpu-gloo/", store), rank, size, timeout)
        if not global_ranks:  # the default (world) group starts JAX's multi-process runtime
            launch.initialize(store, rank, size, timeout)
        self._device_ids = self._exchange_devices()

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

    # --- running programs ---------------------------------------------------------------
    def _expect(self, kind, static, dtype, shape):
        """Declare the call about to run; the next `_run` first checks that every rank made
        the same one (in the same job on the collectives thread, so it costs one handoff)."""
        if not _check_enabled() or self._size == 1:
            return
        sig = _signature(kind, static, dtype, shape)
        key = sig.tobytes()
        mine = self._signatures.get(key)
        if mine is None:  # device copies of recurring signatures: no transfer per call
            mine = self._signatures[key] = jax.device_put(
                sig, runtime.jax_device(runtime.current_device()))
        self._expected = (sig, mine)

    def _run(self, kind, static, local):
        """This rank's block of collective `kind` on its block `local` (see programs.py)."""
        if self._broken is not None:
            raise dist.DistBackendError(
                f"ProcessGroupTPU: the group is unusable after an earlier failure: {self._broken}")
        expected, self._expected = self._expected, None
        if self._size == 1:  # every collective of one rank's block is that block
            return local
        ids = self._device_ids
        mesh = programs.mesh_of(ids)
        fn = programs.program(kind, static, ids)
        metrics.counters[f"collective::{kind}"] += 1
        metrics.counters["collective_bytes"] += local.size * local.dtype.itemsize
        scalar = local.ndim == 0
        if scalar:
            local = local.reshape(1)

        def job():
            if expected is not None:
                check = programs.program("all_gather", None, ids)
                signatures = check(programs.as_global(mesh, expected[1]))
                rows = np.asarray(programs.local_block(signatures)).reshape(self._size, -1)
                if any(not np.array_equal(row, expected[0]) for row in rows):
                    return rows
            return fn(programs.as_global(mesh, local))

        try:
            out = _executor.submit(job).result(self._timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            self._broken = (f"{kind} timed out after {self._timeout} on rank {self._rank} "
                            "(another rank is gone, stuck, or called a different collective)")
            raise dist.DistBackendError(f"ProcessGroupTPU: {self._broken}") from None
        except Exception as e:  # the runtime's report of a lost peer
            self._broken = f"{kind} failed on rank {self._rank}: {e}"
            raise dist.DistBackendError(
                f"ProcessGroupTPU: {self._broken} (did another rank exit?)") from e
        if isinstance(out, np.ndarray):  # the ranks' signatures differ
            calls = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(out))
            raise RuntimeError(
                f"ProcessGroupTPU: ranks disagree on a collective call ({calls}); every rank "
                "must call the same collectives in the same order with tensors of the same "
                "shape and dtype")
        out = programs.local_block(out)
        return out.reshape(()) if scalar else out

    def _values(self, tensors):
        fused.flush(FlushReason.COLLECTIVE)
        return [value_of(t) for t in tensors]

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

    def _cpu_group(self):
        return self._cpu

    def _done(self, result, arrays=()):
        return _Work(result, list(arrays), self._timeout)

    # --- all-reduce and friends -----------------------------------------------------------
    def allreduce(self, tensors, opts):
        if self._route(tensors, "allreduce") == "cpu":
            return self._cpu_group().allreduce(tensors, opts)
        op = _reduce_op(opts, "allreduce")
        arrays = []
        for t, v in zip(tensors, self._values(tensors)):
            self._expect("all_reduce", op, t.dtype, t.shape)
            out = self._run("all_reduce", op, v)
            _assign(t, out)
            arrays.append(out)
        return self._done(tensors, arrays)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        if self._route(tensors, "reduce") == "cpu":
            return self._cpu_group().reduce(tensors, opts)
        op = _reduce_op(opts, "reduce")
        (t,), (v,) = tensors, self._values(tensors)
        self._expect("reduce", (op, opts.rootRank), t.dtype, t.shape)
        out = self._run("all_reduce", op, v)
        if self._rank == opts.rootRank:
            _assign(t, out)
        return self._done(tensors, [out])

    def broadcast(self, tensors, opts):
        if self._route(tensors, "broadcast") == "cpu":
            return self._cpu_group().broadcast(tensors, opts)
        t = tensors[opts.rootTensor]
        (v,) = self._values([t])
        self._expect("broadcast", opts.rootRank, t.dtype, t.shape)
        out = self._run("broadcast", opts.rootRank, v)
        if self._rank != opts.rootRank:
            _assign(t, out)
        return self._done(tensors, [out])

    def barrier(self, opts):
        fused.flush(FlushReason.COLLECTIVE)
        one = jnp.ones((1,), jnp.int32, device=runtime.jax_device(runtime.current_device()))
        self._expect("barrier", None, torch.int32, (1,))
        out = self._run("all_reduce", "sum", one)
        out.block_until_ready()
        return self._done([], [out])

    # --- gathers ------------------------------------------------------------------------
    def _gather_rows(self, kind, t, static=None):
        (v,) = self._values([t])
        self._expect(kind, static, t.dtype, t.shape)
        rows = self._run("all_gather", None, v)  # (n * shape[0], ...)
        return rows.reshape(self._size, *t.shape)

    def allgather(self, output_tensors, input_tensors, opts):
        if self._route(input_tensors + [o for out in output_tensors for o in out],
                       "allgather") == "cpu":
            return self._cpu_group().allgather(output_tensors, input_tensors, opts)
        arrays = []
        for outs, t in zip(output_tensors, input_tensors):
            if len(outs) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::allgather: expected {self._size} output "
                                   f"tensors, got {len(outs)}")
            rows = self._gather_rows("all_gather", t)
            for r, o in enumerate(outs):
                _assign(o, rows[r])
            arrays.append(rows)
        return self._done(output_tensors, arrays)

    def allgather_coalesced(self, output_lists, input_list, opts):
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts):
        if self._route([output, input], "all_gather_into_tensor") == "cpu":
            return self._cpu_group()._allgather_base(output, input, opts)
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise ValueError(
                "ProcessGroupTPU::all_gather_into_tensor: output tensor must have "
                f"{self._size} times the input's elements and the same dtype, got output "
                f"{tuple(output.shape)} {output.dtype} and input {tuple(input.shape)} {input.dtype}")
        (v,) = self._values([input])
        self._expect("all_gather", "into_tensor", input.dtype, input.shape)
        rows = self._run("all_gather", None, v)
        _assign(output, rows)
        return self._done([output], [rows])

    _allgather_base = all_gather_single

    def _each(self, collective, outputs, inputs, opts):
        """A coalesced call: `collective` per (output, input) pair, one Work for all."""
        works = [collective(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._done(outputs, [a for w in works for a in w._arrays])

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return self._each(self.all_gather_single, outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts):
        if self._route(input_tensors + [o for out in output_tensors for o in out],
                       "gather") == "cpu":
            return self._cpu_group().gather(output_tensors, input_tensors, opts)
        (t,) = input_tensors
        rows = self._gather_rows("gather", t, opts.rootRank)
        if self._rank == opts.rootRank:
            outs = output_tensors[0]
            if len(outs) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::gather: expected {self._size} output "
                                   f"tensors on the root, got {len(outs)}")
            for r, o in enumerate(outs):
                _assign(o, rows[r])
        return self._done(output_tensors, [rows])

    # --- scatters -----------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + [i for ins in input_tensors for i in ins],
                       "reduce_scatter") == "cpu":
            return self._cpu_group().reduce_scatter(output_tensors, input_tensors, opts)
        op = _reduce_op(opts, "reduce_scatter")
        arrays = []
        for out, ins in zip(output_tensors, input_tensors):
            if len(ins) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::reduce_scatter: expected {self._size} "
                                   f"input tensors, got {len(ins)}")
            vals = self._values(ins)
            self._expect("reduce_scatter", op, out.dtype, out.shape)
            # Row j of the stack is this rank's contribution to rank j's result.
            res = self._run("reduce_scatter", op, jnp.stack([v.reshape(-1) for v in vals]))
            _assign(out, res.reshape(out.shape))
            arrays.append(res)
        return self._done(output_tensors, arrays)

    def reduce_scatter_single(self, output, input, opts):
        if self._route([output, input], "reduce_scatter_tensor") == "cpu":
            return self._cpu_group()._reduce_scatter_base(output, input, opts)
        if input.numel() != output.numel() * self._size or output.dtype != input.dtype:
            raise ValueError(
                "ProcessGroupTPU::reduce_scatter_tensor: input tensor must have "
                f"{self._size} times the output's elements and the same dtype, got input "
                f"{tuple(input.shape)} {input.dtype} and output {tuple(output.shape)} {output.dtype}")
        op = _reduce_op(opts, "reduce_scatter_tensor")
        (v,) = self._values([input])
        self._expect("reduce_scatter", (op, "tensor"), input.dtype, input.shape)
        if input.dim() == 0 or input.shape[0] % self._size:
            v = v.reshape(self._size, -1)
        res = self._run("reduce_scatter", op, v)
        _assign(output, res.reshape(output.shape))
        return self._done([output], [res])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return self._each(self.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def scatter(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + [i for ins in input_tensors for i in ins],
                       "scatter") == "cpu":
            return self._cpu_group().scatter(output_tensors, input_tensors, opts)
        (out,) = output_tensors
        if self._rank == opts.rootRank:
            ins = input_tensors[0]
            if len(ins) != self._size:
                raise RuntimeError(f"ProcessGroupTPU::scatter: expected {self._size} input "
                                   f"tensors on the root, got {len(ins)}")
            stacked = jnp.stack(self._values(ins))
        else:
            fused.flush(FlushReason.COLLECTIVE)
            stacked = jnp.zeros((self._size, *out.shape), to_jax_dtype(out.dtype),
                                device=runtime.jax_device(out.device.index))
        self._expect("scatter", opts.rootRank, out.dtype, out.shape)
        received = self._run("all_to_all", None, stacked)  # row j: what rank j sent me
        _assign(out, received[opts.rootRank])
        return self._done([out], [received])

    # --- all-to-all ---------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts):
        if self._route([output, input], "all_to_all_single") == "cpu":
            return self._cpu_group().alltoall_base(output, input, output_split_sizes,
                                                   input_split_sizes, opts)
        n = self._size
        (v,) = self._values([input])
        rest = tuple(input.shape[1:])
        if not output_split_sizes and not input_split_sizes:
            if input.shape[0] % n or output.shape != input.shape:
                raise ValueError(
                    "ProcessGroupTPU::all_to_all_single: without split sizes, input and output "
                    f"must have the same shape with dim 0 divisible by {n}, got input "
                    f"{tuple(input.shape)} and output {tuple(output.shape)}")
            self._expect("all_to_all", None, input.dtype, input.shape)
            res = self._run("all_to_all", None, v)
            _assign(output, res.reshape(output.shape))
            return self._done([output], [res])
        ins = list(input_split_sizes) or [input.shape[0] // n] * n
        outs = list(output_split_sizes) or [output.shape[0] // n] * n
        if sum(ins) != input.shape[0] or sum(outs) != output.shape[0] or len(ins) != n \
                or len(outs) != n:
            raise ValueError("ProcessGroupTPU::all_to_all_single: split sizes do not match the "
                             f"tensors: input {tuple(input.shape)} split {ins}, output "
                             f"{tuple(output.shape)} split {outs}")
        self._expect("all_to_all_uneven", None, input.dtype, rest)
        # Every rank learns every split, pads its chunks to the largest one, and exchanges
        # equal-sized chunks; the padding is cut off on arrival.
        splits = np.asarray(self._run("all_gather", None, jax.device_put(
            np.asarray(ins, np.int64), runtime.jax_device(input.device.index)))).reshape(n, n)
        if list(splits[:, self._rank]) != outs:
            raise RuntimeError(
                f"ProcessGroupTPU::all_to_all_single: rank {self._rank} expects chunks of "
                f"{outs} rows but the other ranks send {list(splits[:, self._rank])}")
        chunk = max(int(splits.max()), 1)
        starts = np.concatenate([[0], np.cumsum(ins)])
        padded = jnp.stack([jnp.pad(v[starts[j]:starts[j + 1]],
                                    [(0, chunk - ins[j])] + [(0, 0)] * len(rest))
                            for j in range(n)])
        res = self._run("all_to_all", None, padded.reshape(n * chunk, *rest)).reshape(
            n, chunk, *rest)
        _assign(output, jnp.concatenate([res[j, :outs[j]] for j in range(n)]))
        return self._done([output], [res])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts):
        if self._route(output_tensors + input_tensors, "alltoall") == "cpu":
            return self._cpu_group().alltoall(output_tensors, input_tensors, opts)
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in output_tensors + input_tensors):
            raise ValueError("ProcessGroupTPU::alltoall: all tensors must have the same dtype")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype,
                               device=flat_in.device)
        work = self.all_to_all_single(flat_out, flat_in, [t.numel() for t in output_tensors],
                                      [t.numel() for t in input_tensors], opts)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            for o, piece in zip(output_tensors, flat_out.split([t.numel() for t in output_tensors])):
                o.copy_(piece.view(o.shape))
        return self._done(output_tensors, work._arrays)

    # --- point to point -----------------------------------------------------------------
    # JAX has no one-sided transfer between processes: a program must run on both ends, so
    # `isend` followed by `recv` on both ranks could never match. Point-to-point traffic
    # therefore goes through the group's gloo side, staged through host memory.
    def send(self, tensors, dst, tag=0):
        if self._route(tensors, "send") == "cpu":
            return self._cpu_group().send(tensors, dst, tag)
        host = [t.detach().cpu() for t in tensors]
        metrics.counters["collective::send"] += 1
        return self._cpu_group().send(host, dst, tag)

    def recv(self, tensors, src, tag=0):
        if self._route(tensors, "recv") == "cpu":
            return self._cpu_group().recv(tensors, src, tag)
        host = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        metrics.counters["collective::recv"] += 1
        return _ReceiveWork(self._cpu_group().recv(host, src, tag), host, tensors)

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


def create(opts, backend_options=None):
    """The creator registered with `dist.Backend.register_backend("tpu", ..., extended_api=True)`."""
    return ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                           opts.global_ranks_in_group, str(opts.group_id))
