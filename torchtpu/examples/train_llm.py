"""The main job: train a small Llama-style language model on `tpu`, checkpoint, resume, sample.

    python -m torchtpu.examples.train_llm [--steps 60] [--batch-size 8] [--mode strict|fused|compile]
                                          [--dtype fp32|bf16] [--resume] [--checkpoint PATH]
                                          [--log-every 10]

The corpus is generated on the spot from the documentation strings of Python's standard
library (identical on every machine with the same Python), tokenised by bytes.  A progress bar
(tqdm, on stderr: steps, elapsed time, ETA) shows the loss read every --log-every steps,
tokens/s, achieved TFLOP/s and, when the device's peak is known, model FLOPs utilisation.
Checkpoints are written with torch.save (and safetensors when installed, with --format
safetensors); --resume continues from the last one; the run ends by sampling text.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import torchtpu  # noqa: F401  (a plain `import torch` also works once installed)
from torchtpu.examples.models import Llama

# Peak dense bf16 TFLOP/s by JAX device kind (for MFU); unknown devices show no MFU.
PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5p": 459, "TPU v6 lite": 918,
               "TPU v6e": 918, "NVIDIA H100": 989, "NVIDIA H200": 989, "NVIDIA A100": 312}

_CORPUS_MODULES = ["argparse", "collections", "contextlib", "dataclasses", "functools", "heapq",
                   "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
                   "shutil", "statistics", "string", "textwrap", "threading", "typing", "unittest",
                   "urllib.parse", "uuid", "zipfile", "datetime", "decimal", "fractions", "math"]


def corpus():
    """A few hundred KB of English: docstrings of standard-library modules and their members."""
    import importlib
    import inspect
    texts = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for _, member in sorted(vars(module).items()):
            doc = inspect.getdoc(member) if callable(member) else None
            if doc and len(doc) > 80:
                texts.append(doc)
    return "\n\n".join(texts).encode("utf-8", errors="ignore")


# --- the model (torchtpu.examples.models.Llama) -----------------------------------------------

def flops_per_token(model, seq):
    n = sum(p.numel() for p in model.parameters())
    d, layers = model.embed.embedding_dim, len(model.blocks)
    return 6 * n + 12 * layers * d * seq  # matmuls forward+backward, plus attention scores


# --- training -----------------------------------------------------------------------------

def batches(data, batch_size, seq, generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch_size,), generator=generator)
        chunk = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def save_checkpoint(path, model, opt, step, args, fmt):
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "args": vars(args)}
    torch.save(state, path)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  os.path.splitext(path)[0] + ".safetensors")


@torch.no_grad()
def sample(model, prompt, tokens, device, temperature=0.8, seed=0):
    """Sampled continuation of `prompt`; the model always sees a window of its full context
    length (left-padded with spaces), so every token reuses one compiled shape."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    context = model.context
    ids = list(prompt.encode())
    for _ in range(tokens):
        window = ([32] * context + ids)[-context:]
        logits = model(torch.tensor([window], device=device))[0, -1].float().cpu()
        ids.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)))
    model.train()
    return bytes(ids).decode("utf-8", errors="replace")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu.examples.train_llm", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mode", choices=["strict", "fused", "compile"], default="strict")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="tpu")
    p.add_argument("--checkpoint", default="train_llm_checkpoint.pt")
    p.add_argument("--format", choices=["torch", "safetensors"], default="torch")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: only at the end)")
    p.add_argument("--log-every", type=int, default=10,
                   help="read the loss every N steps (each read waits for the device)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sample-tokens", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.log_every < 1:
        p.error("--log-every must be at least 1")

    torch.manual_seed(args.seed)
    data = torch.tensor(list(corpus()), dtype=torch.long)
    model = Llama(d=args.d_model, layers=args.layers, heads=args.heads,
                  hidden=int(args.d_model * 8 / 3) // 16 * 16 or 16).to(args.device)
    model.context = args.seq
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    start = 0
    if args.resume and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed from {args.checkpoint} at step {start}")
    if args.mode == "fused":
        torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE

    def step_fn(x, y):
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    step = torch.compile(step_fn, backend="tpu") if args.mode == "compile" else step_fn
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(model, args.seq)
    kind = torch.tpu.get_device_name() if args.device.startswith("tpu") else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if kind.startswith(k)), None)
    print(f"Llama-style model, {n_params / 1e6:.2f}M parameters, {len(data) / 1e3:.0f}K-byte corpus, "
          f"device {args.device} ({kind}), mode {args.mode}, {args.dtype}")
    generator = torch.Generator().manual_seed(args.seed + start)
    stream = batches(data, args.batch_size, args.seq, generator)
    tokens_per_step = args.batch_size * args.seq
    t_first = time.perf_counter()
    loss_value, bar, t_steady = float("nan"), None, None
    for i in range(start + 1, args.steps + 1):
        x, y = next(stream)
        loss = step(x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True))
        if i == start + 1:  # waited for, to time the compilation apart
            loss_value = loss.item()
            print(f"step {i}: loss {loss_value:.3f} (first step incl. compilation "
                  f"{time.perf_counter() - t_first:.1f}s)")
            t_steady = time.perf_counter()
            # From here, so that its rate and ETA are the compiled steps' (the line above gives
            # the first's time); on stderr, where it is no terminal (a log file) redrawn every
            # 30 s rather than 10 times a second.
            bar = tqdm(total=args.steps, initial=i, unit="step", file=sys.stderr,
                       dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 30.0,
                       postfix=f"step {i}: loss={loss_value:.3f}")
        elif i % args.log_every == 0 or i == args.steps:
            # The loss is read every --log-every steps, not at each: `.item()` waits for all the
            # work queued so far, as on CUDA (here the device-side checks of every queued op,
            # _execution/sync.py), so a read at every step, even of the step before's loss once
            # this one is queued, drains the device at every step (strict eager on the CPU:
            # 7.0-7.7K tokens/s instead of 8.5-9.4K).  The postfix says which step its loss is,
            # and its speeds are measured to that step's end, which the read waited for.
            loss_value = loss.item()
            tok_s = (i - start - 1) * tokens_per_step / (time.perf_counter() - t_steady)
            tflops = tok_s * flops / 1e12
            mfu = f", MFU={100 * tflops / peak:.1f}%" if peak else ""
            bar.set_postfix_str(f"step {i}: loss={loss_value:.3f}, tok/s={tok_s:,.0f}, "
                                f"TFLOP/s={tflops:.3f}{mfu}", refresh=False)
        if i > start + 1:
            bar.update()
        if args.checkpoint_every and i % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, model, opt, i, args, args.format)
    if bar is not None:
        bar.close()
    if start < args.steps:
        save_checkpoint(args.checkpoint, model, opt, args.steps, args, args.format)
        print(f"final loss {loss_value:.3f}; checkpoint written to {args.checkpoint}")
    if args.sample_tokens:
        text = sample(model, "The ", args.sample_tokens, args.device)
        print("sample:", repr(text))
    return loss_value


if __name__ == "__main__":
    main()
