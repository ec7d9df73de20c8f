"""One FSDP unit's all-gather and reduce-scatter compiled for a TPU slice, as FSDP2 does them
(one buffer for the unit: the shards copied in, gathered, and copied out column by column from
its (ranks, total) view; the gradients concatenated by `_chunk_cat` and reduce-scattered) and
one collective per parameter (what torchtpu makes FSDP2 do on a TPU mesh:
torchtpu/_distributed/fsdp.py, and what JAX's FSDP does).  Written in JAX, compiled by libtpu
here (no TPU needed).

    python benchmarks/tpu_fsdp_gather.py [--target v5e:2x2] [--model llama-1b]

The unit is one block of the model (bf16 gathers, float32 gradients).  Printed per variant:
per-chip HBM (temporaries), bytes accessed, roofline, relayout loops (`while`s in the
scheduled program), collectives (overlapped), compile seconds; unit / per parameter.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def block_shapes(config):
    d, hidden, heads, kv = config["d"], config["hidden"], config["heads"], config["kv_heads"]
    kv_d = d // heads * kv
    return [(d,), (d, d), (kv_d, d), (kv_d, d), (d, d), (d,), (hidden, d), (hidden, d), (d, hidden)]


def variants(shapes, n):
    import jax.numpy as jnp
    from jax import lax
    ks = [-(-int(np.prod(s)) // n) for s in shapes]  # each parameter's padded shard
    offs = np.cumsum([0] + ks)
    total = int(offs[-1])

    def use(params, x):  # each gathered parameter feeds a matmul (or a sum), as a block's do
        out = 0.
        for p in params:
            out = out + (jnp.sum(p.astype(jnp.float32)) if p.ndim == 1 else
                         jnp.sum(jnp.dot(x[:, :p.shape[1]], p.T, preferred_element_type=jnp.float32)))
        return out

    def unshard(flat, i):
        return flat[:int(np.prod(shapes[i]))].reshape(shapes[i])

    def gather_unit(shard, x):  # FSDP2: the unit's buffer, its (ranks, total) view's columns
        pad = -total % 1024  # (whole tiles: collective_ops._all_gather)
        rows = lax.all_gather(jnp.pad(shard, (0, pad)), "fsdp")[:, :total]
        return use([unshard(rows[:, offs[i]:offs[i + 1]].reshape(-1), i)
                    for i in range(len(shapes))], x)

    def gather_each(shard, x):
        return use([unshard(lax.all_gather(shard[offs[i]:offs[i + 1]], "fsdp", tiled=True), i)
                    for i in range(len(shapes))], x)

    def grads(x):  # each chip's bf16 gradients of the unit's parameters
        r = lax.axis_index("fsdp").astype(jnp.bfloat16)
        return [jnp.broadcast_to(x[0, 0] * r, (ks[i] * n // (int(np.prod(s[1:])) or 1),) + s[1:])
                for i, s in enumerate(shapes)]

    def reduce_unit(shard, x):  # FSDP2: _chunk_cat into (ranks, total), reduce-scattered flat
        rows = jnp.concatenate([g.astype(jnp.float32).reshape(n, -1) for g in grads(x)], 1)
        return lax.psum_scatter(rows.reshape(-1), "fsdp", tiled=True)

    def reduce_each(shard, x):
        return jnp.concatenate([lax.psum_scatter(g.astype(jnp.float32).reshape(-1), "fsdp",
                                                 tiled=True) for g in grads(x)])

    return total, {"all-gather, unit buffer": gather_unit, "all-gather, per parameter": gather_each,
                   "reduce-scatter, unit buffer": reduce_unit,
                   "reduce-scatter, per parameter": reduce_each}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="v5e:2x2")
    ap.add_argument("--model", default="llama-1b")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from torchtpu import scaling
    from torchtpu._core import tpu_compiler
    chips = tpu_compiler.topology(a.target)
    n = len(chips)
    mesh = Mesh(np.array(chips), ("fsdp",))
    shapes = block_shapes(scaling.MODELS[a.model])
    total, fns = variants(shapes, n)
    d = shapes[1][0]
    args = (jax.ShapeDtypeStruct((total * n,), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp"))),
            jax.ShapeDtypeStruct((2048, max(max(s) for s in shapes)), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P())))
    print(f"# one {a.model} block (d {d}, {total * n / 1e6:.1f}M parameters) on {a.target}")
    reports = {}
    for name, fn in fns.items():
        out = P("fsdp") if name.startswith("reduce") else P()
        step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("fsdp"), P()), out_specs=out,
                                     check_vma=False))
        with jax.enable_x64(False):
            r = tpu_compiler.compile_for(step, args, a.target, name)
        reports[name] = r
        kinds = ", ".join(f"{k} {c} ({o} overlapped)" for k, (c, o) in r.collectives.items())
        print(f"{name:30s} HBM {r.hbm_bytes / 2**20:8.1f} MiB (temporaries {r.temp_bytes / 2**20:7.1f}), "
              f"{r.bytes_accessed / 1e6:8.1f} MB, roofline {r.optimal_seconds * 1e3:6.3f} ms, "
              f"{r.text.count(' while('):2d} relayout loops, {kinds}; compiled in {r.compile_seconds:5.1f} s",
              flush=True)
    for kind in ("all-gather", "reduce-scatter"):
        u, e = reports[f"{kind}, unit buffer"], reports[f"{kind}, per parameter"]
        print(f"{kind}: unit / per parameter: bytes {u.bytes_accessed / e.bytes_accessed:.2f}x, "
              f"HBM {u.hbm_bytes / e.hbm_bytes:.2f}x, compile {u.compile_seconds / e.compile_seconds:.1f}x")


if __name__ == "__main__":
    main()
