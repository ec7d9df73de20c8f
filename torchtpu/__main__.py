"""`python -m torchtpu info`: platform, devices, versions and memory."""
import argparse
import sys


def info():
    import jax
    import torch

    import torchtpu
    from torchtpu._device import runtime

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


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu")
    p.add_argument("command", choices=["info"])
    args = p.parse_args(argv)
    if args.command == "info":
        info()
    return 0


if __name__ == "__main__":
    sys.exit(main())
