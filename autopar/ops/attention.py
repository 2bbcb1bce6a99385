"""Which op of a captured graph is attention.

The capture keeps ``F.scaled_dot_product_attention`` whole: torch.export leaves the
composite ``aten.scaled_dot_product_attention`` in the graph (causal or masked, with
dropout or grouped-query ``enable_gqa``, it is the same op), and the fused kernel under it
(``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``,
``_flash_attention_for_cpu``) is chosen only when the graph runs. Everything that treats
attention specially (its sharding rule ``autopar.sharding.rules.attention``, context
parallelism's pins and prices, the capture's sequence layout, causal-mask and grouped-KV
rewrites) asks :func:`is_attention`, which reads the op's arguments in that op's schema
``(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)``: the fused
kernels' schemas differ (no ``attn_mask`` at 3, extra outputs), so they are not it.
"""
from __future__ import annotations

import torch

SDPA = torch.ops.aten.scaled_dot_product_attention.default
"""The captured attention op."""


def is_attention(target) -> bool:
    """Whether ``target`` (an fx node's target, or an ``OpCall``'s op) is the captured
    attention op, :data:`SDPA`."""
    return target is SDPA
