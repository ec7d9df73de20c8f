"""`python -m torchtpu info` (platform, devices, versions, memory, eager mode),
`python -m torchtpu bench` (the benchmarks/ suite: per-op overhead and the training step) and
`python -m torchtpu cache {info,clear}` (the persistent compilation cache)."""
import argparse
import sys


def info():
    import jax
    import torch

    import torchtpu
    from torchtpu._core import runtime

    print(f"torchtpu  {torchtpu.__version__}")
    print(f"torch     {torch.__version__}")
    print(f"jax       {jax.__version__}")
    print(f"platform  {runtime.platform()}")
    print(f"devices   {runtime.device_count()}")
    for i, d in enumerate(runtime.devices()):
        props = torch.tpu.get_device_properties(i)
        total = f"{props.total_memory / 2**30:.1f} GiB" if props.total_memory else "n/a"
        print(f"  tpu:{i}  {d.device_kind}  (jax {d})  memory {total}, "
              f"allocated {torch.tpu.memory_allocated(i)} B")
    print(f"float32 matmul precision  {torch.get_float32_matmul_precision()}")
    print(f"eager mode  {torch.tpu.eager_mode.name}")
    from torchtpu._compile import cache
    print(f"compilation cache  {cache.directory() or 'off'}")


def bench(extra):
    """Run the benchmark scripts of a source checkout; each prints its ratio table."""
    import os
    import subprocess
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if not os.path.isdir(root):
        print("the benchmarks/ directory ships with the source checkout, not the wheel", file=sys.stderr)
        return 1
    status = 0
    for script in ("overhead.py", "train_step.py"):
        print(f"== {script}", flush=True)
        status |= subprocess.call([sys.executable, os.path.join(root, script), *extra])
    return status


def cache(action):
    """`python -m torchtpu cache info` shows the compilation cache, `cache clear` empties it."""
    from torchtpu._compile import cache as compilation_cache
    if action == "clear":
        print(f"removed {compilation_cache.clear()} entries from {compilation_cache.directory()}")
    else:
        print("\n".join(compilation_cache.info()))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu")
    p.add_argument("command", choices=["info", "bench", "cache"])
    args, extra = p.parse_known_args(argv)
    if args.command == "info":
        info()
        return 0
    if args.command == "cache":
        if extra not in (["info"], ["clear"]):
            p.error("usage: python -m torchtpu cache {info,clear}")
        return cache(extra[0])
    return bench(extra)


if __name__ == "__main__":
    sys.exit(main())
