"""Dispatcher kernels composed of table kernels and tpu ops, for ops whose PyTorch contract the
lowering table's pure functions cannot express: in-place running statistics, PyTorch's choice
of factoring a transpose, an output filled in place *and* returned."""
import math
import os
import warnings

import torch
import torch.nn.functional as F

from .._core import metrics, runtime
from .._core.dtypes import to_torch_dtype
from .._lowerings import attention
from .._lowerings.batch_norm import stats_dtype
from .._lowerings.factories import check_arange
from .._lowerings.indexing import check_searchsorted_out
from .._lowerings.meta import c10_name, dtype_name, warn_resized
from . import growing_sequences, recording
from .overlap import (BETWEEN_MESSAGE, INTERNAL_MESSAGE, PARTIAL, internal_overlap,
                      overlap_between)
from .kernels import kernel_for

aten = torch.ops.aten


# --- batch norm: the eager ops with in-place running statistics ----------------------------

def _saved_dtype(x, *params):
    """The dtype of the statistics PyTorch's CPU kernels return, those they compute in
    (PyTorch's meta kernels, which fix the table ops' output dtypes, say float32 for any
    half-precision input, as on CUDA)."""
    return to_torch_dtype(stats_dtype(x, *params))


def _no_stats(x, weight, bias, training, momentum, eps):
    out, mean, invstd = kernel_for(aten._native_batch_norm_legit.no_stats)(
        x, weight, bias, training, momentum, eps)
    dtype = _saved_dtype(x, weight, bias)
    return out, mean.to(dtype), invstd.to(dtype)


def _with_update(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if running_mean is None or running_var is None:
        if not training:
            raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, momentum, eps)
    dtype = _saved_dtype(x, weight, bias, running_mean, running_var)
    if not training:
        out, _, _ = aten._native_batch_norm_legit_no_training(x, weight, bias, running_mean,
                                                               running_var, momentum, eps)
        # In evaluation nothing is saved for backward: empty, as the CPU kernel returns.
        empty = x.new_empty((0,), dtype=dtype)
        return out, empty, empty.clone()
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean.to(dtype), invstd.to(dtype)


def _batch_norm_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    # The training-mode batch norm nn.BatchNorm uses since PyTorch 2.3; `reserve` is cuDNN's
    # workspace, empty elsewhere.
    out, mean, invstd = _with_update(x, weight, bias, running_mean, running_var, True,
                                     momentum, eps)
    return out, mean, invstd, x.new_empty((0,), dtype=torch.uint8)


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    # Layer norm's saved mean/rstd have the same CPU-vs-meta dtype difference.
    out, mean, rstd = kernel_for(aten.native_layer_norm.default)(x, normalized_shape, weight,
                                                                 bias, eps)
    dtype = _saved_dtype(x, weight, bias)
    return out, mean.to(dtype), rstd.to(dtype)


# --- det / slogdet ------------------------------------------------------------------------

# PyTorch factors the transpose of a contiguous real matrix for det/slogdet (det(Aᵀ) = det(A),
# and it avoids a copy on the CPU), and the backward formulas rely on it: they solve with the
# returned LU as that of Aᵀ. The kernels below make the same choice, then run the lowering.
def _transposed_like_pytorch(overload):
    kernel = kernel_for(overload)

    def run(A):
        return kernel(A.mH if A.is_contiguous() and not A.is_complex() else A)
    return run


# --- rrelu --------------------------------------------------------------------------------

