"""Zero bubble's weight half without a node run twice by two groups (issue 43).

torch splits a pipeline stage's backward into the inputs' half (I,
``stage_backward_input``) and the weights' half (W, ``stage_backward_weight``). At I it
groups the weights by the values of the inputs' closure they meet (their *meeting points*,
``param_groups``' ``intermediates``) and saves the gradient each meeting point got; at W it
runs one ``autograd.grad`` per group, from the group's meeting points to its weights, each
freeing the graph it ran. Two groups whose passes share a node fail the second ("Trying to
backward through the graph a second time"), and torch's grouping lets that happen:

- a weight's own value read at two depths of the inputs' chain with another weight's
  meeting point between (``c = x * s; f = c * q; y = f * s`` with ``s`` from weight ``p``):
  ``p``'s pass runs ``y``'s node, then ``f``'s (on its way to ``c``), which is ``q``'s
  meeting point. T5's relative position bias is such a value: computed once from its
  weight and added to the attention scores of every decoder layer (the seed-2026 sweep's
  t5:pp-dualpipev:200289:gloo);
- a weight meeting two existing groups is merged into one of them, and the other is left
  listed with it (``get_param_groups`` rekeys only the meeting points it walks).

:func:`merge_overlapping` merges every two groups whose passes share a node (to a fixed
point: a merged group's pass can reach further), so each node runs in one pass. Within a
group torch clamps every meeting point's gradient to the one saved at I, so a merged group
is as exact as torch's own. Groups that share nothing stay apart (a W pass per group runs
only the nodes between its meeting points and its weights, as torch intends).
"""
from __future__ import annotations

from typing import Any

from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc


def _on_paths(roots, targets) -> set:
    """The autograd nodes on a path from one of ``roots`` down ``next_functions`` to one of
    ``targets`` (what ``autograd.grad`` from ``roots`` to ``targets`` runs)."""
    hits: dict = {}
    stack = [(r, False) for r in roots]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            hits[node] = node in targets or any(
                hits.get(c, False) for c, _ in node.next_functions if c is not None)
        elif node not in hits:
            hits[node] = False
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions
                         if c is not None and c not in hits)
    return {n for n, hit in hits.items() if hit}


def _merge(groups: list[dict[str, Any]]) -> dict[str, Any]:
    params, nodes, grads, seen = set(), [], [], set()
    for g in groups:
        params |= set(g["params"])
        for node, grad in zip(g["intermediates"], g["grads"]):
            if node not in seen:
                seen.add(node)
                nodes.append(node)
                grads.append(grad)
    return {"params": params, "intermediates": nodes, "grads": grads}


def merge_overlapping(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's weight groups of one split backward (after I: each with ``params``,
    ``intermediates`` and their saved ``grads``) with every two whose W passes would share
    an autograd node merged into one. ``groups`` itself when nothing overlaps."""
    if len(groups) < 2 or any("grads" not in g or "intermediates" not in g for g in groups):
        return groups
    current = groups
    while True:
        paths = [_on_paths(g["intermediates"], set(g["params"])) for g in current]
        owner: dict = {}
        parent = list(range(len(current)))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i
        for i, nodes in enumerate(paths):
            for n in nodes:
                j = owner.setdefault(n, i)
                if find(j) != find(i):
                    parent[find(i)] = find(j)
        blocks: dict[int, list] = {}
        for i, g in enumerate(current):
            blocks.setdefault(find(i), []).append(g)
        if len(blocks) == len(current):
            return current
        current = [b[0] if len(b) == 1 else _merge(b) for b in blocks.values()]


class GroupMerger:
    """:func:`merge_overlapping` for one stage, its answer kept by the groups' weights (their
    places in ``weights``): every micro-batch runs the same program, so torch's groups and
    their overlaps repeat, and the walk of the graph (about 23 ms of CPU a micro-batch for
    an 8-layer pre-norm encoder's 56 groups, scratch measurement on this 2-core machine)
    runs once per grouping torch hands over."""

    def __init__(self):
        self._known: dict[frozenset, list[frozenset]] = {}

    def __call__(self, groups: list[dict[str, Any]], weights) -> list[dict[str, Any]]:
        if len(groups) < 2 or any("grads" not in g or "intermediates" not in g for g in groups):
            return groups
        place = {_get_grad_fn_or_grad_acc(w): i for i, w in enumerate(weights)}
        keys = [frozenset(place.get(p, -1) for p in g["params"]) for g in groups]
        blocks = self._known.get(frozenset(keys))
        if blocks is None:
            merged = merge_overlapping(groups)
            self._known[frozenset(keys)] = [frozenset(place.get(p, -1) for p in m["params"])
                                            for m in merged]
            return merged
        together: dict[int, list] = {}
        for g, k in zip(groups, keys):
            together.setdefault(next(i for i, b in enumerate(blocks) if k <= b), []).append(g)
        if len(together) == len(groups):
            return groups
        return [b[0] if len(b) == 1 else _merge(b) for b in together.values()]
