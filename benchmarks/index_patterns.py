"""New advanced-indexing patterns, as PyTorch's `test_advancedindex` (float64) writes them:
about 100 index patterns on [4, 5], [4, 8, 5] and [3, 9, 8, 6] tensors, each read (`x[ix]`),
set to a number and to a tensor, and differentiated, every result compared with NumPy's.

    python benchmarks/index_patterns.py

Each pattern's shapes make a program of their own.  Printed, each in a fresh process with cold
caches: the workload on tpu (strict eager; small index ops of new patterns run on the host,
advanced_indexing.py), on tpu compiling every pattern (TORCHTPU_INDEX_HOST_SECONDS=0), on
torch's CPU, and the same gets, sets and scatter-adds written in JAX (eager `x[ix]` and
`x.at[ix]`, which compile per pattern too), with the executables each built.
"""
import json
import os
import subprocess
import sys
import time

S, E = slice(None), Ellipsis

p1 = [(S, [1, 3]), ([0, 2], S), (S, [[0, 1], [2, 3]]), ([-1], [0]), ([0, 2], [-1]), (S, [-1])]

p2 = [(S, S, (0, 3, 4)), (S, (2, 4, 5, 7), S), ((2, 3), S, S), (S, (0, 2, 3), (1, 3, 4)),
      (S, (0,), (1, 2, 4)), (S, (0, 1, 3), (4,)), (S, ((0, 1), (1, 0)), ((2, 3),)),
      (S, ((0, 1), (2, 3)), ((0,),)), (S, ((5, 6),), ((0, 3), (4, 4))), ((0, 2, 3), (1, 3, 4), S),
      ((0,), (1, 2, 4), S), ((0, 1, 3), (4,), S), (((0, 1), (1, 0)), ((2, 1), (3, 5)), S),
      (((0, 1), (1, 0)), ((2, 3),), S), (((0, 1), (2, 3)), ((0,),), S),
      (((2, 1),), ((0, 3), (4, 4)), S), (((2,),), ((0, 3), (4, 1)), S), ((0, 2, 3), S, (1, 3, 4)),
      ((0, 2),), ((0, 2), S), ((0, 2), E), ((0, 2), S, E), ((0, 2), E, S), ((0, 2), (1, 3)),
      ((0, 2), (1, 3), E), (E, (1, 3), (2, 3)), (E, (2, 3, 4)), (E, S, (2, 3, 4)), (S, E, (2, 3, 4)),
      (E, S, S, (0, 3, 4)), (S, E, S, (0, 3, 4)), (S, S, E, (0, 3, 4)), (S, S, (0, 3, 4), E),
      (E, ((0, 1), (1, 0)), ((2, 1), (3, 5)), S), (((0, 1), (1, 0)), ((2, 1), (3, 5)), E, S),
      (((0, 1), (1, 0)), ((2, 1), (3, 5)), S, E)]

p3 = [(S, S, S, (0, 3, 4)), (S, S, (2, 4, 5, 7), S), (S, (2, 3), S, S), ((1, 2), S, S, S),
      (S, S, (0, 2, 3), (1, 3, 4)), (S, S, (0,), (1, 2, 4)), (S, S, (0, 1, 3), (4,)),
      (S, S, ((0, 1), (1, 0)), ((2, 3),)), (S, S, ((0, 1), (2, 3)), ((0,),)),
      (S, S, ((5, 6),), ((0, 3), (4, 4))), (S, (0, 2, 3), (1, 3, 4), S), (S, (0,), (1, 2, 4), S),
      (S, (0, 1, 3), (4,), S), (S, ((0, 1), (3, 4)), ((2, 3), (0, 1)), S),
      (S, ((0, 1), (3, 4)), ((2, 3),), S), (S, ((0, 1), (3, 2)), ((0,),), S),
      (S, ((2, 1),), ((0, 3), (6, 4)), S), (S, ((2,),), ((0, 3), (4, 2)), S),
      ((0, 1, 2), (1, 3, 4), S, S), ((0,), (1, 2, 4), S, S), ((0, 1, 2), (4,), S, S),
      (((0, 1), (0, 2)), ((2, 4), (1, 5)), S, S), (((0, 1), (1, 2)), ((2, 0),), S, S),
      (((2, 2),), ((0, 3), (4, 5)), S, S), (((2,),), ((0, 3), (4, 5)), S, S),
      (S, (3, 4, 6), (0, 2, 3), (1, 3, 4)), (S, (2, 3, 4), (1, 3, 4), (4,)),
      (S, (0, 1, 3), (4,), (1, 3, 4)), (S, (6,), (0, 2, 3), (1, 3, 4)), (S, (2, 3, 5), (3,), (4,)),
      (S, (0,), (4,), (1, 3, 4)), (S, (6,), (0, 2, 3), (1,)),
      (S, ((0, 3), (3, 6)), ((0, 1), (1, 3)), ((5, 3), (1, 2))), ((2, 2, 1), (0, 2, 3), (1, 3, 4), S),
      ((2, 0, 1), (1, 2, 3), (4,), S), ((0, 1, 2), (4,), (1, 3, 4), S), ((0,), (0, 2, 3), (1, 3, 4), S),
      ((0, 2, 1), (3,), (4,), S), ((0,), (4,), (1, 3, 4), S), ((1,), (0, 2, 3), (1,), S),
      (((1, 2), (1, 2)), ((0, 1), (2, 3)), ((2, 3), (3, 5)), S), (E, (0, 3, 4)), (E, S, (0, 3, 4)),
      (E, S, S, (0, 3, 4)), (S, E, (0, 3, 4)), (S, S, E, (0, 3, 4)), (S, (0, 2, 3), (1, 3, 4)),
      (S, (0, 2, 3), (1, 3, 4), E), (E, (0, 2, 3), (1, 3, 4), S), ((0,), (1, 2, 4)),
      ((0,), (1, 2, 4), S), ((0,), (1, 2, 4), E), ((0,), (1, 2, 4), E, S), ((1,),),
      ((0, 2, 1), (3,), (4,)), ((0, 2, 1), (3,), (4,), S), ((0, 2, 1), (3,), (4,), E),
      (E, (0, 2, 1), (3,), (4,))]


