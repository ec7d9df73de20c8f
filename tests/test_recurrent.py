"""nn.LSTM / nn.GRU / LSTMCell / GRUCell forward and backward against the CPU (on tpu they run
ATen's fused-cell path, `_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell` and their backwards)."""
import copy

import pytest
import torch

from conftest import assert_same


def _compare(module, *inputs, call=None, rtol=1e-5, atol=1e-5):
    """`call(module, *inputs)` (default: module(*inputs)) on tpu and on the CPU: outputs, input
    and parameter gradients agree."""
    call = call or (lambda m, *xs: m(*xs))
    module.zero_grad(set_to_none=True)
    dev = copy.deepcopy(module).to("tpu")
    cpu_in = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    dev_in = [x.detach().to("tpu").requires_grad_(x.is_floating_point()) for x in inputs]
    want, got = call(module, *cpu_in), call(dev, *dev_in)
    flat_want = torch.utils._pytree.tree_leaves(want)
    flat_got = torch.utils._pytree.tree_leaves(got)
    for g, w in zip(flat_got, flat_want, strict=True):
        assert_same(g, w, rtol=rtol, atol=atol)
    # A loss touching every output (the final states too) so each backward path is used.
    weights = [torch.randn(w.shape) for w in flat_want]
    sum(((w * c).sum() for w, c in zip(flat_want, weights)), torch.zeros(())).backward()
    sum(((g * c.to("tpu")).sum() for g, c in zip(flat_got, weights)),
        torch.zeros((), device="tpu")).backward()
    for d, c in zip(dev_in, cpu_in):
        if c.grad is not None:
            assert_same(d.grad, c.grad, rtol=rtol, atol=atol)
    for (name, p), q in zip(module.named_parameters(), dev.parameters(), strict=True):
        assert_same(q.grad, p.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_two_layer_bidirectional_batch_first(kind):
    rnn = getattr(torch.nn, kind)(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    _compare(rnn, torch.randn(3, 4, 5))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_initial_state_no_bias(kind):
    rnn = getattr(torch.nn, kind)(4, 6, bias=False)
    h0 = torch.randn(1, 2, 6)
    state = (h0, torch.randn(1, 2, 6)) if kind == "LSTM" else h0
    x = torch.randn(5, 2, 4)
    if kind == "LSTM":
        _compare(rnn, x, *state, call=lambda m, x, h, c: m(x, (h, c)))
    else:
        _compare(rnn, x, state)


def test_lstm_projection():
    _compare(torch.nn.LSTM(4, 6, proj_size=3), torch.randn(5, 2, 4))


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_cells(kind):
    cell = getattr(torch.nn, kind)(3, 5)
    _compare(cell, torch.randn(4, 3))
    h = torch.randn(4, 5)
    if kind == "LSTMCell":
        _compare(cell, torch.randn(4, 3), h, torch.randn(4, 5), call=lambda m, x, h, c: m(x, (h, c)))
    else:
        _compare(cell, torch.randn(4, 3), h)


def test_lstm_half_precision_in_float32():
    # CUDA's fused kernel computes half-precision cells in float32 and rounds once.
    rnn = torch.nn.LSTM(4, 6).to(torch.bfloat16)
    _compare(rnn, torch.randn(3, 2, 4).to(torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_double_backward_of_the_cell():
    # create_graph=True makes PyTorch differentiate the cell with ordinary ops instead.
    cell = torch.nn.GRUCell(3, 4).to("tpu")
    x = torch.randn(2, 3, device="tpu", requires_grad=True)
    (g,) = torch.autograd.grad(cell(x).pow(2).sum(), x, create_graph=True)
    g.sum().backward()
    cpu = copy.deepcopy(cell).cpu()
    xc = x.detach().cpu().requires_grad_()
    (gc,) = torch.autograd.grad(cpu(xc).pow(2).sum(), xc, create_graph=True)
    gc.sum().backward()
    assert_same(g, gc)
    assert_same(x.grad, xc.grad)
