"""Our programs compiled for TPU slices by libtpu's compiler, which runs without a TPU
(torchtpu._core.tpu_compiler, torch.tpu.compile_for, TPUGraph.compile_for)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu
from torchtpu._core import tpu_compiler

pytestmark = pytest.mark.skipif(not tpu_compiler.have_libtpu(),
                                reason="libtpu is not installed (pip install -e '.[test]' brings it)")


def test_libtpu_installed_without_a_tpu_stays_on_the_cpu_quietly():
    """With libtpu installed and no TPU chip, the device is the CPU at once and libtpu says
    nothing (it would print its complaints about the host at JAX's first use)."""
    code = ("import torch, torchtpu; x = torch.ones(2, device='tpu') + 1; "
            "print(torchtpu._runtime.platform(), x.cpu().tolist())")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TORCHTPU_PLATFORM", "JAX_FORCE_TPU_INIT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "[2.0,", "2.0]"]
    assert "TPU" not in out.stderr and "libtpu" not in out.stderr, out.stderr


def test_a_strict_op_compiled_for_v5e_inside_compile_for():
    x = torch.randn(256, 512, device="tpu")
    w = torch.randn(512, 128, device="tpu")
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        y = x @ w
    assert y.shape == (256, 128)  # the op ran here as usual
    torch.testing.assert_close(y.cpu(), x.cpu() @ w.cpu(), rtol=1e-4, atol=1e-4)
    (r,) = [r for r in reports if "mm" in r.name]
    assert not r.error and r.chip == "v5e" and r.fits
    assert r.flops == 2 * 256 * 512 * 128
    # At least its inputs and output cross HBM once; the roofline is positive.
    assert r.bytes_accessed >= 4 * (256 * 512 + 512 * 128 + 256 * 128)
    assert r.optimal_seconds > 0 and r.x64_calls == 0
    assert r.parameters == 2 and r.outputs == 1
    assert r.hbm_capacity == 16 * 2**30 and r.hbm_bytes >= r.argument_bytes > 0
    assert "v5e" in str(r) and "compiled in" in str(r)


def test_attention_compiled_for_a_tpu_target_is_the_tpus_not_the_cpus():
    """The CPU runs L = 128 attention as blockwise loops; the program compiled for v5e is the one
    a TPU would run: the dense program at L = 128, the Pallas kernel (Mosaic, not interpreted)
    at L = 512."""
    from torchtpu._core import metrics
    for length, on_tpu in ((128, "dense"), (512, "pallas")):
        q, k, v = (torch.randn(2, 4, length, 64, device="tpu", requires_grad=True)
                   for _ in range(3))
        torchtpu.clear_caches()
        before = metrics.counters["attention::blockwise"]
        with torch.tpu.compile_for("v5e:1x1") as reports:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        assert metrics.counters["attention::blockwise"] == before + 1  # what ran here
        programs = [r for r in reports if "attention" in r.name]
        assert len(programs) == 2 and not any(r.error for r in programs), reports.table()
        for r in programs:
            assert " while(" not in r.text  # (the blockwise loops are while loops)
            assert ("tpu_custom_call" in r.text) == (on_tpu == "pallas"), r.name


def _mlp_step(capturable):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=capturable)
    x = torch.randn(32, 64, device="tpu")
    y = torch.randint(0, 10, (32,), device="tpu")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss
    return m, step


def test_a_captured_step_compiled_for_v6e():
    m, step = _mlp_step(capturable=True)
    step()
    step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        step()
    before = [p.detach().cpu().clone() for p in m.parameters()]
    r = g.compile_for("v6e:1x1")
    # Compiling for a target neither runs the step nor touches its storages.
    for p, b in zip(m.parameters(), before):
        torch.testing.assert_close(p.detach().cpu(), b, rtol=0, atol=0)
    g.replay()
    assert not r.error, r.error
    # (the roofline is a float32 from which 5 emulated 64-bit calls' -1 s each were taken
    # back: this step's microseconds are below its rounding, see tpu_compiler)
    assert r.chip == "v6e" and r.fits and r.optimal_seconds >= 0
    # forward + backward of two Linear layers at least: 3 matmuls each.
    assert r.flops >= 3 * 2 * 32 * (64 * 128 + 128 * 10)
    # The step's parameters, gradients and AdamW's moments are its inputs and results.
    n = sum(p.numel() for p in m.parameters())
    assert r.argument_bytes >= 4 * n * 4
    assert r.alias_bytes >= 4 * n * 3  # parameters, moments: written in place
    with pytest.raises(RuntimeError, match="not captured"):
        torch.tpu.TPUGraph().compile_for("v5e:1x1")


