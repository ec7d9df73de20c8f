"""A loop over new tensor sizes, as PyTorch's device-generic tests write them: each iteration
has sizes no earlier one had, so every op of it needs an executable of its own.

    python benchmarks/new_sizes.py [--iterations 40]

The loop is test_indexing's `index_put_(accumulate=True)` test with duplicate indices: a random
walk of i steps (uniform_, cumsum, a cast), then randn of two new sizes and the accumulating
index_put. It prints the time on tpu (strict eager, cold caches) against torch on the CPU, with
the executables compiled per iteration. PyTorch's test runs 511 iterations (`--iterations 511`).
"""
import argparse
import os
import time

os.environ.setdefault("TORCHTPU_CACHE_DIR", "")  # cold: nothing from an earlier run

import torch  # noqa: E402

import torchtpu  # noqa: E402


def loop(device, iterations):
    for i in range(1, iterations + 1):
        delta = torch.empty(i, dtype=torch.double, device=device).uniform_(-1, 1)
        indices = delta.cumsum(0).long()
        inp = torch.randn(int(indices.abs().max()) + 1, device=device)
        values = torch.randn(indices.size(0), device=device)
        out = inp.index_put((indices,), values, accumulate=True)
        expected = inp.cpu().index_put((indices.cpu(),), values.cpu(), accumulate=True)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=40)
    a = ap.parse_args()
    torch.tpu.eager_mode = "strict"
    timings = {}
    for device in ("cpu", "tpu"):
        t0 = time.perf_counter()
        loop(device, a.iterations)
        timings[device] = time.perf_counter() - t0
    built = torchtpu.metrics().get("executables_compiled", 0)
    print(f"{a.iterations} iterations: tpu {timings['tpu']:.1f} s, torch CPU {timings['cpu']:.2f} s "
          f"({timings['tpu'] / timings['cpu']:.0f}x); {built} executables compiled, "
          f"{built / a.iterations:.1f} per iteration")


if __name__ == "__main__":
    main()
