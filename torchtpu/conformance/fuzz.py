"""A bad-input fuzzer: the same randomly built calls on `tpu` and on the CPU, compared.

    python -m torchtpu.conformance.fuzz --seed 0 --seconds 600 --modes strict,fused,debug

Each call gets common ops (pointwise, reductions, indexing, matmuls, views, factories, losses,
convolutions, cat/stack, in-place and out= variants) with inputs chosen to be wrong as often as
right: mismatched shapes and dtypes, negative and out-of-range indices, bad sizes and dims, out=
tensors of the wrong dtype or shape, NaN/inf, zero-size and 0-dim tensors.  Every call is
classified, in every eager mode:

  ok            both ran and agree (values, dtype, shape)
  raise_same    both raised, the same exception type (a subclass of the CPU's counts)
  raise_other   both raised, another type
  wrong         both ran, the values, dtype or shape differ
  tpu_only      the tpu raised where the CPU ran
  silent        the tpu ran where the CPU raised (a silently wrong answer)
  mutated       the tpu raised and changed an input or out= tensor
  unusable      after the tpu raised, a fresh small op failed
  timeout       the call ran past --call-timeout
  crash         the process died during the call (only seen with isolation, the CLI default)

The command line runs the calls in a worker process, restarted after a crash, and prints the
counts and every offending call.  `run()` is the in-process entry point the tests use.
"""
import argparse
import collections
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

CLASSES = ("ok", "raise_same", "raise_other", "wrong", "tpu_only", "silent", "mutated", "unusable",
           "timeout", "crash")
# Classes the long run must not see; the short run in the tests asserts none of these.
FAILURES = ("wrong", "silent", "mutated", "unusable", "timeout", "crash")

_FLOATS = (torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DTYPES = _FLOATS + (torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64)
_SHAPES = ((), (0,), (1,), (3,), (2, 3), (3, 1), (1, 3), (3, 3), (2, 0, 3), (2, 3, 4), (4, 4))


class Gen:
    """Random inputs: mostly sensible, often wrong."""

    def __init__(self, rng):
        self.rng = rng

    def pick(self, *options):
        return self.rng.choice(options)

    def chance(self, p):
        return self.rng.random() < p

    def shape(self):
        return self.rng.choice(_SHAPES)

    def dtype(self, floating=False):
        return self.rng.choice(_FLOATS if floating or self.chance(0.5) else _DTYPES)

    def tensor(self, shape=None, dtype=None, special=0.15, low=-4, high=4):
        shape = self.shape() if shape is None else tuple(shape)
        dtype = self.dtype() if dtype is None else dtype
        g = torch.Generator().manual_seed(self.rng.getrandbits(31))
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) < 0.5
        if dtype.is_floating_point or dtype.is_complex:
            x = torch.randn(shape, generator=g, dtype=torch.float64) * (high - low) / 4
            if self.chance(special) and x.numel():
                flat = x.view(-1)
                for _ in range(self.rng.randint(1, 3)):
                    flat[self.rng.randrange(flat.numel())] = self.pick(
                        math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e-30)
            x = x.to(dtype)
            if dtype.is_complex:
                x = x + 1j * torch.randn(shape, generator=g).to(dtype)
            return x
        lo = max(low, 0) if dtype == torch.uint8 else low
        return torch.randint(lo, high + 1, shape, generator=g, dtype=torch.int64).to(dtype)

    def like(self, x, p_wrong=0.25):
        """A tensor meant to match `x`, with a wrong shape or dtype now and then."""
        shape, dtype = tuple(x.shape), x.dtype
        if self.chance(p_wrong):
            shape = self.shape()
        if self.chance(p_wrong):
            dtype = self.dtype()
        return self.tensor(shape, dtype)

    def dim(self, x):
        n = max(x.dim(), 1)
        return self.rng.randint(-n - 1, n) if self.chance(0.2) else self.rng.randint(-n, n - 1)

    def index(self, size, shape=None, p_bad=0.3):
        shape = (self.rng.randint(0, 4),) if shape is None else shape
        lo, hi = (-size - 2, size + 2) if self.chance(p_bad) else (0, max(size - 1, 0))
        g = torch.Generator().manual_seed(self.rng.getrandbits(31))
        idx = torch.randint(lo, hi + 1, shape, generator=g) if size or lo < hi else \
            torch.zeros(shape, dtype=torch.int64)
        if self.chance(0.05):
            idx = idx.to(self.pick(torch.int32, torch.float32, torch.uint8))
        return idx

    def out(self, like):
        """An out= tensor: right, of another dtype, of another shape, or 0-dim."""
        kind = self.rng.randrange(4)
        shape = tuple(like.shape) if kind in (0, 1) else self.pick((), (0,), (5,), (2, 2))
        dtype = like.dtype if kind in (0, 2) else self.dtype()
        return self.tensor(shape, dtype)

    def size(self):
        return [self.rng.randint(-1 if self.chance(0.1) else 0, 4)
                for _ in range(self.rng.randint(0, 3))]

    def scalar(self):
        return self.pick(0, 1, -2, 2.5, -0.5, math.nan, math.inf, True, 3)


