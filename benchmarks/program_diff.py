"""The optimized programs of a compiled training step (forward, backward, AdamW) side by side with
the hand-written `jax.jit` step of the same model and optimizer, per model:

    python benchmarks/program_diff.py [--models small,gpt4,llama] [--steps 5] [--repeat 3]
                                      [--dump DIR]  (each program's optimized HLO as text)
                                      [--target v5e:1x1]  (compiled for a TPU slice instead)
                                      [--dtype bf16]  (the models' weights and math in bf16)
                                      [--matmul-precision medium]  (float32 matmuls' precision)

With `--target`, each mode's programs of a steady step, and JAX's, are compiled for that TPU
slice by libtpu's compiler (no TPU needed; `pip install -e ".[tpu]"`), and it prints what the
TPU compiler says of them (torchtpu._core.tpu_compiler.Report): bytes accessed, the roofline,
HBM per chip, compile seconds, fusions, copies, parameters and 64-bit emulations, each beside
JAX's.  Nothing is timed then: the CPU's times say nothing of the TPU's.

- "1-exe": `torch.compile(step, backend="tpu", mode="reduce-overhead")`, one executable a step;
  with `--target` also "1-exe, grads freed", the same step ending with `opt.zero_grad()`, whose
  program keeps what JAX's keeps (no gradients after the step);
- "compiled": `torch.compile(step, backend="tpu")`, which runs a step as several programs: the
  Dynamo graphs' forward and backward and the graph after `zero_grad`'s break (the optimizer
  step), plus eager ops between them; it names them, and Dynamo's break reasons
  (`torch._dynamo.explain`);
- "JAX": `jax.jit` of benchmarks/jax_models.py's loss and AdamW, donating params and state.

Per mode: XLA's cost analysis of the optimized programs (FLOPs, bytes accessed; summed over a
step's programs), top-level fusions in their entry computations (and of them, those computing
one number), copies (and of them, copies of an input), parameters and results, and the steady
time per step (ratio to JAX's, a range over `--repeat` alternating runs), with the loss after
the timed steps (all modes run the same steps from the same weights, so the losses must agree).
Cost analysis and counts are deterministic; times are the noisy part.  docs/performance.md
("Compiled programs beside JAX's") reads the figures.

The models: the small GPT (2 layers, d 128, T 64) and the 4-layer GPT (d 256, T 128) of
benchmarks/train_step.py, and a Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query SDPA)
of the 4-layer GPT's width; batch 8, AdamW(lr=1e-3).
"""
import argparse
import collections
import contextlib
import copy
import os
import re
import time

os.environ.setdefault("TORCHTPU_CACHE_DIR", "")  # cold: the programs are built here

import jax
import jax.numpy as jnp
import torch

import jax_models
import torchtpu  # noqa: F401
from torchtpu._core import runtime, tpu_compiler
from torchtpu._execution.segment import Segment
from train_step import build_model, default_options, time_steps, torch_step


def _from_train_step(name):
    """(a maker of, sequence length of) train_step.py's model `name` at its default sizes."""
    a = default_options(name)
    return (lambda: build_model(a)), a.seq


MODELS = {
    "small": ("small GPT (2 layers, d 128, T 64)", *_from_train_step("small")),
    "gpt4": ("4-layer GPT (d 256, T 128)", *_from_train_step("gpt")),
    "llama": ("Llama (4 layers, d 256, 4 heads, 2 kv heads, T 128)", *_from_train_step("llama")),
}
BATCH = 8
LR = 1e-3


@contextlib.contextmanager
def programs_run(into, target=None):
    """Collects, in order, the executables (jax.stages.Compiled) of the segments that run
    meanwhile (compiled graphs, graph replays, fused segments); with `target`, each compiled
    for that TPU slice instead (tpu_compiler.Report)."""
    run = Segment.run

    def recording(self, ext_arrays, call, packed_scalars):
        if target is not None:  # before the run, which may consume its inputs
            into.append((self.kind, self.compile_for(target, ext_arrays, packed_scalars, call[0])))
        out = run(self, ext_arrays, call, packed_scalars)
        if target is None:
            into.append((self.kind, self.executables[call[0]].last))
        return out

    Segment.run = recording
    try:
        yield
    finally:
        Segment.run = run


