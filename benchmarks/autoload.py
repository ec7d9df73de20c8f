"""What torchtpu adds to `import torch` through PyTorch's device-backend autoload.

Runs `python -c "import torch"` in fresh processes, alternately with the autoload on and off
(TORCH_DEVICE_BACKEND_AUTOLOAD=1/0), and prints the median wall time, CPU time (user+system) and maximum RSS of each and
their differences. Run from the repository root (so that this checkout's torchtpu is imported):

    python benchmarks/autoload.py --runs 9
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

CODE = "import torch"


def _one(autoload, code):
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=str(int(autoload)))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{code!r} failed (autoload={autoload})")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # KiB -> MiB on Linux


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--code", default=CODE, help="the program to time (default: %(default)r)")
    args = ap.parse_args()
    _one(True, args.code)  # warm the file cache
    runs = {True: [], False: []}
    for _ in range(args.runs):
        for autoload in (True, False):
            runs[autoload].append(_one(autoload, args.code))
    med = {a: [statistics.median(col) for col in zip(*r)] for a, r in runs.items()}
    for a in (False, True):
        print(f"autoload={int(a)}  wall {med[a][0]:.3f} s  CPU {med[a][1]:.3f} s  "
              f"max RSS {med[a][2]:.1f} MiB (medians of {args.runs})")
    (w1, c1, m1), (w0, c0, m0) = med[True], med[False]
    print(f"autoload adds {w1 - w0:+.3f} s wall ({w1 / w0:.2f}x), {c1 - c0:+.3f} s CPU "
          f"({c1 / c0:.2f}x), {m1 - m0:+.1f} MiB")


if __name__ == "__main__":
    main()
