"""One rank of a multi-process test (launched by tests/test_distributed.py, or by torchrun).

`python tests/dist_worker.py SCENARIO` with the torch launch environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Each scenario asserts; a rank that finishes prints
"PASS <scenario> rank <r>" plus any `MEASURE` lines the test reads.
"""
import datetime
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import torchtpu


def close(tpu, cpu, **kw):
    assert tpu.device.type == "tpu" and cpu.device.type == "cpu"
    assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape, (tpu.dtype, cpu.dtype, tpu.shape)
    torch.testing.assert_close(tpu.cpu(), cpu, **kw)


def pair(make):
    """The same tensor on the CPU (for gloo) and on tpu (for the tpu backend)."""
    cpu = make()
    return cpu, cpu.to("tpu")


def both(fn, *cpu_and_tpu_args):
    """Run collective `fn` once with the CPU tensors (gloo) and once with the tpu ones."""
    fn(*[a[0] for a in cpu_and_tpu_args])
    fn(*[a[1] for a in cpu_and_tpu_args])


# --- collectives: every one against gloo on the same values --------------------------------
def scenario_collectives():
    dist.init_process_group("cpu:gloo,tpu:tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    assert isinstance(dist.group.WORLD, dist.ProcessGroup)
    g = torch.Generator().manual_seed(100 + r)

    def rand(*shape, dtype=torch.float32):
        if dtype.is_floating_point:
            return torch.randn(*shape, generator=g).to(dtype)
        if dtype == torch.bool:
            return torch.rand(*shape, generator=g) > 0.5
        return torch.randint(-50, 50, shape, generator=g, dtype=dtype)

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "product": dist.ReduceOp.PRODUCT}
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.float64):
        for name, op in ops.items():
            c, t = pair(lambda dtype=dtype: rand(5, 3, dtype=dtype))
            dist.all_reduce(c, op=op)
            dist.all_reduce(t, op=op)
            close(t, c, **({"rtol": 3e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}))
    for name in ("BAND", "BOR", "BXOR"):
        c, t = pair(lambda: rand(7, dtype=torch.int32))
        both(lambda x, name=name: dist.all_reduce(x, op=getattr(dist.ReduceOp, name)), (c, t))
        close(t, c)
    # AVG: gloo has none; it must equal SUM / world size.
    c, t = pair(lambda: rand(4, 4))
    expect = c.clone()
    dist.all_reduce(expect)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    close(t, expect / n)
    # A non-contiguous view is reduced in place through its strides (gloo would treat the
    # view's memory as contiguous, so the reference reduces a contiguous copy).
    c, t = pair(lambda: rand(6, 4))
    cols = c[:, 1:3].contiguous()
    dist.all_reduce(cols)
    c[:, 1:3] = cols
    dist.all_reduce(t[:, 1:3])
    close(t, c)
    # async_op returns a Work: wait() orders later work after it, as on a CUDA stream (it does
    # not block the host), and is_completed() says whether the results exist.
    c, t = pair(lambda: rand(8))
    works = [dist.all_reduce(x, async_op=True) for x in (c, t)]
    assert all(w.wait() for w in works)
    torch.tpu.synchronize()
    assert works[1].is_completed() and works[1].is_success()
    close(t, c)
    fut = dist.all_reduce(t, async_op=True).get_future()
    dist.all_reduce(c)
    close(fut.wait()[0], c)

    for root in range(n):
        c, t = pair(lambda: rand(3, 2))
        both(lambda x, root=root: dist.broadcast(x, src=root), (c, t))
        close(t, c)
        c, t = pair(lambda: rand(4))
        both(lambda x, root=root: dist.reduce(x, dst=root), (c, t))
        if r == root:
            close(t, c)

    c, t = pair(lambda: rand(2, 3))
    outs = [([torch.empty(2, 3) for _ in range(n)]), [torch.empty(2, 3, device="tpu") for _ in range(n)]]
    dist.all_gather(outs[0], c)
    dist.all_gather(outs[1], t)
    for a, b in zip(outs[1], outs[0]):
        close(a, b)
    for dtype in (torch.float32, torch.int64, torch.bool):
        c, t = pair(lambda dtype=dtype: rand(3, 2, dtype=dtype))
        oc, ot = torch.empty(3 * n, 2, dtype=dtype), torch.empty(3 * n, 2, dtype=dtype, device="tpu")
        dist.all_gather_into_tensor(oc, c)
        dist.all_gather_into_tensor(ot, t)
        close(ot, oc)

    for name in ("SUM", "MAX", "MIN"):
        c, t = pair(lambda: rand(2 * n, 3))
        oc, ot = torch.empty(2, 3), torch.empty(2, 3, device="tpu")
        dist.reduce_scatter_tensor(oc, c, op=getattr(dist.ReduceOp, name))
        dist.reduce_scatter_tensor(ot, t, op=getattr(dist.ReduceOp, name))
        close(ot, oc, rtol=1e-6, atol=1e-5)
    ins = [rand(2, 2) for _ in range(n)]
    oc, ot = torch.empty(2, 2), torch.empty(2, 2, device="tpu")
    dist.reduce_scatter(oc, ins)
    dist.reduce_scatter(ot, [i.to("tpu") for i in ins])
    close(ot, oc, rtol=1e-6, atol=1e-5)

    c, t = pair(lambda: rand(2 * n, 3))
    oc, ot = torch.empty(2 * n, 3), torch.empty(2 * n, 3, device="tpu")
    dist.all_to_all_single(oc, c)
    dist.all_to_all_single(ot, t)
    close(ot, oc)
    # Uneven splits: rank r sends (r + j + 1) rows to rank j.
    in_splits = [r + j + 1 for j in range(n)]
    out_splits = [j + r + 1 for j in range(n)]
    c, t = pair(lambda: rand(sum(in_splits), 2))
    oc, ot = torch.empty(sum(out_splits), 2), torch.empty(sum(out_splits), 2, device="tpu")
    dist.all_to_all_single(oc, c, out_splits, in_splits)
    dist.all_to_all_single(ot, t, out_splits, in_splits)
    close(ot, oc)
    ins = [rand(3, 2) for j in range(n)]  # gloo's list all_to_all wants equal sizes
    outs_c = [torch.empty(3, 2) for _ in range(n)]
    outs_t = [torch.empty(3, 2, device="tpu") for _ in range(n)]
    dist.all_to_all(outs_c, ins)
    dist.all_to_all(outs_t, [i.to("tpu") for i in ins])
    for a, b in zip(outs_t, outs_c):
        close(a, b)

    root = n - 1
    c, t = pair(lambda: rand(3))
    gc = [torch.empty(3) for _ in range(n)] if r == root else None
    gt = [torch.empty(3, device="tpu") for _ in range(n)] if r == root else None
    dist.gather(c, gc, dst=root)
    dist.gather(t, gt, dst=root)
    if r == root:
        for a, b in zip(gt, gc):
            close(a, b)
    chunks = [rand(2, 2) for _ in range(n)] if r == 0 else None
    oc, ot = torch.empty(2, 2), torch.empty(2, 2, device="tpu")
    dist.scatter(oc, chunks, src=0)
    dist.scatter(ot, [x.to("tpu") for x in chunks] if r == 0 else None, src=0)
    close(ot, oc)

    # Point to point, including the isend-then-recv exchange that needs real asynchrony.
    peer = r ^ 1
    if peer < n:
        c, t = pair(lambda: rand(4))
        rc, rt = torch.empty(4), torch.empty(4, device="tpu")
        for x, y in ((c, rc), (t, rt)):
            req = dist.isend(x, peer)
            dist.recv(y, peer)
            req.wait()
        close(rt, rc)
        ops_ = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, rt, peer)]
        for req in dist.batch_isend_irecv(ops_):
            req.wait()
        close(rt, rc)

    # Sub-groups (collective on the even ranks only; every rank creates the group).
    evens = dist.new_group(list(range(0, n, 2)), backend="cpu:gloo,tpu:tpu")
    if r % 2 == 0:
        c, t = pair(lambda: rand(5))
        both(lambda x: dist.all_reduce(x, group=evens), (c, t))
        close(t, c)
    if n == 4:  # the groups of a 2-D DeviceMesh's dimensions
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            group = mesh.get_group(dim)
            x = torch.full((3,), float(r), device="tpu")
            dist.all_reduce(x, group=group)
            expect = float(sum(dist.get_process_group_ranks(group)))
            assert torch.equal(x.cpu(), torch.full((3,), expect)), (dim, x.cpu(), expect)
    dist.barrier()
    # Object collectives ride the CPU side.
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "tag": "x" * r})
    assert objs == [{"rank": i, "tag": "x" * i} for i in range(n)]

    # A rank with another shape gets a clear error (no runtime abort, no hang) where the host
    # next waits (the collective is dispatched asynchronously, as on CUDA), naming both sides,
    # and nothing changes.
    t = torch.ones(3 + r, device="tpu")
    try:
        dist.all_reduce(t)
        t.cpu()
        raise AssertionError("mismatched shapes were not detected")
    except RuntimeError as e:
        assert "ranks disagree" in str(e) and "(3,)" in str(e) and "(4,)" in str(e), e
    assert torch.equal(t.cpu(), torch.ones(3 + r))
    try:  # as after NCCL's abort: the ranks are out of step, the group refuses more work
        dist.all_reduce(t)
        raise AssertionError("the group kept working after the ranks disagreed")
    except dist.DistBackendError as e:
        assert "unusable" in str(e) and "disagreed" in str(e), e
    dist.destroy_process_group()


