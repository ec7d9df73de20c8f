"""Warm-up: a training loop's second and later steps compile nothing (strict, fused,
torch.compile), with the losses of the same loop on the CPU."""
import copy

import pytest
import torch

import torchtpu
from torchtpu.examples.models import GPT

from conftest import MODES, backward_and_step

# Every kind of executable a step can build, and every program traced and compiled or loaded
# from the persistent cache (the small ones around them included: a number put on the device).
_BUILT = ("compiles", "segment_compiles", "graph_captures", "graph_compiles",
          "executables_compiled", "executables_loaded")

_OPTIMIZERS = {
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adam_fused": (torch.optim.Adam, dict(lr=1e-2, fused=True)),
    "adamw_fused_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, fused=True)),
    "sgd_momentum_foreach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "sgd_nesterov_fused": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, fused=True)),
}


def _built():
    m = torchtpu.metrics()
    return sum(m.get(k, 0) for k in _BUILT)


def _train(model, x, name, scaler, compiled, steps=4):
    """Losses of `steps` steps and, per step, the executables it built."""
    cls, kw = _OPTIMIZERS[name]
    opt = cls(model.parameters(), **kw)
    scaler = torch.amp.GradScaler(x.device.type, init_scale=2.0 ** 8) if scaler else None

    def step():
        loss = model(x, x)
        opt.zero_grad()
        backward_and_step(loss, opt, scaler)
        return loss

    if compiled:
        step = torch.compile(step, backend="tpu")
    losses, built = [], []
    for _ in range(steps):
        before = _built()
        losses.append(step().item())
        built.append(_built() - before)
    return losses, built


@pytest.mark.parametrize("name,scaler", [(name, False) for name in _OPTIMIZERS]
                         + [("adamw_foreach", True), ("adam_fused", True)])
@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_second_step_compiles_nothing(mode, name, scaler):
    torch._dynamo.reset()
    torchtpu.clear_caches()
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=2, n_layers=1, seq=16)
    x = torch.randint(0, 64, (2, 16))
    cpu_losses, _ = _train(copy.deepcopy(model), x, name, scaler, compiled=False)
    with torch.tpu.set_eager_mode(MODES["strict" if mode == "compiled" else mode]):
        losses, built = _train(model.to("tpu"), x.to("tpu"), name, scaler, compiled=mode == "compiled")
    assert built[0] > 0, built  # the counters see the first step's compiles
    assert built[1:] == [0, 0, 0], built
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_sgd_momentum_buffers_start_as_pytorchs_copy_of_the_gradient(mode):
    # PyTorch's first SGD step makes each momentum buffer a copy of the gradient; the buffers
    # made before it (-0.0) must give exactly that, signed zeros included.
    with torch.tpu.set_eager_mode(MODES[mode]):
        model = torch.nn.Linear(3, 2).to("tpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
        x = torch.tensor([[1.0, -0.0, 0.0]], device="tpu")
        (model(x).sum() * -0.0).backward()  # gradients of both signed zeros
        grads = [p.grad.cpu() for p in model.parameters()]
        opt.step()
        for p, g in zip(model.parameters(), grads):
            buf = opt.state[p]["momentum_buffer"].cpu()
            assert torch.equal(buf, g) and torch.equal(buf.signbit(), g.signbit()), (buf, g)
        assert any(g.signbit().any() for g in grads) and not all(g.signbit().all() for g in grads)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_whole_storage_zero_and_host_copy_are_seen_by_views(mode):
    with torch.tpu.set_eager_mode(MODES[mode]):
        t = torch.arange(6.0, device="tpu").view(2, 3)
        view = t[1]
        doubled = t * 2  # recorded before: keeps the old value
        t.zero_()
        assert torch.equal(view.cpu(), torch.zeros(3)) and torch.equal(doubled.cpu()[1], torch.tensor([6.0, 8.0, 10.0]))
        t.copy_(torch.ones(2, 3))
        assert torch.equal(view.cpu(), torch.ones(3)) and torch.equal(t.cpu(), torch.ones(2, 3))
        part = t[0]  # a view that is not the whole storage zeroes through the op
        part.zero_()
        assert torch.equal(t.cpu(), torch.tensor([[0.0, 0, 0], [1, 1, 1]]))
