"""An MLP and a 2-layer GPT-style transformer trained 20 steps with AdamW on tpu match the
same run on the CPU (same initial weights, dropout off)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from torchtpu.examples.models import GPT, MLP


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