def scenario_divergent():
    """Rank 0 calls a collective that rank 1 does not: each rank gets a RuntimeError naming
    both sides (no hang, no abort), at the collective (strict eager) or where it next waits
    (fused eager), and its tensors keep their values (as of the first collective, in fused
    eager); the group then refuses further collectives."""
    mode = os.environ["TORCHTPU_TEST_MODE"]
    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=60))
    r = dist.get_rank()
    torch.tpu.eager_mode = {"strict": "DEFER_NEVER", "fused": "DEFER_AND_FUSE",
                            "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING"}[mode]
    t, u = torch.ones(4, device="tpu"), torch.ones(3, device="tpu")
    # The ranks compare every run of a program (TORCHTPU_DIST_CHECK=first: its first run).
    import torchtpu
    w = torch.ones(5, device="tpu")
    checks = torchtpu.metrics().get("collective_checks", 0)
    for _ in range(3):
        dist.all_reduce(w)
    assert torch.equal(w.cpu(), torch.full((5,), 8.0))
    first_only = os.environ.get("TORCHTPU_DIST_CHECK") == "first"
    if mode != "fused":  # (fused eager: the three are one program)
        assert torchtpu.metrics()["collective_checks"] - checks == (1 if first_only else 3)
    if mode == "strict" and not first_only:  # programs compared before, then split into
        dist.all_reduce(t)
        dist.all_reduce(u)
        t.fill_(1)
        u.fill_(1)
    try:
        if r == 0:
            dist.all_reduce(t)  # rank 0 only
        dist.all_reduce(u)
        # Fused eager defers this into the segment of the collectives, and keeps what strict
        # eager had before the first of them.
        u.mul_(2)
        u.cpu()
        raise AssertionError("the ranks' different collectives were not detected")
    except RuntimeError as e:
        text = str(e)
        assert "ranks disagree" in text and "rank 0:" in text and "rank 1:" in text, e
        assert "(4,)" in text and "(3,)" in text, e
    torch.tpu.eager_mode = "DEFER_NEVER"
    # The ranks compare each program's collectives before running it: in strict eager the
    # error comes at the collective that disagreed (its wait), before the scaling.
    assert torch.equal(t.cpu(), torch.ones(4)) and torch.equal(u.cpu(), torch.ones(3)), (t.cpu(), u.cpu())
    try:  # no collective runs after a disagreement
        dist.all_reduce(u)
        raise AssertionError("the group kept working after the ranks disagreed")
    except dist.DistBackendError as e:
        assert "unusable" in str(e) and "disagreed" in str(e), e
    print(f"PASS divergent rank {r}", flush=True)
    # No collective can end the job: the ranks meet in the store, then leave.
    store = dist.distributed_c10d._get_default_store()
    if r:
        store.set("divergent/done", "1")
        store.wait(["divergent/bye"])
    else:  # (the store's server: it leaves last)
        store.wait(["divergent/done"])
        store.set("divergent/bye", "1")
        time.sleep(1)
    os._exit(0)


