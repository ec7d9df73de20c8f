"""torch dtype <-> JAX dtype, and host conversions that numpy cannot do for bfloat16."""
import math

import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def to_jax_dtype(dtype):
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        # A RuntimeError, as PyTorch's kernels raise for a dtype they lack ("not implemented for
        # 'ComplexHalf'"): a TypeError inside `tensor * 1j` becomes Python's "unsupported operand".
        raise RuntimeError(f"dtype {dtype} is not supported on the tpu device") from None


def to_torch_dtype(jdtype):
    return _JAX_TO_TORCH[np.dtype(jdtype)]


# numpy has no bfloat16/float8 that torch.from_numpy accepts: move them as same-size integers.
_BITS_CARRIER = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
}


def tensor_to_numpy(t):
    """A contiguous CPU tensor's values as a numpy array of the matching JAX dtype."""
    carrier = _BITS_CARRIER.get(t.dtype)
    if carrier is None:
        return t.numpy()
    return t.view(carrier).numpy().view(to_jax_dtype(t.dtype))


def numpy_to_tensor(a, dtype):
    carrier = _BITS_CARRIER.get(dtype)
    if carrier is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(to_jax_dtype(carrier))).view(dtype)


def cast(x, dtype):
    """`x.astype(dtype)` converting floats to integers as PyTorch's CPU kernels do on x86:
    through int64 for int64 and through int32 for narrower types (so -4.0 becomes 252 in uint8
    and 300.0 becomes 44 in int8, where XLA saturates), an out-of-range or NaN value giving the
    intermediate type's minimum (cvttss2si's "integer indefinite").  CUDA saturates those
    out-of-range values instead; its in-range wrap-around agrees with the CPU."""
    x = jnp.asarray(x)
    dtype = jnp.dtype(dtype)
    if not (jnp.issubdtype(x.dtype, jnp.inexact) and jnp.issubdtype(dtype, jnp.integer)):
        return x.astype(dtype)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.real(x)
    wide = jnp.int64 if dtype.itemsize == 8 else jnp.int32
    low = float(jnp.iinfo(wide).min)
    fits = (x >= low) & (x < -low)  # False for NaN
    y = jnp.where(fits, x, 0).astype(wide)
    return jnp.where(fits, y, jnp.iinfo(wide).min).astype(dtype)


_CPP_NAMES = {torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t",
              torch.int32: "int", torch.int64: "int64_t", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.float32: "float", torch.float64: "double"}


def check_scalar_fits(value, dtype, numel=2):
    """PyTorch's checked conversion of a Scalar to a tensor's dtype (c10::overflows), as its CPU
    fill kernels apply it (fill_, full, masked_fill, index_fill): RuntimeError for a value out of
    the dtype's range, NaN for an integer type, or a complex value with an imaginary part for a
    real type.  Unsigned types take negative integers down to -max (they wrap); infinities fit
    floating types.  A one-element half-precision tensor is filled unchecked on the CPU."""
    if dtype == torch.bool or dtype.is_complex or isinstance(value, bool):
        return
    if dtype in (torch.float16, torch.bfloat16) and numel == 1:
        return
    if isinstance(value, complex):
        bad = value.imag != 0
        value = value.real
    else:
        bad = False
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        bad = bad or (not math.isinf(value) and not math.isnan(value)
                      and not info.min <= value <= info.max)
    else:
        info = torch.iinfo(dtype)
        low = -info.max if info.min == 0 and isinstance(value, int) else info.min
        bad = bad or math.isnan(value) or not low <= value <= info.max
    if bad:
        raise RuntimeError(f"value cannot be converted to type {_CPP_NAMES.get(dtype, dtype)} "
                           "without overflow")
