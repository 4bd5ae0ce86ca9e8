"""The trainable EAGLE-3 head of head.py, with EAGLE-3's training-time test.

Parameter names are the official checkpoint's (``fc.weight``, ``midlayer.self_attn.q_proj.weight``
..., docs/eagle3_format.md §3), so the state dict is the head. The numerics reuse eagle3.py's
RMSNorm and RoPE; tests prove the unrolled forward gives Eagle3Drafter's logits for the same
weights.

Training-time test (unroll U steps over a sequence of T tokens, n = T - 1 indices p):
* step 0 at index p: (fc(features of token p), embed(token p+1)) at RoPE position p, attending
  causally to the step-0 keys at indices <= p: the committed pairs of the drafter;
* step s >= 1 at index p: (h2 of step s-1 at p, embed(token p+1+s)) at position p+s, attending to
  the step-0 keys at indices <= p plus the keys of steps 1..s at index p (the diagonal): exactly
  the ancestor chain a level-s tree node sees in Eagle3Drafter.expand (committed pairs 0..p,
  ancestors at p+1..p+s-1, itself at p+s);
* step s at index p predicts token p+2+s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rheo_engine.models.eagle3 import HeadConfig, apply_rope, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class HeadAttention(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        H2, D = 2 * cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H2, cfg.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H2, cfg.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H2, cfg.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * D, cfg.hidden_size, bias=False)


class HeadMLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def unrolled_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                       diag_k: list[torch.Tensor],
                       diag_v: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """q [B, n, Hq, D] at index p over the step-0 keys k0, v0 [B, n, Hkv, D] at indices <= p
    and the diagonal keys diag_k[j], diag_v[j] [B, n, Hkv, D] of steps 1..s at p -> [B, n, Hq, D].
    One softmax over both parts, in fp32 as the head's inference attention."""
    B, n, Hq, D = q.shape
    g = Hq // k0.shape[2]  # GQA group
    scale = D**-0.5
    qf = q.float()
    s0 = torch.einsum("bphd,bjhd->bhpj", qf, k0.float().repeat_interleave(g, 2)) * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))  # [B, Hq, n, n]
    sd = [(qf * k.float().repeat_interleave(g, 2)).sum(-1).transpose(1, 2) * scale
          for k in diag_k]  # fmt: skip  # each [B, Hq, n]
    probs = torch.softmax(torch.cat([s0, *(s.unsqueeze(-1) for s in sd)], -1), -1)
    probs = probs.to(v0.dtype)  # [B, Hq, n, n + s]
    out = torch.einsum("bhpj,bjhd->bphd", probs[..., :n], v0.repeat_interleave(g, 2))
    for j, v in enumerate(diag_v):
        out = out + probs[..., n + j].transpose(1, 2).unsqueeze(-1) * v.repeat_interleave(g, 2)
    return out


class MidLayer(nn.Module):
    """The head's one decoder layer (docs/eagle3_format.md §7): input concat(norm(embed),
    norm(h)), 2H."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = HeadMLP(cfg)

    def forward(self, h: torch.Tensor, e: torch.Tensor, positions: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """h, e [B, n, H] (state, token embedding) at positions [B, n]; kv holds the (k, v)
        [B, n, Hkv, D] of the earlier steps (step 0 first) and gets this step's appended."""
        B, n, _ = h.shape
        c, a = self.cfg, self.self_attn
        # Embedding half first; the residual is the un-normed h (docs/eagle3_format.md §7).
        x = torch.cat((self.input_layernorm(e), self.hidden_norm(h)), -1)  # [B, n, 2H]
        q = apply_rope(a.q_proj(x).view(B, n, -1, c.head_dim), positions, c.rope_theta)
        k = apply_rope(a.k_proj(x).view(B, n, -1, c.head_dim), positions, c.rope_theta)
        v = a.v_proj(x).view(B, n, -1, c.head_dim)
        kv.append((k, v))
        (k0, v0), diag = kv[0], kv[1:]
        attn = unrolled_attention(q, k0, v0, [d[0] for d in diag], [d[1] for d in diag])
        h1 = h + a.o_proj(attn.reshape(B, n, -1))
        return h1 + self.mlp(self.post_attention_layernorm(h1))


class TrainableHead(nn.Module):
    """An EAGLE-3 head as an nn.Module; ``embed_tokens`` [V, H] is the target's, frozen."""

    def __init__(self, cfg: HeadConfig, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        F_in = len(cfg.feature_layers) * cfg.target_hidden_size
        self.fc = nn.Linear(F_in, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Not a parameter and not saved: official heads borrow the target's
        # (docs/eagle3_format.md §5).
        self.register_buffer("embed_tokens", embed_tokens.detach().float(), persistent=False)

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, unroll: int
    ) -> list[torch.Tensor]:
        """Draft logits of the training-time test: features [B, T, F], tokens [B, T] ->
        ``unroll`` tensors [B, T-1, Vd] float32; entry s at index p predicts token p+2+s.
        Indices whose input token p+1+s is past the end embed token 0 (mask them in the loss)."""
        B, T = tokens.shape
        n = T - 1
        h = self.fc(features[:, :n].to(self.fc.weight.dtype))  # [B, n, H]
        padded = F.pad(tokens, (0, unroll))  # [B, T + U]: token ids beyond the end are 0
        index = torch.arange(n, device=tokens.device).expand(B, n)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for s in range(unroll):
            e = F.embedding(padded[:, 1 + s : 1 + s + n], self.embed_tokens).to(h.dtype)
            h = self.midlayer(h, e, index + s, kv)
            logits.append(self.lm_head(self.norm(h)).float())
        return logits

    def head_weights(self) -> dict[str, torch.Tensor]:
        """The trainable tensors under the official key names (no embed_tokens)."""
        return {k: v.detach() for k, v in self.state_dict().items()}