def test_64_bit_emulation_is_counted_and_the_roofline_corrected():
    """libtpu's cost model counts each X64Split*/X64Combine as -1 s; the report adds them back."""
    x = jax.ShapeDtypeStruct((1024,), jnp.int64)
    r = tpu_compiler.compile_for(jax.jit(lambda a: (a * 3 + 1).sum()), (x,), "v5e:1x1")
    assert r.x64_calls >= 3
    assert 0 <= r.optimal_seconds < 1e-3


def test_a_roofline_that_leaves_out_conditional_branches_says_so():
    """libtpu's roofline costs a conditional's first branch only (a user's `lax.cond`, or a
    step whose work sits in a later branch): the report says so, and adds back only the -1 s
    calls the cost model counted."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    n = jax.ShapeDtypeStruct((1024,), jnp.int64)

    def f(a, i, ok):
        return jax.lax.cond(ok, lambda: (a @ a, i * 3 + 1), lambda: (a, i))

    r = tpu_compiler.compile_for(jax.jit(f), (x, n, jax.ShapeDtypeStruct((), jnp.bool_)), "v5e:1x1")
    assert not r.error and not r.branches_costed
    assert "its first branch only" in str(r)
    assert 0 <= r.optimal_seconds < 1e-3, r.optimal_seconds
    plain = tpu_compiler.compile_for(jax.jit(lambda a: a @ a), (x,), "v5e:1x1")
    assert plain.branches_costed and plain.optimal_seconds >= 2 * 1024**3 / 197e12


def test_a_program_larger_than_the_chip_is_reported_not_raised():
    big = jax.ShapeDtypeStruct((5 * 2**30,), jnp.float32)  # 20 GiB, a v5e chip has 16
    r = tpu_compiler.compile_for(jax.jit(lambda a: a * 2), (big,), "v5e:1x1")
    assert not r.fits
    assert r.error or r.hbm_bytes > r.hbm_capacity
    assert "v5e:1x1" in str(r)


def test_collectives_and_their_overlap_are_read_from_the_tpu_schedule():
    """An FSDP-like step on 4 chips: the weights' all-gathers are scheduled by the TPU compiler,
    some inside async collective fusions (overlapped with the matmuls)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devices = tpu_compiler.topology("v5e:2x2")
    mesh = Mesh(tpu_compiler._grid(devices, (4,)), ("fsdp",))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())))
        return x.sum()

    def step(ws, x):
        return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws, x))]

    shard = NamedSharding(mesh, P("fsdp"))
    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=shard) for _ in range(4)]
    x = jax.ShapeDtypeStruct((4 * 1024, 1024), jnp.bfloat16, sharding=shard)
    r = tpu_compiler.compile_for(jax.jit(step), (ws, x), "v5e:2x2")
    assert not r.error, r.error
    gathers, overlapped = r.collectives["all-gather"]
    assert gathers >= 4 and 1 <= overlapped <= gathers


