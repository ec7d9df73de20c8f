"""Seconds spent where ops compile per new shape (issue 17's slow device-generic tests).

  python benchmarks/op_compile_time.py grid      # grid_sampler_3d forward+backward lowerings,
                                                 # 3 paddings x 2 align_corners, compiled
  python benchmarks/op_compile_time.py indices   # PyTorch's index_put(accumulate=True)
                                                 # duplicate-indices loop, executables per op

Compile times on a shared machine vary several-fold: compare runs made side by side."""
import argparse
import collections
import time

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401
from torchtpu._core import registry
from torchtpu._execution import op_programs

aten = torch.ops.aten


def grid():
    fwd = registry.TABLE[aten.grid_sampler_3d.default].fn
    bwd = registry.TABLE[aten.grid_sampler_3d_backward.default].fn
    x, g = jnp.ones((2, 3, 4, 5, 6)), jnp.full((2, 3, 4, 2, 3), 0.3)
    grad = jnp.ones((2, 3, 3, 4, 2))
    start = time.perf_counter()
    for pad in (0, 1, 2):
        for align in (False, True):
            jax.jit(lambda x, g: fwd(x, g, 0, pad, align)).lower(x, g).compile()
            jax.jit(lambda gr, x, g: bwd(gr, x, g, 0, pad, align, [True, True])).lower(grad, x, g).compile()
    print(f"grid_sampler_3d: 12 executables compiled in {time.perf_counter() - start:.1f}s")


def indices(n):
    seconds, count = collections.Counter(), collections.Counter()
    build = op_programs.build

    def timed_build(kernel, *args):  # the first call of each executable traces and compiles it
        compiled = build(kernel, *args)
        fn, name, first = compiled.fn, str(kernel.overload), [True]

        def call(*a):
            if not first:
                return fn(*a)
            first.clear()
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*a))
            seconds[name] += time.perf_counter() - t
            count[name] += 1
            return out
        compiled.fn = call
        return compiled

    op_programs.build = timed_build
    start = time.perf_counter()
    for i in range(1, n):
        delta = torch.empty(i, dtype=torch.double, device="tpu").uniform_(-1, 1)
        idx = delta.cumsum(0).long()
        x = torch.randn(idx.abs().max() + 1, device="tpu")
        x.index_put((idx,), torch.randn(idx.size(0), device="tpu"), accumulate=True).tolist()
    print(f"{n - 1} iterations: {time.perf_counter() - start:.1f}s")
    for name, s in seconds.most_common():
        print(f"  {s:6.2f}s  {count[name]:4d} first calls  {name}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["grid", "indices"])
    p.add_argument("--iterations", type=int, default=40)
    args = p.parse_args()
    grid() if args.what == "grid" else indices(args.iterations)
