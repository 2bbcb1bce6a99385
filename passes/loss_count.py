"""The global count of a mean cross-entropy, from the whole target: no all-reduce for it.

A mean cross-entropy (or NLL) over targets sharded on the batch divides each rank's sum by
the count of non-ignored targets of the WHOLE batch (``local_ops.sharded_cross_entropy``,
``batch_axes``). Every rank holds the whole global batch (the graph's user inputs are the
global batch; ``batch="per_rank"`` gathers it first), so the count needs no collective:
:func:`global_loss_counts` copies the captured graph's ops that compute the target from the
user inputs (often none: the target is an input; a Hugging Face model shifts its labels)
into the per-rank graph, before the loss, and passes ``count=`` the global count
(``local_ops.global_target_count``). A target that reads anything but user inputs and
constants (a parameter, a buffer) keeps the all-reduce.
"""
from __future__ import annotations

from torch.fx import Graph, Node

from autopar.capture import Captured
from autopar.ops import local_ops


def global_loss_counts(g: Graph, cap: Captured) -> None:
    """Give every mean ``sharded_cross_entropy`` over batch-sharded targets in the per-rank
    graph ``g`` (rewritten from ``cap``) its global count as an input, in place."""
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}
    for node in list(g.nodes):
        if node.target is not local_ops.sharded_cross_entropy or not node.kwargs.get("batch_axes"):
            continue
        _, _, weight, reduction, ignore_index = node.args[:5]
        if reduction != 1 or "source" not in node.meta:
            continue
        target = cap.node(node.meta["source"]).args[1]
        with g.inserting_before(node):
            whole = _copy_from_inputs(target, cap, placeholders, g)
            if whole is None:
                continue
            count = g.call_function(local_ops.global_target_count, (whole, weight, ignore_index))
        node.kwargs = {**node.kwargs, "count": count}


def _copy_from_inputs(target: Node, cap: Captured, placeholders: dict[str, Node],
                      g: Graph) -> Node | None:
    """``target`` of the captured (global) graph computed in ``g`` from its user inputs; None
    when it reads anything else."""
    need: list[Node] = []
    seen: set[Node] = set()
    stack = [target]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name not in cap.inputs or n.name not in placeholders:
                return None
        elif n.op != "call_function":
            return None
        need.append(n)
        stack.extend(n.all_input_nodes)
    env: dict[Node, Node] = {}
    for n in cap.gm.graph.nodes:          # in graph order
        if n not in seen:
            continue
        env[n] = placeholders[n.name] if n.op == "placeholder" else g.node_copy(n, lambda a: env[a])
    return env[target]