# Its training-mode kernel fills `noise` in place and returns a fresh tensor; it is composed of
# tpu ops as PyTorch's CPU kernel computes it.
def _rrelu_with_noise(x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    if not training:
        return F.leaky_relu(x, (lower + upper) / 2)
    slopes = torch.empty_like(x).uniform_(lower, upper, generator=generator)
    slopes = torch.where(x <= 0, slopes, torch.ones_like(x))  # CPU: x <= 0 draws a slope
    with torch.no_grad():
        noise.copy_(slopes)
    return x * slopes


def _rrelu_with_noise_(x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    return x.copy_(_rrelu_with_noise(x, noise, lower, upper, training, generator))


# --- arange(out=) --------------------------------------------------------------------------

# PyTorch's range factories keep the shape of an out= that has the right number of elements and
# fill it in order (a (2, 2) view stays a (2, 2) view); the meta kernel, like other ops', would
# resize it to one dimension.
def _arange_out(start, end, step=1, *, out):
    check_arange(start, end, step, out.dtype)
    n = torch.arange(start, end, step, dtype=out.dtype, device="meta").numel()
    kernel = kernel_for(aten.arange.start_out)
    if out.numel() != n:  # the CPU kernel's own warning, then a plain resize
        if out.numel() > 0:
            warnings.warn(f"The number of elements in the out tensor of shape {list(out.shape)} is "
                          f"{out.numel()} which does not match the computed number of elements {n}. "
                          "Note that this may occur as a result of rounding error. The out tensor "
                          f"will be resized to a tensor of shape ({n},).", stacklevel=2)
        # Sized here, the op runs as any other (`torch.arange(n, device=...)` fills a fresh
        # empty tensor each step; resized by the kernel, the op would run and be waited for
        # at once, as ops whose out= is resized are, to keep out's layout should a
        # device-side check fail: arange has none).
        out.resize_(n)
    if out.numel() != n or out.dim() == 1:
        return kernel(start, end, step, out=out)
    return out.copy_(kernel(start, end, step, out=out.new_empty(n)).view(out.shape))


# torch.arange(end) and arange(start, end) reach arange.start_out with a new, empty out= (their
# CompositeExplicitAutograd kernels); the functional overload instead: no out= to size, and the
# same op (and executable key) as arange(start, end, step).
def _arange(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return kernel_for(aten.arange.start_step)(0, end, 1, dtype=dtype, layout=layout,
                                              device=device, pin_memory=pin_memory)


def _arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return kernel_for(aten.arange.start_step)(start, end, 1, dtype=dtype, layout=layout,
                                              device=device, pin_memory=pin_memory)


# --- eye, linspace, logspace and nonzero (out=) ------------------------------------------

def _resizing_silently(overload, shape):
    """The out= kernel of a factory whose CPU kernel resizes `out` to `shape(*args)` without
    resize_output's warning (eye); the meta kernel would warn."""
    kernel = kernel_for(overload)

    def run(*args, out, **kwargs):
        want = shape(*args)
        if tuple(out.shape) != want and min(want) >= 0:
            out.resize_(0)
        return kernel(*args, out=out, **kwargs)
    return run


def _space_out(functional):
    """linspace/logspace(out=) as ATen's kernels: computed in out's dtype, out resized without a
    warning only when its number of elements differs (out keeps its shape otherwise, filled in
    order), an overlapping out refused."""
    def run(start, end, steps, *base, out):
        result = functional(start, end, steps, *base, dtype=out.dtype, device=out.device)
        if out.numel() != steps:
            out.resize_(0)
            out.resize_(steps)
        elif internal_overlap(out):
            raise RuntimeError(INTERNAL_MESSAGE)
        return out.copy_(result.view(out.shape))
    return run


def _range_out(start, end, step=1, *, out):
    # torch.range (deprecated, end inclusive): ATen's range_out, its checks in its order, out
    # resized without a warning, values start + i * step computed in double.
    if not step:
        raise RuntimeError("step must be nonzero")
    if not (math.isfinite(start) and math.isfinite(end)):
        raise RuntimeError(f"unsupported range: {start:g} -> {end:g}")
    if not ((step > 0 and end >= start) or (step < 0 and end <= start)):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    n = int((end - start) / step + 1)
    if out.numel() != n:
        out.resize_(0)
        out.resize_(n)
    values = torch.arange(n, dtype=torch.float64, device=out.device) * step + start
    return out.copy_(values.view(out.shape))


def _nonzero_out(x, *, out):
    # The functional op's values decide the shape (a synchronisation, as on CUDA); like the
    # CPU kernel, an out of another shape is resized (resize_output's warning) to a transposed
    # (column-major) layout.
    if out.dtype != torch.int64:
        raise RuntimeError("nonzero: Expected out tensor to have scalar type Long but got scalar "
                           f"type{dtype_name(out.dtype)}")
    result = torch.nonzero(x)
    shape = tuple(result.shape)
    if out.shape != shape:
        warn_resized(out, shape)
        out.resize_(0)
        out.resize_(shape[::-1])
        out.as_strided_(shape, (1, shape[0]))
    return out.copy_(result)


def _abs_out(x, *, out):
    """abs(out=) as ATen's unary_op_impl_with_complex_to_float_out: a complex input's magnitudes
    go to a real out its real dtype can be cast to, or to a complex out of its own dtype (an
    imaginary part of zero); otherwise out has the input's dtype (PyTorch's meta kernel wants
    the real dtype, and says so in other words)."""
    if x.is_complex() and not out.is_complex():
        real = x.real.dtype
        if not torch.can_cast(real, out.dtype):
            raise RuntimeError(f"result type {dtype_name(real)} can't be cast to the desired "
                               f"output type {dtype_name(out.dtype)}")
    elif out.dtype != x.dtype:
        raise RuntimeError(f"Found dtype {dtype_name(out.dtype)} but expected {dtype_name(x.dtype)}")
    elif not x.is_complex():
        return kernel_for(aten.abs.out)(x, out=out)
    if internal_overlap(out):
        raise RuntimeError(INTERNAL_MESSAGE)
    result = torch.abs(x)
    if out.shape != result.shape:
        warn_resized(out, tuple(result.shape))
        out.resize_(result.shape)
        if out.is_complex():  # ATen's TensorIterator lays a resized out out as the input
            out.as_strided_(result.shape, result.stride())
    return out.copy_(result)


def _bucketing_out(functional):
    """searchsorted/bucketize(out=): the functional op's checks, then ATen's of out's dtype
    (the derived out variant would cast), out resized as resize_output does."""
    def run(a, b, *, out_int32=False, out, **kwargs):
        result = functional(a, b, out_int32=out_int32, **kwargs)
        check_searchsorted_out(out, out_int32)
        if out.shape != result.shape:
            warn_resized(out, tuple(result.shape))
            out.resize_(result.shape)
        return out.copy_(result)
    return run


def _margin_loss_input_dims(x):
    """x's dims, after the margin losses' shared input check (ATen's words)."""
    ndims = x.dim()
    if not ((ndims == 2 and x.shape[1] != 0) or (ndims == 1 and x.shape[0] != 0) or ndims == 0):
        raise RuntimeError("Expected non-empty vector or matrix with optional 0-dim batch size, "
                           f"but got: {list(x.shape)}")
    return ndims


def _multilabel_margin_loss_forward(x, target, reduction):
    """ATen's shape rules (multilabel_margin_loss_shape_check): a vector or scalar input takes
    any target of as many elements, of at most one dim, and gives a 0-dim loss even unreduced;
    PyTorch's decomposition wants equal shapes and gives (1,)."""
    ndims = _margin_loss_input_dims(x)
    if ndims <= 1:
        ok = target.dim() <= 1 and target.numel() == (x.shape[0] if ndims else 1)
    else:
        ok = target.dim() == 2 and target.shape == x.shape
    if not ok:
        raise RuntimeError(f"inconsistent target size: {list(target.shape)} for input of size: "
                           f"{list(x.shape)}")
    kernel = kernel_for(aten.multilabel_margin_loss_forward.default)
    if ndims == 2:
        return kernel(x, target, reduction)
    loss, is_target = kernel(x.reshape(-1), target.reshape(-1), reduction)
    return loss.reshape(()), is_target.reshape(target.shape)


def _multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    """ATen's shape rules (multi_margin_loss_shape_check): a vector or scalar input is one
    sample, its target of one element of at most one dim, and the unreduced loss has the
    target's shape; PyTorch's decomposition words its checks apart and gives (1,)."""
    ndims = _margin_loss_input_dims(x)
    nframe, dim = (1, x.shape[0] if ndims else 1) if ndims <= 1 else tuple(x.shape)
    if not (target.dim() <= 1 and target.numel() == nframe):
        raise RuntimeError(
            "multi_margin_loss: target tensor should be 1-D with size equal to the number of "
            f"input samples (batch size). Expected target size [{nframe}], but got "
            f"{list(target.shape)}. Input has shape {list(x.shape)}.")
    if weight is not None and not (weight.dim() <= 1 and weight.numel() == dim):
        raise RuntimeError(f"inconsistent weight size, expected {dim} but got {list(weight.shape)}")
    loss = kernel_for(aten.multi_margin_loss.default)(
        x.reshape(nframe, dim), target.reshape(nframe), p, margin,
        None if weight is None else weight.reshape(dim), reduction)
    if reduction == 0:
        return loss.reshape((nframe,) if target.dim() else ())
    return loss


def _masked_scatter_(x, mask, source):
    # ATen's masked_scatter_ expands the mask to self (expand_inplace): a mask broadcasting past
    # self is refused in expand's words (the lowering broadcasts both, for masked_scatter).
    mask.expand(x.shape)
    return kernel_for(aten.masked_scatter_.default)(x, mask, source)


def _shift_(overload):
    """__ilshift__/__irshift__: ATen's TensorIterator raises its overlap and cast errors before
    the kernel refuses the dtype (the lowering's validate), so they come first."""
    kernel = kernel_for(overload)

    def run(x, other):
        if internal_overlap(x):
            raise RuntimeError(INTERNAL_MESSAGE)
        if (isinstance(other, torch.Tensor) and other.device == x.device
                and overlap_between(x, other) == PARTIAL):
            raise RuntimeError(BETWEEN_MESSAGE)
        dtype = torch.result_type(x, other)
        if not torch.can_cast(dtype, x.dtype):
            raise RuntimeError(f"result type {dtype_name(dtype)} can't be cast to the desired "
                               f"output type {dtype_name(x.dtype)}")
        return kernel(x, other)
    return run


def _abs_(x):
    if x.is_complex():  # ATen's abs_ (the derived in-place variant would cast to the real dtype)
        raise RuntimeError("In-place abs is not supported for complex tensors.")
    return kernel_for(aten.abs_.default)(x)


# masked_select(out=): the functional op's values decide the shape (PyTorch has no meta kernel of
# the out variant); out is resized as ATen's resize_output does.
def _masked_select_out(x, mask, *, out):
    result = torch.masked_select(x, mask)
    if out.dtype != result.dtype:
        raise RuntimeError("masked_select(): self and result must have the same scalar type")
    if out.shape != result.shape:
        warn_resized(out, tuple(result.shape))
        out.resize_(result.shape)
    return out.copy_(result)


# Whether two tensors are the same view of the same storage (ATen's is_set_to reads the data
# pointers, which a tpu storage's placeholder address stands in for).
def _is_set_to(x, other):
    return (x.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
            and x.storage_offset() == other.storage_offset() and x.shape == other.shape
            and x.stride() == other.stride())


# --- nn.TransformerEncoderLayer's inference fast path ----------------------------------------

# PyTorch takes the fused encoder-layer op for privateuse1 tensors too (eval mode, no grad); its
# kernel (ATen's transformer_encoder_layer_forward) is this sequence of ops, each a tpu op.
def _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                   proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                   norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                                   ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if src.numel() == 0:
        return src.clone()

    def norm(x, weight, bias):
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                   mask, mask_type, need_weights=False)[0]
    x = x + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    x = F.linear(x, ffn_weight_1, ffn_bias_1)
    x = F.gelu(x) if use_gelu else F.relu(x)
    x = F.linear(x, ffn_weight_2, ffn_bias_2) + residual
    return x if norm_first else norm(x, norm_weight_2, norm_bias_2)


def _attention(query, key, value, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
               proj_bias, mask, mask_type, need_weights, average_attn_weights=True):
    """The fast paths' attention of batch-first tensors. Their mask: (batch, seq) key padding
    (mask_type 1), (seq, seq) attention mask (0), or both merged into (batch, heads, seq, seq)
    (2); True masks out, as in MultiheadAttention."""
    padding = mask if mask is not None and mask_type == 1 else None
    attn_mask = None
    if mask is not None and mask_type != 1:
        attn_mask = mask
        if mask.dim() == 4:
            b, (l, s) = query.shape[0], mask.shape[-2:]
            attn_mask = mask.expand(b, num_heads, l, s).reshape(b * num_heads, l, s)
    out, weights = F.multi_head_attention_forward(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), embed_dim, num_heads,
        qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias, training=False,
        key_padding_mask=padding, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights)
    return out.transpose(0, 1).contiguous(), weights  # (contiguous, as ATen's kernels give it)


# nn.MultiheadAttention's inference fast path (batch first, eval mode, no grad), taken for
# privateuse1 tensors too: ATen's kernel (native_multi_head_attention) computes this attention.
def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                 proj_weight, proj_bias, mask=None, need_weights=True,
                                 average_attn_weights=True, mask_type=None):
    out, weights = _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                              proj_weight, proj_bias, mask, mask_type, need_weights,
                              average_attn_weights)
    return out, weights  # None without weights: the undefined tensor ATen returns


