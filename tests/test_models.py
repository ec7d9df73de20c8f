"""Hugging Face models (random weights from small configs), mixed precision, data loading."""
import copy

import pytest
import torch
import torch.nn.functional as F

import transformers  # noqa: E402  (a test dependency: the model tests must run, not skip)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _vit():
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128, num_labels=10,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)


def _batch(kind, step):
    g = torch.Generator().manual_seed(step)
    if kind == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 10, (2,), generator=g)}
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids}


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "vit": _vit}


@pytest.mark.parametrize("kind", list(MODELS))
def test_three_training_steps_match_cpu(kind):
    torch.manual_seed(0)
    cpu_model = MODELS[kind]()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (cpu_model, tpu_model)]
    for step in range(3):
        batch = _batch(kind, step)
        losses = []
        for model, opt, dev in zip((cpu_model, tpu_model), opts, ("cpu", "tpu")):
            loss = model(**{k: v.to(dev) for k, v in batch.items()}).loss
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            if step == 0:
                grads = [p.grad for p in model.parameters()]
                if dev == "cpu":
                    cpu_grads = grads
                else:
                    for (name, _), gc, gt in zip(cpu_model.named_parameters(), cpu_grads, grads):
                        torch.testing.assert_close(gt.cpu(), gc, rtol=1e-3, atol=1e-5, msg=name)
            opt.step()
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), (step, losses)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_generate_with_kv_cache_matches_cpu(kind):
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    tpu_model = copy.deepcopy(model).to("tpu")
    prompt = torch.randint(0, 128, (1, 8))
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    got = tpu_model.generate(prompt.to("tpu"), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_decodes_new_lengths_with_the_executables_it_has(cache, mode):
    # generate() grows input_ids by a token per step, and the growing sequence keeps its
    # storage's shape (growing_sequences.py).  With the static KV cache every other shape stays
    # the same; the default (dynamic) one grows each layer's keys and values by cat along the
    # length, which keep their arrays' shapes too, and attention over them takes the length as
    # an argument.  Once a call has run two decode steps (the first reads the prompt's positions,
    # a layout of its own), lengths never seen before compile nothing: no op, and in fused
    # eager no segment (the last token's clone keeps the strides of a [1, L] view, a layout
    # of its own per length, which must not make the segment another program).
    from torchtpu._core import metrics
    torch.manual_seed(0)
    model = _llama().eval()
    tpu_model = copy.deepcopy(model).to("tpu")
    prompt = torch.randint(0, 128, (1, 8))
    kw = dict(do_sample=False, pad_token_id=0)
    if cache == "static":
        kw.update(cache_implementation="static", max_cache_len=48)
    with torch.tpu.set_eager_mode(mode):
        tpu_model.generate(prompt.to("tpu"), max_new_tokens=3, min_new_tokens=3, **kw).cpu()
        before = sum(metrics.build_counts.values())
        got = tpu_model.generate(prompt.to("tpu"), max_new_tokens=30, min_new_tokens=30, **kw)
        torch.tpu.synchronize()
    built = sum(metrics.build_counts.values()) - before
    assert torch.equal(got.cpu(), model.generate(prompt, max_new_tokens=30, min_new_tokens=30, **kw))
    assert built == 0, {k: v for k, v in metrics.build_counts.items()}


def test_bf16_autocast_step_is_close_to_fp32():
    torch.manual_seed(0)
    model = _llama().to("tpu")
    batch = {k: v.to("tpu") for k, v in _batch("llama", 0).items()}
    fp32 = model(**batch).loss
    with torch.autocast("tpu", dtype=torch.bfloat16):
        out = model(**batch)
    assert out.logits.dtype == torch.bfloat16  # matmuls ran in bf16
    assert out.loss.dtype == torch.float32     # the loss in fp32
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert abs(out.loss.item() - fp32.item()) <= 2e-2


def test_autocast_policy():
    assert torch.tpu.get_amp_supported_dtype() == [torch.bfloat16, torch.float16]
    x, w = torch.randn(4, 8, device="tpu"), torch.randn(8, 8, device="tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        mm, lin = x @ w, F.linear(x, w)
        soft = mm.softmax(-1)
        mixed = torch.cat([mm, x])
    assert mm.dtype == lin.dtype == torch.bfloat16
    assert soft.dtype == mixed.dtype == torch.float32
    assert (x @ w).dtype == torch.float32  # off again outside the block


def test_grad_scaler_fp16_matches_cpu_schedule_and_skips_inf_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def train(m, dev, init_scale):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev, init_scale=init_scale, growth_interval=2)
        history = []
        for _ in range(4):
            with torch.autocast(dev, dtype=torch.float16, enabled=dev == "tpu"):
                loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            history.append((loss.item(), scaler.get_scale()))
        return history

    tpu = train(copy.deepcopy(model).to("tpu"), "tpu", 2.0 ** 10)
    cpu = train(copy.deepcopy(model), "cpu", 2.0 ** 10)
    assert [s for _, s in tpu] == [s for _, s in cpu]
    for (lt, _), (lc, _) in zip(tpu, cpu):
        assert lt == pytest.approx(lc, rel=5e-3)  # fp16 matmuls vs fp32
    before = [p.detach().clone() for p in model.parameters()]
    tpu_model = copy.deepcopy(model).to("tpu")
    overflow = train(tpu_model, "tpu", 2.0 ** 40)  # fp16 gradients overflow: steps skipped
    assert overflow[0][1] == 2.0 ** 39
    for p, q in zip(tpu_model.parameters(), before):
        if overflow[-1][1] < 2.0 ** 36:  # every step overflowed
            torch.testing.assert_close(p.detach().cpu(), q)


def test_dataloader_pin_memory_and_non_blocking_copies():
    from torch.utils.data import DataLoader, TensorDataset
    data = TensorDataset(torch.randn(20, 4), torch.arange(20))
    seen = []
    for xb, yb in DataLoader(data, batch_size=8, pin_memory=True):
        xt, yt = xb.to("tpu", non_blocking=True), yb.to("tpu", non_blocking=True)
        seen.append(yt)
        torch.testing.assert_close(xt.cpu(), xb)
    assert torch.equal(torch.cat(seen).cpu(), torch.arange(20))
    assert torch.randn(3).pin_memory(device="tpu").device.type == "cpu"


def test_train_llm_main_job_trains_checkpoints_resumes_and_samples(tmp_path, capsys, monkeypatch):
    from torchtpu.examples import train_llm
    shown = []  # (steps counted, postfix) at each step the progress bar counts

    class Bar(train_llm.tqdm):
        def update(self, n=1):
            super().update(n)
            shown.append((self.n, self.postfix))

    monkeypatch.setattr(train_llm, "tqdm", Bar)
    ckpt = str(tmp_path / "llm.pt")
    small = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch-size", "4",
             "--checkpoint", ckpt, "--sample-tokens", "8", "--format", "safetensors"]
    first = train_llm.main(["--steps", "12", "--log-every", "3", *small])
    state = torch.load(ckpt)
    assert state["step"] == 12 and (tmp_path / "llm.safetensors").exists()
    # The bar counts every step; its postfix shows the loss and speeds of the latest step read
    # (the first, every 3rd, the last), saying which step that is.
    assert [n for n, _ in shown] == list(range(2, 13))
    assert [postfix.split(":")[0] for _, postfix in shown] == [
        f"step {max(k for k in (1, 3, 6, 9, 12) if k <= n)}" for n in range(2, 13)]
    losses = {postfix.split(",")[0].split("loss=")[1] for _, postfix in shown}
    assert len(losses) >= 4, losses  # 5 reads, 5 losses (give or take an equal rounding)
    assert shown[-1][1].startswith(f"step 12: loss={first:.3f}, tok/s=") and "TFLOP/s=" in shown[-1][1]
    resumed = train_llm.main(["--steps", "24", "--resume", *small])
    captured = capsys.readouterr()
    assert "resumed from" in captured.out and "sample:" in captured.out
    assert "step 13: loss" in captured.out and f"final loss {resumed:.3f}" in captured.out
    assert "24/24" in captured.err and f"step 24: loss={resumed:.3f}" in captured.err  # its last line
    assert torch.load(ckpt)["step"] == 24
    assert resumed < first < 5.6  # it learns (the untrained loss is ln 256 = 5.5)
