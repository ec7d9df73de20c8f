"""Embedding lookups (`embedding`, `embedding_bag`) and their backward ops."""
import jax
import jax.numpy as jnp

from .._core.registry import check, lowering


def _check_embedding(weight, *rest):
    if weight.dim() != 2:  # PyTorch's meta kernel asserts instead
        raise RuntimeError("'weight' must be 2-D")


@lowering("aten::embedding.default", validate=_check_embedding)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    from .indexing import check_index
    check_index(indices, weight.shape[0], "index out of range in self", negative=False)
    return jnp.take(weight, indices, axis=0)


# Hand-written: PyTorch's decomposition of this op costs 1.7x its first call (trace and compile:
# 220-237 ms against 124-146 ms for a [8, 128, 256] gradient of 1024 rows; the steady call is
# the same), paid by every language model's first training step and every new batch shape
# (python benchmarks/backward_lowerings.py --ops embedding_dense_backward, 2026-12-03).
@lowering("aten::embedding_dense_backward.default")
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_idx = indices.reshape(-1)
    g = grad.reshape(-1, grad.shape[-1])
    if padding_idx >= 0:
        g = jnp.where((flat_idx == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[flat_idx].add(1)
        g = g / counts[flat_idx][:, None]
    return jnp.zeros((num_weights, g.shape[-1]), g.dtype).at[flat_idx].add(g)


# nn.Embedding(max_norm=...) renormalises, in place and before the lookup, the rows its indices
# name whose norm exceeds max_norm (ATen's embedding_renorm_: scale max_norm / (norm + 1e-7)).
@lowering("aten::embedding_renorm.default")
def embedding_renorm(weight, indices, max_norm, norm_type):
    rows = jnp.zeros(weight.shape[0], jnp.bool_).at[indices.reshape(-1)].set(True)
    x = weight.astype(jnp.float32) if weight.dtype in (jnp.float16, jnp.bfloat16) else weight
    norms = jnp.linalg.norm(x, ord=norm_type, axis=1, keepdims=True)
    scale = jnp.where(rows[:, None] & (norms > max_norm), max_norm / (norms + 1e-7), 1)
    return (x * scale).astype(weight.dtype)


# --- embedding_bag -----------------------------------------------------------------------------
def _check_embedding_bag(weight, indices, offsets, *rest):
    # The CPU kernel's first checks (PyTorch's meta kernel has none of them)
    if indices.dim() not in (1, 2):
        raise RuntimeError(f"input has to be a 1D or 2D Tensor, but got Tensor of dimension "
                           f"{indices.dim()}")
    if indices.dim() == 1 and offsets.dim() != 1:
        raise RuntimeError(f"offsets has to be a 1D Tensor, but got Tensor of dimension "
                           f"{offsets.dim()}")
    if weight.dim() != 2:
        raise RuntimeError(f"weight has to be a 2D Tensor, but got Tensor of dimension "
                           f"{weight.dim()}")


@lowering("aten::_embedding_bag.default", "aten::_embedding_bag_forward_only.default",
          validate=_check_embedding_bag)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    n, dim = indices.shape[0], weight.shape[1]
    # The CPU kernel's check of the indices, read at the next wait (CUDA's kernel has none).
    check(jnp.all((indices >= 0) & (indices < weight.shape[0])),
          "Expected idx >= 0 && idx < num_embeddings to be true, but got false.", RuntimeError)
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bag = jnp.searchsorted(offsets[:bags], jnp.arange(n), side="right") - 1  # offset2bag
    if include_last_offset and n:
        bag = jnp.where(jnp.arange(n) >= offsets[-1], bags, bag)  # past the last bag: dropped
    valid = (indices != padding_idx) & (bag >= 0) & (bag < bags)
    rows = jnp.take(weight, indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    segment = jnp.where(valid, bag, bags)  # invalid positions go to a dropped extra segment
    count = jax.ops.segment_sum(valid.astype(jnp.int64), segment, bags + 1)[:bags]
    if mode == 2:
        best = jax.ops.segment_max(jnp.where(valid[:, None], rows, -jnp.inf), segment, bags + 1)
        best = best[:bags]
        at_best = valid[:, None] & (rows == best[segment.clip(0, bags - 1)])
        first = jax.ops.segment_min(jnp.where(at_best, jnp.arange(n)[:, None], n), segment,
                                    bags + 1)[:bags]
        # (an empty bag's index is 0, as on the CPU; its gradient goes nowhere: bag_size is 0)
        picked = indices[jnp.clip(first, 0, n - 1)] if n else jnp.zeros((bags, dim), indices.dtype)
        max_indices = jnp.where(count[:, None] > 0, picked, 0)
        out = jnp.where(count[:, None] > 0, best, 0)
    else:
        out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), segment, bags + 1)[:bags]
        if mode == 1:
            out = out / jnp.maximum(count, 1)[:, None].astype(out.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    # bag_size has one entry per offset, even the closing one of include_last_offset
    bag_size = jnp.concatenate([count, jnp.zeros(offsets.shape[0] - bags, jnp.int64)])
    return (out.astype(weight.dtype).reshape(bags, dim), bag.astype(jnp.int64),
            bag_size, max_indices.astype(jnp.int64))


# The embedding_bag backward ops scatter by what the forward saved (offset2bag, bag_size,
# maximum_indices), as PyTorch defines them; PyTorch has no decomposition of them.
@lowering("aten::_embedding_bag_dense_backward.default")
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                 num_weights, scale_grad_by_freq, mode, per_sample_weights=None,
                                 padding_idx=-1):
    dim = grad.shape[1]
    if mode == 2:
        filled = (bag_size[:grad.shape[0]] > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(dim), maximum_indices.shape)
        return jnp.zeros((num_weights, dim), grad.dtype).at[
            jnp.where(filled, maximum_indices, num_weights), cols].add(grad, mode="drop")
    bags = grad.shape[0]
    valid = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < bags)
    bag = jnp.clip(offset2bag, 0, max(bags - 1, 0))
    g = grad[bag]
    if mode == 1:
        g = g / jnp.maximum(bag_size[bag], 1)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        g = g * per_sample_weights[:, None].astype(g.dtype)
    if scale_grad_by_freq:
        freq = jnp.zeros(num_weights, g.dtype).at[indices].add(1)
        g = g / freq[indices][:, None]
    g = jnp.where(valid[:, None], g, 0)
    return jnp.zeros((num_weights, dim), grad.dtype).at[indices].add(g)


@lowering("aten::_embedding_bag_per_sample_weights_backward.default")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    bags = grad.shape[0]
    valid = (indices != padding_idx) & (offset2bag >= 0) & (offset2bag < bags)
    g = grad[jnp.clip(offset2bag, 0, max(bags - 1, 0))]
    return jnp.where(valid, jnp.sum(g * weight[indices], axis=1), 0).astype(grad.dtype)


@lowering("aten::_embedding_bag_backward.default")
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse,
                           per_sample_weights=None, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag(sparse=True) gradients are sparse tensors, "
                                  "which the tpu device does not support")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                        num_weights, scale_grad_by_freq, mode,
                                        per_sample_weights, padding_idx)
