"""FlexAttention on tpu: the kernels of PyTorch's flex_attention operators (the higher-order ops
`torch.nn.attention.flex_attention` calls, in eager mode through Dynamo's "eager" backend and in
torch.compile graphs) for tpu tensors, below autograd. A call JAX's Pallas splash-attention
kernel can take runs `torchtpu::flex_splash` (its backward `torchtpu::flex_splash_backward`);
any other runs the operators' own dense implementation (the whole score matrix) in tpu ops.

The kernel takes a boolean mask per head, fixed when its program is made. So it takes a call
whose score_mod is the identity and whose mask_mod is a traced graph of (b, h, q_idx, kv_idx)
that reads no tensor (causal, sliding windows, prefix-LM: not document ids, which are data):
that graph is evaluated on the host over the (Q_LEN, KV_LEN) grid (per batch element and head
only where it reads b or h), once per graph and shape. Both implementations read the mask_mod
alone (not the BlockMask's block lists), as the operator's dense implementation does.

Chosen per call (`implementation`), counted as `flex_attention::splash` or
`flex_attention::dense`, overridable with `torch.tpu.flex_attention_implementation` or
TORCHTPU_FLEX_ATTENTION (docs/kernels.md)."""
import numpy as np
import torch
from torch._C import DispatchKey
from torch._higher_order_ops.flex_attention import (_permute_strides, flex_attention,
                                                    flex_attention_backward, sdpa_dense,
                                                    sdpa_dense_backward)
from torch.utils import _pytree as pytree

from .._core import metrics, runtime
from .._lowerings import accelerated_attention
from . import composed_kernels

IMPLEMENTATIONS = ("splash", "dense")
# Query rows evaluated at once: the mask_mod's intermediates are int64 (Bm, Hm, rows, KV_LEN).
_MASK_ELEMENTS = 1 << 22
_masks = {}  # (graph code, Bm, Hm, Q_LEN, KV_LEN) -> (why the kernel cannot take it, mask key)


def _is_identity(score_mod):
    from torch.nn.attention.flex_attention import _identity
    if score_mod is _identity:  # (not traced: _FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
        return True
    if not isinstance(score_mod, torch.fx.GraphModule):
        return False
    nodes = list(score_mod.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    result = next(n for n in nodes if n.op == "output").args[0]
    if isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]
    return bool(placeholders) and result is placeholders[0]


def _pure_mask_graph(mask_mod, buffers):
    """Why `mask_mod` is not a graph of (b, h, q_idx, kv_idx) alone, or None."""
    if buffers:  # (the values it reads that Dynamo passes at run time)
        return "a mask_mod that reads tensors (e.g. document ids) or other run-time values"
    if not isinstance(mask_mod, torch.fx.GraphModule):
        return "a mask_mod that was not traced (_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)"
    for node in mask_mod.graph.nodes:
        if node.op in ("get_attr", "call_module") or any(
                isinstance(a, torch.Tensor) for a in pytree.tree_leaves((node.args, node.kwargs))):
            return "a mask_mod that reads tensors (e.g. document ids)"
    if sum(n.op == "placeholder" for n in mask_mod.graph.nodes) != 4:
        return "a mask_mod of other arguments than (b, h, q_idx, kv_idx)"
    return None


