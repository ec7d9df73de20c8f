"""Strict eager writes into views of a large storage: DDP's gradient bucket (each gradient
scaled into its view of a flat bucket, `torch.mul(grad, 1 / world, out=bucket_view)`, then
read back) and a KV cache's rows.  µs per op on tpu, beside native torch on the CPU and the
same write as a cached jax.jit call, with and without donating the storage (without, XLA
copies the whole storage at every write).  With --target (e.g. v5e:1x1, libtpu installed),
the op's two strict executables, donating and not, compiled for that TPU: bytes accessed and
roofline.

    python benchmarks/view_writes.py [--storage-mb 1.88] [--ops 400] [--target v5e:1x1]
"""
import argparse

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401
from distributed import seconds_per_call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--storage-mb", type=float, default=1.88)
    p.add_argument("--ops", type=int, default=400)
    p.add_argument("--target", help="a TPU topology to compile the op's executables for")
    args = p.parse_args()
    numel = int(args.storage_mb * 2**20 / 4)
    shape = (128, 384)
    size = shape[0] * shape[1]
    scale = torch.tensor(0.5, dtype=torch.float64)  # DDP's wrapped 1 / world size
    rows = {}
    for device in ("tpu", "cpu"):
        bucket = torch.zeros(numel, device=device)
        grad = torch.randn(shape, device=device)
        view = bucket[1000:1000 + size].view(shape)
        sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
        rows[f"mul.out into a view, {device}"] = seconds_per_call(
            lambda: torch.mul(grad, scale, out=view), args.ops, sync) * 1e6
        rows[f"copy_ of a view into a tensor, {device}"] = seconds_per_call(
            lambda: grad.copy_(view), args.ops, sync) * 1e6
    for donate in (True, False):
        write = jax.jit(lambda b, g: jax.lax.dynamic_update_slice(b, (g * 0.5).reshape(-1), (1000,)),
                        donate_argnums=(0,) if donate else ())
        state = [jnp.zeros(numel, jnp.float32)]
        g = jnp.ones(shape, jnp.float32)

        def run():
            state[0] = write(state[0], g)
        rows[f"the write in jax.jit, {'donating' if donate else 'not donating'}"] = seconds_per_call(
            run, args.ops, lambda: state[0].block_until_ready()) * 1e6
    print(f"storage {args.storage_mb} MB, a view of {size * 4 / 1e3:.0f} KB")
    for name, us in rows.items():
        print(f"  {name:45s} {us:8.1f} us/op")
    if args.target:
        _compiled_for(args.target)


def _compiled_for(target):
    """The strict executables of the last tpu mul.out into a view (its own and the one that
    reuses the storage's buffer), compiled for `target` on the arguments they last ran on."""
    from torchtpu._execution import kernels
    (program,) = [c for c in kernels.kernel_for(torch.ops.aten.mul.out).cache.values()
                  if c.donor is not None]
    for name, fn in (("not donating", program.fn), ("donating", program.donor)):
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
                for a in jax.tree_util.tree_leaves(fn.last.in_avals)]
        report = fn.compile_for(target, *args)
        print(f"  {target}, {name:13s} {report.bytes_accessed / 1e6:8.3f} MB accessed, "
              f"roofline {report.optimal_seconds * 1e6:.2f} us")


if __name__ == "__main__":
    main()
