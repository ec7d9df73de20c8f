"""Small models used by the demo, the tests and the benchmarks (random weights, no downloads)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=32, d_hidden=64, n_classes=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Pre-LN decoder-only transformer with a GELU MLP (GPT-2 style)."""

    def __init__(self, vocab=1024, d_model=256, n_heads=4, n_layers=4, seq=128, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, positions):
    """Rotary position embedding (RoPE) of the last dim's two halves."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm attention with RoPE (grouped-query when kv_heads < heads) and a SwiGLU MLP."""

    def __init__(self, d, heads, hidden, kv_heads=None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.kv_dim = d // heads * self.kv_heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, d + 2 * self.kv_dim, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, positions):
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split([C, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(B, T, self.heads, -1).transpose(1, 2)
        k, v = (t.view(B, T, self.kv_heads, -1).transpose(1, 2) for t in (k, v))
        q, k = rotary(q, positions), rotary(k, positions)
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    """Llama-style decoder: RMSNorm, RoPE, SwiGLU, optional grouped-query attention."""

    def __init__(self, vocab=256, d=128, layers=4, heads=4, hidden=352, kv_heads=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, hidden, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, positions)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
