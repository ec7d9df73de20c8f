"""The main job: a short training run on the `tpu` device, printing loss and steps/s.

    python -m torchtpu.examples.train_demo [--steps 50]
"""
import argparse
import time

import torch

import torchtpu  # noqa: F401  (a plain `import torch` also works once installed)
from torchtpu.examples.models import GPT


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="tpu")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=32).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable toy task: predict the next token of a repeating sequence.
    data = (torch.arange(8 * 33) % 17).view(8, 33).to(a.device)
    x, y = data[:, :-1], data[:, 1:]
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            print(f"step 1: loss {loss.item():.4f}  (first step incl. compilation "
                  f"{time.perf_counter() - t0:.1f}s)")
            t1 = time.perf_counter()
        elif step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    torch.tpu.synchronize() if a.device.startswith("tpu") else None
    rate = (a.steps - 1) / (time.perf_counter() - t1)
    print(f"device {x.device}, {rate:.1f} steps/s")


if __name__ == "__main__":
    main()
