"""transformers' LlamaForCausalLM as an :class:`Example`, on the meta device (plans only):
a Hugging Face model for the planner's own checks (``tests/test_speculate.py``,
``benchmarks/solve_time.py``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.base import Example


def hf_lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's ``out.logits`` (B, T, V) against ``target`` (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def hf_llama_meta(batch: int, seq: int, **config) -> Example:
    """``LlamaForCausalLM(LlamaConfig(**config))`` on the meta device, without a KV cache,
    with a (batch, seq) token batch as input and target."""
    import transformers
    cfg = transformers.LlamaConfig(**config)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return Example(model, (tokens,), tokens, hf_lm_loss)
