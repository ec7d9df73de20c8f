"""Time to the first 3 training steps in a fresh process, with an empty and then a warm
persistent compilation cache, in strict, fused and compiled mode (the GPT step of
train_step.py), and where the time goes (trace, lowering, XLA, cache loads).

    python benchmarks/compile_cache.py [--modes strict,fused,compiled] [--layers 4 ...]

Each mode gets its own empty cache directory; cold and restart run one after the other, so
their ratio is what to read on a shared machine.
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
from torchtpu._execution import executables
sys.path.insert(0, sys.argv[1])
from train_step import torch_step
mode = sys.argv[2]
a = dict(arg.split("=") for arg in sys.argv[3:])
torch.tpu.eager_mode = "fused" if mode == "fused" else "strict"
torch.manual_seed(0)
model = GPT(int(a["vocab"]), int(a["d_model"]), int(a["heads"]), int(a["layers"]), int(a["seq"])).to("tpu")
idx = torch.randint(0, int(a["vocab"]), (int(a["batch"]), int(a["seq"])), device="tpu")
step = torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), idx, idx)
if mode == "compiled":
    step = torch.compile(step, backend="tpu")
t1 = time.perf_counter()
losses = [step().item() for _ in range(3)]
t2 = time.perf_counter()
executables.wait_for_writes()
m = torchtpu.metrics()
print("RESULT", f"{t2 - t1:.3f}", f"{t2 - t0:.3f}", *(m.get(k, 0) for k in (
    "executables_compiled", "executables_loaded", "trace_seconds", "lower_seconds",
    "xla_compile_seconds", "cache_load_seconds")), *losses)
"""


def run(mode, child_args, env):
    out = subprocess.run([sys.executable, "-c", CHILD, HERE, mode, *child_args], env=env,
                         capture_output=True, text=True, check=True).stdout
    fields = out.split("RESULT")[1].split()
    return [float(f) for f in fields]


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 4), ("d-model", 256), ("heads", 4), ("seq", 128), ("batch", 8), ("vocab", 1024)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--modes", default="strict,fused,compiled")
    a = ap.parse_args()
    child_args = [f"{k.replace('-', '_')}={v}" for k, v in vars(a).items() if k != "modes"]
    print(f"GPT {a.layers} layers, d_model {a.d_model}: first 3 training steps in a fresh process")
    print(f"  {'mode':9s} {'cache':8s} {'3 steps':>8s} {'process':>8s} {'built':>6s} {'loaded':>6s} "
          f"{'trace':>6s} {'lower':>6s} {'XLA':>6s} {'load':>6s}")
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHTPU_CACHE_DIR": cache}
            rows = [("cold", run(mode, child_args, env)), ("restart", run(mode, child_args, env))]
        for label, r in rows:
            print(f"  {mode:9s} {label:8s} {r[0]:7.2f}s {r[1]:7.2f}s {int(r[2]):6d} {int(r[3]):6d} "
                  f"{r[4]:6.2f} {r[5]:6.2f} {r[6]:6.2f} {r[7]:6.2f}")
        same = rows[0][1][8:] == rows[1][1][8:]
        print(f"  {mode:9s} restart {rows[0][1][0] / rows[1][1][0]:.2f}x faster than cold "
              f"(target >= 3x); losses {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
