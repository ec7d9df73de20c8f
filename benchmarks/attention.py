"""Causal attention forward+backward (F.scaled_dot_product_attention, batch 1, 8 heads, head dim
64, float32): time and peak memory on tpu (the implementation torchtpu chooses, and each one
forced), against torch CPU's SDPA and JAX's `jax.nn.dot_product_attention` (one jax.jit of
forward and backward), in one run.

    python benchmarks/attention.py [--seq 1024,4096,16384] [--repeats 3]
                                   [--impls auto,xla,blockwise] [--dense-max-seq 8192]
                                   [--heads 8 --dim 64 --dtype float32]

Each (implementation, length) runs in a process of its own (resident_memory.py says how memory
is read): "peak" is the highest resident set above the one before
the first call (so it includes compiling the programs, some 20-150 MiB that does not grow with
L), "steady" the highest above the one after it, during the timed calls (XLA:CPU keeps an
executable's temporary buffers between calls, so for its programs this undercounts: the
first call's are already resident). Dense programs ("xla", JAX's) need several L x L float32
arrays per head; above --dense-max-seq they are not run (16384 would need ~40 GiB).
Times are the range (min-max) of --repeats calls after the warm-up.

    python benchmarks/attention.py --target v5e:1x1 [--seq 128,256,384,512,1024,2048]
                                   [--dtype bfloat16 --heads 16]

compiles instead each implementation's forward+backward program (torchtpu's lowering of the op,
as a TPU would build it) and JAX's for a TPU slice with libtpu's compiler, no TPU needed
(docs/tpu.md), and prints the compiler's bytes, roofline and HBM: what `choose` on a TPU is
set by.  `--impls flex_splash` adds FlexAttention's splash kernel with a causal block mask,
and `--kv-heads` grouped-query heads.  libtpu does not cost Pallas kernels (their roofline leaves the kernel out).
"""
import argparse
import json
import time

from resident_memory import reset_peak, run_worker, status


def _measure(step, repeats):
    base = status("VmRSS")
    step()
    warm = status("VmRSS")
    peak_warm = status("VmHWM")
    reset_peak()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = max(peak_warm, status("VmHWM"))
    return dict(times=times, peak=peak - base, steady=status("VmHWM") - warm)


def _torch_step(impl, seq, heads, dim, dtype):
    import torch
    import torch.nn.functional as F
    device = "cpu" if impl == "torch" else "tpu"
    if device == "tpu":
        import torchtpu  # noqa: F401
        torch.tpu.attention_implementation = None if impl == "auto" else impl
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, dtype=dtype, device=device, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, seq, dim, dtype=dtype, device=device)
    if device == "tpu":  # the inputs' own programs compile and run before the measurement
        torch.tpu.synchronize()

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        if device == "tpu":
            torch.tpu.synchronize()
        q.grad = k.grad = v.grad = None
    return step


def _jax_step(seq, heads, dim, dtype):
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (1, seq, heads, dim), getattr(jnp, dtype))
                  for key in keys)
    jax.block_until_ready((q, k, v, g))

    @jax.jit
    def fwd_bwd(q, k, v, g):
        out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                           q, k, v)
        return out, vjp(g)

    def step():
        jax.block_until_ready(fwd_bwd(q, k, v, g))
    return step


