"""ms/step of a GPT-style training step (forward, backward, AdamW) on tpu in each eager mode
vs native torch CPU eager vs the same step written directly in JAX under one jax.jit.

    python benchmarks/train_step.py [--mode strict,fused,compile,graph] [--layers 4 --d-model 256
                                     --heads 4 --seq 128 --batch 8 --vocab 1024]
                                    [--models small,gpt,llama]  (default: gpt)
                                    [--small]  (the same as adding "small" to --models)

Models: "gpt" is the GPT the size options describe; "small" the small GPT (2 layers, d 128,
T 64); "llama" a Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query SDPA with half as many
kv heads as heads, SwiGLU hidden 704 at d 256) of the size options' width, depth and length.
                                    [--fused-adamw]  (AdamW(fused=True) everywhere)

Each mode starts from empty executable caches, so its first step shows its own warm-up (the
persistent compilation cache is off here unless TORCHTPU_CACHE_DIR is set).
"compile" is torch.compile(step, backend="tpu") of the whole step (forward, backward, AdamW);
with it, torch.compile (inductor) of the same step on the CPU is measured too.
"graph" captures the step once into a torch.tpu graph (AdamW with capturable=True, after two
eager warm-up steps) and times `g.replay()`.
"onestep" is torch.compile(step, backend="tpu", mode="reduce-overhead"): the whole compiled
step (AdamW as given, no capturable flag) replayed as one executable, captured in the first
call after an eager warm-up of it.
Strict and fused eager are timed again alternately (`--repeat` runs in all), and their
speed-up is given for the first run and as a range over all of them.
Per mode it prints the host's time per step (dispatch, before waiting for the device), and the
compilations and blocking waits of the host in one steady step (no .item() in it). For graph
replay and the one-executable compiled step it also prints the host time beyond that of the
one-jax.jit step (on the CPU, XLA may run part of a program inside the call that dispatches it,
so the host time of either includes some of the device's; the difference is TorchTPU's own).
"""
import argparse
import copy
import os
import time

# Warm-up figures are for cold compiles: no persistent compilation cache (compile_cache.py
# measures the cache) unless TORCHTPU_CACHE_DIR is set explicitly.
os.environ.setdefault("TORCHTPU_CACHE_DIR", "")

import jax
import jax.numpy as jnp
import torch

import jax_models
import torchtpu  # noqa: F401
from torchtpu.examples.models import GPT, Llama


def time_steps(step, n, sync, host=None):
    step()
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if host is not None:  # the host's time alone: dispatch, before waiting for the device
        host.append((time.perf_counter() - t0) / n * 1e3)
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def jax_step_fn(model):
    """The same model and AdamW step, written in JAX (benchmarks/jax_models.py, functional
    params): (jitted step(p, m, v, t, idx, tgt) -> (p, m, v, loss), params, m, v)."""
    params = jax_models.params_of(model)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.jit(jax_models.train_step(model)), params, zeros, zeros


def torch_step(m, opt, x, y):
    """One training step of `m` (forward, backward, optimizer); returns the loss. Also used by
    compile_cache.py."""
    def step():
        loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    return step


# The small GPT's options over the size options' defaults (the rest).
SMALL_GPT = {"layers": 2, "d_model": 128, "seq": 64, "kind": "gpt"}


def model_options(a, name):
    """The options `run` (and build_model) takes for model `name` (small, gpt, llama), given
    the parsed command line `a`; None for an unknown name."""
    if name == "small":
        return argparse.Namespace(**{**vars(a), **SMALL_GPT})
    if name in ("gpt", "llama"):
        return argparse.Namespace(**{**vars(a), "kind": name})
    return None


def default_options(name):
    """`model_options` for model `name` at this script's default command line."""
    return model_options(parser().parse_args([]), name)


def parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3,
                    help="time strict and fused eager alternately this often (their speed-up), and "
                         "graph replay or the one-executable step and the JAX step")
    ap.add_argument("--mode", default="strict,fused,compile",
                    help="comma list of strict, fused, debug, compile, graph, onestep")
    ap.add_argument("--no-inductor", action="store_true",
                    help="with compile: skip torch.compile (inductor) on the CPU, which takes minutes")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="AdamW(fused=True) (one _fused_adamw_ op) in every torch mode, the CPU's included")
    ap.add_argument("--models", default="gpt", help="comma list of small, gpt, llama; run in this order")
    ap.add_argument("--small", action="store_true",
                    help="run the small GPT (2 layers, d_model 128, seq 64) first, in the same process")
    return ap


