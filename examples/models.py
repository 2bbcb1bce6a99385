"""Small, readable example models for autopar.

Four models a new user can copy from, each with a factory that returns an ``Example``
(model, example inputs, target, loss function) at TINY sizes, so tests run in seconds:

    gpt     nanoGPT-style decoder: fused c_attn, causal SDPA, GELU MLP, tied lm_head
    llama   Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention,
            SwiGLU MLP, untied output head
    resnet  a conv stem and two BasicBlocks with BatchNorm2d, avg pool, linear head
    mlp     three Linear layers with GELU, MSE loss

Every model exports with ``torch.export.export(model, inputs, strict=False)``: static
shapes, no data-dependent control flow, dropout 0 by default (so no random ops in the
graph). Every default dimension is divisible by 4, so 2- and 4-way sharding applies.

    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"](batch=8, seed=0)
    loss = ex.loss_fn(ex.model(*ex.inputs), ex.target)

    with torch.device("meta"):                      # planning at scale: no memory
        ex = EXAMPLES["gpt"](batch=8, config="gpt-175b")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Example", "EXAMPLES",
    "GPTConfig", "GPT", "gpt_config", "GPT_PRESETS", "gpt_factory",
    "LlamaConfig", "Llama", "llama_factory",
    "ResNet", "resnet_factory",
    "MLP", "mlp_factory",
    "lm_loss", "classification_loss", "mse_loss",
]


@dataclass
class Example:
    """A model with everything needed to run one training step on it."""

    model: nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    config: Any = None

    def loss(self) -> torch.Tensor:
        return self.loss_fn(self.model(*self.inputs), self.target)


# ---------------------------------------------------------------------------- losses

def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of next-token logits (B, T, V) against token ids (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _dropout(p: float) -> nn.Module:
    # With p == 0 no dropout op is put in the graph at all.
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _apply_overrides(config, overrides: dict):
    names = {f.name for f in fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"unknown {type(config).__name__} field(s) {unknown}; "
                        f"known: {sorted(names)}")
    return replace(config, **overrides)


# ------------------------------------------------------------------------------- GPT

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


def gpt_config(size: str = "tiny", **overrides) -> GPTConfig:
    """A GPTConfig preset: "tiny" (the test default) or one of GPT_PRESETS."""
    if size == "tiny":
        config = GPTConfig()
    elif size in GPT_PRESETS:
        config = GPT_PRESETS[size]
    else:
        raise KeyError(f"unknown GPT size {size!r}; known: {['tiny', *GPT_PRESETS]}")
    return _apply_overrides(config, overrides)


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


def gpt_factory(batch: int = 8, *, seed: int = 0, seq_len: int | None = None,
                config: GPTConfig | str | None = None, **overrides) -> Example:
    """GPT example; `config` is a GPTConfig or a preset name, `overrides` its fields."""
    if isinstance(config, str):
        config = gpt_config(config)
    config = _apply_overrides(config or GPTConfig(), overrides)
    return _language_model(GPT, config, batch, seq_len or config.block_size, seed)


def _language_model(cls, config, batch: int, seq_len: int, seed: int) -> Example:
    """A seeded model and a random token batch whose target is the batch shifted by one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
    return Example(model, (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(),
                   lm_loss, config)


# ----------------------------------------------------------------------------- Llama

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
    config = _apply_overrides(config or LlamaConfig(), overrides)
    return _language_model(Llama, config, batch, seq_len or config.max_seq_len, seed)


# ---------------------------------------------------------------------------- ResNet

class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """forward(images (B, in_ch, H, W)) -> logits (B, num_classes)."""

    def __init__(self, in_channels: int = 3, width: int = 16, num_classes: int = 8):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, stride=1)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet_factory(batch: int = 8, *, seed: int = 0, image_size: int = 16,
                   in_channels: int = 3, width: int = 16, num_classes: int = 8) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet(in_channels, width, num_classes)
        images = torch.randn(batch, in_channels, image_size, image_size)
        target = torch.randint(0, num_classes, (batch,))
    config = dict(image_size=image_size, in_channels=in_channels, width=width,
                  num_classes=num_classes)
    return Example(model, (images,), target, classification_loss, config)


# ------------------------------------------------------------------------------- MLP

class MLP(nn.Module):
    """Three Linear layers with GELU between them."""

    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def mlp_factory(batch: int = 8, *, seed: int = 0, in_features: int = 32, hidden: int = 64,
                out_features: int = 16) -> Example:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(in_features, hidden, out_features)
        x = torch.randn(batch, in_features)
        target = torch.randn(batch, out_features)
    config = dict(in_features=in_features, hidden=hidden, out_features=out_features)
    return Example(model, (x,), target, mse_loss, config)


EXAMPLES: dict[str, Callable[..., Example]] = {
    "gpt": gpt_factory,
    "llama": llama_factory,
    "resnet": resnet_factory,
    "mlp": mlp_factory,
}
