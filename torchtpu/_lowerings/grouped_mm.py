"""`torch._grouped_mm`, the grouped GEMM of mixture-of-experts layers (torchtitan's, PyTorch's
own), as `jax.lax.ragged_dot_general`: the groups' sizes are the differences of `offs`, an array
on the device, so neither a new routing of tokens to experts nor its values on the host are ever
needed: one program per shape, no host wait.

The op `torchtpu::grouped_mm` (and its backward, the `jax.vjp` of the forward) is what
`aten::_grouped_mm` runs on tpu, through the dispatcher kernel in
`_execution/composed_kernels.py` (which checks the call as the CPU's kernel does). PyTorch's
meta kernel of `_grouped_mm` mirrors CUDA's and refuses float32, which the CPU takes; this
op's fake kernel follows the CPU.

The four layouts (offs marks the ends of the groups along the dim named):
  2-D x 3-D, offs along a's rows:     (M, K) x (G, K, N) -> (M, N), rows of group g use b[g]
  3-D x 2-D, offs along b's columns:  (G, M, K) x (K, N) -> (M, N), columns of g use a[g]
  2-D x 2-D, offs along K:            (M, K) x (K, N) -> (G, M, N), g sums over its K slice
  3-D x 3-D, no offs:                 (G, M, K) x (G, K, N) -> (G, M, N), a batched matmul
Rows (columns) past the last offset are zeros (PyTorch leaves them unwritten)."""
import jax
import jax.numpy as jnp
import torch
from jax import lax

from .._core import runtime
from .._core.registry import check, lowering
from .._core.runtime import jax_precision as _precision


def _group_sizes(offs, length):
    """The groups' sizes from their end offsets, with the CPU's contract checked on the device:
    non-decreasing offsets within the dim (the CPU kernel would read groups that overlap, or
    past the tensor's end)."""
    offs = offs.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), offs[:-1]])
    sizes = offs - starts
    if offs.size:
        check(jnp.all(sizes >= 0) & (offs[-1] <= length),
              f"grouped_mm: offs must be non-decreasing and at most {length}", RuntimeError)
    return jnp.maximum(sizes, 0)


def grouped_mm(a, b, offs):
    """The product in float32 (float64 never reaches here): callers round it to a's dtype."""
    kw = dict(precision=_precision(), preferred_element_type=jnp.float32)
    if runtime.program_platform() == "cpu":
        # XLA:CPU has no bfloat16 x bfloat16 -> float32 dot (UNIMPLEMENTED in DotThunk, met by
        # the gradients' dots); float32 operands give the same products, exactly
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.ndim == 3 and b.ndim == 3:
        return jnp.einsum("gmk,gkn->gmn", a, b, **kw)
    if a.ndim == 2 and b.ndim == 3:
        return lax.ragged_dot(a, b, _group_sizes(offs, a.shape[0]), **kw)
    if a.ndim == 3:  # (the transpose of the 2-D x 3-D form)
        out_t = lax.ragged_dot(b.T, jnp.swapaxes(a, 1, 2), _group_sizes(offs, b.shape[1]), **kw)
        return out_t.T
    return _ragged_contracting(a, b, _group_sizes(offs, a.shape[1]))


@jax.custom_vjp
def _ragged_contracting(a, b, sizes):
    """(G, M, N): group g's slice of K of a (M, K) times that of b (K, N)."""
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())), lhs_ragged_dimensions=(1,),
        rhs_group_dimensions=())
    return lax.ragged_dot_general(a, b, sizes, numbers, precision=_precision(),
                                  preferred_element_type=jnp.float32)


# A backward of its own: jax 0.10's ragged_dot_general has no transpose rule for a ragged
# contracting dim (NotImplementedError "Unimplemented grad_y_dims ... RAGGED_CONTRACTING").
# Each gradient is a ragged dot over K's groups: da[:, k] = grad[g] @ b[k]ᵀ for k in group g.
def _ragged_contracting_fwd(a, b, sizes):
    return _ragged_contracting(a, b, sizes), (a, b, sizes)


def _ragged_contracting_bwd(residuals, grad):
    a, b, sizes = residuals
    kw = dict(precision=_precision(), preferred_element_type=jnp.float32)
    grad = grad.astype(jnp.float32)
    da = lax.ragged_dot(b.astype(jnp.float32), jnp.swapaxes(grad, 1, 2), sizes, **kw).T
    db = lax.ragged_dot(a.T.astype(jnp.float32), grad, sizes, **kw)
    return da.astype(a.dtype), db.astype(b.dtype), None


_ragged_contracting.defvjp(_ragged_contracting_fwd, _ragged_contracting_bwd)


_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("grouped_mm(Tensor a, Tensor b, Tensor? offs) -> Tensor")
_lib.define("grouped_mm_backward(Tensor grad, Tensor a, Tensor b, Tensor? offs, bool[2] mask) "
            "-> (Tensor grad_a, Tensor grad_b)")


@torch.library.register_fake("torchtpu::grouped_mm")
def _grouped_mm_shape(a, b, offs):
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    else:
        shape = (a.shape[-2], b.shape[-1])
    return a.new_empty(shape)


@torch.library.register_fake("torchtpu::grouped_mm_backward")
def _grouped_mm_backward_shape(grad, a, b, offs, mask):
    return (torch.empty_like(a) if mask[0] else a.new_empty((0,)),
            torch.empty_like(b) if mask[1] else b.new_empty((0,)))


def _save(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[:2])
    ga, gb = torch.ops.torchtpu.grouped_mm_backward(grad, a, b, offs, mask)
    return ga if mask[0] else None, gb if mask[1] else None, None


torch.library.register_autograd("torchtpu::grouped_mm", _backward, setup_context=_save)


@lowering("torchtpu::grouped_mm", precision=True)
def grouped_mm_op(a, b, offs):
    return grouped_mm(a, b, offs)


@lowering("torchtpu::grouped_mm_backward", precision=True)
def grouped_mm_backward(grad, a, b, offs, mask):
    out, vjp = jax.vjp(lambda a, b: grouped_mm(a, b, offs).astype(a.dtype), a, b)
    ga, gb = vjp(grad.astype(out.dtype))
    return (ga if mask[0] else jnp.zeros((0,), a.dtype),
            gb if mask[1] else jnp.zeros((0,), b.dtype))
