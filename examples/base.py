"""What every example shares: the :class:`Example` a factory returns, the loss functions,
and the helpers that build a seeded model and batch."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Example", "lm_loss", "classification_loss", "mse_loss"]


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


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of next-token logits (B, T, V) against token ids (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def dropout_layer(p: float) -> nn.Module:
    # With p == 0 no dropout op is put in the graph at all.
    return nn.Dropout(p) if p > 0 else nn.Identity()


def apply_overrides(config, overrides: dict):
    names = {f.name for f in fields(config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"unknown {type(config).__name__} field(s) {unknown}; "
                        f"known: {sorted(names)}")
    return replace(config, **overrides)


def language_model(cls, config, batch: int, seq_len: int, seed: int) -> Example:
    """A seeded model and a random token batch whose target is the batch shifted by one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
    return Example(model, (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(),
                   lm_loss, config)
