"""An MLP and a 2-layer GPT-style transformer trained 20 steps with AdamW on tpu match the
same run on the CPU (same initial weights, dropout off)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import torchtpu

from torchtpu.examples.models import GPT, MLP
from conftest import backward_and_step


def _train(model, opt, batches, loss_fn):
    losses = []
    for x, y in batches:
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _compare(model, make_opt, batches, loss_fn, compare_params=True):
    cpu_model = model
    tpu_model = copy.deepcopy(model).to("tpu")
    cpu_losses = _train(cpu_model, make_opt(cpu_model), batches, loss_fn)
    tpu_batches = [(x.to("tpu"), y.to("tpu")) for x, y in batches]
    tpu_losses = _train(tpu_model, make_opt(tpu_model), tpu_batches, loss_fn)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-6)
    for (n, p_cpu), p_tpu in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        assert p_tpu.device.type == "tpu" and p_tpu.grad.device.type == "tpu"
        if compare_params:
            torch.testing.assert_close(p_tpu.detach().cpu(), p_cpu.detach(), rtol=1e-3, atol=1e-4, msg=n)


def test_mlp_adamw_matches_cpu():
    torch.manual_seed(0)
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(20)]
    _compare(MLP(), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), batches,
             lambda m, x, y: F.cross_entropy(m(x), y))


@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "adam"])
def test_gpt_matches_cpu(opt):
    torch.manual_seed(0)
    model = GPT(vocab=128, d_model=32, n_heads=4, n_layers=2, seq=16, dropout=0.0)
    batches = [(torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))) for _ in range(20)]
    make = {
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
        "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
    }[opt]
    # Parameters are not compared: the attention key bias has a mathematically zero gradient,
    # so Adam normalises rounding noise into full-size steps on either device.
    _compare(model, make, batches, lambda m, x, y: m(x, y), compare_params=(opt == "sgd_momentum"))


def test_dropout_trains_and_is_seeded():
    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=1, seq=8, dropout=0.1).to("tpu")
    x = torch.randint(0, 64, (2, 8), device="tpu")
    torch.manual_seed(1)
    a = model(x, x).item()
    torch.manual_seed(1)
    b = model(x, x).item()
    assert a == b
    model(x, x).backward()
    assert all(p.grad is not None for p in model.parameters())


# -- fused optimizer steps (torch.optim's fused=True: one executable per step) ----------------

_FUSED = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad_maximize": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True,
                                                     maximize=True)),
    "adamw_tensor_lr": (torch.optim.AdamW, dict(lr=torch.tensor(1e-2), amsgrad=True)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3,
                                                     maximize=True)),
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_tensor_lr": (torch.optim.SGD, dict(lr=torch.tensor(0.1), momentum=0.9)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
    "adagrad_tensor_lr": (torch.optim.Adagrad, dict(lr=torch.tensor(0.1), lr_decay=0.01)),
}


def _fused_run(dev, name, impl, scaler=False, overflow=(), steps=3):
    """Parameters and optimizer state after `steps` steps of a small MLP with a changing lr
    (with a GradScaler: the loss of the steps in `overflow` is infinite)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(dev)
    cls, kw = _FUSED[name]
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    opt = cls(model.parameters(), **kw, **{impl: True})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 8) if scaler else None
    for i in range(steps):
        loss = model(torch.randn(5, 4).to(dev)).pow(2).sum() * (float("inf") if i in overflow else 1)
        opt.zero_grad()
        backward_and_step(loss, opt, scaler)
        sched.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return ([t.detach().cpu() for t in [*model.parameters(), *state]],
            scaler.get_scale() if scaler else None)


