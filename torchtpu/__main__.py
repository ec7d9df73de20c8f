"""`python -m torchtpu info` (platform, devices, versions, memory, eager mode, and on a TPU
host its accelerator, hosts, slices and the variables one process per chip sets),
`python -m torchtpu bench` (the benchmarks/ suite: per-op overhead and the training step) and
`python -m torchtpu cache {info,clear}` (the persistent compilation cache)."""
import argparse
import sys


def tpu_hosts_info(environ=None, chips=None, metadata=None):
    """Lines saying what this host is (accelerator, chips, hosts, slices) and the variables a
    process here would set for libtpu: this process's, and under torchrun with one process per
    chip, its first one's."""
    import os
    from torchtpu._core import tpu_hosts
    environ = dict(os.environ if environ is None else environ)
    chips = tpu_hosts.scan_chips() if chips is None else chips
    metadata = metadata or tpu_hosts.read_metadata
    if not chips:
        return ["TPU hosts  no TPU host detected (no TPU chip on this host's PCI bus)"]
    lines = []
    try:
        launch = tpu_hosts.derive(environ, chips, metadata)
        if not launch.per_chip and not environ.get("LOCAL_WORLD_SIZE"):
            # not under torchrun: what each of `torchrun --nproc-per-node=<chips>`'s would do
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                environ.pop(name, None)
            per_chip = tpu_hosts.derive(dict(environ, LOCAL_RANK="0",
                                             LOCAL_WORLD_SIZE=str(len(chips))), chips, metadata)
        else:
            per_chip = launch
    except ValueError as e:
        return [f"TPU hosts  {len(chips)} {chips[0]} chips on this host; this launch cannot "
                f"form a slice: {e}"]
    lines += [f"accelerator  {launch.accelerator} ({launch.chip_kind} chips)",
              f"chips on this host  {launch.chips} (bounds {','.join(map(str, launch.chip_bounds))})",
              f"hosts  {len(launch.hosts)} (bounds {','.join(map(str, launch.host_bounds))}): "
              f"{', '.join(launch.hosts)}; this is worker {launch.worker_id}",
              f"slices  {launch.slices}; this is slice {launch.slice_id}",
              f"processes on this host  {launch.local_world_size}"
              + (" (one per chip)" if launch.per_chip else " (one for the host's chips)")]
    if launch is not per_chip:
        lines.append(f"under torchrun --nproc-per-node={launch.chips}, local rank 0 would be "
                     f"JAX process {per_chip.process_id} of {per_chip.process_count} and set:")
    else:
        lines.append(f"JAX process {launch.process_id} of {launch.process_count}; sets:"
                     if launch.per_chip else "sets nothing: libtpu's defaults give the process "
                     "every chip of its host")
    lines += [f"  {k}={v}" for k, v in per_chip.env.items()]
    lines += [f"  {k}={v} (yours, kept)" for k, v in per_chip.kept.items()]
    return lines


def info():
    # before anything starts the runtime: the TPU host's variables are derived from the
    # environment as the launch left it
    hosts = tpu_hosts_info()
    import jax
    import torch

    import torchtpu
    from torchtpu._core import runtime

    print(f"torchtpu  {torchtpu.__version__}")
    print(f"torch     {torch.__version__}")
    print(f"jax       {jax.__version__}")
    print("\n".join(hosts))  # (a launch libtpu cannot form a slice from stops the runtime's start)
    print(f"platform  {runtime.platform()}")
    print(f"devices   {runtime.device_count()}")
    for i, d in enumerate(runtime.devices()):
        props = torch.tpu.get_device_properties(i)
        total = f"{props.total_memory / 2**30:.1f} GiB" if props.total_memory else "n/a"
        print(f"  tpu:{i}  {d.device_kind}  (jax {d})  memory {total}, "
              f"allocated {torch.tpu.memory_allocated(i)} B")
    print(f"float32 matmul precision  {torch.get_float32_matmul_precision()}")
    print(f"eager mode  {torch.tpu.eager_mode.name}")
    from torchtpu._execution import persistent_cache as cache
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
    from torchtpu._execution import persistent_cache as compilation_cache
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