# --- the ops ------------------------------------------------------------------------------
# Each entry builds one call: (label, function, args, kwargs, random) from a Gen.  The label
# names the op and its inputs' layouts; tensors in args/kwargs are CPU tensors, moved to the
# device under test by the runner.

def _describe(args, kwargs):
    def d(v):
        if isinstance(v, torch.Tensor):
            return f"T{list(v.shape)}:{str(v.dtype).replace('torch.', '')}"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(d(x) for x in v) + "]"
        return repr(v)
    parts = [d(a) for a in args] + [f"{k}={d(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


_UNARY = ["neg", "abs", "sign", "sqrt", "exp", "log", "tanh", "sigmoid", "relu", "round",
          "floor", "ceil", "trunc", "nan_to_num", "bitwise_not", "logical_not", "digamma", "erf",
          "reciprocal", "frac", "sin", "isnan", "signbit", "square", "angle", "sgn"]
_BINARY = ["add", "sub", "mul", "div", "floor_divide", "remainder", "fmod", "maximum", "minimum",
           "atan2", "pow", "bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "eq", "lt",
           "heaviside", "copysign", "hypot", "igamma", "xlogy", "bitwise_left_shift",
           "bitwise_right_shift", "fmax", "nextafter"]
_INPLACE = ["add_", "mul_", "div_", "sub_", "floor_divide_", "clamp_", "neg_", "abs_", "sqrt_",
            "relu_", "fill_", "copy_", "zero_", "exp_", "masked_fill_", "bitwise_not_", "lerp_",
            "__ilshift__", "__irshift__", "__iand__"]
_REDUCTIONS = ["sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "std",
               "var", "logsumexp", "cumsum", "all", "any", "norm", "nansum", "median", "cumprod",
               "softmax", "log_softmax", "sort", "topk", "count_nonzero", "aminmax"]


def _unary(g):
    name = g.pick(*_UNARY)
    x = g.tensor()
    fn = getattr(torch, name)
    if g.chance(0.3):
        return name + "(out=)", fn, (x,), {"out": g.out(x)}, False
    return name, fn, (x,), {}, False


def _binary(g):
    name = g.pick(*_BINARY)
    x = g.tensor()
    y = g.like(x) if g.chance(0.8) else g.scalar()
    fn = getattr(torch, name)
    if g.chance(0.25):
        return name + "(out=)", fn, (x, y), {"out": g.out(x)}, False
    return name, fn, (x, y), {}, False


def _ternary(g):
    name = g.pick("lerp", "where", "clamp", "addcmul", "addcdiv")
    x = g.tensor()
    if name == "where":
        return name, torch.where, (g.like(x).to(torch.bool) if g.chance(0.8) else g.like(x), x, g.like(x)), {}, False
    if name == "clamp":
        lo = g.pick(None, g.scalar(), g.like(x))
        hi = g.pick(None, g.scalar(), g.like(x))
        return name, torch.clamp, (x, lo, hi), {}, False
    if name == "lerp":
        return name, torch.lerp, (x, g.like(x), g.pick(0.5, g.like(x))), {}, False
    return name, getattr(torch, name), (x, g.like(x), g.like(x)), {"value": g.pick(1, 0.5, 2)}, False


def _inplace(g):
    name = g.pick(*_INPLACE)
    x = g.tensor()
    if name in ("neg_", "abs_", "sqrt_", "relu_", "zero_", "exp_", "bitwise_not_"):
        args = ()
    elif name == "fill_":
        args = (g.pick(g.scalar(), g.tensor(()), g.like(x)),)
    elif name == "clamp_":
        args = (g.pick(None, g.scalar()), g.pick(None, g.scalar()))
    elif name == "masked_fill_":
        args = (g.like(x).to(g.pick(torch.bool, torch.bool, torch.uint8)), g.scalar())
    elif name == "lerp_":
        args = (g.like(x), 0.5)
    else:
        args = (g.like(x) if g.chance(0.8) else g.scalar(),)
    return name, (lambda t, *a: getattr(t, name)(*a)), (x,) + args, {}, False


def _reduction(g):
    name = g.pick(*_REDUCTIONS)
    x = g.tensor()
    fn = getattr(torch, name)
    if name in ("softmax", "log_softmax", "cumsum", "cumprod"):
        return name, fn, (x, g.dim(x)), {}, False
    if name == "topk":
        return name, fn, (x, g.rng.randint(-1, 4)), {"dim": g.dim(x)}, False
    if name in ("sort", "argmax", "argmin", "median", "count_nonzero"):
        return name, fn, (x,) + ((g.dim(x),) if g.chance(0.7) else ()), {}, False
    kwargs = {}
    if g.chance(0.7):
        kwargs["dim"] = g.dim(x) if name in ("max", "min", "aminmax") or g.chance(0.7) else [g.dim(x), g.dim(x)]
        kwargs["keepdim"] = g.chance(0.5)
    if name in ("sum", "mean", "prod", "nansum") and g.chance(0.2):
        kwargs["dtype"] = g.dtype()
    if name in ("sum", "mean", "amax") and "dim" in kwargs and g.chance(0.2):
        kwargs["out"] = g.out(x)
        return name + "(out=)", fn, (x,), kwargs, False
    return name, fn, (x,), kwargs, False


def _indexing(g):
    name = g.pick("gather", "scatter", "scatter_add", "scatter_reduce", "index_select",
                  "index_add", "index_fill", "index_copy", "index_put", "getitem", "setitem",
                  "mask_get", "mask_set", "masked_select", "take", "put_", "embedding", "one_hot")
    x = g.tensor(g.pick((3,), (2, 3), (3, 4), (0, 3), ()), g.dtype())
    d = g.dim(x)
    size = x.shape[d] if x.dim() and -x.dim() <= d < x.dim() else 1
    if name == "gather":
        return name, torch.gather, (x, d, g.index(size, tuple(x.shape))), {}, False
    if name in ("scatter", "scatter_add", "scatter_reduce"):
        idx = g.index(size, tuple(x.shape))
        src = g.like(x, 0.15)
        if name == "scatter_reduce":
            return name, torch.scatter_reduce, (x, d, idx, src, g.pick("sum", "amax", "mean", "prod")), {}, False
        return name, getattr(torch, name), (x, d, idx, src), {}, False
    if name in ("index_select", "index_fill"):
        idx = g.index(size)
        args = (x, d, idx) + ((g.scalar(),) if name == "index_fill" else ())
        return name, getattr(torch, name), args, {}, False
    if name in ("index_add", "index_copy"):
        idx = g.index(size)
        shape = list(x.shape) or [1]
        if -x.dim() <= d < x.dim():
            shape[d] = idx.numel()
        src = g.tensor(shape if g.chance(0.8) else g.shape(), x.dtype if g.chance(0.8) else g.dtype())
        return name, getattr(torch, name), (x, d, idx, src), {}, False
    if name == "index_put":
        idx = tuple(g.index(n) for n in x.shape[:g.rng.randint(1, max(x.dim(), 1))]) or (g.index(1),)
        vals = g.tensor(g.pick((), (1,), (idx[0].numel(),), (2, 2)), x.dtype if g.chance(0.8) else g.dtype())
        return name, torch.index_put, (x, idx, vals, g.chance(0.4)), {}, False
    if name in ("getitem", "setitem"):
        idx = g.index(x.shape[0] if x.dim() else 1)
        if name == "getitem":
            return name, (lambda t, i: t[i]), (x, idx), {}, False
        v = g.tensor(g.pick((), (1,), (3,), tuple(idx.shape)), x.dtype if g.chance(0.8) else g.dtype())
        return name, _setitem, (x, idx, v), {}, False
    if name in ("mask_get", "mask_set", "masked_select"):
        shape = tuple(x.shape) if g.chance(0.6) else g.pick((3,), (2,), (1, 3), (4, 3))
        mask = g.tensor(shape, torch.bool if g.chance(0.9) else torch.uint8)
        if name == "mask_get":
            return name, (lambda t, m: t[m]), (x, mask), {}, False
        if name == "masked_select":
            return name, torch.masked_select, (x, mask), {}, False
        return name, _setitem, (x, mask, g.tensor(g.pick((), (1,), (2,)), x.dtype)), {}, False
    if name in ("take", "put_"):
        idx = g.index(x.numel())
        if name == "take":
            return name, torch.take, (x, idx), {}, False
        src = g.tensor((idx.numel(),) if g.chance(0.8) else (2,), x.dtype)
        return name, (lambda t, i, s, a: t.put_(i, s, a)), (x, idx, src, g.chance(0.5)), {}, False
    if name == "embedding":
        w = g.tensor(g.pick((5, 3), (5,), (0, 3)), g.dtype(floating=True))
        return name, F.embedding, (g.index(w.shape[0] if w.dim() else 1, (g.rng.randint(0, 4),)), w), {}, False
    idx = g.index(4, (g.rng.randint(0, 4),))
    return name, F.one_hot, (idx, g.pick(-1, 0, 4, 5)), {}, False


def _setitem(x, idx, v):
    x[idx] = v
    return x


def _matmul(g):
    name = g.pick("mm", "bmm", "matmul", "addmm", "mv", "dot", "baddbmm", "outer", "inv",
                  "solve", "cholesky", "det", "eigh", "einsum")
    dt = g.pick(torch.float32, torch.float32, torch.float64, g.dtype())
    n, m = g.rng.randint(0, 3), g.rng.randint(1, 3)
    shapes = {"mm": ((n, m), (m, 2)), "bmm": ((2, n, m), (2, m, 2)), "matmul": ((n, m), (m,)),
              "mv": ((n, m), (m,)), "dot": ((m,), (m,)), "outer": ((n,), (m,))}
    if name in shapes:
        a, b = (g.tensor(s if g.chance(0.8) else g.shape(), dt if g.chance(0.85) else g.dtype())
                for s in shapes[name])
        return name, getattr(torch, name), (a, b), {}, False
    if name in ("addmm", "baddbmm"):
        batch = (2,) if name == "baddbmm" else ()
        a = g.tensor(batch + (n, m), dt)
        b = g.tensor(batch + (m, 2), dt if g.chance(0.8) else g.dtype())
        bias = g.tensor(g.pick(batch + (n, 2), (2,), (), (3, 3)), dt if g.chance(0.8) else g.dtype())
        return name, getattr(torch, name), (bias, a, b), {"beta": g.pick(1, 0, 0.5), "alpha": g.pick(1, 2)}, False
    if name == "einsum":
        return name, torch.einsum, (g.pick("ij,jk->ik", "ii->i", "ij->", "i,i->"), g.tensor((3, 3), dt), g.tensor((3, 3), dt)), {}, False
    a = g.tensor(g.pick((3, 3), (2, 2), (3,), (2, 3), (0, 0), (2, 3, 3)), dt)
    if name == "cholesky" and g.chance(0.5) and a.dim() >= 2 and a.shape[-1] == a.shape[-2]:
        a = a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype) if a.is_floating_point() else a
    fn = {"inv": torch.linalg.inv, "cholesky": torch.linalg.cholesky, "det": torch.linalg.det,
          "eigh": lambda t: torch.linalg.eigh(t).eigenvalues}.get(name)
    if name == "solve":
        return name, torch.linalg.solve, (a, g.tensor(g.pick((3,), (3, 2), (2,)), dt)), {}, False
    return name, fn, (a,), {}, False


