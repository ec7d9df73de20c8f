"""A mixture-of-experts training step (torchtpu.examples.moe.MoEModel: top-2 routing over 8
experts, SwiGLU experts in bfloat16 through torch._grouped_mm, load-balancing loss, AdamW):
time per step and peak memory on tpu (compiled; strict eager; and the per-expert loop most
MoE code has, e.g. Hugging Face's Mixtral, in strict eager) against the same step written in
JAX (jax.lax.ragged_dot under one jax.jit) and torch CPU (eager, _grouped_mm), in one run.

    python benchmarks/moe.py [--tokens 2048 --dim 256 --hidden 512 --experts 8 --top-k 2]
                             [--steps 5] [--runs jax,tpu-compile,tpu-strict,tpu-loop,torch]

Every step draws new tokens, so the routing changes each step. Each run is a process of its
own (resident_memory.py says how memory is read); "peak" is its highest resident set above the one before the first step (the first step,
compiling included), as in benchmarks/attention.py. "waits" and "compiles" are torchtpu's
blocking host waits and executables built over the timed steps (after two warm-up steps).
Times are the range (min-max) of the timed steps.
"""
import argparse
import json
import time

from resident_memory import run_worker, status

VOCAB = 1024


def _batches(a, n):
    import torch
    g = torch.Generator().manual_seed(0)
    seq = 128
    return [(torch.randint(0, VOCAB, (a.tokens // seq, seq), generator=g),
             torch.randint(0, VOCAB, (a.tokens // seq, seq), generator=g)) for _ in range(n)]


def _torch_run(run, a):
    import torch
    device = "cpu" if run == "torch" else "tpu"
    if device == "tpu":
        import torchtpu  # noqa: F401
    from torchtpu.examples.moe import MoEModel, training_step
    torch.manual_seed(0)
    model = MoEModel(VOCAB, a.dim, a.hidden, a.experts, a.top_k,
                     experts="loop" if run == "tpu-loop" else "grouped_mm").to(device)
    step = training_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3,
                                                  capturable=device == "tpu"))
    fn = torch.compile(step, backend="tpu") if run == "tpu-compile" else step
    batches = [(i.to(device), t.to(device)) for i, t in _batches(a, a.steps + 2)]

    def call(i):
        loss = fn(*batches[i])
        if device == "tpu":
            torch.tpu.synchronize()
        return loss
    return call


def _jax_run(a):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from torchtpu.examples.moe import MoEModel
    torch.manual_seed(0)
    model = MoEModel(VOCAB, a.dim, a.hidden, a.experts, a.top_k)
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}
    E, k = a.experts, a.top_k

    def rms(x, w):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + jnp.finfo(x.dtype).eps) * w

    def gmm(x, w, sizes):  # bfloat16 operands, float32 products (as the tpu lowering on a CPU)
        return jax.lax.ragged_dot(x.astype(jnp.bfloat16).astype(jnp.float32),
                                  w.astype(jnp.bfloat16).astype(jnp.float32),
                                  sizes).astype(jnp.bfloat16)

    def loss_fn(p, idx, tgt):
        x = p["embed.weight"][idx].reshape(-1, a.dim)
        h = rms(x, p["norm.weight"])
        probs = jax.nn.softmax(h @ p["moe.router.weight"].T, axis=-1)
        scores, chosen = jax.lax.top_k(probs, k)
        scores = scores / scores.sum(-1, keepdims=True)
        flat = chosen.reshape(-1)
        counts = jnp.bincount(flat, length=E)
        order = jnp.argsort(flat, stable=True)
        tokens = order // k
        routed = h[tokens]
        sizes = counts.astype(jnp.int32)
        w1, w2, w3 = (jnp.swapaxes(p[f"moe.{n}"], 1, 2) for n in ("w1", "w2", "w3"))
        g = gmm(routed, w1, sizes)
        u = jax.nn.silu(g.astype(jnp.float32)).astype(jnp.bfloat16) * gmm(routed, w3, sizes)
        out = gmm(u, w2, sizes).astype(jnp.float32) * scores.reshape(-1)[order, None]
        y = jnp.zeros_like(h).at[tokens].add(out)
        logits = rms(x + y, p["norm_out.weight"]) @ p["head.weight"].T
        logp = jax.nn.log_softmax(logits, -1)
        ce = -jnp.take_along_axis(logp, tgt.reshape(-1, 1), 1).mean()
        balance = E * (counts / flat.size * probs.mean(0)).sum()
        return ce + 0.01 * balance

    @jax.jit
    def step(p, m, v, t, idx, tgt):
        loss, g = jax.value_and_grad(loss_fn)(p, idx, tgt)
        t = t + 1
        lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 1e-2
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        p = jax.tree.map(lambda p, m, v: p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) /
                         (jnp.sqrt(v / (1 - b2 ** t)) + eps), p, m, v)
        return p, m, v, t, loss

    state = [params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params),
             jnp.zeros((), jnp.float32)]
    batches = [(jnp.asarray(np.asarray(i)), jnp.asarray(np.asarray(t)))
               for i, t in _batches(a, a.steps + 2)]

    def call(i):
        out = step(*state, *batches[i])
        state[:] = out[:4]
        return jax.block_until_ready(out[4])
    return call


def worker(run, a):
    call = _jax_run(a) if run == "jax" else _torch_run(run, a)
    base = status("VmRSS")
    call(0)
    call(1)
    metrics = None
    if run.startswith("tpu"):
        import torchtpu
        metrics = torchtpu.metrics()
    times = []
    for i in range(2, a.steps + 2):
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
    result = dict(times=times, peak=status("VmHWM") - base)
    if metrics is not None:
        after = torchtpu.metrics()
        result["waits"] = after.get("blocking_waits", 0) - metrics.get("blocking_waits", 0) \
            - a.steps  # (the synchronize() after each step)
        result["compiles"] = sum(after.get(k, 0) - metrics.get(k, 0)
                                 for k in ("executables_compiled", "compiles"))
    print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", default="jax,tpu-compile,tpu-strict,tpu-loop,torch")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a)
    print(f"MoE step: {a.tokens} tokens, dim {a.dim}, hidden {a.hidden}, {a.experts} experts, "
          f"top-{a.top_k}, bfloat16 experts, AdamW; seconds per step (min-max of {a.steps})")
    print(f"{'run':12s} {'seconds':>15s} {'/ JAX':>7s} {'peak MiB':>9s} {'waits':>6s} "
          f"{'compiles':>8s}")
    rows = {}
    args = [f"--tokens={a.tokens}", f"--dim={a.dim}", f"--hidden={a.hidden}",
            f"--experts={a.experts}", f"--top-k={a.top_k}", f"--steps={a.steps}"]
    for run in a.runs.split(","):
        r = run_worker(__file__, [run, *args])
        if "error" in r:
            print(f"{run:12s} failed: {r['error']}")
            continue
        rows[run] = r
        jax_t = min(rows["jax"]["times"]) if "jax" in rows else None
        vs = f"{min(r['times']) / jax_t:.2f}x" if jax_t else "-"
        print(f"{run:12s} {min(r['times']):7.3f}-{max(r['times']):7.3f} {vs:>7s} "
              f"{r['peak']:9.0f} {r.get('waits', '-'):>6} {r.get('compiles', '-'):>8}",
              flush=True)
    if "tpu-compile" in rows and "tpu-loop" in rows:
        print(f"per-expert loop / compiled grouped_mm step: "
              f"{min(rows['tpu-loop']['times']) / min(rows['tpu-compile']['times']):.1f}x")


if __name__ == "__main__":
    main()
