"""First compiled training step in a fresh process, with an empty and then a warm persistent
compilation cache (the same GPT step as train_step.py).

    python benchmarks/compile_cache.py [--layers 4 --d-model 256 ...]
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch, torchtpu
from torchtpu.examples.models import GPT
sys.path.insert(0, sys.argv[1])
from train_step import torch_step
a = dict(arg.split("=") for arg in sys.argv[2:])
torch.manual_seed(0)
model = GPT(int(a["vocab"]), int(a["d_model"]), int(a["heads"]), int(a["layers"]), int(a["seq"])).to("tpu")
idx = torch.randint(0, int(a["vocab"]), (int(a["batch"]), int(a["seq"])), device="tpu")
step = torch.compile(torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), idx, idx),
                     backend="tpu")
t1 = time.perf_counter()
step().item()
t2 = time.perf_counter()
m = torchtpu.metrics()
print(f"RESULT {t2 - t1:.2f} {t2 - t0:.2f} {m.get('persistent_cache_hits', 0)} {m.get('compile_seconds', 0):.2f}")
"""


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 4), ("d-model", 256), ("heads", 4), ("seq", 128), ("batch", 8), ("vocab", 1024)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    child_args = [f"{k.replace('-', '_')}={v}" for k, v in vars(a).items()]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHTPU_CACHE_DIR": cache}
        rows = []
        for label in ("empty cache", "warm cache"):
            out = subprocess.run([sys.executable, "-c", CHILD, HERE, *child_args], env=env, capture_output=True,
                                 text=True, check=True).stdout
            first, total, hits, compile_s = out.split("RESULT")[1].split()
            rows.append((label, float(first), float(total), int(hits), float(compile_s)))
    print(f"GPT {a.layers} layers, d_model {a.d_model}: first torch.compile(backend='tpu') training step")
    for label, first, total, hits, compile_s in rows:
        print(f"  {label:11s}: first step {first:6.2f} s (process start to end {total:6.2f} s); "
              f"persistent cache hits {hits}; first runs of executables {compile_s:.2f} s")
    print(f"  speed-up of the first step from the cache: {rows[0][1] / rows[1][1]:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