# nn.TransformerEncoder (its only caller in PyTorch) asks this before packing a padded batch into
# a nested tensor for its inference fast path; tpu has no nested tensors. Answering "not aligned"
# would take the dense path, whose padded positions hold computed values where the CPU's fast
# path gives zeros: a different answer, so the user is told how to choose the dense path.
def _nested_tensor_from_mask_left_aligned(t, mask):
    raise NotImplementedError(
        "nn.TransformerEncoder's inference fast path packs the batch into a nested tensor, and "
        "nested tensors are not supported on the tpu device: build it with "
        "enable_nested_tensor=False (the same results, except that padded positions hold "
        "computed values instead of zeros).")


# randperm's check of n against its output's dtype (the table's lowering draws int64s).
_CPP_INT_NAMES = {torch.int8: "int8_t", torch.uint8: "uint8_t", torch.int16: "int16_t",
                  torch.int32: "int", torch.int64: "int64_t"}


def _randperm_out(n, *, generator=None, out):
    if n < 0:
        raise RuntimeError(f"n must be non-negative, got{n}")
    dtype = out.dtype
    if dtype.is_floating_point:
        limit = 2 ** (1 - int(math.log2(torch.finfo(dtype).eps))) + 1  # every integer exact
        if n > limit:
            raise RuntimeError(f"n cannot be greater than {limit} for {dtype_name(dtype)} type.")
    elif dtype in _CPP_INT_NAMES and n > 0 and n - 1 > torch.iinfo(dtype).max:
        raise RuntimeError(f"value cannot be converted to type {_CPP_INT_NAMES[dtype]} without overflow")
    return _randperm_resizing(n, generator=generator, out=out)  # (no warning, as the CPU's)


