"""A torchtitan-style mixture-of-experts layer (random weights), for the tests and benchmarks/moe.py.

Top-k token-choice routing (softmax scores in float32, the top k renormalised), tokens permuted
into expert order by a stable `argsort`, the experts' SwiGLU MLPs as three `torch._grouped_mm`
calls over the per-expert token counts (`histc`, on the device), the outputs weighted by their
router scores and summed back per token (`index_add_`), and the Switch-style load-balancing
loss (experts · Σ_e fraction of tokens routed to e · mean router probability of e).

`experts="loop"` runs the experts as the common per-expert loop instead (Mixtral's in
Hugging Face transformers: each expert gathers its tokens by `torch.where`), whose shapes
depend on the routing.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, dim=64, hidden=128, n_experts=8, top_k=2, experts="grouped_mm",
                 compute_dtype=torch.bfloat16):
        super().__init__()
        self.n_experts, self.top_k, self.experts = n_experts, top_k, experts
        self.compute_dtype = compute_dtype
        self.router = nn.Linear(dim, n_experts, bias=False)
        scale = dim ** -0.5
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim) * scale)  # gate
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, dim) * scale)  # up
        self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden) * hidden ** -0.5)  # down

    def route(self, x):
        """Router probabilities (N, E), the top-k (scores, experts) (N, k), per-expert counts."""
        probs = self.router(x).float().softmax(dim=-1)
        scores, chosen = torch.topk(probs, self.top_k, dim=-1)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.histc(chosen.reshape(-1).float(), bins=self.n_experts, min=0,
                             max=self.n_experts)
        return probs, scores, chosen, counts

    def forward(self, x):
        """(output of x's shape, load-balancing loss)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, scores, chosen, counts = self.route(x)
        if self.experts == "loop":
            out = self._loop(x, scores, chosen)
        else:
            out = self._grouped(x, scores, chosen, counts)
        fraction = counts / chosen.numel()
        balance = self.n_experts * (fraction * probs.mean(dim=0)).sum()
        return out.reshape(shape), balance

    def _grouped(self, x, scores, chosen, counts):
        order = torch.argsort(chosen.reshape(-1), stable=True)
        tokens = order // self.top_k  # the token of each (token, choice) in expert order
        routed = x[tokens].to(self.compute_dtype)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        # (spelled out: a generator here made Dynamo skip the frame, "graph break in a
        # generator's next() call")
        w1 = self.w1.to(self.compute_dtype).transpose(-2, -1)
        w2 = self.w2.to(self.compute_dtype).transpose(-2, -1)
        w3 = self.w3.to(self.compute_dtype).transpose(-2, -1)
        h = F.silu(torch._grouped_mm(routed, w1, offs=offs))
        h = h * torch._grouped_mm(routed, w3, offs=offs)
        out = torch._grouped_mm(h, w2, offs=offs).to(x.dtype)
        out = out * scores.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _loop(self, x, scores, chosen):
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, slot = torch.where(chosen == e)
            h = x[token].to(self.compute_dtype)
            w1, w2, w3 = (w[e].to(self.compute_dtype) for w in (self.w1, self.w2, self.w3))
            y = (F.silu(h @ w1.T) * (h @ w3.T)) @ w2.T
            out.index_add_(0, token, y.to(x.dtype) * scores[token, slot, None].to(x.dtype))
        return out


class MoEModel(nn.Module):
    """Embedding, one pre-norm MoE block with a residual, a head: cross-entropy plus
    `balance_coef` times the load-balancing loss."""

    def __init__(self, vocab=256, dim=64, hidden=128, n_experts=8, top_k=2,
                 experts="grouped_mm", compute_dtype=torch.bfloat16, balance_coef=0.01):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.moe = MoE(dim, hidden, n_experts, top_k, experts, compute_dtype)
        self.norm_out = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.balance_coef = balance_coef

    def forward(self, idx, targets):
        x = self.embed(idx)
        y, balance = self.moe(self.norm(x))
        logits = self.head(self.norm_out(x + y))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss + self.balance_coef * balance


def training_step(model, optimizer):
    """step(idx, targets): forward, backward, optimizer step; returns the loss (detached)."""
    def step(idx, targets):
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step
