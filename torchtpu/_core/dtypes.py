"""torch dtype <-> JAX dtype, and host conversions that numpy cannot do for bfloat16."""
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
        raise TypeError(f"dtype {dtype} is not supported on the tpu device") from None


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