_randperm_resizing = _resizing_silently(aten.randperm.generator_out, lambda n: (n,))


# nll_loss (not nll_loss2d) takes a uint8 target on the CPU as an int64 one; PyTorch's meta kernel (a
# decomposition through gather) refuses it.
def _long_target(overload, position):
    kernel = kernel_for(overload)

    def run(*args):
        if args[position].dtype == torch.uint8:
            args = args[:position] + (args[position].long(),) + args[position + 1:]
        return kernel(*args)
    return run


# --- zero_ -------------------------------------------------------------------------------

# Optimizers create their state with zeros_like (empty_like, then zero_) on their first step:
# zeroing a whole storage forgets its value instead of running an op (recording.replace_value).
def _zero_(t):
    if recording.replace_value(t, None):
        return t
    return kernel_for(aten.zero_.default)(t)


# The CPU's huber_loss computes each element's loss in the promoted dtype into an output of the
# input's dtype, then reduces that (PyTorch's meta kernel says the promoted dtype).
def _huber_loss(x, target, reduction=1, delta=1.0):
    kernel = kernel_for(aten.huber_loss.default)
    if x.dtype == target.dtype:
        return kernel(x, target, reduction, delta)
    loss = kernel(x, target, 0, delta).to(x.dtype)
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


# --- where with a uint8 condition ----------------------------------------------------------

