"""torch.tpu.pallas.jax_op: JAX functions as torch ops in every mode, compiled, with autograd;
the Pallas RMSNorm example kernel."""
import copy

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torchtpu
from torchtpu.examples.pallas_rmsnorm import RMSNormMLP, rms_norm, rms_norm_reference

MODES = [torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE,
         torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING]


@torch.tpu.pallas.jax_op
def gelu_gate(x, gate, *, scale=1.0):
    return jax.nn.gelu(x, approximate=False) * jax.nn.sigmoid(gate) * scale


def gelu_gate_reference(x, gate, scale=1.0):
    return F.gelu(x) * torch.sigmoid(gate) * scale


@torch.tpu.pallas.jax_op
def split_stats(x, index):
    """Two outputs, one integer input (not differentiable)."""
    return x.sum(-1), jnp.take(x, index, axis=0)


def _leaves(*tensors):
    cpu = [t.clone().requires_grad_() for t in tensors]
    tpu = [t.detach().to("tpu").requires_grad_() for t in tensors]
    return cpu, tpu


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_jax_op_values_and_gradients_match_torch_cpu(mode):
    (x, g), (xt, gt) = _leaves(torch.randn(4, 8), torch.randn(4, 8))
    with torch.tpu.set_eager_mode(mode):
        out = gelu_gate(xt, gt, scale=2.0)
        (out * out).sum().backward()
        torch.testing.assert_close(out.detach().cpu(), gelu_gate_reference(x, g, 2.0).detach(),
                                   rtol=1e-5, atol=1e-6)
    ref = gelu_gate_reference(x, g, 2.0)
    (ref * ref).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gt.grad.cpu(), g.grad, rtol=1e-5, atol=1e-5)


def test_jax_op_multiple_outputs_and_integer_inputs():
    (x,), (xt,) = _leaves(torch.randn(5, 3))
    index = torch.tensor([4, 0])
    total, rows = split_stats(xt, index.to("tpu"))
    torch.testing.assert_close(total.detach().cpu(), x.detach().sum(-1))
    torch.testing.assert_close(rows.detach().cpu(), x.detach()[index])
    (total.sum() + (rows * 3).sum()).backward()
    (x.sum(-1).sum() + (x[index] * 3).sum()).backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


def test_jax_op_inside_compiled_graphs_forward_and_backward():
    (x, g), (xt, gt) = _leaves(torch.randn(4, 8), torch.randn(4, 8))
    f = torch.compile(lambda a, b: gelu_gate(a.tanh(), b, scale=0.5).sum(), backend="tpu")
    out = f(xt, gt)
    out.backward()
    ref = gelu_gate_reference(x.tanh(), g, 0.5).sum()
    ref.backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    assert torchtpu.metrics().get("graph_eager_runs", 0) == 0


def test_fake_implementation_gives_shapes_and_dtypes():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(3, 7, device="tpu"))
        i = mode.from_tensor(torch.empty(2, dtype=torch.int64, device="tpu"))
        total, rows = split_stats(x, i)
    assert total.shape == (3,) and rows.shape == (2, 7)
    assert total.dtype == rows.dtype == torch.float32 and total.device.type == "tpu"


def test_bad_arguments_raise_type_error():
    x = torch.ones(2, device="tpu")
    with pytest.raises(TypeError, match="positional arguments must be tensors"):
        gelu_gate(x, 3.0)
    with pytest.raises(TypeError, match="Python literals"):
        gelu_gate(x, x, scale=[1, 2])


def test_pallas_rms_norm_matches_reference():
    (x, w), (xt, wt) = _leaves(torch.randn(6, 16), torch.randn(16))
    out = rms_norm(xt, wt, eps=1e-5)
    ref = rms_norm_reference(x, w, 1e-5)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.sin().sum().backward()
    ref.sin().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), w.grad, rtol=1e-5, atol=1e-5)


def test_model_with_pallas_kernel_trains_like_the_torch_model_on_cpu():
    torch.manual_seed(0)
    cpu_model = RMSNormMLP(kernel=False)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    tpu_model.norm.kernel = True
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cpu_model, tpu_model)]
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    for _ in range(5):
        losses = []
        for model, opt, dev in zip((cpu_model, tpu_model), opts, ("cpu", "tpu")):
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_backward_is_given_the_keyword_defaults_the_forward_used():
    """A `backward=` that declares the static keywords without defaults, called after a forward
    that left them to the function's defaults (`rms_norm(x, w)` without `eps`)."""
    seen = []

    def backward(primals, cotangents, *, scale):
        seen.append(scale)
        x, = primals
        return (cotangents[0] * scale,)

    @torch.tpu.pallas.jax_op(backward=backward)
    def scaled(x, *, scale=3.0):
        return x * scale

    x = torch.randn(4, device="tpu", requires_grad=True)
    scaled(x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 3.0))
    x.grad = None
    scaled(x, scale=0.5).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 0.5))
    assert seen == [3.0, 0.5]
    xs, ws = torch.randn(3, 8), torch.rand(8) + 0.5
    (xc, wc), (xt, wt) = _leaves(xs, ws)
    rms_norm(xt, wt).sum().backward()  # the example kernel's backward takes eps without default
    rms_norm_reference(xc, wc).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wt.grad.cpu(), wc.grad, rtol=1e-4, atol=1e-5)
