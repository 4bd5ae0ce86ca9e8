"""The trainable Llama of target.py: HF LlamaForCausalLM numerics as a torch nn.Module.

Parameter names are HF's (``model.layers.{i}.self_attn.q_proj.weight`` ...), so the state dict
is the checkpoint. The embedding is tied to the output projection (no ``lm_head.weight``): at
V=4096 and hidden 256 that saves 1M parameters, a seventh of the default model, for little loss.
The engine runs the result with rheo_engine.models.llama.LlamaModel; a test checks both give the
same logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

RMS_EPS = 1e-5
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, RMS_EPS)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.H, self.Hkv, self.D = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.D, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.D, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.D, bias=False)
        self.o_proj = nn.Linear(heads * self.D, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # x [B, T, dim]; cos, sin [T, D]
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.Hkv, self.D).transpose(1, 2)  # [B, Hkv, T, D]
        q = q * cos + rotate_half(q) * sin  # RoPE, HF rotate_half convention
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's ``LlamaModel`` part: the ``model.`` prefix of every checkpoint name."""

    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers)
        )
        self.norm = RMSNorm(dim)


class TinyLlama(nn.Module):
    """A LlamaForCausalLM with tied embeddings; ``forward(tokens [B, T]) -> logits [B, T, V]``."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        heads: int,
        kv_heads: int,
        hidden: int,
        max_len: int,
    ) -> None:
        super().__init__()
        self.model = LlamaBody(vocab, dim, layers, heads, kv_heads, hidden)
        D = dim // heads
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, D/2]
        emb = torch.cat((freqs, freqs), -1)  # [max_len, D]
        # Not saved: derived from the config, and absent from HF checkpoints.
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        # GPT-2 style: N(0, 0.02), with the projections that write into the residual stream
        # scaled by 1/sqrt(2 * layers) so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * layers) ** 0.5 if residual else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # [T, D]
        x = self.model.embed_tokens(tokens)  # [B, T, dim]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)  # [B, T, V]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets`` [B, T] are ``tokens`` shifted by one."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
