"""Small index ops whose inputs are ready run on the host, by PyTorch's CPU kernel, until their
pattern has cost as much host time as compiling it (advanced_indexing.py), in strict and debug
eager; fused eager records them.  Values, layouts, gradients and errors equal the CPU's either
way."""
import pytest
import torch

import torchtpu
from torchtpu._execution import advanced_indexing
from torchtpu._execution.kernels import kernel_for

from conftest import assert_same

aten = torch.ops.aten
INDEX_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default)


@pytest.fixture
def host_seconds(monkeypatch):
    """Sets the host time a pattern may spend before it compiles (conftest turns it off)."""
    def set_budget(seconds):
        monkeypatch.setattr(advanced_indexing, "_HOST_SECONDS", seconds)
        monkeypatch.setattr(advanced_indexing, "_spent", {})
    return set_budget


def index_programs():
    return sum(len(kernel_for(op).cache) for op in INDEX_OPS)


def on_host():
    return torchtpu.metrics().get("index_ops_on_host", 0)


def ready(*tensors):
    torch.tpu.synchronize()
    return tensors


GETS = {
    "rows": lambda x, i, j, m, n: x[i],
    "columns": lambda x, i, j, m, n: x[:, i],
    "pairs": lambda x, i, j, m, n: x[i, j],
    "broadcast": lambda x, i, j, m, n: x[i.view(-1, 1), j],
    "ellipsis": lambda x, i, j, m, n: x[..., j],
    "negative": lambda x, i, j, m, n: x[n],
    "transposed": lambda x, i, j, m, n: x.t()[j],
    "mask": lambda x, i, j, m, n: x[m],
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_gets_equal_the_cpu_and_build_no_program(eager_mode, host_seconds, dtype):
    host_seconds(1e9)
    cpu = (torch.arange(20).view(4, 5).to(dtype), torch.tensor([0, 2, 3]),
           torch.tensor([1, 4, 4]), torch.tensor([True, False, True, True]),
           torch.tensor([-1, -4, 2]))
    tpu = ready(*[t.to("tpu") for t in cpu])
    programs, hosted = index_programs(), on_host()
    for name, get in GETS.items():
        assert_same(get(*tpu), get(*cpu))
    if eager_mode == "fused":
        assert on_host() == hosted  # recorded into the trace
    else:
        assert on_host() - hosted == len(GETS)
        assert index_programs() == programs


def test_sets_and_accumulation_equal_the_cpu(eager_mode, host_seconds):
    host_seconds(1e9)
    base = torch.arange(20.0, dtype=torch.float64).view(4, 5)
    i_cpu = torch.tensor([0, 2, 0])
    v_cpu = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.float64)
    cases = {
        "scalar": lambda x, i, v: x.__setitem__(i, 7.0),
        "values": lambda x, i, v: x.__setitem__((i, slice(1, 2)), v),
        "accumulate": lambda x, i, v: x.index_put_((i,), v, accumulate=True),
        "functional": lambda x, i, v: x.copy_(x.index_put((i,), v.view(3, 1), accumulate=True)),
        "augmented": lambda x, i, v: x.__setitem__(i[:2], x[i[:2]] + 1),
        "into a view": lambda x, i, v: x[1:].__setitem__(i[:2], -1.0),
    }
    hosted = on_host()
    for name, case in cases.items():
        x_cpu = base.clone()
        case(x_cpu, i_cpu, v_cpu)
        x, i, v = ready(base.to("tpu"), i_cpu.to("tpu"), v_cpu.to("tpu"))
        case(x, i, v)
        assert_same(x, x_cpu)
    if eager_mode != "fused":  # (a Python number's 0-dim value may still be being made)
        assert on_host() - hosted >= 3


