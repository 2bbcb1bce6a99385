"""nanoGPT-style decoder: fused c_attn, causal SDPA, GELU MLP, tied lm_head (GPT-2's layout).

The classes live in ``autopar.nanogpt`` (the model ``autopar demo`` runs, shipped in the
package); this file gives them the examples' factory and ``Example``.

``gpt_factory(batch=8)`` is the tiny test model; ``gpt_factory(config="gpt-175b")`` under
``torch.device("meta")`` plans at scale without memory.
"""

from __future__ import annotations

from autopar.nanogpt import GPT, GPT_PRESETS, GPTConfig, gpt_preset
from examples.base import Example, apply_overrides, language_model

__all__ = ["GPTConfig", "GPT", "gpt_config", "GPT_PRESETS", "gpt_factory"]


def gpt_config(size: str = "tiny", **overrides) -> GPTConfig:
    """A GPTConfig preset: "tiny" (the test default) or one of GPT_PRESETS."""
    return apply_overrides(gpt_preset(size), overrides)


def gpt_factory(batch: int = 8, *, seed: int = 0, seq_len: int | None = None,
                config: GPTConfig | str | None = None, **overrides) -> Example:
    """GPT example; `config` is a GPTConfig or a preset name, `overrides` its fields."""
    if isinstance(config, str):
        config = gpt_config(config)
    config = apply_overrides(config or GPTConfig(), overrides)
    return language_model(GPT, config, batch, seq_len or config.block_size, seed)
