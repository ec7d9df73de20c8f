"""torch.compile(backend="tpu"): compiled vs eager vs CPU, training, graph breaks, errors."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_same, counts

import torchtpu
from torchtpu.examples.models import GPT, MLP


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _close(tpu, cpu, rtol=1e-4, atol=1e-5):
    # Compiled graphs are compared more loosely than eager ops: XLA may fuse and reorder.
    assert_same(tpu, cpu, rtol, atol, strides=False)


def test_function_forward_and_backward_match_cpu():
    def f(x, w):
        return F.gelu(x @ w).softmax(-1).sum(-1)

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    xt, wt = (t.detach().to("tpu").requires_grad_() for t in (x, w))
    g = torch.compile(f, backend="tpu")
    out = g(xt, wt)
    ref = f(x, w)
    _close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    _close(xt.grad, x.grad)
    _close(wt.grad, w.grad)
    eager = f(xt.detach(), wt.detach())
    _close(out.detach(), eager.cpu())


def test_repeated_calls_replay_one_executable():
    g = torch.compile(lambda x: (x * 2).relu() + 1, backend="tpu")
    x = torch.randn(16, device="tpu")
    g(x)
    before = counts("graph_compiles", "graph_cache_hits")
    for _ in range(3):
        out = g(x)
    after = counts("graph_compiles", "graph_cache_hits")
    assert after[0] == before[0] and after[1] == before[1] + 3
    _close(out, (x.cpu() * 2).relu() + 1)


def test_graph_donates_exactly_the_inputs_it_overwrites():
    # The segment runner's donation rule, as compiled graphs use it: the old array of `w`
    # (overwritten, referenced by nothing else) is consumed, the read-only `b` never is.
    g = torch.compile(lambda w, b: w.add_(b * 2), backend="tpu")
    w, b = torch.zeros(8, device="tpu"), torch.ones(8, device="tpu")
    for _ in range(2):  # (the first call's array may still be referenced: a second executable)
        g(w, b)
    before = counts("donated_buffers", "graph_cache_hits")
    for _ in range(2):
        g(w, b)
    assert counts("donated_buffers", "graph_cache_hits") == (before[0] + 2, before[1] + 2)
    _close(w, torch.full((8,), 8.0))
    _close(b, torch.ones(8))


def test_failed_index_check_in_graph_names_the_op_and_changes_nothing():
    def step(w, idx):
        w.mul_(2)
        return w[idx].sum()

    g = torch.compile(step, backend="tpu")
    w = torch.arange(4.0, device="tpu")
    assert g(w, torch.tensor([1], device="tpu")).item() == 2.0
    # The graph's check is read at the next wait of the host (here .item()), as CUDA's
    # device asserts surface at the next sync.
    bad = g(w, torch.tensor([7], device="tpu"))
    with pytest.raises(IndexError, match=r"(?s)out of (range|bounds).*aten.index.Tensor.*in compiled graph"):
        bad.item()
    _close(w, torch.tensor([0.0, 2.0, 4.0, 6.0]))  # the failed call's mul_ was not committed


def test_default_backend_routes_tpu_inputs_here():
    g = torch.compile(lambda x: torch.sin(x) * 3)  # no backend: inductor cannot do tpu
    x = torch.randn(5, device="tpu")
    before = counts("graph_captures")[0]
    _close(g(x), torch.sin(x.cpu()) * 3)
    assert counts("graph_captures")[0] == before + 1


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_models_inference_match_eager_and_cpu(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = MLP(), torch.randn(8, 32)
    else:
        model, x = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16), torch.randint(0, 64, (2, 16))
    model.eval()
    tm = copy.deepcopy(model).to("tpu")
    compiled = torch.compile(tm, backend="tpu")
    with torch.no_grad():
        ref = model(x)
        eager = tm(x.to("tpu"))
        out = compiled(x.to("tpu"))
    _close(out, ref)
    _close(out, eager.cpu())


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("train", [True, False])
def test_conv_batchnorm_updates_running_stats(train):
    torch.manual_seed(0)
    model = ConvNet().train(train)
    tm = copy.deepcopy(model).to("tpu")
    compiled = torch.compile(tm, backend="tpu")
    x = torch.randn(4, 3, 8, 8)
    for _ in range(2):
        ref = model(x)
        out = compiled(x.to("tpu"))
    _close(out, ref, rtol=1e-4, atol=1e-4)
    _close(tm.bn.running_mean, model.bn.running_mean)
    _close(tm.bn.running_var, model.bn.running_var)
    assert tm.bn.num_batches_tracked.item() == model.bn.num_batches_tracked.item()


def test_graph_break_runs_the_rest_eagerly():
    def f(x):
        y = x.sin() * 2
        print("graph break", end="")  # unsupported Python: Dynamo splits the graph here
        return (y + 1).cos()

    x = torch.randn(6)
    out = torch.compile(f, backend="tpu")(x.to("tpu"))
    _close(out, f(x))


def test_in_place_heavy_function_mutates_inputs():
    def f(a, b):
        a.add_(1).mul_(b)
        b[1:].zero_()
        a.t()[0].sub_(5)
        return a + b

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    at, bt = a.to("tpu"), b.to("tpu")
    out = torch.compile(f, backend="tpu")(at, bt)
    ref = f(a, b)
    _close(out, ref)
    _close(at, a)
    _close(bt, b)


def test_compiled_training_step_matches_cpu_for_20_steps():
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16)
    batches = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(4)]

    def make_step(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x, y):
            loss = m(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        return step

    cpu_model = copy.deepcopy(model)
    cpu_step = make_step(cpu_model)
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_step = torch.compile(make_step(tpu_model), backend="tpu")
    tpu_batches = [(x.to("tpu"), y.to("tpu")) for x, y in batches]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torchtpu")  # no graph may run op by op
        for i in range(20):
            lc = cpu_step(*batches[i % 4]).item()
            lt = tpu_step(*tpu_batches[i % 4]).item()
            assert abs(lt - lc) <= 1e-4 * abs(lc), (i, lt, lc)
            if i == 4:
                before = counts("graph_compiles")
    assert counts("graph_compiles") == before, "a steady compiled step compiled again"
    assert counts("donated_buffers")[0] > 0  # parameters and AdamW state updated in place
    # (Parameters are not compared: the attention key bias has an exactly-zero gradient, whose
    # rounding noise AdamW normalises into full-size steps on either device.)
    _close(tpu_model.head.weight.detach(), cpu_model.head.weight.detach(), rtol=1e-3, atol=1e-4)


def test_compiled_step_with_fused_adamw_matches_cpu():
    # torch.optim keeps Dynamo out of its fused step (torch.compiler.disable): the graphs around
    # it are compiled and the step runs as the fused kernel, once per call.
    torch.manual_seed(0)
    model = MLP()
    batches = [(torch.randn(8, 32), torch.randint(0, 10, (8,))) for _ in range(3)]

    def run(m, dev, compile):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = torch.compile(step, backend="tpu") if compile else step
        return [step(x.to(dev), y.to(dev)).item() for x, y in batches]

    tpu_model = copy.deepcopy(model).to("tpu")
    torchtpu.reset_metrics()
    tpu = run(tpu_model, "tpu", True)
    assert counts("graph_compiles", "op::aten._fused_adamw_.default") >= (1, 3)
    cpu = run(model, "cpu", False)
    torch.testing.assert_close(torch.tensor(tpu), torch.tensor(cpu), rtol=1e-5, atol=1e-6)
    for p, q in zip(tpu_model.parameters(), model.parameters()):
        _close(p.detach(), q.detach())


def test_a_second_optimizer_compiled_in_the_same_process_matches_cpu():
    # The same step code compiled with a fused AdamW, then with a foreach AdamW, without
    # torch._dynamo.reset() between them: the second step's optimizer was traced inline, never
    # marked capturable, and Dynamo failed ("Expected scalars to be on CPU, got meta").
    def run(dev, fused, compile):
        torch.manual_seed(0)
        m = nn.Linear(8, 4).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
        x = torch.randn(16, 8).to(dev)

        def step():
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            return loss

        step = torch.compile(step, backend="tpu") if compile else step
        losses = [step().item() for _ in range(4)]
        return losses, m.weight.detach()

    for fused in (True, False):
        (tpu, w_tpu), (cpu, w_cpu) = run("tpu", fused, True), run("cpu", fused, False)
        torch.testing.assert_close(torch.tensor(tpu), torch.tensor(cpu), rtol=1e-5, atol=1e-6)
        _close(w_tpu, w_cpu)


def test_new_shapes_recompile_and_are_counted():
    g = torch.compile(lambda x: x.exp().sum(0), backend="tpu", dynamic=False)
    for n in (3, 5):
        x = torch.randn(n, 4)
        _close(g(x.to("tpu")), x.exp().sum(0))
    assert counts("graph_captures")[0] >= 2


_probe = torch.library.Library("torchtpu_test_compile", "DEF")
_probe.define("cpu_only(Tensor x) -> Tensor")
_probe.impl("cpu_only", lambda x: x * 2, "CPU")
_probe.impl("cpu_only", lambda x: torch.empty_like(x), "Meta")


def test_op_without_lowering_raises_naming_op_and_line():
    def f(x):
        return torch.ops.torchtpu_test_compile.cpu_only(x + 1)

    with pytest.raises(Exception, match="torchtpu_test_compile.cpu_only") as info:
        torch.compile(f, backend="tpu")(torch.ones(3, device="tpu"))
    assert "test_compile.py" in str(info.value)


def test_op_without_lowering_runs_with_cpu_fallback(monkeypatch):
    monkeypatch.setattr(torch.tpu, "enable_cpu_fallback", True)

    def f(x):
        return torch.ops.torchtpu_test_compile.cpu_only(x + 1) * 3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(f, backend="tpu")(torch.ones(3, device="tpu"))
    _close(out, torch.full((3,), 12.0))


def test_export_gives_stablehlo_of_the_model():
    model = MLP().to("tpu").eval()
    text = torchtpu.export(model, (torch.randn(4, 32, device="tpu"),))
    assert text.startswith("module @") and "func.func public @main" in text
    assert "stablehlo.dot_general" in text


def test_persistent_cache_makes_a_second_process_hit(tmp_path):
    import subprocess
    import sys
    script = (
        "import jax, torch, torchtpu\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
        "g = torch.compile(lambda x: (x @ x).tanh().sum(), backend='tpu')\n"
        "g(torch.ones(8, 8, device='tpu')).item()\n"
        "from torchtpu._execution import executables; executables.wait_for_writes()\n"
        "m = torchtpu.metrics()\n"
        "print(m.get('persistent_cache_hits', 0) + m.get('executables_loaded', 0), m.get('executables_compiled', 0))\n")
    env = {**__import__("os").environ, "TORCHTPU_CACHE_DIR": str(tmp_path)}
    runs = [tuple(map(int, subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                          text=True, check=True).stdout.split()[-2:])) for _ in range(2)]
    # (programs served by a cache, programs compiled): the first process compiles, the second
    # loads what the first one compiled (our cache or, for programs that are not ours, JAX's)
    assert runs[0][0] == 0 and runs[0][1] >= 1
    assert runs[1][0] >= 1 and runs[1][1] == 0
    disabled = subprocess.run([sys.executable, "-c", "import jax, torchtpu; print(jax.config.jax_compilation_cache_dir)"],
                              env={**env, "TORCHTPU_CACHE_DIR": ""}, capture_output=True, text=True, check=True)
    assert disabled.stdout.strip() in ("None", "")