def test_collective_bytes_are_counted_once_per_collective():
    """A tuple-typed all-reduce (its type holds `/*index=5*/` comments) is read, and an
    all-gather overlapped across a chain of async collective fusions (each naming it, beside
    its start and done halves) is one collective."""
    text = """HloModule m

%fused_start (p: bf16[4]) -> (bf16[4], bf16[16]) {
  %p = bf16[4]{0} parameter(0)
  %ag.1 = bf16[16]{0:T(1024)} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
  ROOT %cc = (bf16[4]{0}, bf16[16]{0}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (p: bf16[4]) -> bf16[16] {
  %p = bf16[4]{0} parameter(0)
  ROOT %ag.2 = bf16[16]{0:T(1024)} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
}

%async_collective_fusion.2 (p: bf16[4]) -> bf16[16] {
  %p = bf16[4]{0} parameter(0)
  ROOT %ag.3 = bf16[16]{0:T(1024)} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}
}

ENTRY %main (a: f32[8], b: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %ar = (f32[8]{0:T(128)S(1)}, f32[8]{0}, f32[8]{0}, f32[8]{0}, f32[8]{0}, /*index=5*/f32[8]{0}) all-reduce(%a, %b, %a, %b, %a, /*index=5*/%b), channel_id=2, replica_groups=[1,4]<=[4], to_apply=%add
  %f = (f32[8]{0}, f32[8]{0}, /*index=5*/f32[8]{0}) fusion(%a), kind=kLoop, calls=%x
  ROOT %gte = f32[8]{0} get-tuple-element(%ar), index=0
}
"""
    assert tpu_compiler.collectives(text) == {"all-gather": (1, 1), "all-reduce": (1, 0)}
    sent = tpu_compiler.collective_bytes(text)
    assert sent["all-gather"] == (16 * 2 * 3 / 4, 16 * 2 * 3 / 4)  # the whole, less one's own
    assert sent["all-reduce"] == (6 * 8 * 4 * 2 * 3 / 4, 0.0)     # twice, for an all-reduce
    assert [op for _, op in tpu_compiler.entry_instructions(text)] == [
        "parameter", "parameter", "all-reduce", "fusion", "get-tuple-element"]


