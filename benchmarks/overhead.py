"""Per-op overhead: a chain of small elementwise ops on tpu (strict eager, and the recording
cost of fused eager, and a torch.tpu graph of the whole chain replayed) vs native torch CPU
eager vs the same ops as cached jax.jit calls written directly in JAX, and as one jax.jit;
also the chain under torch.compile(backend="tpu") and mode="reduce-overhead" (one executable
replayed), with the compilations and blocking waits of the host per steady run.

It also measures the floor under fused recording, in a child process: the same chain with the
tpu kernels of mul and add replaced by Python kernels that only return their input (PyTorch's
dispatch from `x * s` to a Python kernel) or a new tpu tensor (dispatch plus creating the
output tensor over a new storage, as every recorded op must), so the recording cost splits into
what any Python kernel pays and what torchtpu's own recording adds; and a third kernel that
records as little as a recording can (a key of its operands, one dict lookup, an entry in a
trace, an output over a pending value), the least any recording written in Python adds.
A fourth does the least a strict-eager kernel can do (call the op's own executable on its
input's array and give the result a new tensor: no key, no look-up, no checks); the child times
the chain as jax.jit calls beside it, so that floor's ratio to jax.jit is measured in one
process.

    python benchmarks/overhead.py [--ops 2000] [--size 64]
"""
import argparse
import json
import os
import subprocess
import sys
import time
import types
import warnings

import jax
import jax.numpy as jnp
import torch

import torchtpu  # noqa: F401