def _view(g):
    name = g.pick("view", "reshape", "permute", "transpose", "narrow", "select", "expand",
                  "squeeze", "unsqueeze", "flatten", "t", "diagonal", "split", "chunk", "unbind",
                  "movedim", "view_dtype", "unfold", "as_strided", "contiguous_t")
    x = g.tensor()
    d = g.dim(x)
    calls = {
        "view": lambda: (lambda t, s: t.view(s), (x, g.size() + [-1] * g.chance(0.3))),
        "reshape": lambda: (torch.reshape, (x, g.size() + [-1] * g.chance(0.5))),
        "permute": lambda: (torch.permute, (x, [g.dim(x) for _ in range(x.dim())])),
        "transpose": lambda: (torch.transpose, (x, d, g.dim(x))),
        "narrow": lambda: (torch.narrow, (x, d, g.rng.randint(-1, 3), g.rng.randint(-1, 3))),
        "select": lambda: (torch.select, (x, d, g.rng.randint(-4, 4))),
        "expand": lambda: (lambda t, s: t.expand(s), (x, g.size())),
        "squeeze": lambda: (torch.squeeze, (x, d)),
        "unsqueeze": lambda: (torch.unsqueeze, (x, g.rng.randint(-x.dim() - 2, x.dim() + 1))),
        "flatten": lambda: (torch.flatten, (x, d, g.dim(x))),
        "t": lambda: (torch.t, (x,)),
        "diagonal": lambda: (torch.diagonal, (x, g.rng.randint(-2, 2), d, g.dim(x))),
        "split": lambda: (torch.split, (x, g.rng.randint(-1, 3), d)),
        "chunk": lambda: (torch.chunk, (x, g.rng.randint(-1, 3), d)),
        "unbind": lambda: (torch.unbind, (x, d)),
        "movedim": lambda: (torch.movedim, (x, d, g.dim(x))),
        "view_dtype": lambda: (lambda t, dt: t.view(dt), (x, g.dtype())),
        "unfold": lambda: (lambda t, *a: t.unfold(*a), (x, d, g.rng.randint(0, 3), g.rng.randint(0, 2))),
        "as_strided": lambda: (torch.as_strided, _strided_args(g, x)),
        "contiguous_t": lambda: (lambda t: t.mT.contiguous() * 1, (x,)),
    }
    fn, args = calls[name]()
    return name, fn, args, {}, False


