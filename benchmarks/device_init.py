"""Initialising a model on the device: every parameter gets a random fill there (nn.Linear's
kaiming_uniform_, nn.Embedding's normal_), as under `with torch.device("tpu"):` or
`nn.Linear(..., device="tpu")`.  Cold caches, each mode in a fresh process: seconds to the
initialised parameters against torch CPU eager and against the same fills in JAX
(`jax.random.uniform` per parameter), with the programs compiled.

    python benchmarks/device_init.py [--layers 40]

The model is a stack of Linear layers of distinct widths (so no two parameters share a shape),
the case a real model's many shapes make: fused eager used to compile every fill of a
segment as a threefry program of its own (~0.5 s of XLA:CPU each).
"""
import argparse
import json
import os
import subprocess
import sys
import time


def _child(device, layers):
    os.environ["TORCHTPU_CACHE_DIR"] = ""  # cold: nothing from an earlier run
    widths = [64 + 8 * i for i in range(layers + 1)]
    if device == "jax":
        import jax
        import numpy as np
        start = time.perf_counter()
        key = jax.random.PRNGKey(0)
        params = []
        for i in range(layers):
            key, kw, kb = jax.random.split(key, 3)
            bound = 1 / np.sqrt(widths[i])
            params.append(jax.random.uniform(kw, (widths[i + 1], widths[i]), minval=-bound, maxval=bound))
            params.append(jax.random.uniform(kb, (widths[i + 1],), minval=-bound, maxval=bound))
        jax.block_until_ready(params)
        return {"seconds": time.perf_counter() - start}
    import torch
    import torchtpu
    mode = None
    if device.startswith("tpu:"):
        device, mode = device.split(":")
        torch.tpu.eager_mode = mode
    if device == "tpu":
        torch.zeros(1, device="tpu").cpu()  # the runtime started, as in a script that uses it
    start = time.perf_counter()
    model = torch.nn.Sequential(*[torch.nn.Linear(widths[i], widths[i + 1], device=device)
                                  for i in range(layers)])
    if device == "tpu":
        torch.tpu.synchronize()  # every fill has run
    result = {"seconds": time.perf_counter() - start}
    if device == "tpu":
        result["built"] = torchtpu.metrics().get("executables_compiled", 0)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.layers)))
        return
    results = {}
    for what in ("cpu", "jax", "tpu:strict", "tpu:fused"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", what,
                              "--layers", str(a.layers)], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
        results[what] = json.loads(out.stdout.strip().splitlines()[-1])
    cpu, jax_s = results["cpu"]["seconds"], results["jax"]["seconds"]
    print(f"{a.layers} Linear layers of distinct widths initialised on the device, cold caches")
    print(f"  torch CPU eager  : {cpu:7.3f} s")
    print(f"  JAX, per-param   : {jax_s:7.3f} s")
    for mode in ("strict", "fused"):
        r = results[f"tpu:{mode}"]
        print(f"  tpu {mode:6s}       : {r['seconds']:7.3f} s = {r['seconds'] / jax_s:5.2f}x JAX, "
              f"{r['seconds'] / cpu:6.1f}x torch CPU; {r['built']} programs compiled")


if __name__ == "__main__":
    main()