def main():
    ap = parser()
    a = ap.parse_args()
    models = a.models.split(",")
    if a.small and "small" not in models:
        models.insert(0, "small")
    for name in models:
        options = model_options(a, name)
        if options is not None:
            run(options)
        else:
            ap.error(f"unknown model {name!r}: choose from small, gpt, llama")


def build_model(a):
    """The model the options describe (random weights, seeded)."""
    torch.manual_seed(0)
    if a.kind == "llama":
        # SwiGLU's hidden width as Llama sizes it (8/3 d rounded up to a multiple of 64): 704 at d 256.
        hidden = -(-8 * a.d_model // 3 // 64) * 64
        return Llama(vocab=a.vocab, d=a.d_model, layers=a.layers, heads=a.heads, hidden=hidden,
                     kv_heads=max(1, a.heads // 2))
    return GPT(a.vocab, a.d_model, a.heads, a.layers, a.seq)


def graph_step(model, x, y, adamw_options):
    """A torch.tpu graph of the training step: warm up eagerly, capture once, replay."""
    opt = torch.optim.AdamW(model.parameters(), **adamw_options, capturable=True)
    step = torch_step(model, opt, x, y)
    step()
    step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        step()
    return g.replay


def run(a):
    model = build_model(a)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq))
    tgt = torch.randint(0, a.vocab, (a.batch, a.seq))

    cpu_model = copy.deepcopy(model)
    adamw = dict(lr=1e-3, fused=True) if a.fused_adamw else dict(lr=1e-3)
    t_cpu = time_steps(torch_step(cpu_model, torch.optim.AdamW(cpu_model.parameters(), **adamw), idx, tgt),
                       a.steps, lambda: None)
    print(f"  [torch CPU eager: {t_cpu:.1f} ms/step]", flush=True)

    modes = {"strict": torch.tpu.EagerMode.DEFER_NEVER, "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
             "debug": torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
             "compile": torch.tpu.EagerMode.DEFER_NEVER, "graph": torch.tpu.EagerMode.DEFER_NEVER,
             "onestep": torch.tpu.EagerMode.DEFER_NEVER}
    counted = ("compiles", "segment_compiles", "graph_compiles", "graph_captures", "tpu_graph_compiles",
               "executables_compiled", "executables_loaded")
    results, replays, eager_steps = {}, {}, {}
    for name in a.mode.split(","):
        torchtpu.clear_caches()
        torch._dynamo.reset()
        with torch.tpu.set_eager_mode(modes[name]):
            tpu_model = copy.deepcopy(model).to("tpu")
            t0 = time.perf_counter()
            step = torch_step(tpu_model, torch.optim.AdamW(tpu_model.parameters(), **adamw),
                              idx.to("tpu"), tgt.to("tpu"))
            if name == "graph":
                step = graph_step(tpu_model, idx.to("tpu"), tgt.to("tpu"), adamw)
            if name == "compile":
                step = torch.compile(step, backend="tpu")
            if name == "onestep":
                step = torch.compile(step, backend="tpu", mode="reduce-overhead")
            step()
            torch.tpu.synchronize()
            warmup = time.perf_counter() - t0
            host = []
            ms = time_steps(step, a.steps, torch.tpu.synchronize, host)
            before = torchtpu.metrics()
            step()
            after = torchtpu.metrics()
            torch.tpu.synchronize()
            new_compiles = sum(after.get(k, 0) - before.get(k, 0) for k in counted)
            waits = after.get("blocking_waits", 0) - before.get("blocking_waits", 0)
            results[name] = (ms, warmup, new_compiles, waits, host[0])
            if name in ("graph", "onestep"):
                replays[name] = step
            if name in ("strict", "fused"):
                eager_steps[name] = (step, modes[name])
            print(f"  [{name}: {ms:.1f} ms/step, first step {warmup:.1f} s]", flush=True)

    t_inductor = None
    if "compile" in results and not a.no_inductor:
        torch._dynamo.reset()
        ind_model = copy.deepcopy(model)
        t0 = time.perf_counter()
        ind_step = torch.compile(torch_step(ind_model, torch.optim.AdamW(ind_model.parameters(), **adamw),
                                            idx, tgt))
        ind_step()
        inductor_warmup = time.perf_counter() - t0
        t_inductor = time_steps(ind_step, a.steps, lambda: None)

    step, p, m, v = jax_step_fn(model)
    ji, jt = jnp.asarray(idx.numpy()), jnp.asarray(tgt.numpy())
    state = {"p": p, "m": m, "v": v, "t": 0}

    def jstep():
        state["t"] += 1
        state["p"], state["m"], state["v"], loss = step(state["p"], state["m"], state["v"], state["t"], ji, jt)
        state["loss"] = loss

    t0 = time.perf_counter()
    jstep()
    state["loss"].block_until_ready()
    jax_warmup = time.perf_counter() - t0
    jax_host = []
    t_jax = time_steps(jstep, a.steps, lambda: state["loss"].block_until_ready(), jax_host)

    kind = "GPT" if a.kind == "gpt" else f"Llama ({max(1, a.heads // 2)} kv heads)"
    print(f"{kind} {a.layers} layers, d_model {a.d_model}, {a.heads} heads, seq {a.seq}, batch {a.batch}, "
          f"vocab {a.vocab}; AdamW{'(fused=True)' if a.fused_adamw else ''}")
    for name, (ms, _, new_compiles, waits, host) in results.items():
        label = {"compile": "compiled", "graph": "graph replay",
                 "onestep": "compiled 1-exe"}.get(name, f"{name} eager")
        print(f"  tpu {label:14s}: {ms:8.1f} ms/step  ({ms / t_cpu:.2f}x torch CPU, "
              f"{ms / t_jax:.2f}x JAX)  host {host:.2f} ms/step  [a steady step: "
              f"{new_compiles} compilations, {waits} blocking waits]")
    print(f"  torch CPU eager  : {t_cpu:9.1f} ms/step  (1.00x)")
    if t_inductor is not None:
        print(f"  torch CPU inductor: {t_inductor:8.1f} ms/step  ({t_inductor / t_cpu:.2f}x torch CPU)")
    print(f"  JAX, one jax.jit : {t_jax:9.1f} ms/step  ({t_jax / t_cpu:.2f}x torch CPU)  "
          f"host {jax_host[0]:.2f} ms/step")
    if "strict" in results and "fused" in results:
        # The first run of each, then --repeat - 1 more, alternating, so that load on a shared
        # machine hits both alike.
        speedups = [results["strict"][0] / results["fused"][0]]
        for _ in range(a.repeat - 1):
            ms = {}
            for name, (eager_step, mode) in eager_steps.items():
                with torch.tpu.set_eager_mode(mode):
                    ms[name] = time_steps(eager_step, a.steps, torch.tpu.synchronize)
            speedups.append(ms["strict"] / ms["fused"])
            print(f"  [strict {ms['strict']:.1f}, fused {ms['fused']:.1f} ms/step]", flush=True)
        print(f"  fused speed-up over strict: {speedups[0]:.2f}x; {min(speedups):.2f}-"
              f"{max(speedups):.2f}x over {len(speedups)} alternating runs (target >= 1.5x)")
    if "compile" in results:
        print(f"  tpu compiled / JAX one jit: {results['compile'][0] / t_jax:.2f}x (target <= 1.0x)")
    for name, replay in replays.items():
        # Alternate the two, so that load on a shared machine hits both alike.
        ratios, extra = [], []
        for _ in range(a.repeat):
            ours, theirs = [], []
            ratios.append(time_steps(replay, a.steps, torch.tpu.synchronize, ours)
                          / time_steps(jstep, a.steps, lambda: state["loss"].block_until_ready(), theirs))
            extra.append(ours[0] - theirs[0])
        label = {"graph": "graph replay", "onestep": "compiled 1-exe"}[name]
        print(f"  tpu {label} / JAX one jit: {min(ratios):.2f}-{max(ratios):.2f}x over "
              f"{a.repeat} alternating runs (target <= 1.1x); host time per step beyond JAX's "
              f"own dispatch of its step: {min(extra):.2f} to {max(extra):.2f} ms (target <= 1 ms)")
    for name, (_, warmup, *_) in results.items():
        print(f"  tpu {name} first step (warm-up incl. compiles): {warmup:.1f} s = "
              f"{warmup * 1e3 / t_cpu:.1f}x one torch CPU step")
    print(f"  JAX first step (trace + compile): {jax_warmup:.1f} s = {jax_warmup * 1e3 / t_cpu:.1f}x")
    if t_inductor is not None:
        print(f"  inductor first step: {inductor_warmup:.1f} s")
    if "compile" in results:
        print(f"  tpu compiled first step / JAX first step: {results['compile'][1] / jax_warmup:.2f}x "
              "(target <= 1.2x)")


if __name__ == "__main__":
    main()