def describe(compiled):
    """What the table prints of one optimized program."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    # (name, result shape, opcode, first operand) of each instruction of the entry computation
    lines = re.findall(r"(%[\w.-]+) = (\([^=]*?\)|\S+) ([a-z][\w-]*)\((%[\w.-]+)?", entry)
    opcodes = collections.Counter(op for _, _, op, _ in lines)
    params = {name for name, _, op, _ in lines if op == "parameter"}
    return dict(flops=cost.get("flops", 0.0), bytes=cost.get("bytes accessed", 0.0),
                fusions=opcodes["fusion"], copies=opcodes["copy"], params=len(params),
                # fusions computing one number (per-parameter scalars: AdamW's step counters
                # and bias corrections), copies of an input (XLA keeps the old value of a
                # donated input that is read after its new value is written)
                scalar_fusions=sum(op == "fusion" and re.match(r"\w+\[1?\]", shape) is not None
                                   for _, shape, op, _ in lines),
                input_copies=sum(op == "copy" and arg in params for _, _, op, arg in lines),
                outputs=len(jax.tree.leaves(compiled.out_info)), text=text, programs=1)


def total(descriptions):
    keys = ("flops", "bytes", "fusions", "copies", "params", "outputs", "programs",
            "scalar_fusions", "input_copies")
    return {k: sum(d[k] for d in descriptions) for k in keys}


def jax_step(model, idx, tgt, target=None):
    """The hand-written step: (run one step, its loss, its Compiled); with `target`, its
    tpu_compiler.Report for that TPU slice instead."""
    step = jax_models.train_step(model, lr=LR)
    params = jax_models.params_of(model)
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = {"p": params, "m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "t": 0}
    ji, jt = jnp.asarray(idx.numpy()), jnp.asarray(tgt.numpy())
    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    # The float32 matmuls at the precision ours run at (torch.get_float32_matmul_precision():
    # PyTorch's default "highest" is jax's HIGHEST; JAX's own default is one bfloat16 pass on
    # TPU, which the same step at "highest" takes 1.08x the bytes and 1.10x the roofline of)
    with jax.default_matmul_precision(runtime.jax_precision().name.lower()):
        if target is not None:
            return tpu_compiler.compile_for(
                jitted, (state["p"], state["m"], state["v"], 1, ji, jt), target, "JAX step")
        compiled = jitted.lower(state["p"], state["m"], state["v"], 1, ji, jt).compile()

    def run():
        state["t"] += 1
        state["p"], state["m"], state["v"], state["loss"] = compiled(
            state["p"], state["m"], state["v"], state["t"], ji, jt)

    return run, lambda: state["loss"], compiled


def tpu_step(model, idx, tgt, mode):
    """(run one step in `mode`, its loss).  "1-exe, grads freed": the one-executable step
    ending with `zero_grad()` (set_to_none), which keeps what JAX's step keeps: PyTorch's
    gradients outlive a step whose `zero_grad` comes first (the benchmark's), and are results
    of its program that JAX's step does not have."""
    tpu_model = copy.deepcopy(model).to("tpu")
    opt = torch.optim.AdamW(tpu_model.parameters(), lr=LR)
    step = torch_step(tpu_model, opt, idx.to("tpu"), tgt.to("tpu"))
    if mode == "1-exe, grads freed":
        step = _then_grads_freed(step, opt)
    options = {"mode": "reduce-overhead"} if mode.startswith("1-exe") else {}
    compiled = torch.compile(step, backend="tpu", **options)
    last = {}

    def run():
        last["loss"] = compiled()

    return run, lambda: last["loss"]


def _then_grads_freed(step, opt):
    def freeing():
        loss = step()
        opt.zero_grad()
        return loss
    return freeing


def graph_breaks(model, idx, tgt):
    """Dynamo's graphs and break reasons for the step (on a copy: explain runs it)."""
    tpu_model = copy.deepcopy(model).to("tpu")
    step = torch_step(tpu_model, torch.optim.AdamW(tpu_model.parameters(), lr=LR),
                      idx.to("tpu"), tgt.to("tpu"))
    torch._dynamo.reset()
    e = torch._dynamo.explain(step)()
    reasons = []
    for b in e.break_reasons:
        first = b.reason.strip().splitlines()
        where = b.user_stack[-1] if b.user_stack else None
        reasons.append(f"{' '.join(first[:2])[:160]}"
                       + (f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""))
    torch._dynamo.reset()
    return e.graph_count, reasons


def model_and_batch(name, dtype):
    """(title, model with seed 0's weights in `dtype`, input ids, targets) of MODELS[name]."""
    title, make, seq = MODELS[name]
    torch.manual_seed(0)
    model = make()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    return title, model, torch.randint(0, 1024, (BATCH, seq)), torch.randint(0, 1024, (BATCH, seq))


def measure_target(name, a):
    """The TPU compiler's view of each mode's steady step beside JAX's (module docstring)."""
    title, model, idx, tgt = model_and_batch(name, a.dtype)
    rows = {}
    for mode in ("1-exe", "1-exe, grads freed", "compiled"):
        torchtpu.clear_caches()
        torch._dynamo.reset()
        run, _ = tpu_step(model, idx, tgt, mode)
        run()
        run()
        torch.tpu.synchronize()
        ran = []
        with programs_run(ran, a.target):
            run()
        torch.tpu.synchronize()
        rows[mode] = [r for _, r in ran]
    rows["JAX"] = [jax_step(model, idx, tgt, a.target)]
    print(f"\n{title}, {a.dtype}, batch {BATCH}, AdamW(lr={LR}); compiled for {a.target} "
          f"({rows['JAX'][0].chip})")
    header = ("", "programs", "GFLOP", "MB accessed", "roofline ms", "HBM MiB", "temp MiB",
              "compile s", "fusions", "copies", "params", "64-bit", "concat")
    def row(cells):  # (the mode's name wider than the figures)
        print("  " + " | ".join([f"{cells[0]:>18s}"] + [f"{c:>12s}" for c in cells[1:]]))

    row(header)
    j = rows["JAX"][0]
    for m, reports in rows.items():
        for r in reports:
            if r.error:
                print(f"  {m}: {r}")
        t = tpu_compiler.Reports(reports).total()
        cells = (m, str(t["programs"]), f"{t['flops'] / 1e9:.2f} {t['flops'] / j.flops:.2f}x",
                 f"{t['bytes_accessed'] / 1e6:.0f} {t['bytes_accessed'] / j.bytes_accessed:.2f}x",
                 f"{t['optimal_seconds'] * 1e3:.3f} {t['optimal_seconds'] / j.optimal_seconds:.2f}x",
                 f"{t['hbm_bytes'] / 2**20:.1f} {t['hbm_bytes'] / j.hbm_bytes:.2f}x",
                 f"{max(r.temp_bytes for r in reports) / 2**20:.1f}",
                 f"{t['compile_seconds']:.1f} {t['compile_seconds'] / j.compile_seconds:.2f}x",
                 str(sum(r.fusions for r in reports)), str(sum(r.copies for r in reports)),
                 str(sum(r.parameters for r in reports)), str(sum(r.x64_calls for r in reports)),
                 str(sum(r.concat_bitcasts for r in reports)))
        row(cells)
        if len(reports) > 1:  # (which of a step's programs holds the bytes)
            for r in reports:
                print(f"      {r}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for m, reports in rows.items():
            for i, r in enumerate(reports):
                with open(os.path.join(a.dump, f"{name}-{a.target}-{m}-{i}.hlo"), "w") as f:
                    f.write(r.text)


def measure(name, a):
    if a.target:
        return measure_target(name, a)
    title, model, idx, tgt = model_and_batch(name, a.dtype)
    steps, rows, losses = {}, {}, {}
    extra = {}
    for mode in ("1-exe", "compiled"):
        torchtpu.clear_caches()
        torch._dynamo.reset()
        run, loss = tpu_step(model, idx, tgt, mode)
        run()  # warm-up (and, for 1-exe, capture)
        run()
        torch.tpu.synchronize()
        before = torchtpu.metrics()
        ran = []
        with programs_run(ran):
            run()
        torch.tpu.synchronize()
        after = torchtpu.metrics()
        ops = {k[4:]: after[k] - before.get(k, 0) for k in after
               if k.startswith("op::") and after[k] != before.get(k, 0)}
        rows[mode] = total([describe(c) for _, c in ran])
        extra[mode] = (ran, ops)
        steps[mode] = (run, loss, torch.tpu.synchronize)
    jrun, jloss, jcompiled = jax_step(model, idx, tgt)
    for _ in range(3):  # as many steps as each tpu mode has run
        jrun()
    rows["JAX"] = total([describe(jcompiled)])
    steps["JAX"] = (jrun, jloss, lambda: jloss().block_until_ready())
    count, reasons = graph_breaks(model, idx, tgt)

    times = {m: [] for m in steps}
    for _ in range(a.repeat):  # alternating, so that the machine's load hits every mode alike
        for m, (run, _, sync) in steps.items():
            times[m].append(time_steps(run, a.steps, sync))
    # Every mode has now run the same number of steps from the same weights.
    for m, (_, loss, _) in steps.items():
        value = loss()
        losses[m] = float(value.item() if isinstance(value, torch.Tensor) else value)

    print(f"\n{title}, batch {BATCH}, AdamW(lr={LR}); {a.repeat} alternating runs of {a.steps} steps")
    header = ("", "programs", "GFLOP", "MB accessed", "fusions", "(1-number)", "copies", "(of inputs)",
              "params", "results", "ms/step", "x JAX", "loss")
    print("  " + " | ".join(f"{h:>11s}" for h in header))
    jr = rows["JAX"]
    for m, r in rows.items():
        ratios = [t / j for t, j in zip(times[m], times["JAX"])]
        cells = (m, str(r["programs"]),
                 f"{r['flops'] / 1e9:.3f} {r['flops'] / jr['flops']:.2f}x",
                 f"{r['bytes'] / 1e6:.1f} {r['bytes'] / jr['bytes']:.2f}x",
                 str(r["fusions"]), str(r["scalar_fusions"]), str(r["copies"]), str(r["input_copies"]),
                 str(r["params"]), str(r["outputs"]),
                 f"{min(times[m]):.1f}-{max(times[m]):.1f}",
                 f"{min(ratios):.2f}-{max(ratios):.2f}", f"{losses[m]:.6f}")
        print("  " + " | ".join(f"{c:>11s}" for c in cells))
    ran, ops = extra["compiled"]
    kinds = collections.Counter(k for k, _ in ran)
    print(f"  compiled mode, a steady step: {', '.join(f'{n} {k} program(s)' for k, n in kinds.items())}"
          f"; eager ops between them: {ops or 'none'}")
    print(f"  Dynamo: {count} graphs; breaks: {'; '.join(reasons) or 'none'}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for m, programs in (("1-exe", extra["1-exe"][0]), ("compiled", ran), ("JAX", [("jax", jcompiled)])):
            for i, (_, c) in enumerate(programs):
                with open(os.path.join(a.dump, f"{name}-{m}-{i}.hlo"), "w") as f:
                    f.write(c.as_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small,gpt4,llama")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dump", help="write each optimized program's HLO text under this folder")
    ap.add_argument("--target", help="a TPU slice to compile for (v5e:1x1, v6e:1x1, ...), untimed")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the models' dtype")
    ap.add_argument("--matmul-precision", default="highest", choices=("highest", "high", "medium"),
                    help="torch.set_float32_matmul_precision for our steps, and the same for JAX's")
    a = ap.parse_args()
    torch.set_float32_matmul_precision(a.matmul_precision)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d')}")
    for name in a.models.split(","):
        measure(name, a)


if __name__ == "__main__":
    main()
