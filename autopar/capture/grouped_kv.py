"""Grouped-query attention given back to attention: ``SDPA(q, repeat_kv(k), repeat_kv(v))``
rewritten to ``SDPA(q, k, v, enable_gqa=True)``.

Llama-style models (transformers' ``repeat_kv``, ``examples.llama``) copy each key/value
head for its group of query heads before attention: ``x[:, :, None].expand(B, Hkv, g, S,
D).reshape(B, Hkv*g, S, D)``. Attention reads the copies as it would read the heads once
(``enable_gqa``, torch >= 2.5), and context parallelism sends K/V between ranks: passed or
gathered before the copy they are ``g`` times smaller (Llama 3 405B: 8 K/V heads for 128
query heads; Dubey et al. 2024, Sec. 3.3.2, gathers K/V before the expansion for that
reason). Applied with the sequence layout of a ``context=`` pin
(``autopar.capture.sequence_layout``); the copies' nodes go when nothing else reads them.
"""
from __future__ import annotations

import torch

from autopar.ops.attention import is_attention

aten = torch.ops.aten

EXPAND = {aten.expand.default}
RESHAPE = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
UNSQUEEZE = {aten.unsqueeze.default}


def _source(node) -> "torch.fx.Node | None":
    """The [B, Hkv, S, D] tensor ``node`` repeats per query-head group, or None."""
    if not isinstance(node, torch.fx.Node) or node.target not in RESHAPE:
        return None
    ex = node.args[0]
    if not isinstance(ex, torch.fx.Node) or ex.target not in EXPAND:
        return None
    un = ex.args[0]
    if not isinstance(un, torch.fx.Node) or un.target not in UNSQUEEZE or un.args[1] != 2:
        return None
    x = un.args[0]
    xv, outv = x.meta.get("val"), node.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(outv, torch.Tensor) or xv.dim() != 4:
        return None
    b, h, s, d = xv.shape
    if tuple(outv.shape) != (b, outv.shape[1], s, d) or outv.shape[1] % h:
        return None
    return x


def ungroup_kv(cap) -> int:
    """Rewrite each SDPA reading repeated K/V heads to ``enable_gqa=True`` (in place); how many."""
    graph, done = cap.gm.graph, 0
    for node in list(graph.nodes):
        if not is_attention(node.target) or len(node.args) < 3:
            continue
        k, v = _source(node.args[1]), _source(node.args[2])
        if k is None or v is None or k.meta["val"].shape[1] != v.meta["val"].shape[1]:
            continue
        old = (node.args[1], node.args[2])
        node.args = (node.args[0], k, v) + tuple(node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        done += 1
        for n in old:
            _erase_unread(graph, n)
    if done:
        graph.lint()
        cap.gm.recompile()
        cap.__post_init__()
    return done


def _erase_unread(graph, node) -> None:
    """``node`` and its view inputs, while nothing reads them."""
    while isinstance(node, torch.fx.Node) and not node.users and node.op == "call_function" \
            and node.target in EXPAND | RESHAPE | UNSQUEEZE:
        src = node.args[0]
        graph.erase_node(node)
        node = src


__all__ = ["ungroup_kv"]
