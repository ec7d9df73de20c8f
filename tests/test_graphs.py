"""torch.tpu graphs: a whole training step captured once and replayed (torch.cuda graphs' API)."""
import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.examples.models import GPT, MLP

# Capture switches to fused recording whatever the eager mode; the steps around it (warm-up,
# the eager reference, copies into static inputs) run in the mode under test.
pytestmark = pytest.mark.parametrize("eager_mode", ["strict", "fused"], indirect=True)

_COMPILES = ("compiles", "segment_compiles", "graph_compiles", "tpu_graph_compiles")


def compiles():
    m = torchtpu.metrics()
    return sum(m.get(k, 0) for k in _COMPILES)


def train_step(model, opt, x, y, loss_fn=F.cross_entropy):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def gpt_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def capture(step, warmup=2):
    for _ in range(warmup):
        step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = step()
    return g, out


def batches(n, make):
    return [make() for _ in range(n)]


def check_replays_equal_eager(model, make_opt, data, loss_fn, cpu=True, seed=None, tol=1e-5):
    """Replays of a captured step on fresh batches (copied into the static inputs) equal the
    same steps run eagerly on tpu and, when `cpu`, on the CPU: losses and parameters."""
    models = {"graph": copy.deepcopy(model).to("tpu"), "eager": copy.deepcopy(model).to("tpu"),
              "cpu": copy.deepcopy(model)}
    opts = {k: make_opt(m, k != "cpu") for k, m in models.items()}
    static_x, static_y = data[0][0].to("tpu"), data[0][1].to("tpu")
    warm = data[0]
    for k in ("graph", "eager", "cpu"):  # the same warm-up everywhere (it creates the state)
        dev = "cpu" if k == "cpu" else "tpu"
        torch.tpu.manual_seed(1)
        for _ in range(2):
            train_step(models[k], opts[k], warm[0].to(dev), warm[1].to(dev), loss_fn)
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = train_step(models["graph"], opts["graph"], static_x, static_y, loss_fn)
    losses = {k: [] for k in models}  # per replay / step
    if seed is not None:
        torch.tpu.manual_seed(seed)
    for i, (x, y) in enumerate(data):
        if i == 1:  # from the second on: the first compiled the fused copies (fused mode)
            before = compiles()
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        losses["graph"].append(static_loss.item())
    replay_compiles = compiles() - before
    if seed is not None:
        torch.tpu.manual_seed(seed)
    for x, y in data:
        losses["eager"].append(train_step(models["eager"], opts["eager"], x.to("tpu"), y.to("tpu"),
                                          loss_fn).item())
        if cpu:
            losses["cpu"].append(train_step(models["cpu"], opts["cpu"], x, y, loss_fn).item())
    assert replay_compiles == 0
    assert losses["graph"] != [losses["graph"][0]] * len(data)  # it trains
    refs = ("eager", "cpu") if cpu else ("eager",)
    for ref in refs:
        torch.testing.assert_close(losses["graph"], losses[ref], rtol=tol, atol=tol)
        for p, q in zip(models["graph"].parameters(), models[ref].parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=tol, atol=tol)
            torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=tol, atol=tol)
    return models, g


def test_mlp_step_replays_equal_eager_and_cpu():
    data = batches(4, lambda: (torch.randn(16, 32), torch.randint(0, 10, (16,))))
    check_replays_equal_eager(
        MLP(), lambda m, tpu: torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=tpu), data,
        F.cross_entropy)


def test_transformer_step_replays_equal_eager_and_cpu():
    data = batches(3, lambda: (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))))
    check_replays_equal_eager(
        GPT(64, 32, 2, 2, 16), lambda m, tpu: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        data, gpt_loss, tol=2e-5)


def test_dropout_draws_fresh_numbers_on_each_replay():
    # Replays use new generator offsets in eager's order: same seed, same masks as eager.
    data = [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))] * 3
    models, _ = check_replays_equal_eager(
        GPT(64, 32, 2, 1, 16, dropout=0.3),
        lambda m, tpu: torch.optim.SGD(m.parameters(), lr=0.1), data, gpt_loss, cpu=False, seed=7)


