"""Attention through the accelerators' own kernels: JAX's Pallas flash-attention kernel for TPUs
(`jax.experimental.pallas.ops.tpu.flash_attention`) and cuDNN's fused attention on NVIDIA GPUs
(`jax.nn.dot_product_attention(implementation="cudnn")`). Each takes PyTorch's layouts
((*batch, H, L, D)) and gives the output only; the backward is the `jax.vjp` of the forward
(each kernel's own backward kernels, after a second forward).

`pallas_flash_unsupported` / `cudnn_unsupported` say why a call is not one the kernel takes
(None when it is): both refuse dropout and boolean masks (a query whose every key is masked
gets the mean of the values from them, not PyTorch's zeros).

Off a TPU the Pallas kernel runs in Pallas' interpret mode (the kernel's own code, evaluated
by XLA on the host; slow, for tests). The cuDNN path needs a CUDA GPU; `CUDNN_BACKEND` is the
`implementation` it asks jax for (tests on the CPU run its layouts with jax's "xla")."""
import contextlib

import jax
import jax.numpy as jnp

from .._core import runtime

CUDNN_BACKEND = "cudnn"
_PALLAS_BLOCKS = (512, 256, 128)  # the kernel's block sizes must divide the sequence lengths


def _flat(x):
    """(*batch, H, L, D) -> (N, H, L, D)."""
    return x.reshape(-1, *x.shape[-3:])


def _full_bias(bias, q, lk):
    """An additive bias broadcast to (N, H, Lq, Lk): both kernels take it whole."""
    *batch, hq, lq, _ = q.shape
    return jnp.broadcast_to(bias, (*batch, hq, lq, lk)).reshape(-1, hq, lq, lk)


def _common_unsupported(q_shape, k_shape, v_shape, mask_dtype, dropout_p):
    if dropout_p:
        return "dropout"
    if mask_dtype == "bool":
        return "a boolean mask"
    if q_shape[-1] != v_shape[-1]:
        return "values of another width than the keys'"
    return None


def _block(length):
    return next((b for b in _PALLAS_BLOCKS if length % b == 0), None)


def pallas_flash_unsupported(q_shape, k_shape, v_shape, dtype, mask_dtype, dropout_p,
                             is_causal):
    reason = _common_unsupported(q_shape, k_shape, v_shape, mask_dtype, dropout_p)
    if reason:
        return reason
    if dtype not in ("float32", "bfloat16"):
        return f"{dtype} inputs (the kernel takes float32 and bfloat16)"
    if _block(q_shape[-2]) is None or _block(k_shape[-2]) is None:
        return "sequence lengths that are not multiples of 128"
    return None


@contextlib.contextmanager
def pallas_context():
    """Where Pallas kernels are traced: with 32-bit integers (the kernels' index arithmetic
    mixes int32 with Python ints, which become int64 under torchtpu's jax_enable_x64), and in
    interpret mode off a TPU."""
    with jax.enable_x64(False):
        if runtime.platform() == "tpu":
            yield
        else:
            import jax.experimental.pallas.tpu as pltpu
            with pltpu.force_tpu_interpret_mode():
                yield


def pallas_flash(q, k, v, bias, is_causal, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    *batch, hq, lq, d = q.shape
    hk, lk = k.shape[-3], k.shape[-2]
    q4, k4, v4 = _flat(q), _flat(k), _flat(v)
    if hk != hq:  # (the kernel wants as many key heads as query heads)
        k4, v4 = (jnp.repeat(x, hq // hk, axis=1) for x in (k4, v4))
    ab = None if bias is None else _full_bias(bias, q, lk).astype(jnp.float32)
    if ab is not None:
        # The kernel scales the bias with the scores ((q kᵀ + ab) · sm_scale); PyTorch adds
        # it after scaling.
        if scale:
            ab = ab / scale
        else:  # (scale 0: the scores are the bias alone)
            q4, scale = jnp.zeros_like(q4), 1.0
    bq, bk = _block(lq), _block(lk)
    blocks = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                           block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk,
                           block_q_dkv=bq, block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)
    out = fa.flash_attention(q4, k4, v4, ab, causal=is_causal, sm_scale=scale,
                             block_sizes=blocks)
    return out.reshape(*batch, hq, lq, v.shape[-1])


def cudnn_unsupported(q_shape, k_shape, v_shape, dtype, mask_dtype, dropout_p, is_causal):
    reason = _common_unsupported(q_shape, k_shape, v_shape, mask_dtype, dropout_p)
    if reason:
        return reason
    if dtype not in ("float16", "bfloat16"):
        return f"{dtype} inputs (cuDNN's fused attention takes float16 and bfloat16)"
    d = q_shape[-1]
    if d % 8 or d > 256:
        return "a head dim that is not a multiple of 8 up to 256"
    if is_causal and q_shape[-2] != k_shape[-2]:
        return "is_causal with queries and keys of different lengths"
    return None


def cudnn(q, k, v, bias, is_causal, scale):
    *batch, hq, lq, d = q.shape
    lk = k.shape[-2]
    # PyTorch's (N, H, L, D) -> jax's (N, L, H, D); jax groups query heads over key heads as
    # PyTorch's enable_gqa does (query head h uses key head h // (Hq / Hk))
    qt, kt, vt = (jnp.swapaxes(_flat(x), 1, 2) for x in (q, k, v))
    b = None if bias is None else _full_bias(bias, q, lk).astype(q.dtype)
    out = jax.nn.dot_product_attention(qt, kt, vt, bias=b, scale=scale, is_causal=is_causal,
                                       implementation=CUDNN_BACKEND)
    return jnp.swapaxes(out, 1, 2).reshape(*batch, hq, lq, v.shape[-1])