# --- the small transformer: DDP and FSDP2 against one process -------------------------------
def make_model():
    from torchtpu.examples.models import GPT
    torch.manual_seed(0)
    return GPT(vocab=128, d_model=32, n_heads=2, n_layers=2, seq=16)


def batches(steps, global_batch):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (global_batch, 17), generator=g) for _ in range(steps)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def reference_losses(data):
    model = make_model().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in data:
        loss = loss_of(model, tokens.to("tpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# How the training scenarios run a step: "eager" (the process's eager mode) or "onestep"
# (torch.compile(step, backend="tpu", mode="reduce-overhead"): one executable per step).
STEP = os.environ.get("TORCHTPU_TEST_STEP", "eager")
_BUILT = ("compiles", "segment_compiles", "graph_compiles", "tpu_graph_compiles",
          "executables_compiled")


def check_steady(before, after, what):
    """A steady step, collectives included, builds nothing and never waits for the host; in
    fused eager it runs as at most 2 executables (forward; backward and optimizer), in
    reduce-overhead mode as 1."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    built = {k: d.get(k, 0) for k in _BUILT if d.get(k, 0)}
    assert not built and d.get("blocking_waits", 0) == 0, (what, built, d.get("blocking_waits"))
    if STEP == "onestep":
        assert d.get("tpu_graph_replays", 0) == 1 and d.get("flushes", 0) == 0, (what, d)
    elif torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_AND_FUSE:
        assert 1 <= d.get("flushes", 0) <= 2, (what, {k: v for k, v in d.items() if "flush" in k})
    return d


def train_sharded(model, data, r, n, what="training"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(local):
        loss = loss_of(model, local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if STEP == "onestep":
        step = torch.compile(step, backend="tpu", mode="reduce-overhead")
    losses = []
    for i, tokens in enumerate(data):
        local = tokens.chunk(n)[r].to("tpu")
        before = torchtpu.metrics()
        loss = step(local)
        if i >= 3:  # (DDP agrees on its gradient buckets at the second step)
            check_steady(before, torchtpu.metrics(), what)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


def check_losses(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what} step {i}: loss {a} vs one process {b}"


def param_bytes(model):
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in model.parameters())


def scenario_training():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    # FSDP2's collectives one per parameter, as on a TPU mesh (_distributed/fsdp.py)
    per_parameter = os.environ.get("TORCHTPU_FSDP_PER_PARAMETER") == "1"
    data = batches(6, 4 * n)  # (steps 3-5 are checked steady)
    full_bytes = param_bytes(make_model())
    trained = {}  # what -> losses, averaged over the ranks: the same on every rank

    ddp = DDP(make_model().to("tpu"))
    trained["DDP"] = train_sharded(ddp, data, r, n, "DDP")
    if r == 0:  # rank-divergent Python: an extra evaluation and logging on rank 0 only
        with torch.no_grad():
            print(f"eval loss {loss_of(ddp.module, data[0].to('tpu')).item():.4f}", flush=True)
    flag = torch.tensor([float(r)], device="tpu")
    dist.all_reduce(flag)  # the ranks still agree on the next collective
    assert flag.item() == n * (n - 1) / 2

    # Every mode runs FSDP2 that reshards after forward; the strict run also the one that keeps
    # parameters gathered (the same step less the backward's all-gathers) and FSDP2 with bf16
    # compute: what differs between those is FSDP2's, not the mode's.
    strict = STEP == "eager" and torch.tpu.eager_mode == torch.tpu.EagerMode.DEFER_NEVER
    for reshard in (True, False) if strict else (True,):
        model = make_model().to("tpu")
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        mine = param_bytes(model)
        what = f"FSDP2 reshard={reshard}"
        trained[what] = train_sharded(model, data, r, n, what)
    print(f"MEASURE fsdp_param_bytes rank={r} full={full_bytes} local={mine}", flush=True)
    assert mine <= full_bytes / n * 1.1 + 4096, (mine, full_bytes)

    if strict:
        model = make_model().to("tpu")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        mixed = train_sharded(model, data[:3], r, n)
    dist.destroy_process_group()
    counted = [torchtpu.metrics().get(f"fsdp_{k}_per_parameter", 0) for k in ("gathers", "reduces")]
    assert all(counted) if per_parameter else not any(counted), counted

    # Against one process training the same batches, on one rank: the others are done.
    if r == 0:
        want = reference_losses(data)
        for what, got in trained.items():
            check_losses(got, want, what)
        if strict:  # bf16 compute with fp32 reduction: close to fp32 training, not equal
            assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(mixed, want)), (mixed, want[:3])


# --- FSDP2 set up as users do: CPU or meta modules, HSDP, checkpointing, clipping, DCP --------
def init_weights(model):
    """What torchtitan's init_weights does: every submodule's reset_parameters, in order."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def meta_model():
    with torch.device("meta"):
        return make_model()


def shard(model, mesh=None, wrap=None, **kw):
    from torch.distributed.fsdp import fully_shard
    for i, block in enumerate(model.blocks):
        if wrap is not None:
            block = model.blocks[i] = wrap(block)
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def train_clipped(model, data, r, n, opt=None, clip=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in data:
        loss = loss_of(model, tokens.chunk(n)[r].to("tpu") if n else tokens.to("tpu"))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if n:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses, opt


def full_params(model):
    from torch.distributed.tensor import DTensor
    return [(name, (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu())
            for name, p in model.named_parameters()]


def scenario_fsdp_setup():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (n,))
    data = batches(6, 4 * n)
    # what -> (losses, averaged over the ranks, of steps `first`...): checked on rank 0 at the
    # end against one process training the whole batches with the same clipping.
    trained = {}

    # A module still on the CPU: fully_shard moves it (`param.data = param.data.to(device)`).
    model = shard(make_model(), mesh)
    assert all(p.device.type == "tpu" for p in model.parameters())
    trained["FSDP2 of a CPU module"] = (train_clipped(model, data, r, n, clip=0.5)[0], 0)

    # torchtitan's flow: built on meta, sharded, materialised with to_empty, initialised by
    # reset_parameters under DTensor: each rank draws its own part of one random stream, so
    # the sharded model holds exactly what the whole model gets from the same seed.
    whole = meta_model().to_empty(device="tpu")
    torch.manual_seed(0)
    init_weights(whole)
    model = shard(meta_model(), mesh).to_empty(device="tpu")
    torch.manual_seed(0)
    init_weights(model)
    expected = full_params(whole)
    for (name, got), (_, want_p) in zip(full_params(model), expected):
        assert torch.equal(got, want_p), f"{name}: sharded initialisation differs from the whole one"
    print(f"MEASURE meta_init_equal rank={r} params={len(expected)}", flush=True)

    # Activation checkpointing of each block and clip_grad_norm_ over the DTensor gradients.
    model = shard(make_model(), mesh, wrap=checkpoint_wrapper)
    losses, opt = train_clipped(model, data[:3], r, n, clip=0.5)
    trained["FSDP2 with activation checkpointing and clipping"] = (losses, 0)

    # torchtitan compiles each block and shards the compiled module: FSDP2's hooks gather its
    # parameters around a graph run by backend="tpu".
    compiled = shard(make_model(), mesh, wrap=lambda b: torch.compile(b, backend="tpu"))
    compiled_losses, _ = train_clipped(compiled, data[:3], r, n, clip=0.5)
    trained["FSDP2 of torch.compile'd blocks"] = (compiled_losses, 0)
    counts = torchtpu.metrics()
    assert counts.get("graph_compiles", 0) + counts.get("graph_cache_hits", 0) > 0, counts

    # DCP: save the model and optimizer, load them into a fresh sharded model, and go on
    # training exactly where the first left off.
    path = [tempfile.mkdtemp(prefix="torchtpu-dcp-") if r == 0 else None]
    dist.broadcast_object_list(path, src=0)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path[0])
    fresh = shard(meta_model(), mesh, wrap=checkpoint_wrapper).to_empty(device="tpu")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    resumed, _ = train_clipped(fresh, data[3:], r, n, opt=fresh_opt, clip=0.5)
    trained["FSDP2 resumed from a DCP checkpoint"] = (resumed, 3)
    if r == 0:  # (every rank has loaded it: they trained together since)
        shutil.rmtree(path[0], ignore_errors=True)

    # What XLA on a TPU is given for a captured FSDP2 step, lowered here without a TPU: one
    # program holding the all-gathers and reduce-scatters among the step's matmuls.
    import re
    model = shard(make_model(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="tpu"), capturable=True)
    tokens = data[0].chunk(n)[r].to("tpu")

    def step():
        loss_of(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(2):
        step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        step()
    g.replay()
    # It reads the shards, their gradients and AdamW's two states (and a few numbers); FSDP2's
    # unsharded parameters and collective buffers are its own temporaries.
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    read = sum(b.nbytes for b in g.input_storages)
    assert read <= 4 * shards + tokens.nbytes + 4096, (read, shards)
    with tempfile.TemporaryDirectory(prefix="torchtpu-hlo-") as folder:
        path = os.path.join(folder, "step.mlir")
        g.debug_dump(path, platform="tpu")
        text = open(path).read()
    ops = {k: len(re.findall(rf"stablehlo\.{k}\b", text))
           for k in ("all_gather", "reduce_scatter", "dot_general")}
    print(f"MEASURE tpu_program rank={r} {ops}", flush=True)
    # FSDP2's units: the root and 2 blocks, gathered in the forward and (blocks) the backward;
    # each unit's gradients reduce-scattered.  (The ranks' check of the program's collectives
    # is beside it, on the host: the program holds no collective of its own.)
    assert ops["all_gather"] == 3 + 2 and ops["reduce_scatter"] == 3, ops
    assert ops["dot_general"] > 0 and text.count("func.func public @main") == 1, ops
    dist.destroy_process_group()

    if r == 0:  # (make_model seeds: the reference starts from the same weights)
        want, _ = train_clipped(make_model().to("tpu"), data, r, 0, clip=0.5)
        for what, (got, first) in trained.items():
            check_losses(got, want[first:], what)


def scenario_fsdp_memory():
    """FSDP2 holds a rank's shards and a few units' unsharded parameters at a time, as on CUDA
    (it frees them with resize_(0) after each unit's forward and backward), never the whole
    model's, in strict and fused eager alike."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.tpu.eager_mode = os.environ["TORCHTPU_TEST_MODE"]
    blocks, width = 8, 512
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(blocks)]).to("tpu")
    for b in model:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    unit = width * width * 4  # one block's unsharded parameters, bytes
    x = torch.randn(16, width, device="tpu")
    activations = blocks * x.nbytes
    for step in range(2):
        torch.tpu.synchronize()
        before = torch.tpu.memory_allocated()
        torch.tpu.reset_peak_memory_stats()
        loss = model(x).square().mean()
        torch.tpu.synchronize()
        forward = torch.tpu.max_memory_allocated() - before
        torch.tpu.reset_peak_memory_stats()
        loss.backward()
        torch.tpu.synchronize()
        backward = torch.tpu.max_memory_allocated() - before
        opt.step()
        opt.zero_grad()
        print(f"MEASURE fsdp_memory rank={r} step={step} forward={forward} backward={backward} "
              f"unit={unit}", flush=True)
        # The whole model unsharded would be `blocks` units; FSDP2 on CUDA holds about two
        # (the unit running, the next prefetched, each briefly as its all-gather's output too).
        assert forward <= 4 * unit + 2 * activations, (step, forward / unit)
        # The backward also holds the gradients: the sharded ones (the whole model's / n) and
        # the unsharded ones of the units in flight.
        assert backward <= blocks * unit / n + 5 * unit + 2 * activations, (step, backward / unit)
    dist.destroy_process_group()
    print(f"PASS fsdp_memory rank {r}", flush=True)


def scenario_hsdp():
    """HSDP: FSDP within each row of a 2-D mesh, replicas across rows."""
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    data = batches(4, 4 * n)
    model = shard(make_model().to("tpu"), mesh)
    local = param_bytes(model)
    got = train_clipped(model, data, r, n)[0]
    assert local <= param_bytes(make_model()) / (n // 2) * 1.1 + 4096, local
    dist.destroy_process_group()
    if r == 0:  # (the losses are averaged over the ranks: one checks them)
        check_losses(got, reference_losses(data), "HSDP")


# --- DTensor and distributed checkpointing ----------------------------------------------------
def scenario_dtensor():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (n,))
    full = torch.arange(4 * n * 3, dtype=torch.float32).reshape(4 * n, 3)
    d = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    assert d.to_local().shape == (4, 3) and d.to_local().device.type == "tpu"
    close(d.to_local(), full[4 * r:4 * r + 4])
    close(d.full_tensor(), full)
    rep = d.redistribute(mesh, [Replicate()])
    close(rep.to_local(), full)
    col = rep.redistribute(mesh, [Shard(1)]) if 3 % n == 0 else None
    if col is not None:
        close(col.full_tensor(), full)
    w = distribute_tensor(torch.ones(3, 5, device="tpu"), mesh, [Replicate()])
    y = d @ w  # row-sharded matmul stays sharded
    close(y.full_tensor(), full @ torch.ones(3, 5))
    s = d.sum()  # a partial sum, reduced across ranks on read
    close(s.full_tensor(), full.sum())

    # DCP round trip of an FSDP2 model: saved by every rank, loaded into a fresh model.
    def sharded():
        model = make_model().to("tpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = sharded()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # differ from a fresh model's values
    path = [tempfile.mkdtemp(prefix="torchtpu-dcp-") if r == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(get_model_state_dict(model), checkpoint_id=path[0])
    fresh = sharded()
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path[0])
    set_model_state_dict(fresh, state)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a.full_tensor().cpu(), b.full_tensor().cpu()), name
    if r == 0:  # (every rank has loaded it: the comparisons above are collectives)
        shutil.rmtree(path[0], ignore_errors=True)
    dist.destroy_process_group()


# --- failures --------------------------------------------------------------------------------
def _group_that_worked_once(timeout_s):
    """Join a tpu group with this timeout and run one collective: (rank, a tpu tensor)."""
    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.ones(4, device="tpu")
    dist.all_reduce(t)
    return dist.get_rank(), t


def scenario_rank_dies():
    r, t = _group_that_worked_once(20)
    if r == 1:
        os._exit(17)  # dies without a word
    time.sleep(1)
    start = time.time()
    try:
        for _ in range(3):
            dist.all_reduce(t)
        t.cpu()  # dispatched asynchronously: the failure shows where the host waits
        raise AssertionError("all_reduce with a dead peer returned")
    except dist.DistBackendError as e:
        print(f"MEASURE error_after={time.time() - start:.1f}s {type(e).__name__}: {e}", flush=True)
    print("PASS rank_dies rank 0", flush=True)
    os._exit(0)  # JAX's coordination service would otherwise report the lost peer at exit


def scenario_rank_stalls():
    r, t = _group_that_worked_once(5)
    if r == 1:
        time.sleep(25)  # alive, but never joins the next collective
        os._exit(0)
    start = time.time()
    try:
        dist.all_reduce(t)
        t.cpu()  # dispatched asynchronously: the host's wait is bounded by the timeout
        raise AssertionError("all_reduce with a stalled peer returned")
    except dist.DistBackendError as e:
        print(f"MEASURE error_after={time.time() - start:.1f}s {type(e).__name__}: {e}", flush=True)
    try:
        dist.all_reduce(t)
        raise AssertionError("the group kept working after a timeout")
    except dist.DistBackendError as e:
        assert "unusable" in str(e), e
    print("PASS rank_stalls rank 0", flush=True)
    os._exit(0)


def scenario_never_joins():
    start = time.time()
    try:
        dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=5))
        raise AssertionError("init_process_group returned without the other rank")
    except (dist.DistError, RuntimeError) as e:
        print(f"MEASURE error_after={time.time() - start:.1f}s {type(e).__name__}: "
              f"{str(e).splitlines()[0]}", flush=True)
    print("PASS never_joins rank 0", flush=True)
    os._exit(0)


def scenario_stops_before_runtime():
    """Rank 1 connects (the store, gloo) and stops before JAX's multi-process runtime, as a host
    whose process died or hangs in its setup: rank 0's init_process_group names it."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        from torchtpu._distributed import launch

        def stop(*args, **kwargs):
            print("PASS stops_before_runtime rank 1", flush=True)
            os._exit(0)
        launch.initialize = stop
    start = time.time()
    try:
        dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=5))
        raise AssertionError("init_process_group returned without rank 1's runtime")
    except dist.DistBackendError as e:
        print(f"MEASURE error_after={time.time() - start:.1f}s {type(e).__name__}: "
              f"{str(e).splitlines()[0]}", flush=True)
    print("PASS stops_before_runtime rank 0", flush=True)
    os._exit(0)


# --- launch order: torch.tpu queries before init_process_group, as in CUDA scripts -----------
def scenario_launch_order():
    local = int(os.environ["LOCAL_RANK"])
    assert torch.tpu.is_available()
    count = torch.tpu.device_count()
    assert count >= 1
    torch.tpu.set_device(local % count)
    name = torch.tpu.get_device_name()
    props = torch.tpu.get_device_properties()
    assert props.name == name and props.index == local % count
    torch.manual_seed(0)
    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    assert torch.tpu.device_count() == count and torch.tpu.current_device() == local % count
    x = torch.full((3,), float(r + 1), device="tpu")
    dist.all_reduce(x)
    assert x.cpu().tolist() == [n * (n + 1) / 2] * 3, x
    dist.destroy_process_group()


def scenario_tensor_before_init():
    keep = torch.ones(2, device="tpu")  # noqa: F841  (a live tensor on the single-process runtime)
    try:
        dist.init_process_group("tpu")
    except RuntimeError as e:
        assert "before this process creates its first tpu tensor" in str(e), e
    else:
        raise AssertionError("init_process_group joined with a tensor on the old runtime")


# --- expert parallelism: tokens to their experts' ranks and back (all_to_all_single) ---------
def scenario_expert_parallel():
    """A top-2 MoE layer whose 4 experts are split over the ranks of a DeviceMesh: each rank
    routes its own tokens, sends each (token, choice) to the rank holding its expert and gets
    the results back (all_to_all_single with split sizes, differentiable), and runs its local
    experts as one torch._grouped_mm. Outputs and gradients equal the whole layer's on the
    CPU."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("tpu")
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (n,), mesh_dim_names=("ep",))
    experts, top_k, dim, hidden = 4, 2, 8, 16
    local = experts // n
    g = torch.Generator().manual_seed(0)  # the same weights on every rank
    router = torch.randn(experts, dim, generator=g)
    w_in = torch.randn(experts, dim, hidden, generator=g) / dim ** 0.5
    w_out = torch.randn(experts, hidden, dim, generator=g) / hidden ** 0.5
    x = torch.randn(6, dim, generator=torch.Generator().manual_seed(10 + r))

    def route(x, router):
        scores, chosen = torch.topk((x @ router.T).softmax(-1), top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=experts, min=0, max=experts).long()
        return scores.reshape(-1)[order], order, counts

    def whole_layer(x, w_in, w_out):  # every expert here: the reference
        scores, order, counts = route(x, router)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch.relu(torch._grouped_mm(x[order // top_k], w_in, offs=offs))
        y = torch._grouped_mm(h, w_out, offs=offs) * scores[:, None]
        return torch.zeros_like(x).index_add(0, order // top_k, y)

    def expert_parallel(x, w_in_local, w_out_local):
        scores, order, counts = route(x, router.to(x.device))
        # how many of my slots go to each expert, and how many each rank sends mine
        received = funcol.all_to_all_single(counts, None, None, mesh).wait()
        counts_to = counts.reshape(n, local).sum(1).tolist()
        counts_from = received.reshape(n, local)  # [source rank, local expert]
        tokens = funcol.all_to_all_single_autograd(
            x[order // top_k], counts_from.sum(1).tolist(), counts_to, mesh)
        # received in (source rank, expert) order: regroup by local expert
        by_expert = torch.argsort(torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(n), counts_from.reshape(-1)),
            stable=True)
        offs = torch.cumsum(counts_from.sum(0), 0).to(torch.int32)
        h = torch.relu(torch._grouped_mm(tokens[by_expert], w_in_local, offs=offs))
        y = torch._grouped_mm(h, w_out_local, offs=offs)
        y = torch.empty_like(y).index_copy(0, by_expert, y)  # back to the order received
        y = funcol.all_to_all_single_autograd(y, counts_to, counts_from.sum(1).tolist(), mesh)
        return torch.zeros_like(x).index_add(0, order // top_k, y * scores[:, None])

    mine = slice(r * local, (r + 1) * local)
    want_in, want_out = w_in.clone().requires_grad_(), w_out.clone().requires_grad_()
    want = whole_layer(x, want_in, want_out)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(20 + r))
    want.backward(grad)
    expert_grads = torch.cat([want_in.grad.reshape(-1), want_out.grad.reshape(-1)])
    dist.all_reduce(expert_grads)  # (CPU tensors: the group's gloo side) every rank's tokens
    want_in_grad, want_out_grad = expert_grads.split([w_in.numel(), w_out.numel()])
    got_in = w_in[mine].to("tpu").requires_grad_()
    got_out = w_out[mine].to("tpu").requires_grad_()
    got = expert_parallel(x.to("tpu"), got_in, got_out)
    close(got, want.detach(), atol=1e-5, rtol=1e-5)
    got.backward(grad.to("tpu"))
    close(got_in.grad, want_in_grad.reshape(w_in.shape)[mine], atol=1e-5, rtol=1e-5)
    close(got_out.grad, want_out_grad.reshape(w_out.shape)[mine], atol=1e-5, rtol=1e-5)
    dist.destroy_process_group()


if __name__ == "__main__":
    name = sys.argv[1]
    if os.environ.get("TORCHTPU_TEST_SET_DEVICE"):  # one process per device of a shared host
        torch.tpu.set_device(int(os.environ["LOCAL_RANK"]))
    globals()[f"scenario_{name}"]()
    print(f"PASS {name} rank {os.environ.get('RANK')}", flush=True)
