"""Starting JAX's multi-process runtime for a torch.distributed job.

The default group of `init_process_group("tpu")` calls `initialize`: rank 0 picks a free port
for JAX's coordinator and publishes it in the c10d store (so only `MASTER_ADDR`/`MASTER_PORT`,
or any other torch rendezvous, is needed), and every rank joins with its torch rank as JAX
process id. JAX requires this before its backends start; as on CUDA, `torch.tpu` queries
(`device_count()`, `get_device_properties()`...) may come first: a runtime they started holds no
array yet, so it is shut down and restarts as part of the multi-process runtime. Only a process
that already holds tpu tensors cannot join.

On a TPU host started with one process per chip (`torchrun --nproc-per-node=<chips>`), libtpu
needs each process's chip, the slice's process bounds and every process's address before it
loads: `tpu_hosts.configure` derives and sets them (the runtime's first start does it too), and
JAX's process id and count are the slice-major ones it derived, with JAX's cluster detection off
(it would count per-chip addresses but use the host's id).  Without TPU chips nothing changes.
"""
import os
import socket

import jax

_initialized = False
_tpu_launch = None  # tpu_hosts.Launch of the default group's process, None without TPU chips


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _coordinator_host():
    host = os.environ.get("MASTER_ADDR")
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def refuse_if_too_late(world_size):
    """Raise if JAX's multi-process runtime can no longer start in this process (a tpu tensor
    exists).  The process group asks before it connects to any other rank: a rank that raised
    after connecting left the others' connections failing instead of raising the same."""
    from jax._src import xla_bridge
    if world_size == 1 or _initialized or not xla_bridge.backends_are_initialized():
        return
    from .._execution import op_keys
    op_keys.clear_scalars()  # device copies of Python scalars, not tensors
    if jax.live_arrays():
        raise RuntimeError(
            "init_process_group('tpu') with world_size > 1 must run before this process "
            "creates its first tpu tensor: JAX's multi-process runtime can only start before "
            "the device runtime does. Move init_process_group above the first tpu tensor "
            "(torch.tpu queries such as device_count() may come before it).")


def configure_tpu_hosts(rank, world_size):
    """Set the TPU host's variables for this process (tpu_hosts.configure), checked against the
    group's rank and size.  The process group calls it before connecting to any other rank, as
    refuse_if_too_late: a launch libtpu cannot form a slice from raises on every rank alike."""
    global _tpu_launch
    if world_size == 1 or _initialized:
        return
    from .._core import tpu_hosts
    _tpu_launch = tpu_hosts.configure(dict(os.environ, RANK=str(rank),
                                           WORLD_SIZE=str(world_size)))


def _shut_down_runtime():
    from .._core import runtime
    from .._execution import fused, kernels
    kernels.clear_caches()  # executables built for the old runtime's devices
    fused.clear_cache()
    runtime.forget()
    from jax._src import api, xla_bridge
    if hasattr(api, "clear_backends"):  # private since JAX 0.4.36 (public jax.clear_backends gone)
        api.clear_backends()
    else:
        xla_bridge._clear_backends()
        jax.clear_caches()


def _host_of(rank):
    """`rank`'s host, where this process knows the TPU slice's hosts (one process per chip)."""
    t = _tpu_launch
    if t is None or not t.per_chip:
        return None
    per_slice = len(t.hosts) * t.local_world_size
    slice_id, worker = rank // per_slice, rank % per_slice // t.local_world_size
    if slice_id != t.slice_id:
        return f"TPU worker {worker} of slice {slice_id}"
    return f"TPU worker {worker} ({t.hosts[worker]})"


def _wait_for_every_rank(store, rank, world_size, timeout):
    """Every rank reaches JAX's multi-process runtime, or a DistBackendError naming those that
    did not within the group's timeout.  JAX's own wait for them ends by aborting the process
    (a fatal log of its coordination service, "DEADLINE_EXCEEDED ... RegisterTask"), which
    nothing can catch; and on a TPU slice a host that never starts leaves the others waiting
    with nothing that names it."""
    keys = [f"torchtpu/jax_joining/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
        return
    except RuntimeError:  # DistStoreError: the timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
    hosts = sorted({h for h in map(_host_of, missing) if h})
    import torch.distributed as dist
    raise dist.DistBackendError(
        f"init_process_group('tpu'): rank(s) {missing} of {world_size} did not reach JAX's "
        f"multi-process runtime within the group's timeout ({timeout})"
        + (f"; their host(s): {', '.join(hosts)}" if hosts else "")
        + ". They connected to the group and then stopped or hang before starting it (a "
        "process that died or was killed): see their output.")


def initialize(store, rank, world_size, timeout):
    global _initialized
    if world_size == 1 or _initialized:
        return
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        refuse_if_too_late(world_size)
        _shut_down_runtime()
    key = "torchtpu/jax_coordinator"
    if rank == 0:
        store.set(key, f"{_coordinator_host()}:{_free_port()}")
    address = store.get(key).decode()
    _wait_for_every_rank(store, rank, world_size, timeout)
    # On the CPU the cross-process collectives run on gloo; TPU and GPU use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # XLA:CPU's concurrency-optimized scheduler orders collectives that do not depend on each
    # other differently in different processes (two FSDP blocks' all-gathers of one shape, in a
    # program that checks the ranks' collectives, swapped their data), and gloo pairs them by
    # order: every program keeps the order it issues them in.  (A compiler option of the
    # program alone did not take; the flag must be set before XLA reads its flags.)
    # On GPUs, XLA's latency-hiding scheduler (which overlaps a program's collectives with its
    # compute) is not on in every jaxlib; NVIDIA's JAX images set it, and so do we.  On TPUs it
    # is XLA's default.  A value the user gives in XLA_FLAGS wins.
    for flag, value in (("--xla_cpu_enable_concurrency_optimized_scheduler", "false"),
                        ("--xla_gpu_enable_latency_hiding_scheduler", "true")):
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={value}".strip()
    options = {}
    if _tpu_launch is not None and _tpu_launch.per_chip:
        # rank and world_size are the derived process id and count (configure_tpu_hosts checked)
        options["cluster_detection_method"] = "deactivate"
    jax.distributed.initialize(address, num_processes=world_size, process_id=rank,
                               initialization_timeout=max(int(timeout.total_seconds()), 1),
                               **options)
    _initialized = True
