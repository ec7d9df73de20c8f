"""rrelu's training-mode kernel: it fills `noise` in place *and* returns a fresh tensor, which the
lowering table's ops (pure functions of their inputs) cannot express, so it is composed of tpu
ops here, as PyTorch's CPU kernel computes it."""
import torch
import torch.nn.functional as F

from .._core.registry import lowering

aten = torch.ops.aten


def _rrelu_with_noise(x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    if not training:
        return F.leaky_relu(x, (lower + upper) / 2)
    slopes = torch.empty_like(x).uniform_(lower, upper, generator=generator)
    slopes = torch.where(x <= 0, slopes, torch.ones_like(x))  # CPU: x <= 0 draws a slope
    with torch.no_grad():
        noise.copy_(slopes)
    return x * slopes


@lowering("aten::rrelu_with_noise_backward.default", static=("lower", "upper"))
def rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training and upper - lower > 1e-6:
        return grad * noise
    slope = (lower + upper) / 2
    return grad * (x > 0) + grad * (x <= 0) * slope


def register(lib):
    lib.impl(aten.rrelu_with_noise.default, _rrelu_with_noise, "PrivateUse1")
    return {aten.rrelu_with_noise.default}
