"""The `_foreach_*` ops torch.optim uses on this device (one executable for the whole list)."""
import jax.numpy as jnp
import numpy as np
import torch

from .pointwise import pow_
from .reductions import vector_norm
from .._core.dtypes import to_jax_dtype, to_torch_dtype
from .._core.registry import lowering


def _map(fn, *lists):
    return [fn(*xs) for xs in zip(*lists)]


def _scalars(s, n):
    return s if isinstance(s, (list, tuple)) else [s] * n


def _binary(name, fn):
    @lowering(f"aten::_foreach_{name}.List")
    def list_(xs, ys, alpha=1):
        return [fn(x, y * alpha).astype(x.dtype) for x, y in zip(xs, ys)]

    @lowering(f"aten::_foreach_{name}.Scalar", f"aten::_foreach_{name}.ScalarList")
    def scalar_(xs, s):
        return [fn(x, v).astype(x.dtype) for x, v in zip(xs, _scalars(s, len(xs)))]


for _name, _fn in {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
                   "div": jnp.divide, "maximum": jnp.maximum, "minimum": jnp.minimum,
                   "pow": jnp.power}.items():
    _binary(_name, _fn)


@lowering("aten::_foreach_mul.Tensor")
def foreach_mul_tensor(xs, t):
    return [(x * t).astype(x.dtype) for x in xs]


@lowering("aten::_foreach_div.Tensor")
def foreach_div_tensor(xs, t):
    return [(x / t).astype(x.dtype) for x in xs]


@lowering("aten::_foreach_add.Tensor")
def foreach_add_tensor(xs, t, alpha=1):
    return [(x + alpha * t).astype(x.dtype) for x in xs]


for _name, _fn in {"sqrt": jnp.sqrt, "neg": jnp.negative, "abs": jnp.abs, "exp": jnp.exp,
                   "log": jnp.log, "reciprocal": lambda x: 1 / x, "sign": jnp.sign,
                   "zero": jnp.zeros_like}.items():
    lowering(f"aten::_foreach_{_name}.default")(
        (lambda f: lambda xs: [f(x).astype(x.dtype) for x in xs])(_fn))


@lowering("aten::_foreach_pow.ScalarAndTensor")
def foreach_pow_scalar_and_tensor(s, exponents):
    # One op for the list: PyTorch's kernel calls pow(s, e) per element, two ops per
    # parameter in AdamW's capturable step (its bias corrections).  The same pow per element,
    # each exponent promoted as pow(s, e) promotes it (the list may mix dtypes).
    number = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}[np.dtype(jnp.result_type(s)).kind]
    out = []
    for e in exponents:
        dtype = torch.result_type(torch.empty((), dtype=to_torch_dtype(e.dtype), device="meta"), number)
        out.append(pow_(s, e.astype(to_jax_dtype(dtype))))
    return out


@lowering("aten::_foreach_addcmul.Scalar", "aten::_foreach_addcmul.ScalarList")
def foreach_addcmul(xs, t1, t2, value=1):
    return [(x + v * a * b).astype(x.dtype) for x, a, b, v in zip(xs, t1, t2, _scalars(value, len(xs)))]


@lowering("aten::_foreach_addcdiv.Scalar", "aten::_foreach_addcdiv.ScalarList")
def foreach_addcdiv(xs, t1, t2, value=1):
    return [(x + v * a / b).astype(x.dtype) for x, a, b, v in zip(xs, t1, t2, _scalars(value, len(xs)))]


@lowering("aten::_foreach_lerp.Scalar")
def foreach_lerp_scalar(xs, ends, w):
    return [(x + w * (e - x)).astype(x.dtype) for x, e in zip(xs, ends)]


@lowering("aten::_foreach_lerp.List")
def foreach_lerp_list(xs, ends, ws):
    return [(x + w * (e - x)).astype(x.dtype) for x, e, w in zip(xs, ends, ws)]


@lowering("aten::_foreach_copy.default")
def foreach_copy(xs, srcs, non_blocking=False):
    return [jnp.broadcast_to(s, x.shape).astype(x.dtype) for x, s in zip(xs, srcs)]


@lowering("aten::_foreach_norm.Scalar", static=("ord",))
def foreach_norm(xs, ord=2, dtype=None):
    return [vector_norm(x, ord) for x in xs]