def _fsdp_collective(body, shapes, target="v5e:2x2", whole=False):
    """`body` (per chip, over axis spmd.AXIS) compiled for `target` as our lowerings build it,
    on arrays of `shapes` sharded over the chips (`whole`: each chip's input is the whole)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from torchtpu._execution import spmd
    devices = tpu_compiler.topology(target)
    mesh = Mesh(np.array(devices), (spmd.AXIS,))
    spec = P() if whole else P(spmd.AXIS)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(spmd.AXIS),
                               check_vma=False))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
            for s in shapes]
    r = tpu_compiler.compile_for(fn, args, target)
    assert not r.error, r.error
    return r


def test_an_fsdp_all_gather_of_any_length_stays_an_all_gather_on_tpu():
    """FSDP2 gathers a unit's padded shards concatenated, of any length; XLA:TPU compiles an
    all-gather of a part that is not whole 1024-element tiles as an all-reduce of the whole
    buffer (twice the bytes, never overlapped): the lowering gathers whole tiles."""
    from jax import lax
    from torchtpu._distributed import collective_ops
    from torchtpu._execution import spmd
    raw = _fsdp_collective(lambda x: lax.all_gather(x, spmd.AXIS, tiled=True)[:x.size] * 2,
                           [(4 * 8208,)])
    ours = _fsdp_collective(lambda x: collective_ops._all_gather(x)[:x.size] * 2, [(4 * 8208,)])
    assert set(raw.collectives) == {"all-reduce"}  # (what libtpu does with it)
    assert set(ours.collectives) == {"all-gather"}
    # (its padding to whole tiles is sent too: 9,216 elements of 8,208 here)
    assert ours.collective_bytes["all-gather"][0] < raw.collective_bytes["all-reduce"][0] / 1.7


def test_the_roofline_adds_back_the_calls_libtpu_costs_as_minus_one_second():
    """libtpu's optimal_seconds counts each of these custom calls as -1 s: on v6e the pair that
    starts a scatter offloaded to the SparseCore (JAX's 8B FSDP step: -1.96 s for one layer)."""
    import types
    text = """HloModule m

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %prepare_start = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  ROOT %split = u32[8]{0} custom-call(%p), custom_call_target="X64SplitLow"
}
"""
    memory = types.SimpleNamespace(argument_size_in_bytes=32, output_size_in_bytes=32,
                                   alias_size_in_bytes=0, temp_size_in_bytes=0)
    compiled = types.SimpleNamespace(
        as_text=lambda: text, cost_analysis=lambda: {"optimal_seconds": -3 + 0.04, "flops": 1.0},
        memory_analysis=lambda: memory, out_info=())
    r = tpu_compiler.read(compiled, tpu_compiler.Report("stub", "v6e:1x1"))
    assert r.optimal_seconds == pytest.approx(0.04) and r.x64_calls == 1


def test_unknown_targets_and_bad_names_raise_value_error():
    with pytest.raises(ValueError, match="v5e:1x1"):
        torch.tpu.compile_for("v5e")
    with pytest.raises(ValueError, match="does not know"):
        torch.tpu.compile_for("v99:7x7")


def test_fused_segments_and_compiled_graphs_compile_for_the_target_too():
    x = torch.randn(64, 64, device="tpu")
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            fused = (x.sin() * 2 + 1).sum()
            fused.item()  # runs the segment, built (and compiled for v5e) now
        before = len(reports)
        graph = torch.compile(lambda a: (a @ a).relu().sum(), backend="tpu")(x)
    torch.testing.assert_close(fused.cpu(), (x.cpu().sin() * 2 + 1).sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(graph.cpu(), (x.cpu() @ x.cpu()).relu().sum(), rtol=1e-4, atol=1e-2)
    segments = [r for r in reports[:before] if r.name.startswith("segment of")]
    graphs = [r for r in reports[before:] if r.name.startswith("segment of")]
    assert segments and graphs
    assert all(not r.error and r.chip == "v5e" for r in segments + graphs)
    assert any(r.flops >= 2 * 64 ** 3 for r in graphs)  # the compiled graph's matmul
    assert reports.total()["programs"] == len(reports) and reports.total()["errors"] == 0


def test_a_program_over_a_process_groups_mesh_compiles_for_the_targets_chips():
    """A program every rank of a group runs (spmd: a shard_map over the group's mesh, here a
    one-rank group) compiles for the target's chips, not this process's devices, with its
    packed host numbers placed on the same chips."""
    import numpy as np
    from torchtpu._execution import spmd
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (spmd.AXIS,))

    def step(x, packed):
        return (jax.lax.psum(x * packed[0], spmd.AXIS) @ x.T,)

    program = spmd.Program(step, mesh, [spmd.describe_collective("all_reduce", "g", "float32", (64, 32))],
                           None, "psum", "psum")
    x = jnp.ones((64, 32), jnp.float32)
    r = program.compile_for("v5e:2x2", x, np.array([2.0], np.float32))
    assert not r.error, r.error
    assert r.chip == "v5e" and r.flops >= 2 * 64 * 64 * 32
    # (a one-rank group's psum is no collective; two ranks': `benchmarks/scaling.py --target`)
    (out,) = program(x, np.array([2.0], np.float32))  # it still runs here
    assert float(out[0, 0]) == 2 * 32


def test_builds_on_other_threads_are_compiled_for_the_target_too():
    """The context is the process's: a program built on another thread (the compile pool's,
    the autograd engine's) while it is open is reported too."""
    import threading
    x = torch.randn(48, 80, device="tpu")
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        t = threading.Thread(target=lambda: (x.tanh() * 3).cpu())
        t.start()
        t.join()
    names = " ".join(r.name for r in reports)
    assert "tanh" in names and not any(r.error for r in reports), reports.table()


_ABORTS_AND_REFUSALS = r'''
import torch, torchtpu
cases = {
    # libtpu aborted the process on these (SVD's int64 sign matrix in a float32 dot; a
    # complex128 number in a complex64 op), and refused these (XLA:TPU has no nonsymmetric
    # eigendecomposition, no 64-bit integer dot)
    "svd": lambda: torch.linalg.svd(torch.randn(5, 3, device="tpu")),
    "pinv": lambda: torch.linalg.pinv(torch.randn(2, 5, 3, device="tpu")),
    "mul_complex_number": lambda: torch.randn(3, device="tpu", dtype=torch.complex64) * (1 + 2j),
    "full_complex": lambda: torch.full((3,), 1 + 2j, device="tpu", dtype=torch.complex64),
    "eig": lambda: torch.linalg.eig(torch.randn(4, 4, device="tpu")),
    "eigvals": lambda: torch.linalg.eigvals(torch.randn(4, 4, device="tpu")),
    "mm_int64": lambda: torch.randint(-9, 9, (4, 3), device="tpu") @ torch.randint(-9, 9, (3, 2), device="tpu"),
    "mv_int64": lambda: torch.mv(torch.randint(-9, 9, (4, 3), device="tpu"), torch.randint(-9, 9, (3,), device="tpu")),
    "dot_int64": lambda: torch.dot(torch.randint(-9, 9, (5,), device="tpu"), torch.randint(-9, 9, (5,), device="tpu")),
    # complex64 ops that held a complex128 value: refused, until they were given complex64
    "diag_embed_complex": lambda: torch.diag_embed(torch.randn(3, device="tpu", dtype=torch.complex64)),
    "logspace_complex": lambda: torch.logspace(0, 1j, 5, device="tpu", dtype=torch.complex64),
}
for name, fn in cases.items():
    with torch.tpu.compile_for("v5e:1x1") as reports:
        fn()
        torch.tpu.synchronize()
    errors = [r.error for r in reports if r.error]
    print(name, len(reports), errors, flush=True)
'''


def test_ops_libtpu_aborted_or_refused_on_compile_for_v5e_now():
    # In a child process: were libtpu to abort again, this test fails instead of the suite.
    env = dict(os.environ, TORCHTPU_CACHE_DIR="", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    run = subprocess.run([sys.executable, "-c", _ABORTS_AND_REFUSALS], capture_output=True,
                         text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line]
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(lines) == 11, run.stdout
    for line in lines:
        name, n, errors = line.split(" ", 2)
        assert int(n) > 0 and errors == "[]", line


def test_complex128_is_refused_for_a_tpu_with_type_error_before_the_compiler_sees_it():
    x = torch.randn(3, device="tpu", dtype=torch.complex128)
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        y = x * 2
    torch.testing.assert_close(y.cpu(), x.cpu() * 2)  # the CPU's program is unchanged
    (r,) = [r for r in reports if "mul" in r.name]
    assert r.error.startswith("TypeError: aten.mul.Tensor: complex128 is not supported on TPU")
    assert "complex64" in r.error
    with pytest.raises(TypeError, match="complex128 is not supported on TPU"):
        tpu_compiler.check_compilable(jax.make_jaxpr(lambda a: jnp.cos(a).real)(
            jnp.zeros(2, jnp.complex128)), "cos")
    tpu_compiler.check_compilable(jax.make_jaxpr(jnp.cos)(jnp.zeros(2, jnp.complex64)), "cos")


def test_an_int64_convolution_is_refused_for_a_tpu_naming_the_op_and_dtype():
    x = torch.randint(-5, 5, (1, 2, 5, 5), device="tpu")
    w = torch.randint(-5, 5, (3, 2, 3, 3), device="tpu")
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        y = torch.nn.functional.conv2d(x, w)
    assert torch.equal(y.cpu(), torch.nn.functional.conv2d(x.cpu(), w.cpu()))  # the CPU's
    (r,) = [r for r in reports if "convolution" in r.name]
    assert r.error == ("""RuntimeError: "convolution" not implemented for 'Long' on TPU """
                       "(XLA:TPU has no 64-bit integer convolution); use int32 or float32")


def test_the_tpus_routes_give_the_cpus_answers():
    # What a TPU program computes instead of what XLA:TPU lacks, run here on the CPU.
    from torchtpu._lowerings import factorizations, linalg
    g = torch.Generator().manual_seed(0)
    for limit in (1 << 22, 7, 1):  # one product, or K in chunks (a loop, and a remainder)
        linalg_limit = linalg._WIDE_PRODUCT_ELEMENTS
        linalg._WIDE_PRODUCT_ELEMENTS = limit
        try:
            for sa, sb in [((5,), (5,)), ((3, 5), (5,)), ((5,), (5, 4)), ((3, 9), (9, 2)),
                           ((2, 3, 5), (5, 4)), ((2, 1, 3, 5), (4, 5, 2)), ((3, 0), (0, 4))]:
                a = torch.randint(-2**62, 2**62, sa, generator=g)
                b = torch.randint(-2**62, 2**62, sb, generator=g)
                got = linalg._wide_integer_matmul(jnp.asarray(a.numpy()), jnp.asarray(b.numpy()))
                assert torch.equal(torch.from_numpy(np.array(got)), torch.matmul(a, b)), (sa, sb)
        finally:
            linalg._WIDE_PRODUCT_ELEMENTS = linalg_limit
    a = torch.randn(3, 5, 5, generator=g)
    with tpu_compiler._building_for("tpu"):
        w, v = jax.jit(factorizations.linalg_eig)(jnp.asarray(a.numpy()))
        u, s, vh = jax.jit(factorizations.linalg_svd)(jnp.asarray(a[:, :, :3].numpy()))
    w, v = torch.from_numpy(np.array(w)), torch.from_numpy(np.array(v))
    assert w.dtype == v.dtype == torch.complex64
    torch.testing.assert_close(w, torch.linalg.eigvals(a))
    torch.testing.assert_close(a.to(torch.complex64) @ v, v * w[:, None, :], atol=1e-5, rtol=1e-5)
    u, s, vh = (torch.from_numpy(np.array(t)) for t in (u, s, vh))
    assert u.shape == (3, 5, 3) and s.shape == (3, 3) and vh.shape == (3, 3, 3)
    torch.testing.assert_close(s, torch.linalg.svdvals(a[:, :, :3]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u * s[:, None, :] @ vh, a[:, :, :3], atol=1e-5, rtol=1e-5)


def test_the_opinfo_sweep_compiles_its_programs_for_a_target():
    from torchtpu.conformance import report, run_op, select_ops
    (op,) = [o for o in select_ops(["mm"]) if o.name == "mm"]
    result = run_op(op, ("float32", "int64"), max_samples=1, errors=False, target="v5e:1x1")
    for dtype in ("float32", "int64"):
        assert result["dtypes"][dtype]["status"] == "pass"
        assert result["target"][dtype]["programs"] > 0 and result["target"][dtype]["failed"] == 0
    text = report.format_target([result])
    assert text.startswith("compiled for v5e:1x1:") and "0 programs of 0 pairs fail to compile" in text


def test_a_tpu_is_given_complex_numbers_as_complex64(monkeypatch):
    from torchtpu._core import runtime
    from torchtpu._execution import op_keys, segment
    assert op_keys.device_scalar(1 + 2j, 0) == 1 + 2j  # the CPU: as JAX takes a Python complex
    monkeypatch.setattr(runtime, "platform", lambda: "tpu")
    v = op_keys.device_scalar(1 + 2j, 0)
    assert v.dtype == jnp.complex64 and v.aval.weak_type and complex(v) == 1 + 2j
    arrays, _ = segment.pack_scalars([0.5, 3, 1 - 1j], [float, int, complex])
    assert [a.dtype for a in arrays] == [np.float64, np.int64, np.bool_, np.complex64]


def test_a_jax_op_pallas_kernel_is_compiled_by_mosaic_for_v5e_and_v6e():
    """The example's Pallas RMSNorm asks the program's platform: the CPU's program interprets it,
    the targets' programs hold the Mosaic kernel (not the interpreter's loops), forward and
    backward, and the values here are the CPU's."""
    from torchtpu.examples import pallas_rmsnorm
    x = torch.randn(16, 256, device="tpu", requires_grad=True)
    w = torch.randn(256, device="tpu", requires_grad=True)
    for target in ("v5e:1x1", "v6e:1x1"):
        torchtpu.clear_caches()
        x.grad = w.grad = None
        with torch.tpu.compile_for(target) as reports:
            y = pallas_rmsnorm.rms_norm(x, w, eps=1e-5)
            y.square().sum().backward()
        xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
        yc = pallas_rmsnorm.rms_norm_reference(xc, wc, 1e-5)
        yc.square().sum().backward()
        torch.testing.assert_close(y.cpu(), yc, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad.cpu(), xc.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(w.grad.cpu(), wc.grad, atol=1e-4, rtol=1e-4)
        assert reports and not [r.error for r in reports if r.error]
        (fwd,) = [r for r in reports if r.name.startswith("torchtpu_jax.pallas_rms_norm")
                  and "_vjp" not in r.name]
        (bwd,) = [r for r in reports if "pallas_rms_norm" in r.name and "_vjp" in r.name]
        assert fwd.text.count("tpu_custom_call") == 1 and " while(" not in fwd.text
        assert bwd.fits and bwd.flops > 0


def test_a_jax_op_is_traced_with_jaxs_own_types():
    """A jax_op's function sees plain JAX: 64-bit types off (torchtpu turns them on for
    PyTorch's int64 and float64), so its new values are float32 and int32 as in JAX, unless
    it is given a 64-bit tensor, which JAX would otherwise truncate."""
    @torch.tpu.pallas.jax_op
    def shifted(x):
        return x + jnp.arange(x.shape[-1]), jnp.zeros(x.shape)

    a, b = shifted(torch.ones(3, device="tpu"))
    assert a.dtype == b.dtype == torch.float32
    assert a.cpu().tolist() == [1.0, 2.0, 3.0] and b.cpu().tolist() == [0.0, 0.0, 0.0]
    big = torch.full((3,), 2**40, dtype=torch.int64, device="tpu")
    (i, _) = shifted(big)
    assert i.dtype == torch.int64 and i.cpu().tolist() == [2**40, 2**40 + 1, 2**40 + 2]


def test_flex_attentions_splash_kernel_is_compiled_by_mosaic_for_v5e(monkeypatch):
    """FlexAttention's splash kernel, grouped-query heads, forward and backward: the programs
    compiled for v5e hold Mosaic kernels, not the interpreter the CPU runs them in."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setattr(torch.tpu, "flex_attention_implementation", "splash")
    L = 256
    q = torch.randn(1, 4, L, 64, device="tpu", requires_grad=True)
    k, v = (torch.randn(1, 2, L, 64, device="tpu", requires_grad=True) for _ in range(2))
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="tpu")
    torchtpu.clear_caches()
    with torch.tpu.compile_for("v5e:1x1") as reports:
        flex_attention(q, k, v, block_mask=mask, enable_gqa=True).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    splash = [r for r in reports if "flex_splash" in r.name]
    assert {r.name.split(".")[1] for r in splash} == {"flex_splash", "flex_splash_backward"}
    for r in splash:
        assert not r.error and r.text.count("tpu_custom_call") >= 1, r


def test_a_linear_of_sequences_keeps_its_results_shape_and_compiles_lean_for_v5e():
    """F.linear with a bias on a [B, T, C] input: the result's storage has the [B, T, N] shape
    (PyTorch's addmm of the rows gives a [B*T, N] one), so XLA:TPU can lay it out for the
    heads that read it: a GPT block's forward and backward access fewer bytes than the same
    block written with PyTorch's addmm, and the values are the CPU's."""
    from torchtpu._core import storage
    from torchtpu.examples.models import Block

    x = torch.randn(2, 8, 16, device="tpu")
    lin = torch.nn.Linear(16, 12).to("tpu")
    y = lin(x)
    assert storage.buffer_or_none(y).value().shape == (2, 8, 12)
    torch.testing.assert_close(y.cpu(), torch.nn.functional.linear(x.cpu(), lin.weight.cpu(),
                                                                   lin.bias.cpu()))

    def compiled_bytes(addmm):
        torch.manual_seed(0)
        block = Block(128, 2, 0.0).to("tpu")
        if addmm:  # PyTorch's own composition of F.linear for a contiguous 3-D input
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    m.forward = lambda v, m=m: torch.addmm(
                        m.bias, v.reshape(-1, v.shape[-1]), m.weight.t()).view(*v.shape[:-1], -1)
        h = torch.randn(2, 128, 128, device="tpu", requires_grad=True)
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            block(h).square().mean().backward()
        r = g.compile_for("v5e:1x1")
        assert not r.error, r.error
        return r.bytes_accessed

    assert compiled_bytes(addmm=False) < 0.9 * compiled_bytes(addmm=True)
