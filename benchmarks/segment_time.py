"""The programs of a fused eager training step timed alone, beside the hand-written `jax.jit`
step of the same model: how much of fused eager's step is its programs' compute, and how much
the host's recording and dispatch around them.

    python benchmarks/segment_time.py [--models small,gpt,llama] [--runs 10]

Each segment of one steady step (after 3 warm-up steps) is run `--runs` times on copies of the
inputs it read, without donation, waiting for each run; it prints the median per segment, their
sum, the JAX step's median (timed the same way) and the fused step's own time per step, with
the CPU time its threads used per step (XLA's compute threads, the Python thread, the autograd
engine's): on a CPU the host's work and the programs share the cores.
Models as benchmarks/train_step.py builds them with its default options (batch 8,
AdamW(lr=1e-3)).
"""
import argparse
import collections
import copy
import os
import time

os.environ.setdefault("TORCHTPU_CACHE_DIR", "")  # cold: the programs are built here

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401
from torchtpu._execution.segment import Segment
from train_step import build_model, default_options, jax_step_fn, torch_step


def thread_cpu_ms():
    """{thread name: CPU ms} of this process's threads (Linux; {} elsewhere)."""
    totals = collections.Counter()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return totals
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        totals[name] += (int(fields[11]) + int(fields[12])) / tick * 1e3  # utime + stime
    return totals


def median_ms(call, runs):
    jax.block_until_ready(call())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def measure(name, a, runs):
    """`a`: the model's options (train_step.default_options)."""
    model = build_model(a)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    tgt = torch.randint(0, a.vocab, (a.batch, a.seq))
    ran = []
    run = Segment.run

    def noting(segment, ext, call, packed):  # the inputs as they were before a run consumed them
        ran.append((segment, [jnp.array(x, copy=True) for x in ext], packed))
        return run(segment, ext, call, packed)

    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        tpu_model = copy.deepcopy(model).to("tpu")
        step = torch_step(tpu_model, torch.optim.AdamW(tpu_model.parameters(), lr=1e-3),
                          idx.to("tpu"), tgt.to("tpu"))
        for _ in range(3):
            step()
        torch.tpu.synchronize()
        cpu0 = thread_cpu_ms()
        t0 = time.perf_counter()
        for _ in range(runs):
            step()
        torch.tpu.synchronize()
        fused_ms = (time.perf_counter() - t0) / runs * 1e3
        cpu = thread_cpu_ms()
        cpu = {name: (ms - cpu0.get(name, 0)) / runs for name, ms in cpu.items()}
        Segment.run = noting
        try:
            step()
            torch.tpu.synchronize()
        finally:
            Segment.run = run
    busy = ", ".join(f"{n} {ms:.1f}" for n, ms in sorted(cpu.items(), key=lambda i: -i[1]) if ms >= 0.5)
    print(f"{name}: fused eager step {fused_ms:.1f} ms; CPU ms per step by thread: {busy}")
    total = 0.0
    for segment, ext, packed in ran:
        keep = (False,) * len(ext)
        executable = segment._make(keep)
        donated, kept = segment.order(keep).split(ext)
        ms = median_ms(lambda: executable(donated, kept, packed), runs)
        total += ms
        print(f"  {segment.name}: {ms:.1f} ms alone")
    jax_step, p, m, v = jax_step_fn(model)
    ji, jt = jnp.asarray(idx.numpy()), jnp.asarray(tgt.numpy())
    jax_ms = median_ms(lambda: jax_step(p, m, v, 1, ji, jt), runs)
    print(f"  segments together {total:.1f} ms; JAX's step {jax_ms:.1f} ms "
          f"(segments x JAX {total / jax_ms:.2f}x; fused step x its segments {fused_ms / total:.2f}x)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small,gpt,llama")
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    models = [(name, default_options(name)) for name in a.models.split(",")]
    for name, options in models:
        if options is None:
            ap.error(f"unknown model {name!r}: choose from small, gpt, llama")
    for name, options in models:
        measure(name, options, a.runs)


if __name__ == "__main__":
    main()
