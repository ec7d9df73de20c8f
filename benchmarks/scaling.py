"""Weak scaling of data-parallel training, measured side by side: TorchTPU's FSDP2 and DDP
against the same FSDP step written directly in JAX and against PyTorch's own FSDP2 and DDP on
CPU tensors over gloo.

    python benchmarks/scaling.py [--models gpt,llama] [--variants ...] [--steps 40]
                                 [--procs 2] [--four] [--cores 0,1]

For each model and variant, in one run:
- two one-rank jobs side by side, each process pinned to its own core (taskset), and
- one two-rank job, rank r pinned to core r,
with the per-rank batch fixed, so both do the same compute on the same cores and only the
communication differs.  Efficiency = step of the one-rank jobs / step of the two-rank job
(1.0: communication costs nothing).  `--four` adds a four-rank job, two processes per core,
against four one-rank jobs likewise placed (reported only).

Per variant: step p50 and p99 over --steps steps (each step ends with a wait for its loss),
efficiency, executables and host waits per steady step (TorchTPU's counters, measured around
the step without that wait), bytes each collective kind moved per rank per step against the
analytic figure (FSDP: all parameters all-gathered in the forward, the blocks' again in the
backward, gradients reduce-scattered, each x (n-1)/n; DDP: gradients all-reduced, 2 (n-1)/n),
and the first loss against JAX's (same initial weights, same data per rank).

Variants (rank processes use one CPU JAX device each, gloo underneath):
  tpu-fsdp-strict, tpu-fsdp-fused, tpu-fsdp-onestep   FSDP2 (fully_shard per block and root)
                                                      on tpu, strict / fused eager /
                                                      torch.compile(mode="reduce-overhead")
  tpu-fsdp-fused-split                                fused eager with each collective a
                                                      program of its own (TORCHTPU_COLLECTIVES
                                                      _IN_PROGRAM=0)
  tpu-ddp-fused, tpu-ddp-onestep                      DDP on tpu
  jax-fsdp                                            one jax.jit: shard_map all-gathers each
                                                      block's shards (again in the backward:
                                                      jax.checkpoint) and psum_scatters the
                                                      gradients, AdamW on the shards
  torch-fsdp, torch-ddp                               PyTorch's FSDP2 / DDP on CPU tensors, gloo

With `--target v5e:2x2` (libtpu installed, no TPU needed) it times nothing: each 2-rank job's
steady step is compiled for the first 2 chips of that TPU topology, and what the TPU compiler
says of each program is printed (HBM per chip, roofline, bytes, collectives and how many of
them overlap compute, compile seconds), the FSDP variants' beside JAX's (FSDP2's collectives
one per parameter, as a job on the TPU's own mesh issues them: TORCHTPU_FSDP_PER_PARAMETER=1):

    python benchmarks/scaling.py --target v5e:2x2 --models gpt \
        --variants tpu-fsdp-fused,tpu-fsdp-onestep,jax-fsdp
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_VARIANTS = ("tpu-fsdp-strict,tpu-fsdp-fused,tpu-fsdp-fused-split,tpu-fsdp-onestep,"
                    "tpu-ddp-fused,tpu-ddp-onestep,jax-fsdp,torch-fsdp,torch-ddp")
MODELS = {
    # The GPT of benchmarks/train_step.py, and a Llama-style model of the same width.
    "gpt": dict(kind="gpt", vocab=1024, d=256, heads=4, layers=4, seq=128),
    "llama": dict(kind="llama", vocab=1024, d=256, heads=4, kv_heads=2, layers=4, hidden=704,
                  seq=128),
}
BATCH = 4  # per rank
LR = 1e-3


# ============================================================== the driver =====================
def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(variant, model, world, cores, steps, timeout, target=None):
    """One job of `world` ranks, rank r pinned to cores[r]; returns each rank's RESULT."""
    port = _port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
                   TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)
        env.setdefault("TORCHTPU_CACHE_DIR", "")  # cold programs, as a first run builds them
        if variant == "tpu-fsdp-fused-split":
            env["TORCHTPU_COLLECTIVES_IN_PROGRAM"] = "0"
        if target:  # FSDP2's collectives as on the target's TPU mesh (_distributed/fsdp.py)
            env.setdefault("TORCHTPU_FSDP_PER_PARAMETER", "1")
        cmd = ["taskset", "-c", str(cores[r]), sys.executable, __file__, "--worker", variant,
               "--model", model, "--steps", str(steps)] + (["--target", target] if target else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{variant} {model} x{world} timed out")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{variant} {model} x{world} failed (exit {p.returncode}):\n{out[-3000:]}")
        results.append(json.loads(lines[-1][7:]))
    return results


