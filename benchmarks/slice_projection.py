"""The FSDP training step of a Llama compiled for a TPU slice: TorchTPU's (PyTorch's FSDP2 on
tpu, recorded as the one program each chip runs) beside the same step written directly in JAX,
both compiled by libtpu for the slice on this machine (no TPU needed).

    python benchmarks/slice_projection.py --model llama-8b --target v5e:16x16 --batch 1 \
        [--seq 2048] [--fit] [--full] [--json FILE] [--dump DIR]

Both steps: fp32 parameters sharded over every chip, bf16 copies all-gathered per unit (again
in the backward: activations kept, gathered weights not; where that does not fit, each block's
activations recomputed too), gradients reduced in float32 and reduce-scattered, AdamW on the
shards, causal attention by JAX's Pallas flash kernel.  Ours has torchtitan's units (the last
block and the output not regathered in the backward); JAX's regathers every block.  Layers are
sampled as `python -m torchtpu.scaling` does (steps of 1 and 3 layers compiled, the rest
extrapolated), or all compiled (--full).  Printed per chip: HBM (and the largest batch that
fits, with --fit), the compiler's roofline, bytes accessed, collective bytes and how many the
schedule overlaps, the exposed collective time, step time and utilisation, compile seconds;
ours / JAX's.
"""
import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def jax_fsdp_report(config, target, layers, seq, batch, checkpoint=False):
    """tpu_compiler.Report of the JAX FSDP step of the `layers`-layer model for `target`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax import lax
    from jax.ad_checkpoint import checkpoint_name
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_models
    from torchtpu._core import tpu_compiler
    from torchtpu.examples.models import Llama
    with torch.device("meta"):
        model = Llama(vocab=config["vocab"], d=config["d"], layers=layers, heads=config["heads"],
                      hidden=config["hidden"], kv_heads=config["kv_heads"])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    heads, kv_heads = config["heads"], config["kv_heads"]
    chips = tpu_compiler.topology(target)
    n = len(chips)
    mesh = Mesh(np.array(chips), ("fsdp",))
    shard = {k: -(-int(np.prod(s)) // n) for k, s in shapes.items()}  # per chip, padded

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def gathered(s, name):
        whole = lax.all_gather(s.astype(jnp.bfloat16), "fsdp", tiled=True)
        return whole[:int(np.prod(shapes[name]))].reshape(shapes[name])

    def gathered_fwd(s, name):
        return gathered(s, name), None

    def gathered_bwd(name, _, g):  # FSDP2's reduce_dtype: float32, averaged over the ranks
        flat = jnp.pad(g.reshape(-1).astype(jnp.float32), (0, shard[name] * n - g.size))
        return (lax.psum_scatter(flat, "fsdp", tiled=True) / n,)

    gathered.defvjp(gathered_fwd, gathered_bwd)

    def attention(q, k, v):  # (keys and values already repeated to the queries' heads)
        return fa.flash_attention(q, k, v, causal=True, sm_scale=1 / np.sqrt(q.shape[-1]))

    def block(shards, i, x):
        q = f"blocks.{i}."

        def run(own, x):
            p = {k: checkpoint_name(gathered(own[k], k), "gathered") for k in own}
            return jax_models.llama_block(p, q, x, heads, kv_heads, attention)

        # FSDP's reshard after forward: the block's weights gathered again in its backward,
        # its activations kept (with `checkpoint`, recomputed too, as torch's
        # checkpoint_wrapper does).
        policy = jax.checkpoint_policies.nothing_saveable if checkpoint else \
            jax.checkpoint_policies.save_anything_except_these_names("gathered")
        return jax.checkpoint(run, policy=policy)({k: v for k, v in shards.items() if k.startswith(q)}, x)

    def loss_fn(shards, idx, tgt):
        x = gathered(shards["embed.weight"], "embed.weight")[idx]
        for i in range(layers):
            x = block(shards, i, x)
        x = jax_models._rms_norm(x, gathered(shards["norm.weight"], "norm.weight"))
        logits = jax_models._linear(x, gathered(shards["head.weight"], "head.weight"))
        return jax_models._cross_entropy(logits.astype(jnp.float32), tgt)

    def body(shards, m, v, t, tokens):
        loss, g = jax.value_and_grad(loss_fn)(shards, tokens[:, :-1], tokens[:, 1:])
        shards, m, v = jax_models.adamw(shards, m, v, g, t, lr=1e-4)
        return shards, m, v, loss

    spec = P("fsdp")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P(), spec),
                                 out_specs=(spec, spec, spec, P()), check_vma=False),
                   donate_argnums=(0, 1, 2))
    sharded = NamedSharding(mesh, spec)
    state = {k: jax.ShapeDtypeStruct((shard[k] * n,), jnp.float32, sharding=sharded) for k in shapes}
    tokens = jax.ShapeDtypeStruct((batch * n, seq + 1), jnp.int32, sharding=sharded)
    t = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    with jax.enable_x64(False):  # (torchtpu turns 64-bit types on; JAX's default is off)
        return tpu_compiler.compile_for(step, (state, state, state, t, tokens), target,
                                        "the JAX FSDP step")


def _dumping(report, folder, who):
    def dumped(config, target, layers, seq, batch, checkpoint=False):
        r = report(config, target, layers, seq, batch, checkpoint)
        os.makedirs(folder, exist_ok=True)
        name = f"{who}.{target.replace(':', '_')}.{layers}l.b{batch}{'.ckpt' if checkpoint else ''}.hlo.txt"
        with open(os.path.join(folder, name), "w") as f:
            f.write(r.text)
        return r
    return dumped


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--target", default="v5e:16x16")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per chip")
    ap.add_argument("--fit", action="store_true", help="also the largest batch that fits "
                    "(two more compiles each)")
    ap.add_argument("--full", action="store_true", help="compile every layer, not 1 and 3")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--dump", help="write each compiled program's TPU-scheduled HLO here")
    a = ap.parse_args()
    import torchtpu  # noqa: F401
    from torchtpu import scaling
    config = scaling.MODELS[a.model]
    target = scaling.topology_of(a.target)
    print(f"# {a.model} FSDP step, {a.batch} x {a.seq} tokens per chip, compiled for {target} "
          f"({time.strftime('%Y-%m-%d')}; "
          f"{'every layer compiled' if a.full else f'layers {scaling.SAMPLED} compiled, extrapolated'})",
          flush=True)
    rows = {}
    for who, report in (("torchtpu", scaling.fsdp_step_report), ("jax", jax_fsdp_report)):
        if a.dump:
            report = _dumping(report, a.dump, who)
        row = scaling.compiled_summary(config, target, a.seq, a.batch, fit=a.fit, report=report,
                                       full=a.full)
        rows[who] = row
        print(f"{who:9s} {scaling.summary_line(row)}", flush=True)
    ours, theirs = rows["torchtpu"], rows["jax"]
    print("torchtpu / jax: " + ", ".join(
        f"{k} {ours[k] / theirs[k]:.2f}x" for k in
        ("hbm", "roofline", "bytes", "sent", "exposed", "step", "compile_seconds") if theirs[k]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), target=target, **rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