def test_replay_reads_static_inputs_and_writes_static_outputs():
    w = torch.randn(8, 8).to("tpu")
    x = torch.zeros(4, 8).to("tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = (x @ w).relu()
        w.mul_(0.5)
    # Capture ran nothing: w kept its value, y reads as zeros.
    torch.testing.assert_close(y.cpu(), torch.zeros(4, 8))
    w0 = w.cpu()
    for i in range(3):
        new = torch.randn(4, 8)
        x.copy_(new)
        g.replay()
        torch.testing.assert_close(y.cpu(), (new @ (w0 * 0.5 ** i)).relu())
        torch.testing.assert_close(w.cpu(), w0 * 0.5 ** (i + 1))


def test_make_graphed_callables_module_equals_eager():
    model = MLP().to("tpu")
    ref = copy.deepcopy(model)
    sample = torch.randn(16, 32, device="tpu", requires_grad=True)
    graphed = torch.tpu.make_graphed_callables(model, (sample,))
    before = torchtpu.metrics()["tpu_graph_compiles"]
    for _ in range(3):
        # As with CUDA, gradients that autograd stores may alias the graph's static ones.
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = torch.randn(16, 32)
        xg, xr = x.to("tpu").requires_grad_(), x.to("tpu").requires_grad_()
        out, out_ref = graphed(xg), ref(xr)
        torch.testing.assert_close(out.cpu(), out_ref.cpu(), rtol=1e-5, atol=1e-5)
        out.pow(2).sum().backward()
        out_ref.pow(2).sum().backward()
        torch.testing.assert_close(xg.grad.cpu(), xr.grad.cpu(), rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-5, atol=1e-5)
    assert torchtpu.metrics()["tpu_graph_compiles"] == before
    model.eval()  # a mode other than the captured one runs eagerly
    torch.testing.assert_close(model(sample).cpu(), ref(sample).cpu(), rtol=1e-5, atol=1e-5)


def test_lr_schedule_under_replay_right_values_no_recompiles():
    # A tensor lr with capturable=True is read at each replay, as with CUDA graphs.
    base = MLP()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    runs = {}
    for kind in ("graph", "eager", "cpu"):
        dev = "cpu" if kind == "cpu" else "tpu"
        model = copy.deepcopy(base).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.02, device=dev),
                               capturable=dev == "tpu")
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        xt, yt = x.to(dev), y.to(dev)
        train_step(model, opt, xt, yt)
        sched.step()
        losses = []
        if kind == "graph":
            g = torch.tpu.TPUGraph()
            with torch.tpu.graph(g):
                loss = train_step(model, opt, xt, yt)
            before = compiles()
            for _ in range(4):
                g.replay()
                sched.step()
                losses.append(loss.item())
            assert compiles() - before == 0
        else:
            for _ in range(4):
                losses.append(train_step(model, opt, xt, yt).item())
                sched.step()
        runs[kind] = (losses, model, float(opt.param_groups[0]["lr"]))
    graph_losses, graph_model, graph_lr = runs["graph"]
    assert graph_lr == pytest.approx(0.02 * 0.5 ** 5)
    for ref in ("eager", "cpu"):
        losses, model, lr = runs[ref]
        assert lr == graph_lr
        torch.testing.assert_close(graph_losses, losses, rtol=1e-5, atol=1e-6)
        for p, q in zip(graph_model.parameters(), model.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_float_hyperparameter_changed_after_capture_raises():
    model = MLP().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 32).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")
    g, _ = capture(lambda: train_step(model, opt, x, y))
    g.replay()
    opt.param_groups[0]["lr"] = 0.05
    before = [p.detach().cpu() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"SGD's param_groups\[...\]\['lr'\] is 0.05 but was 0.1"):
        g.replay()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach().cpu(), b)


def test_optimizer_that_is_not_capturable_or_not_warmed_up_is_refused():
    model = MLP().to("tpu")
    x, y = torch.randn(16, 32).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, x, y)
    with pytest.raises(RuntimeError, match="graph capture of step.. for an instance of Adam but "
                                           "param_groups' capturable is False"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            train_step(model, opt, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="created its state during capture"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            train_step(model, opt, x, y)


def _line_of(marker):
    source, start = inspect.getsourcelines(_capture_error_cases)
    return start + next(i for i, line in enumerate(source) if marker in line)


def _capture_error_cases(x, case):
    y = x * 2
    if case == "item":
        return y.sum().item()  # LINE item
    if case == "nonzero":
        return torch.nonzero(y)  # LINE nonzero
    if case == "mask":
        return y[y > 0]  # LINE mask
    if case == "print":
        print(y)  # LINE print
    if case == "fallback":
        return torch.linalg.ldl_factor(y)  # LINE fallback


@pytest.mark.parametrize("case,op", [("item", "aten::_local_scalar_dense"),
                                     ("nonzero", "aten.nonzero"),
                                     ("mask", "aten.nonzero"),
                                     ("print", "aten.masked_select"),
                                     ("fallback", "aten::linalg_ldl_factor_ex.out (CPU fallback)")])
def test_capture_errors_name_the_op_and_the_line(case, op, eager_mode, monkeypatch):
    monkeypatch.setattr(torch.tpu, "enable_cpu_fallback", True)
    x = torch.randn(4, 4).to("tpu")
    w = torch.randn(4, 4).to("tpu")
    w0 = w.cpu()
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError) as info:
        with torch.tpu.graph(g):
            w.add_(1)
            _capture_error_cases(x, case)
    message = str(info.value)
    assert "torch.tpu graph capture" in message and op in message, message
    assert f"{__file__}:{_line_of('LINE ' + case)} in _capture_error_cases" in message, message
    # Nothing ran or changed, the mode is back, and the device works on.
    assert torch.equal(w.cpu(), w0)
    assert torch.tpu.get_eager_mode().value == eager_mode
    assert not torch.tpu.is_current_stream_capturing()
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)


