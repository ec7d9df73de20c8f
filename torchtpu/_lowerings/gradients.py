"""Backward ops as the JAX gradient of their forward lowering.

PyTorch's autograd calls a dedicated backward op for these (upsampling, replication padding,
margin losses, grid sampling, soft/hard shrink). Each is the vector-Jacobian product of the
table's own forward lowering, so the two always agree; upsampling and padding are linear, so
their VJP at any point is exact."""
import jax
import jax.numpy as jnp
import torch

from .._core.registry import TABLE, lowering

aten = torch.ops.aten


def _forward(op):
    return TABLE[op].fn  # looked up at call time: decomposed lowerings are registered last


def _upsample_backward(forward):
    def backward(grad, output_size, input_size, *rest):
        x = jnp.zeros(tuple(input_size), grad.dtype)
        _, pullback = jax.vjp(lambda a: _forward(forward)(a, output_size, *rest), x)
        return pullback(grad)[0]
    return backward


for _name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
              "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
              "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
              "upsample_bicubic2d", "upsample_trilinear3d"):
    lowering(f"aten::{_name}_backward.default")(
        _upsample_backward(getattr(aten, _name).default))


def _input_backward(forward):
    """backward(grad, self, *args) of a forward(self, *args) with one differentiable input."""
    def backward(grad, x, *args):
        _, pullback = jax.vjp(lambda a: _forward(forward)(a, *args), x)
        return pullback(grad.astype(x.dtype))[0]
    return backward


for _n in (1, 2, 3):
    lowering(f"aten::replication_pad{_n}d_backward.default")(
        _input_backward(getattr(aten, f"replication_pad{_n}d").default))

# Their forwards are PyTorch's decompositions, which take lambd as a constant.
for _name in ("softshrink", "hardshrink"):
    lowering(f"aten::{_name}_backward.default", static=("lambd",))(
        _input_backward(getattr(aten, _name).default))


@lowering("aten::multi_margin_loss_backward.default", static=("p", "margin"))
def multi_margin_loss_backward(grad, x, target, p, margin, weight=None, reduction=1):
    # As the forward's kernel (composed_kernels): one row per sample, the unreduced loss of
    # the target's shape.
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    weight = None if weight is None else weight.reshape(-1)
    forward = _forward(aten.multi_margin_loss.default)
    loss, pullback = jax.vjp(
        lambda a: forward(a, target.reshape(-1), p, margin, weight, reduction), rows)
    return pullback(grad.astype(x.dtype).reshape(loss.shape))[0].reshape(x.shape)


@lowering("aten::multilabel_margin_loss_backward.default")
def multilabel_margin_loss_backward(grad, x, target, reduction, is_target):
    forward = _forward(aten.multilabel_margin_loss_forward.default)
    # (a vector's target may be a scalar, its unreduced loss 0-dim: ATen's shape rules)
    target = target.reshape(x.shape)
    loss, pullback = jax.vjp(lambda a: forward(a, target, reduction)[0], x)
    return pullback(grad.astype(x.dtype).reshape(loss.shape))[0]


def _grid_sampler_backward(forward):
    def backward(grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
        _, pullback = jax.vjp(lambda a, g: _forward(forward)(
            a, g, interpolation_mode, padding_mode, align_corners), x, grid)
        grad_x, grad_grid = pullback(grad.astype(x.dtype))
        # The grid's gradient always (ATen computes it whatever the mask; PyTorch's meta kernels
        # return it: None here left the results one short).
        return (grad_x if output_mask[0] else None), grad_grid
    return backward


for _n in (2, 3):
    lowering(f"aten::grid_sampler_{_n}d_backward.default")(
        _grid_sampler_backward(getattr(aten, f"grid_sampler_{_n}d").default))