# PyTorch's CPU kernel takes a uint8 condition as a boolean one, with a deprecation warning
# (its meta kernel, which the table kernel runs, refuses it).
def _bool_condition(condition):
    if condition.dtype == torch.uint8:
        warnings.warn("where received a uint8 condition tensor. This behavior is deprecated and "
                      "will be removed in a future version of PyTorch. Use a boolean condition "
                      "instead.", stacklevel=3)  # (the caller's line, as the CPU's warning)
        return condition.bool()
    return condition


def _where(condition, x, y):
    return kernel_for(aten.where.self)(_bool_condition(condition), x, y)


def _where_out(condition, x, y, *, out):
    return kernel_for(aten.where.self_out)(_bool_condition(condition), x, y, out=out)


# --- scaled dot-product attention ------------------------------------------------------------

# PyTorch picks an attention kernel per device through a C++ dispatch stub that a Python backend
# cannot fill, so on tpu F.scaled_dot_product_attention would always decompose into its math
# kernel (seven ops, the whole score matrix in memory).  This kernel, installed for the op's
# autograd key as well, runs `torchtpu::attention` instead (one program, its backward one
# more) in the implementation `_implementation` picks, unless the call is one that op does not
# cover or the user has turned PyTorch's fused backends off (torch.nn.attention.sdpa_kernel
# without SDPBackend.OVERRIDEABLE): then the op's own composite runs.
def _fused_attention_covers(q, k, v, mask, enable_gqa):
    if not torch._C._get_overrideable_sdp_enabled():
        return False
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4)):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        return False
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return False
    if not (q.device == k.device == v.device and q.device.type == "tpu"):
        return False
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        return False
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk and not (enable_gqa and hq % hk == 0):
        return False
    if mask is not None:
        # (a mask with is_causal: both apply, as on the CPU; PyTorch's math kernel refuses it)
        if mask.device != q.device or mask.dtype not in (torch.bool, q.dtype):
            return False
        try:
            torch.broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2]))
        except RuntimeError:
            return False
    return True