@pytest.mark.parametrize("name", list(_FUSED))
def test_fused_optimizer_matches_cpu_fused_and_tpu_foreach(name):
    torchtpu.reset_metrics()
    tpu, _ = _fused_run("tpu", name, "fused")
    ops = {k for k in torchtpu.metrics() if k.startswith("op::")}
    assert any(k.startswith("op::aten._fused_") for k in ops), ops
    assert not any("_foreach_" in k and "_foreach_add_" not in k for k in ops), ops  # no decomposed step
    cpu, _ = _fused_run("cpu", name, "fused")
    for a, b in zip(tpu, cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if not name.endswith("tensor_lr"):  # the foreach implementation takes no tensor lr
        foreach, _ = _fused_run("tpu", name, "foreach")
        for a, b in zip(tpu, foreach, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov", "adagrad"])
@pytest.mark.parametrize("overflow", [(1,), (0, 1, 2)])
def test_fused_optimizer_with_grad_scaler_matches_cpu(name, overflow):
    # The fused step unscales finite gradients itself; a step with an infinite gradient is
    # skipped (parameters and state unchanged) and the scale backs off.
    tpu, tpu_scale = _fused_run("tpu", name, "fused", scaler=True, overflow=overflow)
    cpu, cpu_scale = _fused_run("cpu", name, "fused", scaler=True, overflow=overflow)
    assert tpu_scale == cpu_scale
    if name.startswith("sgd") and 0 in overflow:
        # torch.optim allocates momentum buffers with empty_like before the first step: they
        # stay undefined when that step is skipped. Compare the parameters (4 tensors) only.
        tpu, cpu = tpu[:4], cpu[:4]
    for a, b in zip(tpu, cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if len(overflow) == 3:
        start, _ = _fused_run("cpu", name, "fused", steps=0)
        for a, b in zip(tpu, start):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _adamw_args(dev, dtype=torch.float32):
    torch.manual_seed(0)
    lists = [[torch.randn(3, 2), torch.randn(5)] for _ in range(5)]
    lists[3] = [x.abs() for x in lists[3]]
    lists[4] = [x.abs() * 2 for x in lists[4]]
    return [[x.to(dev, dtype) for x in xs] for xs in lists] + [[torch.tensor(2.0, device=dev)] * 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("found_inf", [None, 0.0, 1.0])
def test_fused_adamw_op_unscales_grads_and_skips_on_found_inf(dtype, found_inf):
    def call(dev):
        args = _adamw_args(dev, dtype)
        extra = {} if found_inf is None else dict(grad_scale=torch.tensor(4.0, device=dev),
                                                   found_inf=torch.tensor(found_inf, device=dev))
        torch._fused_adamw_(*args, lr=torch.tensor(0.1, device=dev), beta1=0.9, beta2=0.99,
                            weight_decay=0.1, eps=1e-8, amsgrad=True, maximize=False, **extra)
        return [x.cpu() for xs in args for x in xs]

    tpu, cpu = call("tpu"), call("cpu")
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    for a, b in zip(tpu, cpu, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if found_inf == 1.0:
        for a, b in zip(tpu, [x.cpu() for xs in _adamw_args("cpu", dtype) for x in xs]):
            assert torch.equal(a, b)


def test_fused_optimizer_op_bad_input_matches_cpu_and_leaves_tensors_intact():
    kw = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    def cases(dev):
        a = _adamw_args(dev)
        yield lambda: torch._fused_adamw_(a[0], a[1][:1], a[2], a[3], [], a[5], **kw), a
        yield lambda: torch._fused_adam_(a[0], a[1], a[2], a[3], [], a[5], **dict(kw, amsgrad=True)), a
        yield lambda: torch._fused_adamw_(a[0], [g.double() for g in a[1]], a[2], a[3], [], a[5], **kw), a
        ints = [[x.long() for x in xs] for xs in a[:2]]
        yield lambda: torch._fused_sgd_(*ints, [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                                        nesterov=False, maximize=False, is_first_step=False), ints
        yield lambda: torch._fused_adagrad_(a[0], a[1], a[2][:1], a[5], lr=0.1, lr_decay=0.0,
                                            weight_decay=0.0, eps=1e-10, maximize=False), a

    for (tpu_call, tpu_args), (cpu_call, _) in zip(cases("tpu"), cases("cpu")):
        before = [x.cpu() for xs in tpu_args for x in xs]
        with pytest.raises(Exception) as cpu_err:
            cpu_call()
        with pytest.raises(type(cpu_err.value)) as tpu_err:
            tpu_call()
        assert str(tpu_err.value) == str(cpu_err.value)
        for a, b in zip([x.cpu() for xs in tpu_args for x in xs], before):
            assert torch.equal(a, b)


def test_fused_optimizer_lr_schedule_compiles_once():
    model = torch.nn.Linear(4, 3).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    compiles = []
    for _ in range(4):
        model(torch.randn(2, 4, device="tpu")).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        model.weight.sum().item()
        m = torchtpu.metrics()
        compiles.append(m.get("compiles", 0) + m.get("segment_compiles", 0))
    assert compiles[-1] == compiles[-2] == compiles[-3], compiles
