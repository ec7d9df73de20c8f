"""Attention through the accelerators' own kernels: JAX's Pallas flash-attention kernel for TPUs
(`jax.experimental.pallas.ops.tpu.flash_attention`) and cuDNN's fused attention on NVIDIA GPUs
(`jax.nn.dot_product_attention(implementation="cudnn")`) for scaled dot-product attention, and
JAX's Pallas splash-attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) for
FlexAttention's masks. Each takes PyTorch's layouts ((*batch, H, L, D)); the backward is the
`jax.vjp` of the forward (each kernel's own backward kernels, after a second forward).

`pallas_flash_unsupported` / `cudnn_unsupported` say why a call is not one the kernel takes
(None when it is): both refuse dropout and boolean masks (a query whose every key is masked
gets the mean of the values from them, not PyTorch's zeros).

Off a TPU the Pallas kernel runs in Pallas' interpret mode (the kernel's own code, evaluated
by XLA on the host; slow, for tests). The cuDNN path needs a CUDA GPU; `CUDNN_BACKEND` is the
`implementation` it asks jax for (tests on the CPU run its layouts with jax's "xla")."""
import contextlib
import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

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
        if runtime.program_platform() == "tpu":
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


# --- splash attention: FlexAttention's masks ----------------------------------------------

SPLASH_BLOCK = 128  # the kernel's default blocks (BlockSizes.get_default()); not tuned on a TPU
# key -> (mask (Bm, Hm, Lq, Lk) bool, each (b, h) slice's digest). Kept for the process: a
# program for the key may be traced again (new batch size, dtype, an evicted executable).
_splash_masks = {}


def splash_unsupported(q_shape, k_shape, v_shape, dtype):
    """Why the splash kernel cannot take attention of these shapes and dtype (a name,
    "float32"), or None."""
    if dtype not in ("float32", "bfloat16"):
        return f"{dtype} inputs (the kernel takes float32 and bfloat16)"
    if q_shape[-2] % SPLASH_BLOCK or k_shape[-2] % SPLASH_BLOCK:
        return f"sequence lengths that are not multiples of {SPLASH_BLOCK}"
    return None


def register_splash_mask(mask):
    """The key under which the splash lowerings find `mask`, a boolean array (Bm, Hm, Lq, Lk)
    (Bm, Hm: 1 where it is the same for every batch element, every head): a digest of its
    contents, so equal masks share one key, and with it their compiled programs."""
    mask = np.ascontiguousarray(mask, dtype=bool)
    digests = [[hashlib.sha1(head).hexdigest() for head in per_batch] for per_batch in mask]
    key = "x".join(map(str, mask.shape)) + ":" + hashlib.sha1(
        "".join(d for row in digests for d in row).encode()).hexdigest()
    _splash_masks.setdefault(key, (mask, digests))
    return key


@functools.cache
def _keyed_mask_class():
    from jax.experimental.pallas.ops.tpu.splash_attention import NumpyMask

    @dataclasses.dataclass(eq=False)
    class KeyedMask(NumpyMask):
        """A NumpyMask hashed by its digest: the kernel's mask processing hashes every head's
        mask, and NumpyMask hashes all of its bytes each time."""
        digest: str = ""

        def __eq__(self, other):
            return isinstance(other, KeyedMask) and self.digest == other.digest

        def __hash__(self):
            return hash(self.digest)

    return KeyedMask


@contextlib.contextmanager
def splash_context():
    """Where the splash kernel is traced: with 32-bit integers (as `pallas_context`). Off a TPU
    it runs in Pallas' generic interpreter (`interpret=True`, which `_splash_kernels` sets)
    rather than the TPU interpreter `pallas_context` forces: its programs compiled and ran in
    half the time (the kernel alone in JAX, a jitted forward then its vjp at L=256, 2 heads, d
    64: 2.5 s against 4.7 s, 2026-12-03) and give the same values."""
    with jax.enable_x64(False):
        yield


@functools.lru_cache(maxsize=64)
def _splash_kernels(key, batch, heads, platform):
    """The splash kernels (without, with the log-sum-exp) of the registered mask `key` for
    `batch` x `heads` query heads: the batch is folded into the heads, each (b, h) with its
    mask (the kernel keeps one copy of each distinct one). Interpreted unless `platform` (the
    program's) is a TPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import \
        SplashAttentionKernel
    mask, digests = _splash_masks[key]
    keyed = _keyed_mask_class()
    made = {}
    per_head = []
    for b in range(batch):
        for h in range(heads):
            i, j = min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1)
            if digests[i][j] not in made:
                made[digests[i][j]] = keyed(mask[i, j], digests[i][j])
            per_head.append(made[digests[i][j]])
    # (concrete arrays, made once and cached: not values of the trace that first asks)
    with jax.ensure_compile_time_eval():
        kernel = sa.make_splash_mha(sa.MultiHeadMask(per_head),
                                    block_sizes=sa.BlockSizes.get_default(), head_shards=1,
                                    q_seq_shards=1, interpret=platform != "tpu")
    # (the same processed mask, returning the log-sum-exp: the kernel's vjp refuses that one)
    with_lse = SplashAttentionKernel(kernel.fwd_mask_info, kernel.dq_mask_info,
                                     kernel.dkv_mask_info,
                                     **{**kernel.kwargs, "save_residuals": True})
    return kernel, with_lse


def _splash_call(kernel, q, k, v, scale):
    """`kernel` on PyTorch's (B, H, L, D) layouts, keys and values broadcast over the batch;
    the batch folded into the heads (key head h // (Hq / Hk) serves query head h, as the
    kernel's grouping and FlexAttention's enable_gqa: folding keeps that pairing)."""
    b, hq, lq, _ = q.shape
    k, v = (jnp.broadcast_to(x, (b, *x.shape[1:])) for x in (k, v))
    # (the kernel does not scale the scores; q is scaled in its own dtype)
    q = (q * jnp.asarray(scale, q.dtype)).reshape(b * hq, lq, q.shape[-1])
    return kernel(q, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]))


def splash(q, k, v, key, scale):
    """(softmax(q kᵀ · scale, masked by the registered mask `key`) v, and its log-sum-exp in
    base 2 (as the flex_attention operator returns it), float32); q (B, Hq, Lq, D), k and v
    (B or 1, Hk, Lk, D or Dv)."""
    b, hq, lq, _ = q.shape
    _, with_lse = _splash_kernels(key, b, hq, runtime.program_platform())
    out, (lse,) = _splash_call(with_lse, q, k, v, scale)
    return (out.reshape(b, hq, lq, v.shape[-1]),
            lse.reshape(b, hq, lq).astype(jnp.float32) * (1 / math.log(2)))


def splash_backward(grad, q, k, v, key, scale):
    """(dq, dk, dv) of `splash`'s output: the `jax.vjp` of the kernel."""
    b, hq, lq, _ = q.shape
    kernel, _ = _splash_kernels(key, b, hq, runtime.program_platform())

    def forward(q, k, v):
        return _splash_call(kernel, q, k, v, scale).reshape(b, hq, lq, v.shape[-1])

    out, vjp = jax.vjp(forward, q, k, v)
    return vjp(grad.astype(out.dtype))
