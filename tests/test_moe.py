"""Mixture-of-experts on tpu: the routing ops (bincount, histc, stable argsort, index_copy,
scatter_add, repeat_interleave with a given output size), torch._grouped_mm as a ragged dot over
group sizes on the device, and a torchtitan-style MoE layer training as on the CPU in every
mode, with no host wait and no compile when the routing changes."""
import copy

import pytest
import torch

import torchtpu
from conftest import assert_same, counts
from torchtpu.examples.moe import MoEModel, training_step


def _waits_and_compiles():
    m = torchtpu.metrics()
    return (m.get("blocking_waits", 0), m.get("executables_compiled", 0) + m.get("compiles", 0))


# --- routing ops ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", ["plain", "minlength-weights", "int32-half-weights", "empty"])
def test_bincount_matches_the_cpu(args):
    x = torch.tensor([1, 2, 2, 5, 0])
    call = {"plain": ((x,), {}),
            "minlength-weights": ((x, torch.rand(5)), dict(minlength=8)),
            "int32-half-weights": ((x.int(), torch.rand(5).half()), {}),
            "empty": ((torch.tensor([], dtype=torch.long),), dict(minlength=3))}[args]
    want = torch.bincount(*call[0], **call[1])
    got = torch.bincount(*(a.to("tpu") for a in call[0]), **call[1])
    assert_same(got, want)


@pytest.mark.parametrize("bad", [[-1, 2], [[1]], [1.0]])
def test_bincount_refuses_what_the_cpu_refuses(bad):
    with pytest.raises(Exception) as cpu:
        torch.bincount(torch.tensor(bad))
    with pytest.raises(type(cpu.value), match=str(cpu.value)[:20]):
        torch.bincount(torch.tensor(bad, device="tpu"))