def implementation_setting(attribute="attention_implementation", variable="TORCHTPU_ATTENTION"):
    """The implementation the user asked for: `torch.tpu.<attribute>`, else the environment's
    `variable`; None (or "auto") lets each call choose."""
    name = getattr(torch.tpu, attribute, None)
    if name is None:
        name = os.environ.get(variable) or None
    return None if name == "auto" else name


def _implementation(q, k, v, mask, dropout_p, is_causal):
    """The attention implementation of this call (counted as `attention::<name>`), and the one
    the op is given: the name the user asked for, else "auto" (the lowering chooses for the
    platform its program is built for, which is this one unless a TPU target's)."""
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape), _dtype_name(q.dtype),
              None if mask is None else _dtype_name(mask.dtype), dropout_p, is_causal)
    platform = runtime.platform()
    asked = implementation_setting()
    if asked is None:
        metrics.counters[f"attention::{attention.choose(platform, *shapes)}"] += 1
        return "auto"
    why = attention.unsupported(asked, platform, *shapes)
    if why is not None:
        raise RuntimeError(f"scaled_dot_product_attention: the attention implementation "
                           f"{asked!r} (torch.tpu.attention_implementation or "
                           f"TORCHTPU_ATTENTION) does not take this call: {why}")
    metrics.counters[f"attention::{asked}"] += 1
    return asked


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                  scale=None, enable_gqa=False):
    if _fused_attention_covers(q, k, v, attn_mask, enable_gqa):
        if not dropout_p:
            grown = growing_sequences.attention(q, k, v, attn_mask, is_causal, scale)
            if grown is not None:
                metrics.counters["attention::xla"] += 1
                return grown
        implementation = _implementation(q, k, v, attn_mask, dropout_p, is_causal)
        seed = None
        if dropout_p:  # (drawn from the device's generator: a random op of its own)
            seed = torch.empty((), dtype=torch.int64, device=q.device).random_(1 << 62)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return torch.ops.torchtpu.attention(q, k, v, attn_mask, seed, float(dropout_p),
                                            bool(is_causal), scale, implementation)[0]
    return aten.scaled_dot_product_attention.default.decompose(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


# --- linear of a batch of sequences ----------------------------------------------------------

# PyTorch computes a Linear with a bias on a contiguous 3-D input as one addmm of the input
# seen as rows, then views the [B*T, N] result as [B, T, N] (_flatten_nd_linear): its storage
# keeps the 2-D shape.  On TPU the result's layout follows the storage's shape, and the views
# every consumer reads ([B, T, H, D] heads, [B, T, N]) split its major dim: XLA:TPU chose a
# layout for the 2-D result that took relayout copies of it and of its gradient (a GPT block's
# forward and backward, compiled for v5e: 265 MB accessed against 211 MB for the same block
# whose Linear is matmul + add; benchmarks/program_diff.py --target v5e:1x1).  So the result is
# the matmul's, viewed [B, T, N], plus the bias, as PyTorch computes any other input's (and as
# JAX's `x @ w.T + b` is written).  Half-precision inputs keep addmm: it adds the bias to the
# float32 product and rounds once, an add would round twice (1 ulp of bfloat16 apart, beyond
# the CPU's results).
def _linear(input, weight, bias=None):
    # (anything else as PyTorch computes it, its errors too: addmm refuses a bias of another
    # dtype, which an add would promote)
    if (bias is not None and input.dim() >= 3 and bias.dim() == 1 and weight.dim() == 2
            and bias.shape[0] == weight.shape[0] and input.dtype == weight.dtype == bias.dtype
            and input.dtype not in (torch.float16, torch.bfloat16)):
        return torch.matmul(input, weight.t()) + bias
    return aten.linear.default.decompose(input, weight, bias)


# --- repeat_interleave with its output size given ---------------------------------------------

# The output's length is given: torchtpu::repeat_interleave_sized, without a wait for the
# repeats' values (the table's repeat_interleave reads them to size its output).
def _repeat_interleave(repeats, *, output_size=None):
    if output_size is None or repeats.dim() != 1:
        return kernel_for(aten.repeat_interleave.Tensor)(repeats, output_size=output_size)
    return torch.ops.torchtpu.repeat_interleave_sized(repeats, output_size)


# --- torch._grouped_mm ----------------------------------------------------------------------

# torchtpu::grouped_mm (ragged_dot over group sizes on the device) after the CPU kernel's checks;
# installed for the autograd key too, so its gradient is the jax.vjp of that program rather
# than PyTorch's formula (three more _grouped_mm calls in other layouts), and so that tracing
# (Dynamo, AOTAutograd) records it instead of asking PyTorch's meta kernel, which refuses
# float32 (it mirrors CUDA's kernel).
def _check_grouped_mm(a, b, offs, bias, out_dtype):
    for name, t in (("mat_a", a), ("mat_b", b)):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got "
                               f"{dtype_name(t.dtype)}")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: "
                           f"{c10_name(a.dtype)} != {c10_name(b.dtype)}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise RuntimeError(f"Multiplicands must be 2D or 3D but got mat_a.dim()={a.dim()} and "
                           f"mat_b.dim()={b.dim()}")
    if (offs is not None) == (a.dim() == 3 and b.dim() == 3):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if "
                           "both matrices are 3d")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and out_dtype != a.dtype:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    for t in (a, b):
        _check_grouped_mm_strides(t)


