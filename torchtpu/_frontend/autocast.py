"""`torch.autocast("tpu", dtype=torch.bfloat16)`: the casting policy CUDA users know.

PyTorch ships no autocast kernels for PrivateUse1, so every op would stop at the
AutocastPrivateUse1 key. Ops that are fast and safe in low precision (matmuls, convolutions,
attention) run with their floating inputs cast to the autocast dtype; ops that need range or
accuracy (reductions, norms, softmax, losses, exp/log/pow) run in float32; ops mixing dtypes
(cat, stack, index_put) run in the widest input dtype; every other op passes through.
"""
import torch
from torch.utils._pytree import tree_map

_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION = [
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "scaled_dot_product_attention",
]
FLOAT32 = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "sum", "prod", "cumprod", "cumsum", "softmax", "log_softmax", "cross_entropy_loss",
    "norm", "linalg_vector_norm", "linalg_matrix_norm", "rms_norm",
]
WIDEST = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
          "scatter_add", "tensordot", "cat", "stack"]


def _castable(t):
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
            and t.device.type == "tpu")


def _run(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_KEYS):
        return op(*args, **kwargs)


def _to(dtype):
    return lambda x: x.to(dtype) if _castable(x) and x.dtype is not dtype else x


def _lower(op):
    def kernel(*args, **kwargs):
        cast = _to(torch.get_autocast_dtype("tpu"))
        return _run(op, tree_map(cast, args), tree_map(cast, kwargs))
    return kernel


def _float32(op):
    def kernel(*args, **kwargs):
        cast = _to(torch.float32)
        return _run(op, tree_map(cast, args), tree_map(cast, kwargs))
    return kernel


def _widest(op):
    def kernel(*args, **kwargs):
        floats = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if _castable(x)]
        if floats:
            widest = max((x.dtype for x in floats), key=lambda d: torch.finfo(d).bits)
            cast = _to(widest)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return _run(op, args, kwargs)
    return kernel


def register(lib, fallback_lib):
    fallback_lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    for names, policy in ((LOWER_PRECISION, _lower), (FLOAT32, _float32), (WIDEST, _widest)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if any(a.is_out for a in op._schema.arguments):
                    continue
                lib.impl(op, policy(op), "AutocastPrivateUse1")