def test_index_error_at_replay_raises_at_the_next_sync_and_leaves_tensors_intact():
    model = GPT(64, 32, 2, 1, 16).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randint(0, 64, (4, 16)).to("tpu"), torch.randint(0, 64, (4, 16)).to("tpu")
    g, loss = capture(lambda: train_step(model, opt, x, y, gpt_loss))
    g.replay()
    params = [p.detach().cpu() for p in model.parameters()]
    state = [v.cpu() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    good = x.cpu()
    x[1, 3] = 64
    g.replay()  # the check is read when the host next waits, not here
    with pytest.raises(IndexError, match=r"index out of range in self\n.*aten.embedding.default"
                                         r"(.|\n)*test_graphs.py:\d+ in train_step"):
        torch.tpu.synchronize()
    for p, b in zip(model.parameters(), params):
        assert torch.equal(p.detach().cpu(), b)
    for v, b in zip([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)], state):
        assert torch.equal(v.cpu(), b)
    x.copy_(good)
    g.replay()
    assert all(not torch.equal(p.detach().cpu(), b) for p, b in zip(model.parameters(), params))


def test_warm_up_on_a_side_stream_and_zero_compiles_per_replay():
    model = MLP().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    x, y = torch.randn(16, 32).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")
    s = torch.tpu.Stream()
    s.wait_stream(torch.tpu.current_stream())
    with torch.tpu.stream(s):
        for _ in range(3):
            train_step(model, opt, x, y)
    torch.tpu.current_stream().wait_stream(s)
    pool = torch.tpu.graph_pool_handle()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g, pool=pool):
        loss = train_step(model, opt, x, y)
    assert g.pool() is pool
    before = torchtpu.metrics()
    for _ in range(3):
        g.replay()
    after = torchtpu.metrics()
    for k in _COMPILES + ("flushes", "ops"):
        assert after.get(k, 0) == before.get(k, 0), k
    assert after["tpu_graph_replays"] - before.get("tpu_graph_replays", 0) == 3
    assert after["donated_buffers"] > before.get("donated_buffers", 0)  # parameters, state
    assert torch.isfinite(loss).item()


def test_each_overwritten_storage_gives_its_buffer_to_its_own_new_value():
    # JAX gives a donated input's buffer to the first result of its shape; the step's new
    # gradients have the parameters' shapes, and where one took a parameter's buffer XLA
    # copied every parameter and optimizer state first (segment._Order).
    model = MLP().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    x, y = torch.randn(16, 32).to("tpu"), torch.randint(0, 10, (16,)).to("tpu")
    g, _ = capture(lambda: train_step(model, opt, x, y))
    g.replay()
    segment = g._segment
    overwritten = {k: r for r, k in segment.structure[3]}  # input -> its new value
    checked = 0
    for donate, executable in segment.executables.items():
        order = segment.order(donate)
        header = executable.last.as_text().split("\n", 1)[0]
        for result, param in re.findall(r"\{(\d+)\}: \((\d+), \{\}", header):
            k = order.donated[int(param)]
            if k in overwritten:
                assert order.results[int(result)] == overwritten[k]
                checked += 1
    # at least the parameters, exp_avg, exp_avg_sq and step of the MLP's 6 tensors
    assert checked >= 24


def test_storages_made_during_the_capture_are_zeros_inside_the_program_not_inputs():
    # A step's `zeros` (empty, then zero_), `fill_` of new tensors and the slices its backward
    # writes into zeros: made at every replay inside the program, as a fused segment makes
    # them, not read from their storages as inputs and written back (a Llama step had 20 such,
    # 24 MB).  The storages made before the capture are its only inputs holding bytes.
    x = torch.randn(4, 8).to("tpu")
    w = torch.randn(8, 8).to("tpu").requires_grad_()

    def step():
        z = torch.zeros(4, 16, device="tpu")
        z[:, :8] = x @ w  # a slice of the zeros written, the rest read as zeros
        f = torch.empty(4, 16, device="tpu").fill_(2.0)
        out = (z * f).sum(1)
        out.sum().backward()  # the matmul's and the slice's backward make zeros too
        return z, out

    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        z, out = step()
    made_before = {id(b) for b in (torchtpu._core.storage.buffer_of(t) for t in (x, w))}
    holding = [b for b in g.input_storages if b.nbytes]
    assert holding and {id(b) for b in holding} <= made_before, [b.nbytes for b in holding]
    w0 = w.detach().cpu()
    for i in range(3):
        z.fill_(5.0)  # written outside between replays: the replay makes its zeros again
        new = torch.randn(4, 8)
        x.copy_(new)
        g.replay()
        want = torch.zeros(4, 16)
        want[:, :8] = new @ w0
        torch.testing.assert_close(z.cpu(), want)
        torch.testing.assert_close(out.cpu(), (want * 2).sum(1))
        torch.testing.assert_close(w.grad.cpu(), new.T @ torch.full((4, 8), 2.0))
