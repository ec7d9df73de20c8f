"""The fused LSTM and GRU cells `nn.LSTM`/`nn.GRU`/`nn.LSTMCell`/`nn.GRUCell` call on a
non-CPU device (ATen's RNN code takes the CUDA path for PrivateUse1 too).

Each cell is one JAX function of its gate pre-activations; the backward kernels are its
`jax.vjp`.  The forward's `workspace` output (opaque to PyTorch, only handed back to the
backward) holds the pre-activations the VJP needs, where CUDA keeps activated gates."""
import jax
import jax.numpy as jnp

from .._core.registry import lowering


def _sum_biases(gates, input_bias, hidden_bias):
    return gates if input_bias is None else gates + input_bias + hidden_bias


def _lstm(gates, cx):
    i, f, g, o = jnp.split(gates, 4, axis=1)
    cy = jax.nn.sigmoid(f) * cx + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(cy), cy


@lowering("aten::_thnn_fused_lstm_cell.default", opmath=True)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _sum_biases(input_gates + hidden_gates, input_bias, hidden_bias)
    return (*_lstm(gates, cx), gates)


@lowering("aten::_thnn_fused_lstm_cell_backward_impl.default", opmath=True)
def fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    (hy, cy), vjp = jax.vjp(_lstm, workspace, cx)
    zeros = jnp.zeros_like(cy)
    grad_gates, grad_cx = vjp((zeros if grad_hy is None else grad_hy,
                               zeros if grad_cy is None else grad_cy))
    # The gates are input_gates + hidden_gates (+ both biases): each gets the same gradient.
    return grad_gates, grad_cx, grad_gates.sum(0) if has_bias else None


def _gru(rz, input_n, hidden_n, hx):
    r, z = jnp.split(jax.nn.sigmoid(rz), 2, axis=1)
    n = jnp.tanh(input_n + r * hidden_n)
    return n + z * (hx - n)


@lowering("aten::_thnn_fused_gru_cell.default", opmath=True)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig = input_gates if input_bias is None else input_gates + input_bias
    hg = hidden_gates if hidden_bias is None else hidden_gates + hidden_bias
    (ig_rz, ig_n), (hg_rz, hg_n) = jnp.split(ig, [ig.shape[1] * 2 // 3], 1), jnp.split(hg, [hg.shape[1] * 2 // 3], 1)
    workspace = jnp.concatenate([ig_rz + hg_rz, ig_n, hg_n, hx], axis=1)
    return _gru(ig_rz + hg_rz, ig_n, hg_n, hx), workspace


@lowering("aten::_thnn_fused_gru_cell_backward.default", opmath=True)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    h = grad_hy.shape[1]
    rz, input_n, hidden_n, hx = jnp.split(workspace, [2 * h, 3 * h, 4 * h], axis=1)
    _, vjp = jax.vjp(_gru, rz, input_n, hidden_n, hx)
    g_rz, g_in, g_hn, grad_hx = vjp(grad_hy)
    grad_input_gates = jnp.concatenate([g_rz, g_in], axis=1)
    grad_hidden_gates = jnp.concatenate([g_rz, g_hn], axis=1)
    if not has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, None, None
    return (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0),
            grad_hidden_gates.sum(0))
