"""Warm-up: a training loop's second and later steps compile nothing (strict, fused,
torch.compile), with the losses of the same loop on the CPU."""
import copy

import pytest
import torch

import torchtpu
from torchtpu.examples.models import GPT

from conftest import MODES

# Every kind of executable a step can build.
_BUILT = ("compiles", "segment_compiles", "graph_captures", "graph_compiles")

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
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
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