def test_gradients_equal_the_cpu(eager_mode, host_seconds):
    host_seconds(1e9)
    w_cpu = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    i_cpu, j_cpu = torch.tensor([0, 2, 0]), torch.tensor([1, 4, 1])
    g_cpu = torch.randn(3, dtype=torch.float64)
    w_cpu[i_cpu, j_cpu].backward(g_cpu)
    w = w_cpu.detach().to("tpu").requires_grad_(True)
    i, j, g = ready(i_cpu.to("tpu"), j_cpu.to("tpu"), g_cpu.to("tpu"))
    w[i, j].backward(g)
    assert_same(w.grad, w_cpu.grad)


def test_errors_are_pytorchs_and_leave_the_target_intact(eager_mode, host_seconds):
    host_seconds(1e9)
    x, bad, v = ready(torch.arange(5.0, device="tpu"), torch.tensor([0, 7], device="tpu"),
                      torch.tensor([1.0, 2.0], device="tpu"))
    with pytest.raises(IndexError) as info:
        x[bad]
        x.index_put_((bad,), v)
        torch.tpu.synchronize()  # fused eager raises when its segment runs
    if eager_mode != "fused":  # at the call, naming the op and the line
        assert "aten.index" in str(info.value) and "test_index_patterns.py" in str(info.value)
    with pytest.raises(IndexError):
        x.index_put_((bad,), v)
        torch.tpu.synchronize()
    with pytest.raises(RuntimeError, match="dtype"):
        x.index_put_((bad[:1],), torch.tensor([1], device="tpu"))
        torch.tpu.synchronize()
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (x + 1).sum().item() == 15.0  # the device stays usable


def test_a_pattern_compiles_once_its_host_runs_cost_a_compile(eager_mode, host_seconds):
    host_seconds(1e-12)  # the first run spends it all
    x, i = ready(torch.arange(12.0, device="tpu").view(3, 4), torch.tensor([2, 0], device="tpu"))
    programs, hosted = index_programs(), on_host()
    first = x[:, i]
    after_first = index_programs()
    second, third = x[:, i], x[:, i]
    for y in (first, second, third):
        assert y.cpu().tolist() == [[2.0, 0.0], [6.0, 4.0], [10.0, 8.0]]
    if eager_mode == "fused":
        assert on_host() == hosted
    else:
        assert (after_first, on_host() - hosted) == (programs, 1)
        assert index_programs() == programs + 1  # built at the second call, reused at the third


def test_large_tensors_compile_at_once(eager_mode, host_seconds):
    host_seconds(1e9)
    x, i = ready(torch.zeros(1 << 15, device="tpu"), torch.tensor([5, 1], device="tpu"))
    hosted = on_host()
    x[i] = 3.0
    assert x[i].cpu().tolist() == [3.0, 3.0]
    assert on_host() == hosted


@pytest.mark.parametrize("host", [0.0, 1e9])
def test_an_index_put_into_a_storage_its_operands_share_raises(eager_mode, host_seconds, host):
    """ATen refuses index_put_ whose values or indices overlap the target (the 1-D cases took
    padded.py's path, which skipped the check; host copies would hide it too)."""
    host_seconds(host)
    for make in (lambda x, i: x.index_put_((i,), x[1:3]),  # partial overlap, offset 1
                 lambda x, i: x.index_put_((i,), x[:2]),   # at offset 0
                 lambda x, i: x.index_put_((x[:2].long(),), x[2:4]),
                 lambda x, i: x.long().index_put_((i,), torch.ones(2, dtype=torch.long,
                                                                   device=x.device))):
        for device in ("cpu", "tpu"):
            x, i = ready(torch.arange(6.0, device=device), torch.tensor([0, 1], device=device))
            try:
                make(x, i)
                torch.tpu.synchronize()
                outcome = x.cpu().tolist()
            except RuntimeError as e:
                outcome = "memory location" in str(e)
            if device == "cpu":
                expected = outcome
        assert outcome == expected
    x = ready(torch.arange(6, device="tpu"))[0]
    with pytest.raises(RuntimeError, match="single memory location"):
        x.index_put_((x[:2],), torch.tensor([7, 8], device="tpu"))
    assert x.cpu().tolist() == [0, 1, 2, 3, 4, 5]
