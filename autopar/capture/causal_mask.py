"""A causal mask built by the graph, given back to attention as ``is_causal=True``.

transformers' SDPA path builds its attention mask in the graph whenever it is exported
(``masking_utils.sdpa_mask``: its ``is_causal`` shortcut is skipped while tracing), even
with no padding: a [B, 1, S, S] boolean tensor of aranges, comparisons and a
packed-sequence check. At long sequences it is the largest tensor of the step (64 GiB at
262,144 tokens), and attention cannot skip the blocks it hides without reading it. Where
the mask is computed from constants alone (no input, parameter or buffer feeds it) and its
values are the lower triangle, the attention is ``is_causal=True`` and the mask's nodes go.

Every capture does this (``capture.export``), not only a context-parallel one: on a GPU
an SDPA given a mask cannot run the causal kernels, and cuDNN's attention, torch's choice
on an H100 / H200, expands a boolean mask to a bias of every head and keeps it for
backward. Measured on an H200 (``benchmarks/gpu_check.py``'s scale section, 2026-11-30):
Llama-3-8B's rank under ``tensor=8`` at 8,192 tokens held ~0.5 GiB more a layer than the
plan (35.1 GiB at its peak against 20.65 predicted), a Llama-3-70B pipeline stage 135.8
GiB against 52.75, and their attention took twice its causal price.

Its values are read by running its nodes on the CPU: at its own size when that is small,
else at a small sequence length (:data:`PROBE_SEQ`), every integer argument equal to the
sequence length replaced by it (the mask's code reads only positions and shapes). A mask
whose nodes do not run so, or whose values are anything but the lower triangle (a sliding
window, a padding mask), stays as it is.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autopar.ops.attention import is_attention

aten = torch.ops.aten

DIRECT_MAX = 1 << 24
"""Mask elements evaluated at their own size; above, at :data:`PROBE_SEQ`."""
PROBE_SEQ = 24


def causal_masks_to_flags(cap, seq: int | None = None) -> int:
    """Rewrite every SDPA of ``cap`` whose mask is a constant lower triangle over ``seq``
    positions (None: a square mask's own length) to ``is_causal=True`` (in place); the
    number rewritten."""
    graph = cap.gm.graph
    done, verdict = 0, {}
    for node in list(graph.nodes):
        if not is_attention(node.target) or len(node.args) < 4:
            continue
        mask = node.args[3]
        if not isinstance(mask, torch.fx.Node) or node.kwargs.get("is_causal") \
                or (len(node.args) > 5 and node.args[5]):
            continue
        if mask.name not in verdict:
            verdict[mask.name] = _is_causal(mask, seq if seq is not None else _square(mask))
        if verdict[mask.name]:
            node.args = tuple(node.args[:3])
            node.kwargs = {**node.kwargs, "is_causal": True}
            done += 1
    if done:
        for n in reversed(list(graph.nodes)):      # the masks' nodes no one reads now
            if n.op == "call_function" and not n.users and (
                    n.name in _ancestors_cache or (      # and the checks on them
                        n.target is aten._assert_tensor_metadata.default
                        and all(a.name in _ancestors_cache for a in n.all_input_nodes))):
                graph.erase_node(n)
        graph.lint()
        cap.gm.recompile()
        cap.__post_init__()
    _ancestors_cache.clear()
    return done


_ancestors_cache: set[str] = set()


def _ancestors(node) -> list:
    seen, order, stack = set(), [], [node]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        order.append(n)
        stack.extend(n.all_input_nodes)
    return order


def _square(mask) -> int | None:
    """The length of a square mask (its last two dims alike), else None."""
    val = mask.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-1] == val.shape[-2]:
        return int(val.shape[-1])
    return None


def _is_causal(mask, seq: int | None) -> bool:
    if seq is None:
        return False
    nodes = _ancestors(mask)
    if any(n.op != "call_function" for n in nodes):
        return False                 # an input (a padding mask), a parameter or a buffer
    _ancestors_cache.update(n.name for n in nodes)
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() < 2 \
            or tuple(val.shape[-2:]) != (seq, seq):
        return False
    small = val.numel() <= DIRECT_MAX
    s = seq if small else PROBE_SEQ
    try:
        got = _run(nodes, mask, None if small else (seq, PROBE_SEQ))
    except Exception:  # noqa: BLE001 - a mask that does not run on the CPU stays a mask
        return False
    if not isinstance(got, torch.Tensor) or tuple(got.shape[-2:]) != (s, s):
        return False
    tri = torch.ones(s, s, dtype=torch.bool).tril()
    return bool((got == tri).all())


def _run(nodes, out, swap) -> torch.Tensor:
    """The value of ``out`` from its (constant) ancestors, on the CPU; ``swap``: (from, to)
    for integer arguments."""
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    env = {}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        if swap and isinstance(a, int) and not isinstance(a, bool) and a == swap[0]:
            return swap[1]
        return a

    for n in sorted(nodes, key=order.__getitem__):
        args = pytree.tree_map(arg, n.args, is_leaf=lambda x: isinstance(x, torch.fx.Node))
        kwargs = pytree.tree_map(arg, dict(n.kwargs), is_leaf=lambda x: isinstance(x, torch.fx.Node))
        env[n] = n.target(*args, **kwargs)
    return env[out]


__all__ = ["causal_masks_to_flags"]