def _check_grouped_mm_strides(t):
    """The CPU kernel's layout contract: one of the two inner dims contiguous, the other's
    stride a multiple of 16 bytes."""
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    step = 16 // t.element_size()
    if col_stride == 1 and row_stride >= max(1, cols):
        aligned = row_stride % step == 0
    elif row_stride == 1 and col_stride >= max(1, rows):
        aligned = col_stride % step == 0
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(t.stride())} for strides and "
                           f"{list(t.shape)} for sizes")
    if not aligned:
        raise RuntimeError("strides should be multiple of 16 bytes")


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    _check_grouped_mm(a, b, offs, bias, out_dtype)
    return torch.ops.torchtpu.grouped_mm(a, b, offs)


def autograd_kernels():
    """Kernels of ops this module replaces on tpu together with their gradient: installed for
    both PrivateUse1 and AutogradPrivateUse1 (a backend kernel alone of a
    CompositeImplicitAutograd op would leave it without an autograd formula); they call ops that
    have one."""
    return {aten.scaled_dot_product_attention.default: _scaled_dot_product_attention,
            aten._grouped_mm.default: _grouped_mm,
            aten.linear.default: _linear}


def kernels():
    """The PrivateUse1 kernels of this module (see dispatch.py)."""
    return {aten.native_batch_norm.default: _with_update,
            aten._native_batch_norm_legit.default: _with_update,
            aten._native_batch_norm_legit.no_stats: _no_stats,
            aten._batch_norm_with_update.default: _batch_norm_with_update,
            aten.native_layer_norm.default: _native_layer_norm,
            aten._linalg_det.default: _transposed_like_pytorch(aten._linalg_det.default),
            aten._linalg_slogdet.default: _transposed_like_pytorch(aten._linalg_slogdet.default),
            aten.rrelu_with_noise.default: _rrelu_with_noise,
            aten.rrelu_with_noise_.default: _rrelu_with_noise_,
            aten.arange.start_out: _arange_out,
            aten.eye.out: _resizing_silently(aten.eye.out, lambda n: (n, n)),
            aten.eye.m_out: _resizing_silently(aten.eye.m_out, lambda n, m: (n, m)),
            aten.linspace.out: _space_out(torch.linspace),
            aten.logspace.out: _space_out(torch.logspace),
            aten.nonzero.out: _nonzero_out,
            aten.masked_select.out: _masked_select_out,
            aten.abs.out: _abs_out,
            aten.__ilshift__.Tensor: _shift_(aten.__ilshift__.Tensor),
            aten.__ilshift__.Scalar: _shift_(aten.__ilshift__.Scalar),
            aten.__irshift__.Tensor: _shift_(aten.__irshift__.Tensor),
            aten.__irshift__.Scalar: _shift_(aten.__irshift__.Scalar),
            aten.masked_scatter_.default: _masked_scatter_,
            aten.multi_margin_loss.default: _multi_margin_loss,
            aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
            aten.searchsorted.Tensor_out: _bucketing_out(torch.searchsorted),
            aten.searchsorted.Scalar_out: _bucketing_out(torch.searchsorted),
            aten.bucketize.Tensor_out: _bucketing_out(torch.bucketize),
            aten.bucketize.Scalar_out: _bucketing_out(torch.bucketize),
            aten.abs_.default: _abs_,
            aten.is_set_to.default: _is_set_to,
            aten.range.out: _range_out,
            aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer_fwd,
            aten._native_multi_head_attention.default: _native_multi_head_attention,
            aten.arange.default: _arange,
            aten.arange.start: _arange_start,
            aten.zero_.default: _zero_,
            aten.huber_loss.default: _huber_loss,
            aten.where.self: _where,
            aten.where.self_out: _where_out,
            aten.repeat_interleave.Tensor: _repeat_interleave,
            aten.randperm.generator_out: _randperm_out,
            aten.nll_loss_forward.default: _long_target(aten.nll_loss_forward.default, 1),
            aten.nll_loss_backward.default: _long_target(aten.nll_loss_backward.default, 2),
            aten._nested_tensor_from_mask_left_aligned.default:
                _nested_tensor_from_mask_left_aligned}
