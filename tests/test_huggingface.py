"""Hugging Face accelerate and the transformers Trainer train on tpu with their defaults (the
Trainer's default optimizer is the fused AdamW) and match the same run on the CPU."""
import copy
import json

import accelerate  # noqa: F401  (test dependencies: these tests must run, not skip)
import pytest
import torch
import transformers
from accelerate.state import AcceleratorState

from test_processes import run_script


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerator(**kwargs):
    AcceleratorState._reset_state(reset_partial_state=True)
    return accelerate.Accelerator(**kwargs)


def test_accelerator_defaults_to_tpu_and_an_explicit_choice_wins(monkeypatch):
    assert _accelerator().device.type == "tpu"
    assert _accelerator(cpu=True).device.type == "cpu"
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert _accelerator().device.type == "cpu"


def _tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (8, 8), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def test_accelerator_prepared_loop_matches_cpu():
    model, data = _tiny_gpt2(), _dataset()

    def train(acc):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        m, opt, loader = acc.prepare(m, opt, loader)
        losses = []
        for batch in loader:
            assert batch["input_ids"].device.type == acc.device.type
            loss = m(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    tpu = train(_accelerator())
    cpu = train(_accelerator(cpu=True))
    torch.testing.assert_close(torch.tensor(tpu), torch.tensor(cpu), rtol=1e-4, atol=1e-5)


def _train(model, data, output_dir, **extra):
    """A few Trainer steps with its default arguments: (trainer, logged losses)."""
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
        learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True, **extra)
    trainer = transformers.Trainer(model=copy.deepcopy(model), args=args, train_dataset=data)
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_default_arguments_trains_on_tpu_and_matches_cpu(tmp_path):
    model, data = _tiny_gpt2(), _dataset()
    tpu, tpu_losses = _train(model, data, tmp_path)
    assert tpu.args.device.type == "tpu" and tpu.accelerator.device.type == "tpu"
    assert tpu.optimizer.defaults["fused"] is True  # the default optimizer: adamw_torch_fused
    assert all(p.device.type == "tpu" for p in tpu.model.parameters())
    cpu, cpu_losses = _train(model, data, tmp_path, use_cpu=True)
    assert len(tpu_losses) == 3
    # The Trainer logs losses rounded to 4 decimals.
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=0, atol=2e-4)
    for (name, p), q in zip(tpu.model.named_parameters(), cpu.model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-3, atol=1e-4, msg=name)


def test_defaults_reach_tpu_from_a_bare_import_torch(tmp_path):
    # No `import torchtpu`: PyTorch's autoload registers the device and the accelerate hook,
    # accelerate picks tpu without loading JAX, and the Trainer then trains there.
    out = run_script(tmp_path, f"""
        import json, sys
        sys.path.insert(0, "tests")
        import torch
        import accelerate
        from test_huggingface import _dataset, _tiny_gpt2, _train
        device = accelerate.Accelerator().device.type
        loaded = sorted(m for m in ("jax", "torchtpu") if m in sys.modules)
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        model, data = _tiny_gpt2(), _dataset()
        trainer, losses = _train(model, data, {str(tmp_path)!r})
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        _, cpu_losses = _train(model, data, {str(tmp_path)!r}, use_cpu=True)
        print(json.dumps([device, loaded, trainer.args.device.type, losses, cpu_losses]))
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    device, loaded, trainer_device, losses, cpu_losses = json.loads(out.strip().splitlines()[-1])
    assert (device, loaded, trainer_device) == ("tpu", [], "tpu")
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=0, atol=2e-4)
