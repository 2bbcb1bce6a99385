"""Recomputation (activation checkpointing): run chosen layers again in backward instead of
keeping their activations.

The pass takes a per-rank training graph (``autopar.passes.insert_collectives``: every op
node carries ``meta["source"]``, the name of the captured node it computes) and the
layers to recompute, and returns a new graph in which each layer's nodes are moved into a
submodule that is called through ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``. Forward keeps only what enters a region (the layer's input, the
parameters it reads); backward runs the region's forward again, collectives included
(a ZeRO-3 layer gathers its weights a second time, as FSDP does), then its backward.

A layer is a repeated module of the captured graph, named ``"<container>.<index>"``
(``"transformer.h.3"``; see :func:`autopar.capture.layer_of`). Its region in the per-rank
graph is the span from the first to the last node computed for one of its captured nodes,
with every node in between (the collectives the rewrite put there). A region must not
update a buffer in place (BatchNorm's running statistics would be updated twice); "full" leaves such layers out.

Regions are chosen before the pass (``autopar.analysis.layers``): :func:`select_layers` turns the ``recompute=`` pin
("full": every repeated layer; or a list of layer names, where a unique suffix such as
``"h.0"`` is enough) into layer names, and :func:`layer_members` gives the captured nodes
of each layer.
"""
from __future__ import annotations

import operator

from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import checkpoint

from autopar.analysis.layers import RecomputeError, mutates


class CheckpointedRegion(nn.Module):
    """Calls ``body`` (a GraphModule of one region) through non-reentrant checkpointing."""

    def __init__(self, body: GraphModule, layer: str):
        super().__init__()
        self.body = body
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.body, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}"


def checkpoint_layers(gm: GraphModule, regions: dict[str, set[str]]) -> GraphModule:
    """A new GraphModule in which each region (layer name -> captured node names, matched
    against ``node.meta["source"]``) runs under ``torch.utils.checkpoint``. ``gm`` is left
    alone; its parameters and buffers are shared, not copied."""
    return wrap_layers(gm, regions, lambda body, layer, k: CheckpointedRegion(body, layer),
                       "recompute")


def wrap_layers(gm: GraphModule, regions: dict[str, set[str]], make, kind: str) -> GraphModule:
    """A new GraphModule in which each region (layer name -> captured node names, matched
    against ``node.meta["source"]``) is moved into a submodule ``make(body, layer, k)`` (k:
    the region's index in graph order) called as ``f"{kind}_{k}"``; ``out.meta[kind]`` names
    the layers wrapped. ``gm`` is left alone; its parameters and buffers are shared."""
    nodes = list(gm.graph.nodes)
    spans: list[tuple[int, int, str]] = []
    for layer, names in regions.items():
        hits = [i for i, n in enumerate(nodes) if n.meta.get("source") in names]
        if not hits:
            continue       # none of the layer's nodes is in this graph
        spans.append((hits[0], hits[-1], layer))
    spans.sort()
    for (a0, a1, la), (b0, b1, lb) in zip(spans, spans[1:]):
        if b0 <= a1:
            raise RecomputeError(f"{kind}: layers {la!r} and {lb!r} interleave in the "
                                 f"per-rank graph; {kind} one of them only")
    start_of = {s: (e, layer) for s, e, layer in spans}

    g = Graph()
    env: dict[Node, Node] = {}
    root: dict[str, object] = {}
    i = 0
    k = 0
    while i < len(nodes):
        node = nodes[i]
        if i in start_of:
            end, layer = start_of[i]
            body_nodes = [n for n in nodes[i:end + 1] if n.op not in ("placeholder", "get_attr", "output")]
            outside = [n for n in nodes[i:end + 1] if n.op in ("placeholder", "get_attr")]
            for n in outside:       # hoisted: they depend on nothing
                env[n] = g.node_copy(n, lambda a: env[a])
                if n.op == "get_attr":
                    root[n.target] = _fetch(gm, n.target)
            body, ins, outs = _extract(body_nodes, layer, kind)
            name = f"{kind}_{k}"
            root[name] = make(body, layer, k)
            k += 1
            call = g.call_module(name, tuple(env[a] for a in ins))
            call.meta[kind] = layer
            for j, o in enumerate(outs):
                env[o] = g.call_function(operator.getitem, (call, j))
                env[o].meta = dict(o.meta)
            i = end + 1
            continue
        env[node] = g.node_copy(node, lambda a: env[a])
        if node.op == "get_attr":
            root[node.target] = _fetch(gm, node.target)
        elif node.op == "call_module":
            root[node.target] = gm.get_submodule(node.target)
        i += 1
    out = GraphModule(root, g)
    out.meta.update(gm.meta)
    out.meta[kind] = tuple(layer for _, _, layer in spans)
    return out


def _extract(body_nodes: list[Node], layer: str,
             kind: str = "recompute") -> tuple[GraphModule, list[Node], list[Node]]:
    """(region GraphModule, outer nodes it reads, its nodes read after it)."""
    inside = set(body_nodes)
    for n in body_nodes:
        if mutates(n) and kind == "recompute":
            raise RecomputeError(
                f"recompute: layer {layer!r} cannot be recomputed: node {n.name} "
                f"({n.target}) updates a tensor in place (BatchNorm's running statistics "
                "would be updated twice); leave this layer out of recompute=")
        if n.op not in ("call_function", "call_method"):
            raise RecomputeError(f"{kind}: layer {layer!r} holds a {n.op} node ({n.name}); "
                                 "only op nodes can be wrapped")
    ins: list[Node] = []
    for n in body_nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in ins:
                ins.append(a)
    outs = [n for n in body_nodes if any(u not in inside for u in n.users)]
    sub = Graph()
    env: dict[Node, Node] = {}
    for a in ins:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in body_nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[o] for o in outs))
    return GraphModule(nn.Module(), sub, class_name="Recomputed"), ins, outs


def _fetch(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["checkpoint_layers", "wrap_layers", "CheckpointedRegion"]