def _side_by_side(variant, model, cores, steps, timeout):
    """One one-rank job per core in `cores`, all at once: their results."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(cores)) as pool:
        jobs = [pool.submit(_launch, variant, model, 1, [c], steps, timeout) for c in cores]
        return [j.result()[0] for j in jobs]


def drive(a):
    cores = [int(c) for c in a.cores.split(",")]
    if a.target:
        if a.dump:
            os.environ["TORCHTPU_BENCH_DUMP"] = os.path.abspath(a.dump)
        return drive_target(a, cores)
    print(f"# weak scaling on cores {cores}, {a.steps} steps, batch {BATCH} per rank, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    rows = []
    for model in a.models.split(","):
        jax_first = None
        for variant in a.variants.split(","):
            try:
                single = _side_by_side(variant, model, cores[:2], a.steps, a.timeout)
                job = _launch(variant, model, 2, cores[:2], a.steps, a.timeout)
                four = None
                if a.four:
                    placed = [cores[i % 2] for i in range(4)]
                    four = (_side_by_side(variant, model, placed, a.steps, a.timeout),
                            _launch(variant, model, 4, placed, a.steps, a.timeout))
            except RuntimeError as e:
                print(f"{model:6s} {variant:22s} FAILED: {str(e).splitlines()[0]}", flush=True)
                print("\n".join(str(e).splitlines()[-15:]), flush=True)
                continue
            row = _row(model, variant, single, job, four)
            if variant == "jax-fsdp":
                jax_first = row["first_loss"]
            rows.append(row)
            _print(row, jax_first)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def drive_target(a, cores):
    print(f"# each 2-rank step compiled for {a.target}, {time.strftime('%Y-%m-%d')}", flush=True)
    rows = []
    for model in a.models.split(","):
        jax_total = None
        for variant in a.variants.split(","):
            try:
                result = _launch(variant, model, 2, cores[:2], 0, a.timeout, a.target)[0]
            except RuntimeError as e:
                print(f"{model:6s} {variant:18s} FAILED: {str(e).splitlines()[0]}", flush=True)
                print("\n".join(str(e).splitlines()[-15:]), flush=True)
                continue
            reports, total = result["reports"], result["total"]
            uncosted = not all(r["branches_costed"] for r in reports)
            if variant == "jax-fsdp":
                jax_total = total
            rows.append(dict(model=model, variant=variant, reports=reports, total=total))
            for r in reports:
                print(f"{model:6s} {variant:18s} {r['line']}; {r['hlo_lines']} HLO lines", flush=True)
            line = (f"{model:6s} {variant:18s} step: {total['programs']} programs, HBM "
                    f"{total['hbm_bytes'] / 2**20:.1f} MiB (largest), {total['bytes_accessed'] / 1e6:.1f} MB, "
                    f"roofline {total['optimal_seconds'] * 1e3:.3f} ms"
                    f"{' (conditionals costed by their first branch)' if uncosted else ''}, compile "
                    f"{total['compile_seconds']:.1f} s")
            if jax_total is not None and variant != "jax-fsdp":
                line += " | vs JAX's: " + ", ".join(
                    f"{k} {total[k] / jax_total[k]:.2f}x" for k in
                    ("bytes_accessed", "optimal_seconds", "hbm_bytes", "compile_seconds")
                    if jax_total[k] and not (k == "optimal_seconds" and uncosted))
            print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _row(model, variant, single, job, four):
    single_p50 = statistics.mean(r["p50"] for r in single)
    job_p50 = max(r["p50"] for r in job)
    row = dict(model=model, variant=variant, single_p50=single_p50, p50=job_p50,
               p99=max(r["p99"] for r in job), single_p99=max(r["p99"] for r in single),
               efficiency=single_p50 / job_p50, first_loss=job[0]["first_loss"],
               per_step=job[0].get("per_step"), bytes=job[0].get("bytes"),
               analytic=job[0].get("analytic"))
    if four is not None:
        row["four_single_p50"] = statistics.mean(r["p50"] for r in four[0])
        row["four_p50"] = max(r["p50"] for r in four[1])
        row["four_efficiency"] = row["four_single_p50"] / row["four_p50"]
    return row


def _print(row, jax_first):
    loss = f"{row['first_loss']:.5f}"
    if jax_first is not None and row["variant"] != "jax-fsdp":
        loss += f" ({abs(row['first_loss'] - jax_first) / jax_first:.1e} from JAX's)"
    text = (f"{row['model']:6s} {row['variant']:22s} 1-rank p50 {row['single_p50']:7.1f} ms | "
            f"2-rank p50 {row['p50']:7.1f} p99 {row['p99']:7.1f} ms (p99/p50 {row['p99'] / row['p50']:.2f}) | "
            f"efficiency {row['efficiency']:.2f} | first loss {loss}")
    if row.get("per_step"):
        s = row["per_step"]
        text += f" | per step: {s['executables']} executables, {s['host_waits']} host waits, {s['builds']} builds"
    if row.get("bytes"):
        moved = ", ".join(f"{k} {v / 1e6:.3f} MB (analytic {row['analytic'].get(k, 0) / 1e6:.3f})"
                          for k, v in sorted(row["bytes"].items()))
        text += f" | moved per rank: {moved}"
    if "four_efficiency" in row:
        text += (f" | 4 ranks, 2 per core: p50 {row['four_p50']:.1f} ms vs one-rank "
                 f"{row['four_single_p50']:.1f} ms, efficiency {row['four_efficiency']:.2f}")
    print(text, flush=True)


# ============================================================== the workers ====================
def _torch_model(name):
    import torch
    from torchtpu.examples.models import GPT, Llama
    c = MODELS[name]
    torch.manual_seed(0)
    if c["kind"] == "gpt":
        return GPT(vocab=c["vocab"], d_model=c["d"], n_heads=c["heads"], n_layers=c["layers"], seq=c["seq"])
    return Llama(vocab=c["vocab"], d=c["d"], layers=c["layers"], heads=c["heads"], hidden=c["hidden"],
                 kv_heads=c["kv_heads"])


def _batches(name, rank, steps):
    """This rank's batches: the same in every variant."""
    import torch
    c = MODELS[name]
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, c["vocab"], (BATCH, c["seq"] + 1), generator=g) for _ in range(steps)]