def _strided_args(g, x):
    size = g.size()
    return x, size, [g.rng.randint(0, 3) for _ in size], g.rng.randint(-1, 3)


def _factory(g):
    name = g.pick("zeros", "ones", "full", "arange", "linspace", "eye", "empty_shape", "new_zeros",
                  "randint", "rand", "zeros_like", "tensor_0dim", "arange_out", "full_huge",
                  "zeros_huge", "bernoulli", "multinomial", "logspace")
    kw = {"device": "{device}"}
    if g.chance(0.3):
        kw["dtype"] = g.dtype()
    if name in ("zeros", "ones"):
        return name, getattr(torch, name), (g.size(),), kw, False
    if name == "full":
        return name, torch.full, (g.size(), g.scalar()), kw, False
    if name == "arange":
        return name, torch.arange, (g.pick(0, -3, 2.5), g.pick(4, 0, -2, 7.5, math.inf), g.pick(1, 0.5, -1, 0, 3)), kw, False
    if name == "linspace":
        return name, torch.linspace, (g.pick(0, -3, 2.5, 1e10), g.pick(1, 10, -7.25), g.rng.randint(-1, 40)), kw, False
    if name == "logspace":
        return name, torch.logspace, (g.pick(0, -3), g.pick(1, 3), g.rng.randint(-1, 9)), kw, False
    if name == "eye":
        return name, torch.eye, (g.rng.randint(-1, 4), g.rng.randint(-1, 4)), kw, False
    if name == "empty_shape":
        return name, (lambda s, **k: torch.empty(s, **k).shape), (g.size(),), kw, False
    if name == "new_zeros":
        return name, (lambda t, s: t.new_zeros(s)), (g.tensor(), g.size()), {}, False
    if name == "zeros_like":
        return name, torch.zeros_like, (g.tensor(),), {k: v for k, v in kw.items() if k == "dtype"}, False
    if name == "tensor_0dim":
        return name, (lambda v, **k: torch.tensor(v, **k)), (g.scalar(),), kw, False
    if name == "randint":
        return name, torch.randint, (g.rng.randint(-2, 3), g.rng.randint(-2, 3), g.size()), kw, True
    if name == "rand":
        return name, torch.rand, (g.size(),), kw, True
    if name == "bernoulli":
        return name, torch.bernoulli, (g.tensor(g.shape(), g.dtype(floating=True)),), {}, True
    if name == "multinomial":
        return name, torch.multinomial, (g.tensor(g.pick((3,), (2, 3), (0,)), g.dtype()), g.rng.randint(-1, 4), g.chance(0.5)), {}, True
    if name == "arange_out":
        base = g.tensor((2, 4), g.dtype())
        return name, _arange_out, (base, g.rng.randint(0, 9), g.pick(0, 1)), {}, False
    if name == "full_huge":
        return name, torch.full, ((2 ** 31, 2 ** 31), 1), {"dtype": torch.uint8, "device": "{device}"}, False
    return name, torch.zeros, (g.pick(2 ** 62, 2 ** 40, -(2 ** 62)),), kw, False


