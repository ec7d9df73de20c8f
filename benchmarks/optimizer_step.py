"""AdamW step on tpu: torch.optim's foreach implementation (about a dozen `_foreach_*` ops per
step) vs fused=True (one `_fused_adamw_` executable), in strict and fused eager mode.

    python benchmarks/optimizer_step.py [--layers 24] [--width 256] [--steps 20]
"""
import argparse
import statistics
import time

import torch

import torchtpu  # noqa: F401


def step_seconds(impl, mode, layers, width, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to("tpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{impl: True})
    times = []
    with torch.tpu.set_eager_mode(mode):
        for _ in range(steps + 3):  # the first steps compile
            torch.tpu.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.tpu.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    print(f"AdamW step, {2 * a.layers} tensors, "
          f"{a.layers * (a.width + 1) * a.width / 1e6:.2f}M parameters (median ms)")
    for mode in ("DEFER_NEVER", "DEFER_AND_FUSE"):
        foreach = step_seconds("foreach", mode, a.layers, a.width, a.steps)
        fused = step_seconds("fused", mode, a.layers, a.width, a.steps)
        print(f"{mode:15s} foreach {foreach * 1e3:7.2f}  fused {fused * 1e3:7.2f}  "
              f"foreach/fused {foreach / fused:.2f}x")


if __name__ == "__main__":
    main()