def _evaluate(mask_mod, bm, hm, lq, lk):
    """mask_mod over the grid, on the host: a boolean array (bm, hm, lq, lk)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv
    fn = _vmap_for_bhqkv(mask_mod, prefix=())
    b, h, kv = torch.arange(bm), torch.arange(hm), torch.arange(lk)
    rows = max(1, _MASK_ELEMENTS // (bm * hm * lk))
    parts = []
    with torch.no_grad(), TransformGetItemToIndex():
        for start in range(0, lq, rows):
            part = fn(b, h, torch.arange(start, min(lq, start + rows)), kv)
            if not isinstance(part, torch.Tensor) or part.dtype != torch.bool:
                raise TypeError("mask_mod did not return a boolean tensor")
            parts.append(part.cpu().expand(bm, hm, -1, lk).numpy())
    return np.concatenate(parts, axis=2)


def _mask(mask_mod, buffers, batch, heads, lq, lk):
    """(why the kernel cannot take `mask_mod`, or None; its registered mask's key)."""
    why = _pure_mask_graph(mask_mod, buffers)
    if why is not None:
        return why, None
    b, h = [n for n in mask_mod.graph.nodes if n.op == "placeholder"][:2]
    bm, hm = (batch if b.users else 1), (heads if h.users else 1)
    cache_key = (mask_mod.code, bm, hm, lq, lk)
    found = _masks.get(cache_key)
    if found is None:
        try:
            mask = _evaluate(mask_mod, bm, hm, lq, lk)
        except Exception as e:  # (its dense implementation will say the same, or run)
            found = (f"a mask_mod that could not be evaluated on the host ({e})", None)
        else:
            if not mask.any(axis=-1).all():
                found = ("a query that attends to no key (the kernel does not give it "
                         "PyTorch's zeros)", None)
            else:
                found = (None, accelerated_attention.register_splash_mask(mask))
        _masks[cache_key] = found
    return found


def _splash_unsupported(q, k, v, score_mod, block_mask, kernel_options, score_buffers,
                        mask_buffers):
    """(why the splash kernel cannot take this call, or None; the key of its mask)."""
    if not (q.dtype == k.dtype == v.dtype):
        return "queries, keys and values of different dtypes", None
    why = accelerated_attention.splash_unsupported(
        q.shape, k.shape, v.shape, str(q.dtype).removeprefix("torch."))
    if why is not None:
        return why, None
    if score_buffers or not _is_identity(score_mod):
        return "a score_mod", None
    if kernel_options.get("OUTPUT_MAX"):
        return "max_scores (return_aux)", None
    return _mask(block_mask[-1], mask_buffers, q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _asked():
    return composed_kernels.implementation_setting("flex_attention_implementation",
                                            "TORCHTPU_FLEX_ATTENTION")


def _refusal(asked, why, what="flex_attention"):
    return RuntimeError(f"{what}: the implementation {asked!r} "
                        f"(torch.tpu.flex_attention_implementation or TORCHTPU_FLEX_ATTENTION) "
                        f"does not take this call: {why}")


def implementation(q, k, v, score_mod, block_mask, kernel_options, score_buffers,
                   mask_buffers, platform=None):
    """("splash" and its mask's key) or ("dense", None) for a call of the flex_attention
    operator: splash by default on the TPU platform where it applies (elsewhere Pallas runs it
    in interpret mode: by name only), the user's choice where one is set."""
    asked = _asked()
    if asked not in (None, *IMPLEMENTATIONS):
        raise RuntimeError(f"flex_attention: there is no implementation {asked!r} "
                           f"(choose from {', '.join(IMPLEMENTATIONS)})")
    platform = platform or runtime.platform()
    if asked == "dense" or asked is None and platform != "tpu":
        return "dense", None
    why, mask = _splash_unsupported(q, k, v, score_mod, block_mask, kernel_options,
                                    score_buffers, mask_buffers)
    if why is None:
        return "splash", mask
    if asked == "splash":
        raise _refusal(asked, why)
    return "dense", None


def _strided_like(result, t):
    """`result` in the layout the dense implementation gives (`t`'s dim order)."""
    return result if t.is_contiguous() else _permute_strides(result, t.stride())


def _flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options,
                    score_mod_other_buffers=(), mask_mod_other_buffers=()):
    name, mask = implementation(q, k, v, score_mod, block_mask, kernel_options,
                                score_mod_other_buffers, mask_mod_other_buffers)
    metrics.counters[f"flex_attention::{name}"] += 1
    if name == "dense":
        return sdpa_dense(q, k, v, score_mod, block_mask, scale, kernel_options,
                          score_mod_other_buffers, mask_mod_other_buffers)
    out, lse = torch.ops.torchtpu.flex_splash(q, k, v, mask, float(scale))
    # (the maximum scores are returned only when asked for (OUTPUT_MAX), which splash refuses)
    return _strided_like(out, q), lse, torch.zeros_like(lse)


def _flex_attention_backward(q, k, v, out, lse, grad_out, grad_lse, fw_graph, joint_graph,
                             block_mask, scale, kernel_options, score_mod_other_buffers=(),
                             mask_mod_other_buffers=()):
    # The same choice as the forward's (not counted again). A gradient of the log-sum-exp
    # (returned with return_aux, then differentiated) is one the kernel's vjp does not take:
    # the dense backward takes it, from the forward's output and log-sum-exp.
    name, mask = implementation(q, k, v, fw_graph, block_mask, kernel_options,
                                score_mod_other_buffers, mask_mod_other_buffers)
    if name == "splash" and grad_out is not None and grad_lse is None:
        dq, dk, dv = torch.ops.torchtpu.flex_splash_backward(grad_out, q, k, v, mask,
                                                             float(scale))
        return _strided_like(dq, q), _strided_like(dk, k), _strided_like(dv, v), ()
    if name == "splash" and grad_lse is not None and _asked() == "splash":
        raise _refusal("splash", "a gradient of the log-sum-exp (return_aux)",
                       "flex_attention backward")
    return sdpa_dense_backward(q, k, v, out, lse, grad_out, grad_lse, fw_graph, joint_graph,
                               block_mask, scale, kernel_options, score_mod_other_buffers,
                               mask_mod_other_buffers)


def install():
    """The operators' PrivateUse1 kernels (patches.PATCHES lists them)."""
    for op, kernel in ((flex_attention, _flex_attention),
                       (flex_attention_backward, _flex_attention_backward)):
        if DispatchKey.PrivateUse1 not in op.py_kernels:
            op.py_impl(DispatchKey.PrivateUse1)(kernel)