def _arange_out(base, end, narrow):
    out = base.narrow(1, 1, 2) if narrow else base
    torch.arange(0, end, out=out)
    return base


def _loss(g):
    name = g.pick("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "smooth_l1_loss", "kl_div", "huber_loss",
                  "ctc_loss")
    dt = g.dtype(floating=True) if g.chance(0.9) else g.dtype()
    n, c = g.rng.randint(0, 3), g.rng.randint(1, 4)
    x = g.tensor(g.pick((n, c), (n, c), (c,), (n, c, 2)), dt)
    if name in ("cross_entropy", "nll_loss"):
        target = g.index(c, g.pick((n,), (n,), (n, c), (), (n, 2)), p_bad=0.3)
        if g.chance(0.2):  # class probabilities
            target = g.tensor(tuple(x.shape), dt).softmax(-1) if x.numel() else g.tensor(tuple(x.shape), dt)
        kw = {"reduction": g.pick("mean", "sum", "none")}
        if g.chance(0.3):
            kw["ignore_index"] = g.pick(-1, 0, -100)
        if g.chance(0.2):
            kw["weight"] = g.tensor(g.pick((c,), (c + 1,)), dt)
        return name, getattr(F, name), (x, target), kw, False
    if name == "binary_cross_entropy":
        p = x.sigmoid() if g.chance(0.7) and x.is_floating_point() else x
        return name, F.binary_cross_entropy, (p, g.like(x, 0.15)), {"reduction": g.pick("mean", "none")}, False
    if name == "ctc_loss":
        t_len, s = g.rng.randint(1, 5), g.rng.randint(0, 3)
        lp = g.tensor((t_len, 2, 4), torch.float32).log_softmax(-1)
        # Labels out of range are undefined behaviour on the CPU (no check): not generated.
        targets = torch.randint(1, 4, (2, s), generator=torch.Generator().manual_seed(g.rng.getrandbits(31)))
        lengths = torch.tensor([t_len, max(t_len - 1, 0)])
        return name, F.ctc_loss, (lp, targets, lengths, torch.tensor([s, g.rng.randint(0, s)])), {}, False
    return name, getattr(F, name), (x, g.like(x, 0.2)), {"reduction": g.pick("mean", "sum", "none")}, False