def patterns():
    """(shape, patterns read/set, patterns differentiated) of the test."""
    return [((4, 5), p1 + [(S, [0, 1, 1, 2, 2])], p1),
            ((4, 8, 5), p2, p2),
            ((3, 9, 8, 6), p3 + p3, p3 + [(S, S, [[0, 1], [1, 0]], [[2, 3], [3, 0]]),
                                          (S, S, [[2]], [[0, 3], [4, 4]])])]


def run_torch(device):
    import numpy as np
    import torch
    import torchtpu  # noqa: F401

    def np_idx(ix):
        return tuple(i.tolist() if isinstance(i, torch.Tensor) else i for i in ix)

    def eq(a, b):
        torch.testing.assert_close(a.cpu(), b, check_dtype=False)

    t0 = time.perf_counter()
    for shape, sets, grads in patterns():
        n = int(np.prod(shape))
        x = torch.arange(0.0, n, dtype=torch.double, device=device).view(shape)
        for ix in sets:
            eq(x[ix], torch.tensor(x.cpu().numpy()[np_idx(ix)]))
            for value in (1333, None):
                if value is None:
                    value = torch.randperm(x[ix].numel()).view(x[ix].shape).double().to(device)
                y = x.clone()
                y[ix] = value
                ref = x.cpu().numpy().copy()
                ref[np_idx(ix)] = value if isinstance(value, int) else value.cpu().numpy()
                eq(y, torch.tensor(ref))
        for ix in grads:
            cpu = x.float().detach().cpu().requires_grad_(True)
            out = cpu[ix]
            g = torch.rand_like(out)
            out.backward(g)
            dev = cpu.detach().to(device).requires_grad_(True)
            dev[ix].backward(g.to(device))
            eq(dev.grad, cpu.grad)
    seconds = time.perf_counter() - t0
    built = torchtpu.metrics().get("executables_compiled", 0) if device == "tpu" else 0
    return seconds, built


def run_jax():
    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_enable_x64", True)
    built = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: built.append(1)
        if event == "/jax/core/compile/backend_compile_duration" else None)

    def jnp_idx(ix):
        return tuple(jnp.asarray(i) if isinstance(i, (list, tuple)) else i for i in ix)

    t0 = time.perf_counter()
    for shape, sets, grads in patterns():
        x = jnp.arange(float(np.prod(shape))).reshape(shape)
        for ix in sets:
            ix = jnp_idx(ix)
            r = np.asarray(x[ix])
            np.asarray(x.at[ix].set(1333.0))
            np.asarray(x.at[ix].set(jnp.ones(r.shape)))
        for ix in grads:
            ix = jnp_idx(ix)
            g = jnp.ones(x[ix].shape, jnp.float32)
            np.asarray(jnp.zeros(shape, jnp.float32).at[ix].add(g))
    return time.perf_counter() - t0, len(built)


def child(kind):
    seconds, built = run_jax() if kind == "jax" else run_torch(kind)
    print(json.dumps({"seconds": seconds, "built": built}))


def main():
    env = dict(os.environ, TORCHTPU_CACHE_DIR="", JAX_COMPILATION_CACHE_DIR="")
    runs = {}
    for kind, extra in (("tpu", {}), ("tpu, every pattern compiled", {"TORCHTPU_INDEX_HOST_SECONDS": "0"}),
                        ("cpu", {}), ("jax", {})):
        out = subprocess.run([sys.executable, __file__, "--child", kind.split(",")[0]],
                             env=dict(env, **extra), capture_output=True, text=True, check=True)
        runs[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    cpu, jx = runs["cpu"]["seconds"], runs["jax"]["seconds"]
    for kind, r in runs.items():
        built = "" if kind == "cpu" else f", {r['built']} executables built"
        print(f"{kind:30s} {r['seconds']:6.1f} s = {r['seconds'] / cpu:5.1f}x torch CPU, "
              f"{r['seconds'] / jx:5.2f}x JAX{built}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