def chain_torch(x, n):
    for i in range(n // 2):
        x = x * 1.0001
        x = x + 0.0001
    return x


def _jax_chain(x_cpu, n):
    """The chain as cached jax.jit calls, each op a call (run it twice: the first compiles)."""
    mul = jax.jit(lambda x, s: x * s)
    add = jax.jit(lambda x, s: x + s)
    xj = jnp.asarray(x_cpu.numpy())

    def run_jax():
        y = xj
        for i in range(n // 2):
            y = mul(y, 1.0001)
            y = add(y, 0.0001)
        y.block_until_ready()
        return y
    return run_jax


def _recording_time(x, n):
    """Seconds spent recording the chain in fused mode (leaving the mode then runs it)."""
    with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
        t0 = time.perf_counter()
        chain_torch(x, n)
        recorded = time.perf_counter() - t0
    torch.tpu.synchronize()
    return recorded


def timed(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _floor(size, n):
    """Seconds per op of the chain: torch CPU, then tpu with Python kernels that do only the
    least a kernel can do (run in a process of its own: it replaces torchtpu's kernels)."""
    from torchtpu._core import storage
    x_cpu = torch.randn(size, size)
    x = x_cpu.to("tpu")
    nbytes = x.untyped_storage().nbytes()

    def identity(a, b, **kwargs):
        return a

    def new_output(a, b, **kwargs):
        return storage.wrap(None, a.shape, a.stride(), a.dtype, a.device.index, nbytes)

    trace = types.SimpleNamespace(entries=[], pendings=[])
    programs = {}

    def minimal_recording(a, b, **kwargs):
        # The least a recording kernel adds to the floor: a key of its operands (the tensor's
        # layout and storage, the number's type), one dict lookup, an entry in the trace, and
        # an output over a pending value.
        buf = a.untyped_storage()._tpu
        key = (a.dtype, a.shape, a.stride(), a.storage_offset(), type(b), buf.index)
        program = programs.get(key)
        if program is None:
            program = programs[key] = object()
        pendings = trace.pendings
        p = storage.Pending(trace, len(pendings))
        pendings.append(p)
        trace.entries.append((program, buf, b))
        return storage.wrap(p, a.shape, a.stride(), a.dtype, buf.index, nbytes)

    def recorded_chain():
        trace.entries.clear()
        trace.pendings.clear()
        return chain_torch(x, n)

    strict_floor = {}
    for op, number in (("mul", 1.0001), ("add", 0.0001)):
        strict_floor[op] = _least_strict_kernel(x, getattr(torch.ops.aten, op).Tensor, number)

    run_jax = _jax_chain(x_cpu, n)
    run_jax()
    result = {"cpu": min(timed(lambda: chain_torch(x_cpu, n)) for _ in range(3)) / n}
    libraries = []  # kept: a Library's registrations end when it is freed
    for name, kernels in (("dispatch", identity), ("dispatch_and_output", new_output),
                          ("minimal_recording", minimal_recording), ("strict_floor", strict_floor)):
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for op in ("mul", "add"):
                lib.impl(f"{op}.Tensor", kernels[op] if isinstance(kernels, dict) else kernels,
                         "PrivateUse1")
        libraries.append(lib)
        if name != "strict_floor":
            result[name] = min(timed(recorded_chain) for _ in range(3)) / n
            continue

        def synced():  # timed to its result, as strict eager is
            recorded_chain().untyped_storage()._tpu.value().block_until_ready()
        before = min(timed(synced) for _ in range(3))
        result["jax"] = min(timed(run_jax) for _ in range(3)) / n  # beside it, in turn
        result[name] = min(before, min(timed(synced) for _ in range(3))) / n
    return result


def _least_strict_kernel(x, overload, number):
    """A Python kernel doing the least any strict-eager kernel of `x * number` (or +) can do:
    call the op's own executable (built here by torchtpu's kernel) on its input's array and the
    number's device scalar, and give the result a new tensor over a new storage.  No key, no
    look-up, no checks: it assumes every call is this one."""
    from torchtpu._core import registry, storage
    from torchtpu._execution import kernels, op_keys
    kernel = kernels.kernel_for(overload)
    for _ in range(3):  # builds the executable; the number's device scalar is cached from its 2nd use
        overload(x, number)
    torch.tpu.synchronize()
    call = op_keys.key_of(kernel.args, registry.bind(kernel.params, (x, number), {}), kernel.low.precision)
    compiled = kernel.cache[call.key]
    run, scalars = compiled.fn.last, op_keys.device_scalars(call.scalars, call.device)
    (shape, stride, dtype, nbytes), = compiled.wrap_specs

    def least_strict(a, b, **kwargs):
        outs = run(a.untyped_storage()._tpu.value(), *scalars)[0]
        return storage.wrap(outs[0], shape, stride, dtype, 0, nbytes)
    return least_strict


def _floor_in_child(size, n):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--floor-child",
                          "--ops", str(n), "--size", str(size)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    n = a.ops
    if a.floor_child:
        print(json.dumps(_floor(a.size, n)))
        return

    torch.manual_seed(0)
    x_cpu = torch.randn(a.size, a.size)
    x_tpu = x_cpu.to("tpu")

    def run_tpu():
        y = chain_torch(x_tpu, n)
        torch.tpu.synchronize()
        return y

    def run_fused():
        with torch.tpu.set_eager_mode("DEFER_AND_FUSE"):
            return chain_torch(x_tpu, n)

    def run_fused_synced():
        y = run_fused()
        torch.tpu.synchronize()
        return y

    run_jax = _jax_chain(x_cpu, n)
    x_jax = jnp.asarray(x_cpu.numpy())

    g = torch.tpu.TPUGraph()
    x_static = x_tpu.clone()
    with torch.tpu.graph(g):
        y_static = chain_torch(x_static, n)

    def run_graph():
        g.replay()
        torch.tpu.synchronize()
        return y_static

    compiled = torch.compile(lambda x: chain_torch(x, n), backend="tpu")
    onestep = torch.compile(lambda x: chain_torch(x, n), backend="tpu", mode="reduce-overhead")

    def run_compiled(fn):
        def run():
            y = fn(x_tpu)
            torch.tpu.synchronize()
            return y
        return run

    whole = jax.jit(lambda x: chain_torch(x, n))  # the same Python, on JAX arrays

    def run_jax_whole():
        return whole(x_jax).block_until_ready()

    run_tpu(), run_jax(), chain_torch(x_cpu, n), run_fused_synced()  # warm-up: compile and cache
    run_graph(), run_jax_whole()
    for _ in range(4):  # onestep: two Dynamo-compiled calls, the capture, a replay
        run_compiled(compiled)(), run_compiled(onestep)()
    steady = {}
    for name, fn in (("compiled", compiled), ("onestep", onestep), ("graph", g.replay)):
        before = torchtpu.metrics()
        fn() if name == "graph" else fn(x_tpu)
        after = torchtpu.metrics()
        torch.tpu.synchronize()
        steady[name] = [after.get(k, 0) - before.get(k, 0) for k in ("blocking_waits",)] + [
            sum(after.get(k, 0) - before.get(k, 0) for k in
                ("compiles", "segment_compiles", "graph_compiles", "tpu_graph_compiles"))]
    t_tpu = timed(run_tpu) / n * 1e6
    # Leaving the fused mode runs the recorded chain: time recording alone, then with the run.
    t_record = min(_recording_time(x_tpu, n) for _ in range(3)) / n * 1e6
    t_fused = timed(run_fused_synced) / n * 1e6
    t_cpu = timed(lambda: chain_torch(x_cpu, n)) / n * 1e6
    t_jax = timed(run_jax) / n * 1e6
    t_graph = timed(run_graph, 20) / n * 1e6
    t_whole = timed(run_jax_whole, 20) / n * 1e6
    t_compiled = timed(run_compiled(compiled), 20) / n * 1e6
    t_onestep = timed(run_compiled(onestep), 20) / n * 1e6
    # One program for the chain contracts each mul and add into a fused multiply-add
    # (docs/execution.md, "Fused eager"): over 2000 ops the last bits drift, by up to about 1e-4
    # relative.
    torch.testing.assert_close(run_graph().cpu(), chain_torch(x_cpu, n), rtol=1e-3, atol=1e-5)
    assert torch.allclose(run_tpu().cpu(), chain_torch(x_cpu, n), rtol=1e-4, atol=1e-5)
    print(f"chain of {n} elementwise ops on {a.size}x{a.size} float32")
    print(f"  tpu strict eager : {t_tpu:8.2f} us/op")
    print(f"  torch CPU eager  : {t_cpu:8.2f} us/op")
    print(f"  jax.jit per op   : {t_jax:8.2f} us/op")
    print(f"  ratio tpu / torch CPU : {t_tpu / t_cpu:6.2f}x")
    print(f"  fused: record      : {t_record:8.2f} us/op")
    print(f"  fused: record+run  : {t_fused:8.2f} us/op")
    print(f"  ratio tpu / jax.jit   : {t_tpu / t_jax:6.2f}x   (target <= 2x)")
    floor = _floor_in_child(a.size, n)
    least = floor["strict_floor"] * 1e6
    jax_there = floor["jax"] * 1e6
    print(f"  strict eager, split (floor measured in a child process; jax.jit there {jax_there:.2f} us/op):")
    print(f"    the least a strict kernel does (dispatch, the op's executable, its output): "
          f"{least:8.2f} us/op = {least / jax_there:4.2f}x jax.jit")
    print(f"    torchtpu's own strict work (key, look-up, checks, commit): {t_tpu - least:8.2f} us/op"
          f" (strict eager above less that floor)")
    print(f"  ratio fused recording / torch CPU : {t_record / t_cpu:6.2f}x   (target <= 2x)")
    print(f"  ratio fused record+run / torch CPU: {t_fused / t_cpu:6.2f}x")
    cpu, dispatch, output = (floor[k] * 1e6 for k in ("cpu", "dispatch", "dispatch_and_output"))
    print(f"  fused recording, split (floor measured in a child process; torch CPU there {cpu:.2f} us/op):")
    print(f"    PyTorch's dispatch to a Python kernel    : {dispatch:8.2f} us/op = {dispatch / cpu:5.2f}x torch CPU")
    print(f"    creating the output tensor and storage   : {output - dispatch:8.2f} us/op")
    print(f"    = floor of any Python kernel             : {output:8.2f} us/op = {output / cpu:5.2f}x torch CPU")
    print(f"    torchtpu's own recording (key, trace)    : {t_record - output:8.2f} us/op   (target <= 4)")
    minimal = floor["minimal_recording"] * 1e6
    print(f"    the least a Python recording adds (key, lookup, trace entry, pending output): "
          f"{minimal - output:.2f} us/op")
    for label, t, name in (("graph replay      ", t_graph, "graph"),
                           ("compiled          ", t_compiled, "compiled"),
                           ("compiled 1-exe    ", t_onestep, "onestep")):
        waits, compiles = steady[name]
        print(f"  {label}: {t:8.3f} us/op   ({t / t_cpu:.3f}x torch CPU, {t / t_whole:.2f}x the chain "
              f"as one jax.jit: {t_whole:.3f} us/op) [steady run: {compiles} compilations, "
              f"{waits} blocking waits]")


if __name__ == "__main__":
    main()
