"""A Llama's training step on one TPU chip, in bfloat16: ours (the step recorded as one program,
as a torch.tpu graph or `torch.compile(mode="reduce-overhead")` runs it) beside the same step
written directly in JAX, both compiled by libtpu for the chip on this machine (no TPU needed,
nothing run: the model is built on `meta`).

    python benchmarks/single_chip_step.py [--model llama-1b] [--layers 16] [--seq 2048]
        [--batch 1] [--target v5e:1x1,v6e:1x1] [--dump DIR]

The step: bfloat16 parameters, AdamW (lr 1e-4) with bfloat16 moments, causal attention by
JAX's Pallas flash kernel (ours chooses it on a TPU for these lengths; JAX's step calls it),
cross-entropy of the logits.  `llama-1b` is the Llama 3.2 1B shape with its output projection
untied: 1.5B parameters (issue 45's "1.5B Llama").  Printed per target: bytes accessed,
roofline, HBM per chip (and whether it fits), temporaries, compile seconds; ours / JAX's.
Pallas kernels are not costed by libtpu: both rooflines leave attention out alike.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHTPU_CACHE_DIR", "")  # cold: the programs are built here


def ours(config, layers, seq, batch, target):
    import torch
    from torchtpu import scaling
    from torchtpu._execution.segment import pack_scalars
    from torchtpu.examples.models import Llama
    with torch.device("meta"):
        model = Llama(vocab=config["vocab"], d=config["d"], layers=layers, heads=config["heads"],
                      hidden=config["hidden"], kv_heads=config["kv_heads"]).to(torch.bfloat16)
    model = model.to_empty(device="tpu")
    segment, recorded = scaling._recorded_step(model, seq, batch)
    try:
        arrays = list(recorded.inputs)
        return segment.compile_for(target, arrays, pack_scalars(recorded.scalars, recorded.scalar_types),
                                   recorded.overwritten())
    finally:
        recorded.release()


def jax_step(config, layers, seq, batch, target):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    import jax_models
    from torchtpu._core import tpu_compiler
    from torchtpu.examples.models import Llama
    with torch.device("meta"):
        model = Llama(vocab=config["vocab"], d=config["d"], layers=layers, heads=config["heads"],
                      hidden=config["hidden"], kv_heads=config["kv_heads"])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def attention(q, k, v):  # (keys and values already repeated to the queries' heads)
        return fa.flash_attention(q, k, v, causal=True, sm_scale=1 / np.sqrt(q.shape[-1]))

    def loss_fn(p, idx, tgt):
        x = p["embed.weight"][idx]
        for i in range(layers):
            x = jax_models.llama_block(p, f"blocks.{i}.", x, config["heads"], config["kv_heads"],
                                       attention)
        x = jax_models._rms_norm(x, p["norm.weight"])
        return jax_models._cross_entropy(jax_models._linear(x, p["head.weight"]), tgt)

    def step(p, m, v, t, tokens):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens[:, :-1], tokens[:, 1:])
        return (*jax_models.adamw(p, m, v, g, t, lr=1e-4), loss)

    state = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in shapes.items()}
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    with jax.enable_x64(False):  # (torchtpu turns 64-bit types on; JAX's default is off)
        return tpu_compiler.compile_for(jax.jit(step, donate_argnums=(0, 1, 2)),
                                        (state, state, state, 1, tokens), target, "JAX step")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--layers", type=int, help="default: the model's")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--target", default="v5e:1x1,v6e:1x1", help="comma list of one-chip targets")
    ap.add_argument("--dump", help="write each program's TPU-scheduled HLO under this folder")
    a = ap.parse_args()
    import jax
    import torch

    import torchtpu  # noqa: F401
    from torchtpu import scaling
    config = scaling.MODELS[a.model]
    layers = a.layers or config["layers"]
    print(f"jax {jax.__version__}, torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; "
          f"{a.model} with {layers} layers, bf16, {a.batch} x {a.seq} tokens, AdamW")
    header = ("", "GB accessed", "roofline ms", "HBM GiB", "fits", "temp GiB", "compile s")
    print("  " + " | ".join(f"{h:>14s}" for h in header))
    for target in a.target.split(","):
        reports = {"ours": ours(config, layers, a.seq, a.batch, target),
                   "JAX": jax_step(config, layers, a.seq, a.batch, target)}
        j = reports["JAX"]
        for who, r in reports.items():
            if r.error:
                print(f"  {target} {who}: {r.error.splitlines()[0][:200]}")
            ratio = (lambda x, y: f" {x / y:.2f}x" if y and who != "JAX" else "")
            cells = (f"{target} {who}",
                     f"{r.bytes_accessed / 1e9:.1f}" + ratio(r.bytes_accessed, j.bytes_accessed),
                     f"{r.optimal_seconds * 1e3:.1f}" + ratio(r.optimal_seconds, j.optimal_seconds),
                     f"{r.hbm_bytes / 2**30:.2f}" + ratio(r.hbm_bytes, j.hbm_bytes),
                     str(r.fits), f"{r.temp_bytes / 2**30:.2f}",
                     f"{r.compile_seconds:.0f}" + ratio(r.compile_seconds, j.compile_seconds))
            print("  " + " | ".join(f"{c:>14s}" for c in cells), flush=True)
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                with open(os.path.join(a.dump, f"{a.model}.{layers}l.{target}.{who}.hlo.txt"), "w") as f:
                    f.write(r.text)


if __name__ == "__main__":
    main()
