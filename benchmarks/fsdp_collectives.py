"""The collectives of one FSDP2 step alone, without its compute: the floor under the
communication that benchmarks/scaling.py adds to a step.

    python benchmarks/fsdp_collectives.py [--steps 20]

Two ranks, each pinned to its own core as in scaling.py, issue what FSDP2 issues for the
scaling benchmark's GPT (fully_shard per block and root): each unit's all-gather in the
forward, the blocks' again in the backward, each unit's reduce-scatter, the same sizes, over
torch's own gloo on CPU tensors and over the tpu backend (strict and fused eager; XLA's gloo
path underneath).  Prints the p50 per step of each.
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def worker(backend, mode, steps):
    import torch
    import torch.distributed as dist
    if backend == "tpu":
        import torchtpu  # noqa: F401
    from torchtpu.examples.models import GPT

    dist.init_process_group(backend)
    n = dist.get_world_size()
    device = "tpu" if backend == "tpu" else "cpu"
    model = GPT(vocab=1024, d_model=256, n_heads=4, n_layers=4, seq=128)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    units = [sum(p.numel() for p in model.parameters()) - sum(blocks)] + blocks

    def step():
        out = []
        for u in units + units[:0:-1]:  # forward gathers, then the blocks' in the backward
            full = torch.empty(u // n * n, device=device)
            dist.all_gather_into_tensor(full, torch.ones(u // n, device=device))
            out.append(full)
        for u in reversed(units):
            shard = torch.empty(u // n, device=device)
            dist.reduce_scatter_tensor(shard, torch.ones(u // n * n, device=device))
            out.append(shard)
        return out

    if backend == "tpu":
        torch.tpu.set_eager_mode(mode)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        out = step()  # kept until the wait: results nothing holds could be left out
        out[-1].sum().item()
        del out
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        t = sorted(times[3:])
        print(f"{backend + ' ' + mode if backend == 'tpu' else 'gloo (torch)':<14} "
              f"{statistics.median(t) * 1e3:7.1f} ms per step (min {t[0] * 1e3:.1f}, max "
              f"{t[-1] * 1e3:.1f}); {sum(units + units[1:]) * 4 / 2**20:.1f} MiB gathered, "
              f"{sum(units) * 4 / 2**20:.1f} MiB reduce-scattered per step", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker, a.steps)
    print(f"# the collectives of one FSDP2 step of the GPT alone, 2 ranks on cores 0 and 1, "
          f"{time.strftime('%Y-%m-%d')}")
    for backend, mode in (("gloo", "-"), ("tpu", "strict"), ("tpu", "fused")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       TF_CPP_MIN_LOG_LEVEL="1")
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(r), sys.executable, HERE, "--steps", str(a.steps),
                 "--worker", backend, mode], env=env,
                stdout=None if r == 0 else subprocess.DEVNULL))
        for p in procs:
            p.wait(timeout=600)


if __name__ == "__main__":
    main()
