"""nanoGPT-style decoder: fused c_attn, causal SDPA, GELU MLP, tied lm_head (GPT-2's layout).

The model ``autopar demo`` plans and verifies. It lives in the package, not in ``examples/``,
so that the demo runs from an installed wheel with no source tree (``tests/test_wheel.py``);
``examples.gpt`` builds its test models from these classes.

``demo_factory(batch=8)`` is the tiny model (2 layers, width 32, vocabulary 64, 16 tokens);
``demo_factory(batch=8, config="gpt-1.3b")`` under ``torch.device("meta")`` plans at scale
without memory. The factory returns (model, inputs, loss_fn, target), what
``autopar plan``/``verify`` take from a ``MODULE:FACTORY``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "GPT_PRESETS", "gpt_preset", "lm_loss", "demo_factory"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt2-124m": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                           n_embd=768),
    "gpt-1.3b": GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16,
                          n_embd=2048),
    "gpt-24layer": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16,
                             n_embd=1024),
    "gpt-175b": GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96,
                          n_embd=12288),
}


def gpt_preset(size: str = "tiny") -> GPTConfig:
    """The GPTConfig of a size: "tiny" (the test default) or one of GPT_PRESETS."""
    if size == "tiny":
        return GPTConfig()
    if size in GPT_PRESETS:
        return GPT_PRESETS[size]
    raise KeyError(f"unknown GPT size {size!r}; known: {['tiny', *GPT_PRESETS]}")


def _dropout(p: float) -> nn.Module:
    # With p == 0 no dropout op is put in the graph at all.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k and v projections in ONE Linear (GPT-2's layout), split after.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = _dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT: forward(idx (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=_dropout(config.dropout),
            h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied weights
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled residual init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of next-token logits (B, T, V) against token ids (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


def demo_factory(batch: int = 8, *, config: str = "tiny", seed: int = 0):
    """A seeded GPT of preset ``config`` and a random batch of ``block_size`` + 1 tokens per
    row: inputs the first ``block_size``, target the same shifted by one. The same model,
    batch and loss as ``examples.gpt.gpt_factory(batch, seed=seed, config=config)``."""
    cfg = gpt_preset(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1))
    return model, (tokens[:, :-1].contiguous(),), lm_loss, tokens[:, 1:].contiguous()
