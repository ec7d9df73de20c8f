"""Starting JAX's multi-process runtime for a torch.distributed job.

The default group of `init_process_group("tpu")` calls `initialize`: rank 0 picks a free port
for JAX's coordinator and publishes it in the c10d store (so only `MASTER_ADDR`/`MASTER_PORT`,
or any other torch rendezvous, is needed), and every rank joins with its torch rank as JAX
process id. This must happen before the device runtime starts, i.e. before the process
creates its first tpu tensor.
"""
import os
import socket

import jax

_initialized = False


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


def initialize(store, rank, world_size, timeout):
    global _initialized
    if world_size == 1 or _initialized:
        return
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "init_process_group('tpu') with world_size > 1 must run before this process "
            "creates its first tpu tensor: JAX's multi-process runtime can only start before "
            "the device runtime does. Move init_process_group to the top of the script.")
    key = "torchtpu/jax_coordinator"
    if rank == 0:
        store.set(key, f"{_coordinator_host()}:{_free_port()}")
    address = store.get(key).decode()
    # On the CPU the cross-process collectives run on gloo; TPU and GPU use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=world_size, process_id=rank,
                               initialization_timeout=max(int(timeout.total_seconds()), 1))
    _initialized = True
