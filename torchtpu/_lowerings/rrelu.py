"""rrelu's backward (its forward kernel, which fills `noise` in place, is in
_execution/composite.py)."""
from .._core.registry import lowering


@lowering("aten::rrelu_with_noise_backward.default", static=("lower", "upper"))
def rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training and upper - lower > 1e-6:
        return grad * noise
    slope = (lower + upper) / 2
    return grad * (x > 0) + grad * (x <= 0) * slope
