"""The benchmark models written directly in JAX: the same computation as
torchtpu.examples.models' GPT and Llama, on a dict of arrays named as the torch model's
state_dict (so both start from the same weights), for the benchmarks' JAX baselines."""
import jax
import jax.numpy as jnp


def params_of(model):
    """The torch model's weights as JAX arrays (host copies), by state_dict name."""
    return {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in model.state_dict().items()}


def config_of(model):
    """What the JAX losses need to know of the torch model besides its weights."""
    from torchtpu.examples.models import GPT, Llama
    if isinstance(model, GPT):
        return ("gpt", model.blocks[0].n_heads, len(model.blocks))
    if isinstance(model, Llama):
        b = model.blocks[0]
        return ("llama", b.heads, b.kv_heads, len(model.blocks))
    raise TypeError(f"no JAX twin of {type(model).__name__}")


def _linear(x, w):
    """x @ w.T over x's last dim, as one 2-D matmul (PyTorch's Linear flattens its input the
    same way).  XLA:CPU runs the dot of a 3-D activation against a 2-D weight much slower than
    the 2-D matmul of the same numbers: the 4-layer GPT's forward and backward took 318 ms
    written as `x @ w.T`, 202 ms so."""
    return (x.reshape(-1, x.shape[-1]) @ w.T).reshape(*x.shape[:-1], w.shape[0])


def _layer_norm(x, w, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * w + b


def _rms_norm(x, w):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def _attention(q, k, v):
    """Causal attention of (B, H, T, D) queries over (B, H, T, D) keys and values."""
    T = q.shape[2]
    att = q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
    return jax.nn.softmax(att, -1) @ v


def _rotary(x, positions):
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def gpt_block(p, q, x, heads):
    """One GPT block; `q` is the prefix of its weights' names ("blocks.i.")."""
    B, T, C = x.shape
    h = _linear(_layer_norm(x, p[q + "ln1.weight"], p[q + "ln1.bias"]), p[q + "qkv.weight"])
    h = h + p[q + "qkv.bias"]
    qh, kh, vh = (h[..., j * C:(j + 1) * C].reshape(B, T, heads, -1).transpose(0, 2, 1, 3) for j in range(3))
    y = _attention(qh, kh, vh).transpose(0, 2, 1, 3).reshape(B, T, C)
    x = x + _linear(y, p[q + "proj.weight"]) + p[q + "proj.bias"]
    h = _linear(_layer_norm(x, p[q + "ln2.weight"], p[q + "ln2.bias"]), p[q + "fc.weight"]) + p[q + "fc.bias"]
    return x + _linear(jax.nn.gelu(h, approximate=False), p[q + "fc_out.weight"]) + p[q + "fc_out.bias"]


def llama_block(p, q, x, heads, kv_heads, attention=_attention):
    """One Llama block; `attention(q, k, v)` of (B, H, T, D) heads, keys and values repeated
    to the queries' heads (causal)."""
    B, T, C = x.shape
    kv_dim = C // heads * kv_heads
    h = _linear(_rms_norm(x, p[q + "attn_norm.weight"]), p[q + "qkv.weight"])
    qh = h[..., :C].reshape(B, T, heads, -1).transpose(0, 2, 1, 3)
    kh, vh = (h[..., C + j * kv_dim:C + (j + 1) * kv_dim].reshape(B, T, kv_heads, -1).transpose(0, 2, 1, 3)
              for j in range(2))
    positions = jnp.arange(T)
    qh, kh = _rotary(qh, positions), _rotary(kh, positions)
    kh, vh = (jnp.repeat(t, heads // kv_heads, axis=1) for t in (kh, vh))
    y = attention(qh, kh, vh).transpose(0, 2, 1, 3).reshape(B, T, C)
    x = x + _linear(y, p[q + "proj.weight"])
    gate, up = jnp.split(_linear(_rms_norm(x, p[q + "mlp_norm.weight"]), p[q + "gate_up.weight"]), 2, -1)
    return x + _linear(jax.nn.silu(gate) * up, p[q + "down.weight"])


def _cross_entropy(logits, tgt):
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, tgt[..., None], -1).mean()


def loss_fn(config, block=None):
    """loss(params, idx, tgt) of the model `config` (config_of) describes.  `block(p, i, x,
    run)` (optional) wraps each block's computation `run(p, x)` on weights `p`: FSDP's
    all-gather of the block's shards goes there."""
    kind, layers = config[0], config[-1]

    def run_block(i):
        prefix = f"blocks.{i}."
        if kind == "gpt":
            return lambda p, x: gpt_block(p, prefix, x, config[1])
        return lambda p, x: llama_block(p, prefix, x, config[1], config[2])

    def loss(p, idx, tgt):
        T = idx.shape[1]
        x = p["tok.weight"][idx] + p["pos.weight"][jnp.arange(T)] if kind == "gpt" else p["embed.weight"][idx]
        for i in range(layers):
            x = run_block(i)(p, x) if block is None else block(p, i, x, run_block(i))
        if kind == "gpt":
            x = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
        else:
            x = _rms_norm(x, p["norm.weight"])
        return _cross_entropy(_linear(x, p["head.weight"]), tgt)

    return loss


def train_step(model, lr=1e-3):
    """The training step of the torch `model` in JAX, unjitted: step(p, m, v, t, idx, tgt) ->
    (p, m, v, loss), forward, backward and `adamw` (t counts from 1)."""
    loss_of = loss_fn(config_of(model))

    def step(p, m, v, t, idx, tgt):
        loss, g = jax.value_and_grad(loss_of)(p, idx, tgt)
        return (*adamw(p, m, v, g, t, lr=lr), loss)

    return step


def adamw(p, m, v, g, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    """torch.optim.AdamW's update (its defaults but the lr) on pytrees; t counts from 1."""
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    p = jax.tree.map(lambda p, m, v: p * (1 - lr * wd) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), p, m, v)
    return p, m, v