def test_routing_ops_with_fixed_shapes_stay_on_the_device():
    chosen = torch.tensor([[3, 1], [0, 3], [1, 2], [3, 0]])
    tokens = torch.randn(4, 6)
    dev = chosen.to("tpu"), tokens.to("tpu")
    torch.tpu.synchronize()
    before = counts("blocking_waits")[0]
    results = []
    for c, x in ((chosen, tokens), dev):
        flat = c.reshape(-1)
        counts_ = torch.histc(flat.float(), bins=4, min=0, max=4)
        order = torch.argsort(flat, stable=True)
        repeats = counts_.long()
        expert_of_slot = torch.repeat_interleave(repeats, output_size=flat.numel())
        per_token = torch.repeat_interleave(torch.arange(4, device=x.device), repeats,
                                            output_size=flat.numel())
        gathered = x[order // 2]
        back = torch.zeros(4, 6, device=x.device).index_copy(0, torch.tensor(
            [2, 0, 3, 1], device=x.device), x)
        summed = torch.zeros(4, 6, device=x.device).scatter_add(
            0, (order // 2)[:, None].expand(-1, 6), gathered)
        results.append((counts_, order, expert_of_slot, per_token, gathered, back, summed))
    assert counts("blocking_waits")[0] == before  # (nothing read on the host yet)
    for got, want in zip(results[1], results[0]):
        assert_same(got, want)


def test_repeat_interleave_with_a_wrong_output_size_raises_at_the_next_wait():
    repeats = torch.tensor([1, 2, 3], device="tpu")
    for size in (5, 7):
        with pytest.raises(RuntimeError, match="allocated size does not match"):
            torch.repeat_interleave(repeats, output_size=size)
            torch.tpu.synchronize()
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(torch.tensor([2, -1, 5], device="tpu"), output_size=6)
        torch.tpu.synchronize()


# --- torch._grouped_mm ---------------------------------------------------------------------

GROUPED = {  # (a shape, b shape, offs): the four layouts
    "2d-3d": ((10, 16), (4, 16, 8), [2, 5, 5, 8]),
    "3d-3d": ((4, 5, 16), (4, 16, 8), None),
    "3d-2d": ((4, 8, 16), (16, 16), [4, 8, 8, 12]),
    "2d-2d": ((8, 16), (16, 8), [4, 8, 8, 16]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(GROUPED))
def test_grouped_mm_matches_the_cpu_with_gradients(layout, dtype):
    a_shape, b_shape, offs = GROUPED[layout]
    a = torch.randn(a_shape, dtype=dtype, requires_grad=True)
    b = torch.randn(b_shape, dtype=dtype, requires_grad=True)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    dev = [x.detach().to("tpu").requires_grad_() for x in (a, b)]
    want = torch._grouped_mm(a, b, offs=offs)
    got = torch._grouped_mm(*dev, offs=None if offs is None else offs.to("tpu"))
    grad = torch.randn_like(want)
    # Rows (2-D x 3-D) or columns (3-D x 2-D) past the last offset belong to no group: the
    # CPU leaves them unwritten, and their gradient is not defined
    keep = [slice(None)] * want.dim()
    if layout == "2d-3d":
        keep[0] = slice(0, int(offs[-1]))
    elif layout == "3d-2d":
        keep[1] = slice(0, int(offs[-1]))
    grad_kept = torch.zeros_like(grad)
    grad_kept[tuple(keep)] = grad[tuple(keep)]
    tol = dict(atol=1e-5, rtol=1.3e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    assert_same(got[tuple(keep)], want[tuple(keep)].detach(), **tol)
    want.backward(grad_kept)
    got.backward(grad_kept.to("tpu"))
    a_keep = slice(0, int(offs[-1])) if layout == "2d-3d" else slice(None)
    b_keep = (slice(None), slice(0, int(offs[-1]))) if layout == "3d-2d" else slice(None)
    assert_same(dev[0].grad[a_keep], a.grad[a_keep], **tol)
    assert_same(dev[1].grad[b_keep], b.grad[b_keep], **tol)


@pytest.mark.parametrize("bad", ["float64", "mixed", "int64-offs", "no-offs", "bias",
                                 "out-dtype", "contraction", "unaligned"])
def test_grouped_mm_refuses_what_the_cpu_refuses(bad):
    def call(device):
        a, b = torch.randn(10, 16, device=device), torch.randn(4, 16, 8, device=device)
        kw = dict(offs=torch.tensor([2, 5, 5, 8], dtype=torch.int32, device=device))
        if bad == "float64":
            a, b = a.double(), b.double()
        elif bad == "mixed":
            b = b.bfloat16()
        elif bad == "int64-offs":
            kw["offs"] = kw["offs"].long()
        elif bad == "no-offs":
            del kw["offs"]
        elif bad == "bias":
            kw["bias"] = torch.randn(4, 8, device=device)
        elif bad == "out-dtype":
            kw["out_dtype"] = torch.bfloat16
        elif bad == "contraction":
            a = torch.randn(10, 12, device=device)
        else:  # rows of 10 float32: 40 bytes
            a, b = torch.randn(10, 10, device=device), torch.randn(4, 10, 8, device=device)
        return torch._grouped_mm(a, b, **kw)

    with pytest.raises(RuntimeError) as cpu:
        call("cpu")
    with pytest.raises(RuntimeError, match=str(cpu.value)[:25].replace("(", r"\(")):
        call("tpu")


# --- a torchtitan-style MoE layer ----------------------------------------------------------

def _train(model, device, steps, step_fn=None, mode=None):
    torch.manual_seed(1)
    batches = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))) for _ in range(steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=device == "tpu")
    step = training_step(model, opt)
    run = step if step_fn is None else step_fn(step)
    losses, steady = [], None
    with torch.tpu.set_eager_mode(mode or torch.tpu.eager_mode):
        for i, (idx, tgt) in enumerate(batches):
            idx, tgt = idx.to(device), tgt.to(device)
            if device == "tpu" and i == steps - 1:
                torch.tpu.synchronize()
                before = _waits_and_compiles()
            losses.append(run(idx, tgt))
            if device == "tpu" and i == steps - 1:
                steady = tuple(a - b for a, b in zip(_waits_and_compiles(), before))
    return torch.stack([loss.cpu() for loss in losses]), steady


@pytest.mark.parametrize("mode", ["strict", "fused", "compile"])
def test_moe_layer_trains_as_on_the_cpu_without_waits_or_compiles(mode):
    torch.manual_seed(0)
    model = MoEModel(vocab=64, dim=32, hidden=64, n_experts=4, top_k=2,
                     compute_dtype=torch.float32)
    want, _ = _train(copy.deepcopy(model), "cpu", 3)
    eager = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else None
    compile_ = (lambda f: torch.compile(f, backend="tpu")) if mode == "compile" else None
    got, steady = _train(copy.deepcopy(model).to("tpu"), "tpu", 3, compile_, eager)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the last step routes its tokens anew: no host wait, nothing compiled
    assert steady == (0, 0)
