"""Small, readable example models for autopar.

Four models a new user can copy from, each with a factory that returns an ``Example``
(model, example inputs, target, loss function) at TINY sizes, so tests run in seconds:

    gpt     nanoGPT-style decoder: fused c_attn, causal SDPA, GELU MLP, tied lm_head
    llama   Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention,
            SwiGLU MLP, untied output head
    resnet  a conv stem and two BasicBlocks with BatchNorm2d, avg pool, linear head
    mlp     three Linear layers with GELU, MSE loss
    inception  a conv stem, 2 or 4 independent towers of unequal depth joined by concat
               (``inception.py``; branch parallelism)

Each lives in its own file (``gpt.py``, ``llama.py``, ``small.py`` for resnet and mlp) on
top of ``base.py`` (``Example``, the losses); this module gathers them in ``EXAMPLES``.

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

from typing import Callable

from examples.base import Example, classification_loss, lm_loss, mse_loss
from examples.gpt import GPT, GPT_PRESETS, GPTConfig, gpt_config, gpt_factory
from examples.llama import Llama, LlamaConfig, llama_factory
from examples.inception import Inception, inception_factory
from examples.small import MLP, ResNet, mlp_factory, resnet_factory

__all__ = [
    "Example", "EXAMPLES",
    "GPTConfig", "GPT", "gpt_config", "GPT_PRESETS", "gpt_factory",
    "LlamaConfig", "Llama", "llama_factory",
    "ResNet", "resnet_factory",
    "MLP", "mlp_factory",
    "Inception", "inception_factory",
    "lm_loss", "classification_loss", "mse_loss",
]


EXAMPLES: dict[str, Callable[..., Example]] = {
    "gpt": gpt_factory,
    "llama": llama_factory,
    "resnet": resnet_factory,
    "mlp": mlp_factory,
    "inception": inception_factory,
}
