"""FlexAttention through JAX's Pallas splash-attention kernel: the ops `torchtpu::flex_splash`
(output and log-sum-exp) and `torchtpu::flex_splash_backward` (dq, dk, dv: the `jax.vjp` of the
kernel) that the flex_attention operator's tpu kernels (`_execution/flex_attention_kernels.py`)
call for a mask the kernel can take. `mask` names a mask registered with
`accelerated_attention.register_splash_mask`: a digest of its contents, so a program compiled
for it is one for that mask."""
import torch

from .._core.registry import lowering
from . import accelerated_attention

_lib = torch.library.Library("torchtpu", "FRAGMENT")
_lib.define("flex_splash(Tensor query, Tensor key, Tensor value, str mask, float scale) "
            "-> (Tensor output, Tensor logsumexp)")
_lib.define("flex_splash_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
            "str mask, float scale) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)")


@torch.library.register_fake("torchtpu::flex_splash")
def _flex_splash_shapes(q, k, v, mask, scale):
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


@torch.library.register_fake("torchtpu::flex_splash_backward")
def _flex_splash_backward_shapes(grad, q, k, v, mask, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@lowering("torchtpu::flex_splash")
def flex_splash(q, k, v, mask, scale):
    with accelerated_attention.splash_context():
        return accelerated_attention.splash(q, k, v, mask, scale)


@lowering("torchtpu::flex_splash_backward")
def flex_splash_backward(grad, q, k, v, mask, scale):
    with accelerated_attention.splash_context():
        return accelerated_attention.splash_backward(grad, q, k, v, mask, scale)