def _conv(g):
    name = g.pick("conv1d", "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
                  "conv_transpose2d", "interpolate", "pad")
    dt = g.pick(torch.float32, torch.float32, torch.float64, g.dtype())
    if name == "conv1d":
        x = g.tensor(g.pick((1, 2, 5), (2, 5), (1, 3, 5), (1, 2, 0)), dt)
        w = g.tensor(g.pick((3, 2, 3), (3, 2, 7), (3, 3, 3)), dt if g.chance(0.8) else g.dtype())
        return name, F.conv1d, (x, w), {"stride": g.pick(1, 2, 0), "padding": g.pick(0, 1, -1)}, False
    if name in ("conv2d", "conv_transpose2d"):
        x = g.tensor(g.pick((1, 2, 4, 4), (2, 4, 4), (1, 3, 4, 4)), dt)
        w = g.tensor(g.pick((3, 2, 3, 3), (2, 3, 3, 3), (3, 2, 5, 5)), dt if g.chance(0.8) else g.dtype())
        return name, getattr(F, name), (x, w), {"stride": g.pick(1, 2), "groups": g.pick(1, 1, 2)}, False
    x = g.tensor(g.pick((1, 2, 4, 4), (2, 4, 4), (1, 2, 0, 4), (4,)), dt)
    if name == "max_pool2d":
        return name, F.max_pool2d, (x, g.pick(2, 3, 5, 0)), {"padding": g.pick(0, 1, 2)}, False
    if name == "avg_pool2d":
        return name, F.avg_pool2d, (x, g.pick(2, 3, 5)), {"ceil_mode": g.chance(0.5)}, False
    if name == "adaptive_avg_pool2d":
        return name, F.adaptive_avg_pool2d, (x, g.pick(0, 1, 2, (0, 3), (3, 5))), {}, False
    if name == "interpolate":
        return name, F.interpolate, (x,), {"size": g.pick(2, 3, 0), "mode": g.pick("nearest", "bilinear")}, False
    return name, F.pad, (x, g.pick((1, 1), (1, 2, 3, 4), (-1, 1), (1,))), {"mode": g.pick("constant", "reflect")}, False


def _cat(g):
    name = g.pick("cat", "stack", "hstack", "vstack", "cat_out")
    x = g.tensor()
    ts = [x] + [g.like(x, 0.3) for _ in range(g.rng.randint(0, 2))]
    if name == "cat_out":
        return name, torch.cat, (ts, g.dim(x)), {"out": g.out(x)}, False
    if name in ("cat", "stack"):
        return name, getattr(torch, name), (ts, g.dim(x)), {}, False
    return name, getattr(torch, name), (ts,), {}, False


FAMILIES = [_unary, _binary, _ternary, _inplace, _reduction, _indexing, _matmul, _view, _factory,
            _loss, _conv, _cat]


