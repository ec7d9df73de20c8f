"""torch.distributed on tpu vs the gloo CPU backend, for 1, 2 and 4 processes on this machine.

    python benchmarks/distributed.py [--procs 1,2,4] [--steps 6] [--sizes-mb 0.25,4,16]

For each process count it launches that many ranks (as torchrun would) and prints, from rank 0:
  - all-reduce: latency of a 4-byte all-reduce (tpu with the cross-rank call check comparing
    a program's first run only, TORCHTPU_DIST_CHECK=first; without it, TORCHTPU_DIST_CHECK=0;
    comparing every run, the default) and bus bandwidth for larger float32 tensors, next to gloo on the
    same CPU tensors (bus bandwidth = size / time * 2 (n-1) / n, as nccl-tests reports it) and
    to the same all-reduce written in JAX (a jitted psum over the processes' devices: the
    floor of XLA's collectives that tpu's run on);
  - a DDP and an FSDP2 training step of a small GPT on tpu, the same step without DDP, and
    the same DDP step on the CPU with gloo: ms/step, bytes the collectives moved per step (tpu:
    measured by the backend; gloo: DDP's gradient bytes), and per-rank memory (tpu: peak
    device bytes; FSDP2 also the parameter bytes each rank holds); with --fused, the tpu
    steps also in fused eager.
On one machine with 2 cores every extra process shares the same cores, so these figures show
overheads and correctness of the plumbing, not TPU scaling (see docs/distributed.md).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, args):
    port = _port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen(
            [sys.executable, HERE, "--worker", "--steps", str(args.steps),
             "--sizes-mb", args.sizes_mb] + (["--fused"] if args.fused else []), env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    results = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"rank {r} of {n} failed:\n{out[-4000:]}")
        results.append(json.loads(lines[-1][7:]))
    return results


# --- one rank ------------------------------------------------------------------------------
def seconds_per_call(fn, reps, sync, rounds=3):
    """Seconds per call of fn: the best of `rounds` rounds of `reps` calls (the 2-core machine's
    noise only ever adds), after three calls to warm up."""
    for _ in range(3):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _jax_all_reduce(numel):
    """One all-reduce of `numel` float32 per process written in JAX, run to completion per
    call (as dist.all_reduce on gloo is): a psum over every process's device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "ranks"), mesh=mesh,
                                 in_specs=P("ranks"), out_specs=P("ranks")))
    local = jax.device_put(jnp.ones((numel,), jnp.float32), jax.local_devices()[0])
    x = [jax.make_array_from_single_device_arrays((numel * len(jax.devices()),),
                                                  NamedSharding(mesh, P("ranks")), [local])]

    def run():
        x[0] = psum(x[0])
        x[0].block_until_ready()
    return run