def _analytic(model, kind, n):
    """Bytes a rank moves per step (see the module docstring)."""
    block = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    share = (n - 1) / n
    if kind == "fsdp":
        return {"all_gather": (total + block) * share, "reduce_scatter": total * share}
    return {"all_reduce": 2 * total * share}


def _stats(times):
    times = sorted(times)
    return dict(p50=statistics.median(times), p99=times[min(len(times) - 1, int(0.99 * len(times)))])


def _timed(step, batches, sync, counted=None):
    """Per-step times (ms) of `step(batch)` ended by `sync(loss)`, after 3 warm-up steps; the
    first loss; and per steady step, `counted()`'s counters measured around the step alone."""
    first = float(sync(step(batches[0])))
    for b in batches[1:3]:
        sync(step(b))
    times, deltas = [], []
    for b in batches[3:]:
        before = counted() if counted else None
        t0 = time.perf_counter()
        loss = step(b)
        if counted:
            after = counted()
            deltas.append({k: after.get(k, 0) - before.get(k, 0) for k in after})
        sync(loss)
        times.append((time.perf_counter() - t0) * 1e3)
    return times, first, deltas


def _tpu_worker(variant, name, steps, target=None):
    import torch
    import torch.distributed as dist
    import torchtpu
    torch.set_num_threads(1)
    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    kind, mode = variant.split("-")[1], variant.split("-")[2]
    if mode == "fused":
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
    model = _torch_model(name)
    analytic = _analytic(model, kind, n)
    model = model.to("tpu")
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(tokens):
        x = tokens.to("tpu")
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if mode == "onestep":
        step = torch.compile(step, backend="tpu", mode="reduce-overhead")
    if target:
        return _targeted(step, name, r, target, captured=mode == "onestep")
    times, first, deltas = _timed(step, _batches(name, r, steps), lambda loss: loss.item(),
                                  torchtpu.metrics)
    steady = deltas[len(deltas) // 2]
    executables = {"strict": "ops", "fused": "flushes", "onestep": "tpu_graph_replays"}[mode]
    built = sum(steady.get(k, 0) for k in ("executables_compiled", "compiles", "segment_compiles",
                                           "graph_compiles", "tpu_graph_compiles"))
    moved = {}
    for k, v in steady.items():
        if k.startswith("collective_bytes::") and v:
            kind_ = k.split("::")[1]
            # (what this rank contributed: a shard gathered from n, a full tensor scattered)
            moved[kind_] = v * (n - 1) if kind_ == "all_gather" else v * (n - 1) / n * (
                2 if kind_ == "all_reduce" else 1)
    per_step = dict(executables=steady.get(executables, 0), host_waits=steady.get("blocking_waits", 0),
                    builds=built)
    return dict(times=times, first_loss=first, per_step=per_step, bytes=moved if n > 1 else None,
                analytic=analytic if n > 1 else None)


def _targeted(step, name, r, target, captured):
    """Rank 0's reports of the steady step's programs compiled for `target`: the programs a
    step runs once warm (its ops and segments built again after the caches are cleared), or a
    captured step's one graph."""
    import contextlib
    import torch
    import torchtpu
    batches = _batches(name, r, 4)
    if not captured:
        for b in batches[:3]:
            step(b).item()
        torchtpu.clear_caches()
        batches = batches[3:]
    with torch.tpu.compile_for(target) if r == 0 else contextlib.nullcontext([]) as reports:
        for b in batches:
            step(b).item()
    if captured and reports:  # (the warm-up's op programs before it: the graph is the step)
        reports = [max(reports, key=lambda x: x.parameters)]
    return _reported(reports)


def _reported(reports):
    """What the driver gets of Reports: each as a dict with its printed line and its HLO's
    length (the HLO itself written to $TORCHTPU_BENCH_DUMP, --dump, where set), and their total."""
    from torchtpu._core import tpu_compiler
    return dict(reports=[_one_reported(x) for x in reports],
                total=tpu_compiler.Reports(reports).total())


def _one_reported(report):
    folder = os.environ.get("TORCHTPU_BENCH_DUMP")
    if folder:
        os.makedirs(folder, exist_ok=True)
        name = "".join(c if c.isalnum() else "_" for c in report.name)[:60]
        with open(os.path.join(folder, f"{name}.{report.target}.hlo.txt"), "w") as f:
            f.write(report.text)
    return dict(report.as_dict(), hlo_lines=report.text.count("\n"), line=str(report))


def _torch_cpu_worker(variant, name, steps):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r = dist.get_rank()
    model = _torch_model(name)
    if variant == "torch-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(tokens):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    times, first, _ = _timed(step, _batches(name, r, steps), lambda loss: loss.item())
    return dict(times=times, first_loss=first)


def _jax_worker(name, steps, target=None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_models
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{os.environ['MASTER_PORT']}", num_processes=n,
                                   process_id=r)
    model = _torch_model(name)
    config = jax_models.config_of(model)
    full = {k: np.asarray(v) for k, v in jax_models.params_of(model).items()}
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    sharded = NamedSharding(mesh, P("ranks"))
    device = jax.local_devices()[0]
    shapes = {k: v.shape for k, v in full.items()}
    padded = {k: -(-v.size // n) * n for k, v in full.items()}

    def shard_of(k, v):
        flat = np.pad(v.reshape(-1), (0, padded[k] - v.size))
        local = jax.device_put(flat.reshape(n, -1)[r], device)
        return jax.make_array_from_single_device_arrays((padded[k],), sharded, [local])

    params = {k: shard_of(k, v) for k, v in full.items()}
    groups = [[k for k in full if k.startswith(f"blocks.{i}.")] for i in range(config[-1])]
    root = [k for k in full if not k.startswith("blocks.")]

    def gathered(shards, names):
        return {k: lax.all_gather(shards[k], "ranks", tiled=True)[:int(np.prod(shapes[k]))].reshape(shapes[k])
                for k in names}

    def block(p, i, x, run):
        # FSDP: the block's shards gathered for its forward and again for its backward.
        return jax.checkpoint(lambda s, x: run(gathered(s, groups[i]), x))({k: p[k] for k in groups[i]}, x)

    loss_of = jax_models.loss_fn(config, block)

    def local_loss(shards, idx, tgt):
        p = dict(shards)
        p.update(gathered(shards, root))
        return loss_of(p, idx, tgt)

    def body(shards, m, v, t, tokens):
        loss, g = jax.value_and_grad(local_loss)(shards, tokens[:, :-1], tokens[:, 1:])
        g = jax.tree.map(lambda x: x / n, g)  # the all-gather's transpose summed the ranks'
        shards, m, v = jax_models.adamw(shards, m, v, g, t, lr=LR)
        return shards, m, v, loss  # (this rank's loss, as the torch variants report it)

    def step_over(mesh):
        spec = P("ranks")
        # (the loss is each rank's own: not replicated, which check_vma would refuse)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, P(), spec),
                                     out_specs=(spec, spec, spec, P()), check_vma=False),
                       donate_argnums=(0, 1, 2))

    step = step_over(mesh)
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    state = [params, m, v, 0]

    def run(tokens):
        local = jax.device_put(tokens.numpy(), device)
        batch = jax.make_array_from_single_device_arrays((n * tokens.shape[0], tokens.shape[1]),
                                                         sharded, [local])
        state[3] += 1
        state[0], state[1], state[2], loss = step(state[0], state[1], state[2],
                                                  jnp.float32(state[3]), batch)
        return loss

    if target:
        from torchtpu._core import tpu_compiler
        tokens = _batches(name, r, 1)[0]
        batch = jax.make_array_from_single_device_arrays(
            (n * tokens.shape[0], tokens.shape[1]), sharded, [jax.device_put(tokens.numpy(), device)])
        chips = Mesh(np.array(tpu_compiler.topology(target)[:n]), ("ranks",))
        return _reported([] if r else [tpu_compiler.compile_for(
            step_over(chips), (*state[:3], np.float32(1), batch), target, "the JAX FSDP step")])
    times, first, _ = _timed(run, _batches(name, r, steps),
                             lambda loss: float(loss.addressable_data(0)))
    return dict(times=times, first_loss=first,
                per_step=dict(executables=1, host_waits=0, builds=0))


def work(a):
    if a.worker.startswith("tpu-"):
        result = _tpu_worker(a.worker, a.model, a.steps, a.target)
    elif a.worker.startswith("torch-"):
        result = _torch_cpu_worker(a.worker, a.model, a.steps)
    else:
        result = _jax_worker(a.model, a.steps, a.target)
    if "times" in result:
        result.update(_stats(result.pop("times")))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # (JAX's coordination service would otherwise wait for the slower rank)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--steps", type=int, default=40, help="steps per job (3 more warm up)")
    ap.add_argument("--four", action="store_true", help="also 4 processes, 2 per core")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--target", help="compile each 2-rank step for this TPU topology (e.g. "
                    "v5e:2x2) and report, instead of timing (see above)")
    ap.add_argument("--dump", help="with --target: write each program's TPU-scheduled HLO here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.steps += 3
        work(a)
    else:
        drive(a)


if __name__ == "__main__":
    main()
