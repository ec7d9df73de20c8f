"""Warm-up, in one run: how long until a training step is steady, cold and after a restart,
and how much decoding over new lengths costs.

    python benchmarks/warmup.py [--quick] [--modes strict,fused,compile,onestep] [--workers 0,1,2]
                                [--repeat 2] [--no-decode] [--decode-modes strict,fused]

(`--modes ""` skips the training steps: decoding only.)

Time to a steady step: the first 3 training steps (forward, backward, AdamW) of the GPT of
train_step.py, in a fresh process, for each mode against the same step written in JAX under
one `jax.jit`.  "cold": a new, empty TORCHTPU_CACHE_DIR; "restart": a second process finding
the first one's persistent cache (JAX's own persistent cache for the JAX step).  Printed as
ratios to JAX's time, with the executables each mode built at steps 2 and later (should be 0).
In compiled mode, Dynamo's and AOTAutograd's share of the first step
(`torch._dynamo.utils.compile_times()`) is printed too: it is paid again on every restart.
"onestep" is `torch.compile(step, backend="tpu", mode="reduce-overhead")`: its first call runs
the step eagerly (warm-up, as inductor's CUDA graphs warm up once) and captures it; its
executable is built in that call, beside the warm-up's, and replayed from the second call on.

Parallel compilation: strict eager's cold first steps with TORCHTPU_COMPILE_WORKERS = 0 (XLA
compiles on the calling thread), 1 and 2 (a pool compiles while the host dispatches on).

Decoding: greedy `generate()` of a small random-weight Llama (no downloads) over lengths not
seen before, against the same call once warm, with the dynamic (default) and the static KV
cache, in strict and fused eager; tokens are compared with the CPU's.

"Whole process" is each child's wall time from its start to its exit, imports and model
creation included: what the step timing leaves out (e.g. PyTorch's import of Dynamo, which
torch.optim pays when an optimizer is made, and torch.compile when it is called).

Timings on a shared machine are noisy: compare ratios taken in the same run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
# Executables of every kind (strict ops, fused segments, compiled graphs, the small programs
# around them) that were traced and compiled, or loaded from the persistent cache.
BUILT = ("executables_compiled", "executables_loaded")


# Pieces of torch.compile's own work (torch._dynamo.utils.compile_times(), nested: Dynamo's
# total includes the backend, the backend's includes AOTAutograd).
_DYNAMO_PIECES = (("Dynamo (all)", "_compile.compile_inner"), ("bytecode tracing", "bytecode_tracing"),
                  ("backend", "OutputGraph.call_user_compiler"),
                  ("AOTAutograd", "create_aot_dispatcher_function"))


def _gpt_args(quick):
    return (dict(layers=2, d_model=128, heads=4, seq=64, batch=4, vocab=512) if quick else
            dict(layers=4, d_model=256, heads=4, seq=128, batch=8, vocab=1024))


def _child_train(mode, a):
    """The first STEPS steps of the GPT in this (fresh) process: seconds, and per step the
    executables built and the loss."""
    import torch
    sys.path.insert(0, HERE)
    from torchtpu.examples.models import GPT
    torch.manual_seed(0)
    model = GPT(a["vocab"], a["d_model"], a["heads"], a["layers"], a["seq"])
    idx = torch.randint(0, a["vocab"], (a["batch"], a["seq"]))
    tgt = torch.randint(0, a["vocab"], (a["batch"], a["seq"]))
    if mode == "jax":
        import jax
        jax.config.update("jax_compilation_cache_dir", os.environ["WARMUP_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        import jax.numpy as jnp
        from train_step import jax_step_fn
        step, p, m, v = jax_step_fn(model)
        ji, jt = jnp.asarray(idx.numpy()), jnp.asarray(tgt.numpy())
        start = time.perf_counter()
        losses = []
        for t in range(1, STEPS + 1):
            p, m, v, loss = step(p, m, v, t, ji, jt)
            losses.append(float(loss))
        return dict(seconds=time.perf_counter() - start, losses=losses)

    import torchtpu
    from train_step import torch_step
    eager = {"strict": "strict", "fused": "fused", "compile": "strict", "onestep": "strict"}[mode]
    torch.tpu.eager_mode = eager
    tpu_model = model.to("tpu")
    step = torch_step(tpu_model, torch.optim.AdamW(tpu_model.parameters(), lr=1e-3),
                      idx.to("tpu"), tgt.to("tpu"))
    if mode == "compile":
        step = torch.compile(step, backend="tpu")
    if mode == "onestep":
        step = torch.compile(step, backend="tpu", mode="reduce-overhead")
    start = time.perf_counter()
    losses, built = [], []
    for _ in range(STEPS):
        before = torchtpu.metrics()
        losses.append(step().item())  # .item(): the step has run
        after = torchtpu.metrics()
        built.append(sum(after.get(k, 0) - before.get(k, 0) for k in BUILT))
    result = dict(seconds=time.perf_counter() - start, losses=losses, built=built,
                  cache_hits=sum(torchtpu.metrics().get(k, 0)
                                 for k in ("persistent_cache_hits", "executables_loaded")))
    if mode in ("compile", "onestep"):
        from torch._dynamo.utils import compile_times
        names, seconds = compile_times(repr="csv", aggregate=True)
        result["compile_times"] = {n: float(s) for n, s in zip(names, seconds)}
    return result


def _child_decode(what, quick):
    """Greedy decoding of a small random-weight Llama: a short warm-up call, then `new`
    tokens over lengths not seen before, then the same call again (warm).  `what`:
    "cache implementation:eager mode"."""
    import torch
    import torchtpu
    from transformers import LlamaConfig, LlamaForCausalLM
    cache_impl, mode = what.split(":")
    torch.tpu.eager_mode = mode
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    new = 10 if quick else 40
    # The static cache is sized once (max_cache_len), so every call shares its shapes.
    kw = dict(cache_implementation="static", max_cache_len=128) if cache_impl == "static" else {}

    def generate(m, x, n):
        return m.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

    cpu_tokens = generate(model, ids, new)
    tpu = model.to("tpu")
    x = ids.to("tpu")
    # The prefill and two decode steps: the first decode step reads the prompt's positions
    # (a [1, 8] storage), later ones the step's own, so a steady step appears at the second.
    generate(tpu, x, 3).cpu()
    before = torchtpu.metrics()
    t0 = time.perf_counter()
    tokens = generate(tpu, x, new).cpu()
    t_new = time.perf_counter() - t0
    after = torchtpu.metrics()
    t0 = time.perf_counter()
    again = generate(tpu, x, new).cpu()
    t_warm = time.perf_counter() - t0
    return dict(new=t_new, warm=t_warm, tokens=new,
                built=sum(after.get(k, 0) - before.get(k, 0) for k in BUILT),
                equal=bool(torch.equal(tokens, cpu_tokens) and torch.equal(again, cpu_tokens)))


def _spawn(args, env):
    # The children import the torchtpu of this checkout, not whichever one is installed.
    root = os.path.dirname(HERE)
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                         capture_output=True, text=True)
    process = time.perf_counter() - start
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "process": process}
    raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the small GPT (2 layers, d_model 128, "
                    "seq 64) and 10 decoded tokens: a few minutes")
    ap.add_argument("--modes", default="strict,fused,compile,onestep")
    ap.add_argument("--workers", default="0,1,2", help="compile pool sizes for the parallel-"
                    "compile comparison (strict, cold); empty: skip it")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the parallel-compile comparison")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-modes", default="strict,fused")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, what = a.child
        result = (_child_train(what, _gpt_args(a.quick)) if kind == "train"
                  else _child_decode(what, a.quick))
        print("RESULT " + json.dumps(result), flush=True)
        return

    quick = ["--quick"] if a.quick else []
    modes = [m for m in a.modes.split(",") if m]
    if modes:
        _train(modes, a, quick)
    if not a.no_decode:
        _decode(a, quick)


def _train(modes, a, quick):
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ["jax", *modes]:
            cache = os.path.join(tmp, mode)
            env = {**os.environ, "TORCHTPU_CACHE_DIR": cache, "WARMUP_JAX_CACHE": cache}
            runs[mode] = [_spawn(["--child", "train", mode, *quick], env) for _ in ("cold", "restart")]
            print(f"  [{mode}: cold {runs[mode][0]['seconds']:.2f} s, restart "
                  f"{runs[mode][1]['seconds']:.2f} s]", flush=True)
    g = _gpt_args(a.quick)
    print(f"\nTime to a steady step: the first {STEPS} steps of the GPT ({g['layers']} layers, d_model "
          f"{g['d_model']}, seq {g['seq']}, batch {g['batch']}; AdamW), in a fresh process")
    jax_cold, jax_restart = (r["seconds"] for r in runs["jax"])
    print(f"  {'JAX, one jax.jit':18s} cold {jax_cold:7.2f} s   restart {jax_restart:7.2f} s   "
          f"(whole process {runs['jax'][0]['process']:.2f} s and {runs['jax'][1]['process']:.2f} s)")
    targets = {"strict": 3.0, "fused": 1.5, "compile": 2.0, "onestep": 2.0}
    for mode in modes:
        cold, restart = runs[mode]
        same = all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(cold["losses"], runs["jax"][0]["losses"]))
        print(f"  {mode:18s} cold {cold['seconds']:7.2f} s = {cold['seconds'] / jax_cold:5.2f}x JAX "
              f"(target <= {targets.get(mode, 0):.1f}x)   restart {restart['seconds']:7.2f} s = "
              f"{cold['seconds'] / restart['seconds']:5.2f}x faster than cold (target >= 3x; "
              f"{restart['cache_hits']} programs loaded from the cache)")
        print(f"  {'':18s} executables built per step {cold['built']} cold, {restart['built']} "
              f"restart (target: 0 from step 2); losses {'equal' if same else 'DIFFER from'} JAX's")
        print(f"  {'':18s} whole process (start, imports, model, {STEPS} steps, exit): cold "
              f"{cold['process']:.2f} s = {cold['process'] / runs['jax'][0]['process']:.2f}x JAX's, "
              f"restart {restart['process']:.2f} s = {restart['process'] / runs['jax'][1]['process']:.2f}x "
              f"JAX's, {cold['process'] / restart['process']:.2f}x faster than cold")
        if "compile_times" in restart:
            for label, r in (("cold", cold), ("restart", restart)):
                ct = r["compile_times"]
                print(f"  {'':18s} {label}: " + ", ".join(
                    f"{name} {ct.get(key, 0):.2f} s" for name, key in _DYNAMO_PIECES))

    workers = [w for w in a.workers.split(",") if w]
    if workers:
        print(f"\nParallel compilation: strict eager, cold, the first {STEPS} steps with "
              f"TORCHTPU_COMPILE_WORKERS=N ({a.repeat} rounds, the worker counts interleaved)")
        seconds = {w: [] for w in workers}
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(a.repeat):
                for w in workers:
                    env = {**os.environ, "TORCHTPU_CACHE_DIR": os.path.join(tmp, f"{w}-{round_}"),
                           "TORCHTPU_COMPILE_WORKERS": w}
                    r = _spawn(["--child", "train", "strict", *quick], env)
                    seconds[w].append(r["seconds"])
                    if "strict" in runs and r["losses"] != runs["strict"][0]["losses"]:
                        print(f"  losses with {w} workers DIFFER from the default run's")
        for w in workers:
            print(f"  {w} worker(s){' (on the calling thread)' if w == '0' else '':24s} "
                  f"{min(seconds[w]):6.2f}-{max(seconds[w]):6.2f} s = "
                  f"{min(seconds[w]) / jax_cold:5.2f}-{max(seconds[w]) / jax_cold:5.2f}x JAX")
        for base in ("1", "0"):
            if base in seconds and "2" in seconds:
                ratios = [b / t for b, t in zip(seconds[base], seconds["2"])]
                print(f"  speed-up of 2 workers over {base}: {min(ratios):.2f}-{max(ratios):.2f}x "
                      f"(per round)")



def _decode(a, quick):
    print("\nDecoding (greedy generate(), small random-weight Llama): "
          "lengths not seen before vs the same call warm")
    for mode in a.decode_modes.split(","):
        for impl in ("dynamic", "static"):
            d = _spawn(["--child", "decode", f"{impl}:{mode}", *quick],
                       dict(os.environ, TORCHTPU_CACHE_DIR=""))
            print(f"  {mode:6s} {impl:8s} cache: {d['tokens']} new tokens {d['new']:6.2f} s vs "
                  f"warm {d['warm']:6.2f} s = {d['new'] / d['warm']:6.2f}x (target <= 2x); "
                  f"{d['built']} executables built ({d['built'] / d['tokens']:.1f} per token); "
                  f"tokens {'equal' if d['equal'] else 'DIFFER from'} the CPU's")


if __name__ == "__main__":
    main()