def make_call(seed, i):
    """The i-th call of a seeded run (independent of the others, so a run can resume)."""
    rng = random.Random(f"{seed}:{i}")
    g = Gen(rng)
    family = rng.choice(FAMILIES)
    name, fn, args, kwargs, is_random = family(g)
    return name, fn, args, kwargs, is_random


# --- running and comparing ------------------------------------------------------------------

class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _deadline(seconds):
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _to(v, device, copies):
    if isinstance(v, torch.Tensor):
        t = v.clone().to(device)
        if device != "cpu" and t.dim() == 1 and t.numel() % 2 and not t.requires_grad:
            t = _with_room_to_spare(t)
        copies.append((t, v))
        return t
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device, copies) for x in v)
    if v == "{device}":
        return device
    return v


def _with_room_to_spare(t):
    """t with 3 elements past its own in its array, as a random fill or an append leaves them
    (ops then take padded.py's path): NaN or zero, which a wrong read or check would show."""
    import jax.numpy as jnp
    from .._core import storage
    array = storage.buffer_of(t).value()
    fill = jnp.nan if jnp.issubdtype(array.dtype, jnp.inexact) else 0
    spare = jnp.full((3,), fill, array.dtype)
    padded = jnp.concatenate([array.reshape(-1)[:t.numel()], spare])
    return storage.wrap(padded, [t.numel()], [1], t.dtype, t.device.index,
                        t.numel() * t.element_size())


def _to_cpu(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, (list, tuple)):
        return [_to_cpu(x) for x in v]
    return v