def worker(args):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchtpu
    from torchtpu.examples.models import GPT

    dist.init_process_group("cpu:gloo,tpu:tpu")
    n = dist.get_world_size()
    result = {"procs": n}
    busbw = 2 * (n - 1) / n if n > 1 else 1.0
    sync = torch.tpu.synchronize

    # all-reduce latency and bandwidth
    small_t, small_c = torch.ones(1, device="tpu"), torch.ones(1)
    os.environ["TORCHTPU_DIST_CHECK"] = "first"
    result["latency_us_tpu"] = seconds_per_call(lambda: dist.all_reduce(small_t), 100, sync) * 1e6
    os.environ["TORCHTPU_DIST_CHECK"] = "0"
    # Whether a program is checked is decided when it is built, once per call shape: a shape
    # not seen yet (the same 4 bytes) gets a program without the check.
    unchecked = torch.ones(1, 1, device="tpu")
    result["latency_us_tpu_nocheck"] = seconds_per_call(lambda: dist.all_reduce(unchecked), 100, sync) * 1e6
    del os.environ["TORCHTPU_DIST_CHECK"]  # compared at every run (the default)
    every = torch.ones(1, 1, 1, device="tpu")
    result["latency_us_tpu_every_run"] = seconds_per_call(lambda: dist.all_reduce(every), 100, sync) * 1e6
    result["latency_us_gloo"] = seconds_per_call(lambda: dist.all_reduce(small_c), 100, lambda: None) * 1e6
    result["latency_us_jax"] = seconds_per_call(_jax_all_reduce(1), 100, lambda: None) * 1e6
    result["bandwidth"] = []
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        numel = int(mb * 2**20 / 4)
        t, c = torch.ones(numel, device="tpu"), torch.ones(numel)
        tt = seconds_per_call(lambda t=t: dist.all_reduce(t), 5, sync)
        tc = seconds_per_call(lambda c=c: dist.all_reduce(c), 5, lambda: None)
        tj = seconds_per_call(_jax_all_reduce(numel), 5, lambda: None)
        result["bandwidth"].append({"mb": mb, "tpu_gbps": numel * 4 / tt / 1e9 * busbw,
                                    "gloo_gbps": numel * 4 / tc / 1e9 * busbw,
                                    "tpu_ms": tt * 1e3, "gloo_ms": tc * 1e3, "jax_ms": tj * 1e3})

    # training steps
    def model():
        torch.manual_seed(0)
        return GPT(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=64)

    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(dist.get_rank()))

    def stepper(net, device):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = tokens.to(device)

        def step():
            logits = net(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return step

    def measure(name, net, device):
        step = stepper(net, device)
        for _ in range(3):  # compiles, and DDP rebuilds its buckets after the first step
            step()
        before = torchtpu.metrics().get("collective_bytes", 0)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        result[f"{name}_ms"] = min(ms, result.get(f"{name}_ms", ms))
        result[f"{name}_bytes_per_step"] = (torchtpu.metrics().get("collective_bytes", 0)
                                            - before) / args.steps

    grad_bytes = sum(p.numel() * 4 for p in model().parameters())
    for mode in ("strict", "fused") if args.fused else ("strict",):
        suffix = "" if mode == "strict" else "_fused"
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER if mode == "strict"
                                      else torch.tpu.EagerMode.DEFER_AND_FUSE):
            # alternately, so that both see the same load
            for _ in range(2):
                measure("plain_tpu" + suffix, model().to("tpu"), "tpu")
                measure("ddp_tpu" + suffix, DDP(model().to("tpu")), "tpu")
    torch.tpu.reset_peak_memory_stats()
    measure("ddp_tpu", DDP(model().to("tpu")), "tpu")
    result["ddp_tpu_peak_bytes"] = torch.tpu.max_memory_allocated()
    measure("ddp_gloo", DDP(model()), "cpu")
    result["ddp_gloo_bytes_per_step"] = grad_bytes
    sharded = model().to("tpu")
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    result["fsdp_param_bytes"] = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in sharded.parameters())
    result["full_param_bytes"] = grad_bytes
    torch.tpu.reset_peak_memory_stats()
    measure("fsdp_tpu", sharded, "tpu")
    result["fsdp_tpu_peak_bytes"] = torch.tpu.max_memory_allocated()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sizes-mb", default="0.25,4,16")
    p.add_argument("--fused", action="store_true", help="the tpu steps in fused eager too")
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    print(f"{'procs':>5} {'all-reduce 4 B (us): tpu, first run checked / no check / every run checked (default) / gloo / JAX':>98}")
    rows = []
    for n in (int(x) for x in args.procs.split(",")):
        res = launch(n, args)
        rows.append(res)
        r0 = res[0]
        print(f"{n:>5} {r0['latency_us_tpu']:>20.0f} / {r0['latency_us_tpu_nocheck']:>8.0f} / "
              f"{r0['latency_us_tpu_every_run']:>8.0f} / "
              f"{r0['latency_us_gloo']:>8.0f} / {r0['latency_us_jax']:>8.0f}   tpu - gloo "
              f"{(r0['latency_us_tpu'] - r0['latency_us_gloo']) / 1e3:.2f} ms")
        for b in r0["bandwidth"]:
            print(f"      all-reduce {b['mb']:>6.2f} MB: tpu {b['tpu_ms']:8.2f} ms "
                  f"({b['tpu_gbps']:.2f} GB/s bus)   gloo {b['gloo_ms']:8.2f} ms "
                  f"({b['gloo_gbps']:.2f} GB/s bus)   JAX {b['jax_ms']:8.2f} ms   tpu/gloo time "
                  f"{b['tpu_ms'] / b['gloo_ms']:.2f}x, JAX/gloo {b['jax_ms'] / b['gloo_ms']:.2f}x")
        print(f"      DDP step: tpu {r0['ddp_tpu_ms']:.1f} ms   gloo CPU {r0['ddp_gloo_ms']:.1f} ms   "
              f"tpu/gloo {r0['ddp_tpu_ms'] / r0['ddp_gloo_ms']:.2f}x   collective bytes/step: tpu "
              f"{r0['ddp_tpu_bytes_per_step'] / 1e6:.2f} MB, gloo {r0['ddp_gloo_bytes_per_step'] / 1e6:.2f} MB")
        for mode in ("", "_fused"):
            if f"plain_tpu{mode}_ms" in r0:
                print(f"      {'fused' if mode else 'strict'}: DDP step {r0[f'ddp_tpu{mode}_ms']:.1f} ms, "
                      f"the same without DDP {r0[f'plain_tpu{mode}_ms']:.1f} ms "
                      f"({r0[f'ddp_tpu{mode}_ms'] / r0[f'plain_tpu{mode}_ms']:.2f}x)")
        print(f"      FSDP2 step: tpu {r0['fsdp_tpu_ms']:.1f} ms   collective bytes/step "
              f"{r0['fsdp_tpu_bytes_per_step'] / 1e6:.2f} MB")
        for r, x in enumerate(res):
            print(f"      rank {r} memory: DDP peak {x['ddp_tpu_peak_bytes'] / 1e6:.2f} MB, FSDP2 peak "
                  f"{x['fsdp_tpu_peak_bytes'] / 1e6:.2f} MB, FSDP2 parameters "
                  f"{x['fsdp_param_bytes'] / 1e6:.3f} of {x['full_param_bytes'] / 1e6:.3f} MB")


if __name__ == "__main__":
    main()
