"""Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP,
untied output head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.base import Example, apply_overrides, language_model

__all__ = ["LlamaConfig", "Llama", "llama_factory"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    max_seq_len: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2          # grouped-query attention: n_head // n_kv_head q per kv
    dim: int = 32
    hidden_dim: int = 64        # SwiGLU inner size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, as in the Llama reference code."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, hd); cos, sin: (T, hd)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, hd) -> (B, n_kv * n_rep, T, hd), each kv head shared by n_rep q heads."""
    if n_rep == 1:
        return x
    B, n_kv, T, hd = x.shape
    return x[:, :, None, :, :].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.dim % config.n_head == 0 and config.n_head % config.n_kv_head == 0
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.dim // config.n_head
        self.wq = nn.Linear(config.dim, config.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_head * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-style decoder: forward(tokens (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)  # untied
        # Rotary tables, precomputed once: (max_seq_len, head_dim), halves repeated.
        head_dim = config.dim // config.n_head
        inv_freq = 1.0 / (config.rope_theta
                          ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, T = tokens.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def llama_factory(batch: int = 8, *, seed: int = 0, seq_len: int | None = None,
                  config: LlamaConfig | None = None, **overrides) -> Example:
    config = apply_overrides(config or LlamaConfig(), overrides)
    return language_model(Llama, config, batch, seq_len or config.max_seq_len, seed)