def _call(fn, args, kwargs, device):
    copies = []
    a = _to(args, device, copies)
    k = {key: _to(v, device, copies) for key, v in kwargs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = fn(*a, **k)
            if device != "cpu":
                torch.tpu.synchronize()
            return "ok", _to_cpu(result), copies
        except _Timeout:
            raise
        except Exception as e:  # noqa: BLE001 - the point is to catch what PyTorch raises
            return "raise", e, copies


def _same(a, b, is_random):
    """None if the tpu result `b` matches the CPU's `a`, else what differs."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or not isinstance(b, (list, tuple)) or len(a) != len(b):
            return "structure"
        for x, y in zip(a, b):
            d = _same(x, y, is_random)
            if d:
                return d
        return None
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"type {type(a).__name__} vs {type(b).__name__}"
    if not isinstance(a, torch.Tensor):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return None
        return None if a == b else f"{a!r} vs {b!r}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if is_random:
        return None
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-7}.get(a.dtype, 1.3e-4)
    if a.dtype.is_complex:
        tol = 1e-4
    try:
        torch.testing.assert_close(b, a, rtol=tol, atol=tol, equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[-1][:160] if str(e) else "values"
    return None


def _unchanged(copies):
    """The tpu inputs still hold their original values and layouts."""
    for t, original in copies:
        if t.shape != original.shape or t.dtype != original.dtype:
            return False
        try:
            now = t.cpu()
        except Exception:  # noqa: BLE001 - an unreadable tensor lost its value
            return False
        bits = lambda v: v.reshape(-1).view(torch.uint8) if v.numel() else v  # NaN == NaN
        if not torch.equal(bits(now), bits(original)):
            return False
    return True


def _usable():
    try:
        return torch.equal((torch.ones(3, device="tpu") * 2).cpu(), torch.full((3,), 2.0))
    except Exception:  # noqa: BLE001
        return False


_MODES = {"strict": "DEFER_NEVER", "fused": "DEFER_AND_FUSE", "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING"}


def classify(call, mode, call_timeout=60.0, reference=None):
    """(class, detail) of one call in one eager mode; `reference` is the CPU outcome."""
    name, fn, args, kwargs, is_random = call
    cpu_kind, cpu_value, _ = reference if reference is not None else _call(fn, args, kwargs, "cpu")
    try:
        with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, _MODES[mode])), \
                _deadline(call_timeout):
            kind, value, copies = _call(fn, args, kwargs, "tpu")
    except _Timeout:
        return "timeout", f"over {call_timeout}s"
    if kind == "raise":
        detail = f"{type(value).__name__}: {str(value).splitlines()[0][:160] if str(value) else ''}"
        if not _usable():
            return "unusable", detail
        if not _unchanged(copies):
            return "mutated", detail
        if cpu_kind == "ok":
            return "tpu_only", detail
        same = isinstance(value, type(cpu_value))
        return ("raise_same" if same else "raise_other"), f"cpu {type(cpu_value).__name__}, tpu {detail}"
    if cpu_kind == "raise":
        return "silent", f"cpu raised {type(cpu_value).__name__}: {str(cpu_value).splitlines()[0][:120] if str(cpu_value) else ''}"
    # In-place ops return the tensor they changed, so their results are compared too.
    diff = _same(cpu_value, value, is_random)
    return ("ok", "") if diff is None else ("wrong", diff)


def run(seed=0, calls=None, seconds=None, modes=("strict", "fused"), start=0, call_timeout=60.0,
        on_result=None):
    """Run seeded calls in this process; returns {mode: Counter} and the offending calls."""
    counts = {m: collections.Counter() for m in modes}
    offending = []
    end = time.monotonic() + seconds if seconds else None
    i = start
    while (calls is None or i < start + calls) and (end is None or time.monotonic() < end):
        call = make_call(seed, i)
        reference = _call(call[1], call[2], call[3], "cpu")
        label = f"#{i} {call[0]}({_describe(call[2], call[3])})"
        for mode in modes:
            if on_result:
                on_result("start", i, mode, label, "")
            cls, detail = classify(call, mode, call_timeout, reference)
            counts[mode][cls] += 1
            if cls not in ("ok", "raise_same"):
                offending.append((mode, cls, label, detail))
            if on_result:
                on_result("result", i, mode, cls, detail)
        i += 1
    return counts, offending


# --- the command line: a worker process, restarted after a crash ------------------------------

def _worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int)
    p.add_argument("--start", type=int)
    p.add_argument("--calls", type=int)
    p.add_argument("--deadline", type=float)
    p.add_argument("--modes")
    p.add_argument("--call-timeout", type=float)
    a = p.parse_args(argv)
    import torchtpu  # noqa: F401

    def emit(event, i, mode, cls, detail):
        print(json.dumps([event, i, mode, cls, detail]), flush=True)
        if event == "result" and time.time() > a.deadline:
            sys.exit(0)

    run(a.seed, a.calls, None, a.modes.split(","), a.start, a.call_timeout, emit)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu.conformance.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=60.0, help="stop after this long")
    p.add_argument("--calls", type=int, default=None, help="stop after this many calls")
    p.add_argument("--start", type=int, default=0, help="the first call's number (to resume)")
    p.add_argument("--modes", default="strict,fused,debug")
    p.add_argument("--call-timeout", type=float, default=120.0)
    p.add_argument("--quiet", action="store_true", help="counts only, not the offending calls")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    deadline = time.time() + a.seconds
    counts = {m: collections.Counter() for m in modes}
    offending = []
    i = a.start
    limit = a.start + a.calls if a.calls is not None else 1 << 62
    while i < limit and time.time() < deadline:
        cmd = [sys.executable, "-m", "torchtpu.conformance.fuzz", "--worker", "--seed", str(a.seed),
               "--start", str(i), "--calls", str(limit - i), "--deadline", str(deadline),
               "--modes", a.modes, "--call-timeout", str(a.call_timeout)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current = None
        for line in proc.stdout:
            try:
                event, idx, mode, cls, detail = json.loads(line)
            except ValueError:
                continue
            if event == "start":
                current = (idx, mode, cls)
                continue
            counts[mode][cls] += 1
            if cls not in ("ok", "raise_same"):
                offending.append((mode, cls, current[2], detail))
            current = None
            i = idx + 1 if mode == modes[-1] else idx
        rc = proc.wait()
        if current is not None:  # the worker died inside a call
            idx, mode, label = current
            counts[mode]["crash"] += 1
            offending.append((mode, "crash", label, f"exit status {rc}"))
            i = idx + 1
        elif rc != 0 and i < limit and time.time() < deadline:
            # The worker failed outside any call (building call i, or its CPU reference): the
            # fuzzer's own error, reported and skipped.
            offending.append((modes[0], "fuzzer_error", f"#{i}", f"exit status {rc}"))
            i += 1
    _report(counts, offending, a, quiet=a.quiet)
    return 0


def _report(counts, offending, args, quiet=False):
    print(f"torchtpu.conformance.fuzz --seed {args.seed} --modes {args.modes}: "
          f"{sum(counts[next(iter(counts))].values())} calls per mode")
    for mode, c in counts.items():
        both = c["raise_same"] + c["raise_other"]
        share = f"{100.0 * c['raise_same'] / both:.1f}%" if both else "n/a"
        print(f"  {mode:6s} " + " ".join(f"{k}={c[k]}" for k in CLASSES)
              + f"  same exception type where both raise: {share}")
    if not quiet:
        for mode, cls, label, detail in offending:
            print(f"  [{mode}] {cls}: {label}: {detail}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        sys.exit(main())
