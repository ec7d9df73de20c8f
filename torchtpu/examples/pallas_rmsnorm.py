"""A real custom kernel: RMSNorm written in Pallas, as a differentiable torch op on tpu.

The forward is one Pallas kernel over blocks of rows (compiled by Mosaic for a TPU; run by
Pallas' interpreter in a CPU program: `interpret=` asks the platform of the program being
built, so a TPU target compiled for here gets the kernel).  Pallas kernels have no automatic
derivative, so the backward is given explicitly, in plain JAX.  `RMSNorm` is the nn.Module
using it.
"""
import functools
import math

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from torch import nn

from .. import _runtime
from ..pallas import jax_op


def _kernel(x_ref, w_ref, o_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * scale * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _pallas_rms_norm(x, weight, eps):
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    block = math.gcd(rows.shape[0], 8)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(rows.shape[0] // block,),
        in_specs=[pl.BlockSpec((block, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=pl.BlockSpec((block, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        interpret=_runtime.program_platform() == "cpu",
    )(rows, weight)
    return out.reshape(x.shape)


def _rms_norm_backward(primals, cotangents, *, eps):
    x, weight = primals
    (g,) = cotangents
    x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    gw = g32 * weight
    dx = scale * gw - x32 * scale ** 3 * jnp.mean(gw * x32, axis=-1, keepdims=True)
    dw = (g32 * x32 * scale).reshape(-1, x.shape[-1]).sum(0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


@functools.partial(jax_op, backward=_rms_norm_backward, name="pallas_rms_norm")
def rms_norm(x, weight, *, eps=1e-6):
    return _pallas_rms_norm(x, weight, eps)


def rms_norm_reference(x, weight, eps=1e-6):
    """The same math in plain torch (for checking)."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, kernel=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel  # False: the plain torch reference (runs on any device)

    def forward(self, x):
        if self.kernel:
            return rms_norm(x, self.weight, eps=self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


class RMSNormMLP(nn.Module):
    """The example model: a residual MLP with Pallas RMSNorm."""

    def __init__(self, d_in=32, d_hidden=64, n_classes=10, kernel=True):
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.norm = RMSNorm(d_hidden, kernel=kernel)
        self.hidden = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        h = self.inp(x)
        h = h + torch.nn.functional.silu(self.hidden(self.norm(h)))
        return self.out(h)