def _target_rows(a):
    """Each implementation's forward+backward at each length, compiled for `a.target`."""
    import jax
    import jax.numpy as jnp
    from torchtpu._core import tpu_compiler
    import numpy as np
    from torchtpu._lowerings import accelerated_attention, attention, flex_attention
    impls = [i for i in a.impls.split(",") if i != "auto"] + ["jax"]
    kv_heads = a.kv_heads or a.heads
    print(f"causal SDPA forward+backward, batch 1, {a.heads} heads ({kv_heads} of keys and "
          f"values), head dim {a.dim}, {a.dtype}; compiled for {a.target}")
    print(f"{'L':>6s} {'program':14s} {'MB':>9s} {'roofline ms':>12s} {'HBM MiB':>9s} "
          f"{'temp MiB':>9s} {'compile s':>9s}  {'roofline / JAX':>14s}")
    scale = a.dim ** -0.5
    for seq in map(int, a.seq.split(",")):
        s = jax.ShapeDtypeStruct((1, a.heads, seq, a.dim), getattr(jnp, a.dtype))
        kv = jax.ShapeDtypeStruct((1, kv_heads, seq, a.dim), getattr(jnp, a.dtype))
        reports = {}
        for impl in impls:
            if impl == "jax":
                def fwd_bwd(q, k, v, g):
                    out, vjp = jax.vjp(lambda *qkv: jax.nn.dot_product_attention(
                        *(x.swapaxes(1, 2) for x in qkv), is_causal=True), q, k, v)
                    return out, vjp(g.swapaxes(1, 2))
            elif impl == "flex_splash":  # FlexAttention's splash kernel, a causal block mask
                key = accelerated_attention.register_splash_mask(
                    np.tril(np.ones((seq, seq), bool))[None, None])

                def fwd_bwd(q, k, v, g, key=key):
                    out, lse = flex_attention.flex_splash(q, k, v, key, scale)
                    return out, flex_attention.flex_splash_backward(g, q, k, v, key, scale)
            else:
                def fwd_bwd(q, k, v, g, impl=impl):
                    out, lse = attention.attention_forward(q, k, v, None, None, 0.0, True,
                                                           scale, impl)
                    return attention.attention_backward(g, q, k, v, None, None, out, lse, 0.0,
                                                        True, scale, impl, False)[:3]
            reports[impl] = tpu_compiler.compile_for(jax.jit(fwd_bwd), (s, kv, kv, s), a.target,
                                                     f"{impl} L={seq}")
        base = reports["jax"].optimal_seconds
        for impl, r in reports.items():
            if r.error:
                print(f"{seq:6d} {impl:14s} {r.error}")
                continue
            print(f"{seq:6d} {impl:14s} {r.bytes_accessed / 1e6:9.1f} "
                  f"{r.optimal_seconds * 1e3:12.3f} {r.hbm_bytes / 2**20:9.1f} "
                  f"{r.temp_bytes / 2**20:9.1f} {r.compile_seconds:9.1f}  "
                  f"{r.optimal_seconds / base:13.2f}x")


def worker(impl, seq, heads, dim, dtype, repeats):
    if impl == "jax":
        step = _jax_step(seq, heads, dim, dtype)
    else:
        step = _torch_step(impl, seq, heads, dim, dtype)
    result = _measure(step, repeats)
    if impl not in ("jax", "torch"):
        import torchtpu
        result["chosen"] = sorted(k.split("::")[1] for k in torchtpu.metrics()
                                  if k.startswith("attention::"))
    print(json.dumps(result))


def run(impl, seq, a):
    return run_worker(__file__, [impl, "--seq", str(seq), "--heads", str(a.heads), "--dim",
                                 str(a.dim), "--dtype", a.dtype, "--repeats", str(a.repeats)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="1024,4096,16384")
    ap.add_argument("--impls", default="auto,xla,blockwise")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dense-max-seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="heads of keys and values (grouped-query attention; --target only)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--worker")
    ap.add_argument("--target", help="a TPU slice (v5e:1x1) to compile each program for, "
                                     "untimed")
    a = ap.parse_args()
    if a.target:
        return _target_rows(a)
    if a.worker:
        return worker(a.worker, int(a.seq), a.heads, a.dim, a.dtype, a.repeats)
    print(f"causal SDPA forward+backward, batch 1, {a.heads} heads, head dim {a.dim}, {a.dtype}; "
          f"seconds per call (min-max of {a.repeats}), peak / steady resident MiB")
    print(f"{'L':>6s} {'run':18s} {'seconds':>15s} {'peak':>7s} {'steady':>7s}  "
          f"{'time / JAX':>10s} {'peak / torch':>12s}")
    for seq in map(int, a.seq.split(",")):
        rows = {}
        names = [f"tpu:{i}" for i in a.impls.split(",")] + ["torch", "jax"]
        for name in names:
            impl = name.split(":")[-1]
            if impl in ("xla", "jax") and seq > a.dense_max_seq:
                rows[name] = dict(error=f"not run (dense, L > {a.dense_max_seq})")
                continue
            rows[name] = run(impl, seq, a)
        jax_t = min(rows["jax"]["times"]) if "times" in rows["jax"] else None
        torch_peak = rows["torch"].get("peak")
        for name in names:
            r = rows[name]
            label = name + (f" ({','.join(r['chosen'])})" if r.get("chosen") and
                            name == "tpu:auto" else "")
            if "error" in r:
                print(f"{seq:6d} {label:18s} {r['error']}")
                continue
            t = r["times"]
            vs_jax = f"{min(t) / jax_t:.2f}x" if jax_t else "-"
            vs_torch = f"{r['peak'] / torch_peak:.2f}x" if torch_peak else "-"
            print(f"{seq:6d} {label:18s} {min(t):7.3f}-{max(t):7.3f} {r['peak']:7.0f} "
                  f"{r['steady']:7.0f}  {vs_jax:>10s} {vs_torch:>12s}", flush=True)


if __name__ == "__main__":
    main()
