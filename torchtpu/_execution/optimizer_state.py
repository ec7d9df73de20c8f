"""Optimizer state made before an optimizer's first step, so that the first step runs the same
ops as every later one and compiles nothing at the second.

SGD with momentum (foreach and single-tensor) starts each momentum buffer as a copy of the
gradient on its first step and updates it with `buf * momentum + (1 - dampening) * grad` on
later ones: two programs.  Without dampening, a buffer of -0.0 makes the update equal the copy
bit for bit (-0.0 * momentum is -0.0 for a finite positive momentum, and -0.0 + g is g for
every g, signed zeros and NaN included), so the buffers are made so before the first step and
every step is the later steps' program.  The state after it is the same as PyTorch's.
"""
import math

import torch

from . import modes


def _momentum_buffers(optimizer, args, kwargs):
    # While a torch.tpu graph captures, state created by the step is refused (tpu_graphs.py):
    # PyTorch's own first step runs, so that the refusal names it.
    if not isinstance(optimizer, torch.optim.SGD) or modes.get_eager_mode() is modes.CAPTURE:
        return
    for group in optimizer.param_groups:
        momentum = group["momentum"]
        if (group.get("fused") or group.get("differentiable") or group["dampening"] != 0
                or not (0 < momentum < math.inf)):
            continue  # the fused step has no second program; dampening makes the first differ
        for p in group["params"]:
            g = p.grad
            if g is None or g.device.type != "tpu" or g.is_sparse:
                continue
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                # Made on the host and moved whole, so no op joins a fused trace.
                state["momentum_buffer"] = torch.full(g.shape, -0.0, dtype=g.dtype).to(g.device)


def install():
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(_momentum_buffers)
