"""ZeRO-3 prefetch: each weight's all-gather starts one consumer early.

In the rewritten program a ZeRO-3 weight is gathered (``all_gather(..., regather=True)``)
right before the op that reads it, so the op waits for the collective. This pass splits
every such gather into ``all_gather_start`` (an async collective) and the gather itself,
which now waits for it (``all_gather(..., started=)``: same backward, same re-gather in
backward), and moves the start
of the gathers of consumer ``k`` to where consumer ``k - 1``'s gathers wait: the next op's
weights (the next layer's, at a layer's last op) travel while the current op computes, as
FSDP's forward prefetch does. At most two consumers' gathered weights are alive at once.

Every rank runs the same program, so the collectives start in the same order everywhere.
Programs whose layers are recomputed or split into pipeline stages are left as they are (a
started gather must not cross a recomputed region or a stage boundary).
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from autopar.ops import collectives


def _zero3_gathers(gm: GraphModule) -> list[list[Node]]:
    """The ZeRO-3 weight gathers, grouped by their first consumer, in program order."""
    groups: dict[Node, list[Node]] = {}
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n.target is collectives.all_gather and n.kwargs.get("regather")
                and isinstance(n.args[0], Node) and n.args[0].op == "get_attr" and n.users):
            groups.setdefault(next(iter(n.users)), []).append(n)
    return list(groups.values())


def prefetch_gathers(gm: GraphModule) -> int:
    """Rewrite ``gm``'s ZeRO-3 gathers to start one consumer early; returns how many."""
    groups = _zero3_gathers(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for k, group in enumerate(groups):
        anchor = groups[k - 1][0] if k else group[0]
        for g in group:
            shard = g.args[0]
            if order[shard] > order[anchor]:
                anchor.prepend(shard)            # the get_attr moves up with its gather
                order[shard] = order[anchor] - 0.5
            kw = dict(g.kwargs)
            start_kw = {"axis": kw["axis"], "dim": kw["dim"]}
            start_kw.update({k: kw[k] for k in ("groups", "dtype") if kw.get(k) not in (None, 1)})
            with gm.graph.inserting_before(anchor):
                start = gm.graph.call_function(collectives.all_gather_start, (shard,), start_kw)
            g.kwargs = {**kw, "started": start}
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
