"""Resident memory of a benchmark's process, and runs of its workers in processes of their own
(benchmarks/attention.py, benchmarks/moe.py).

Peak figures read the kernel's own counters (/proc/self/status: VmRSS now, VmHWM the highest
since the process began or since `reset_peak`), not torch.tpu.max_memory_allocated: XLA's
temporaries inside an executable do not show there. Workers run with glibc's mmap threshold
fixed (MALLOC_MMAP_THRESHOLD_), so that freed buffers leave the resident set."""
import json
import os
import subprocess
import sys


def status(field):
    """VmRSS, VmHWM...: MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak():
    """VmHWM becomes the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_worker(script, args):
    """The JSON object the worker (`script --worker ...`) printed last, or {"error": ...}."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TORCHTPU_CACHE_DIR="")
    done = subprocess.run([sys.executable, script, "--worker", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return dict(error=(done.stderr.strip().splitlines() or ["?"])[-1][:100])
    return json.loads(done.stdout.strip().splitlines()[-1])
