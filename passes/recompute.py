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

Regions are chosen before the pass: :func:`select_layers` turns the ``recompute=`` pin
("full": every repeated layer; or a list of layer names, where a unique suffix such as
``"h.0"`` is enough) into layer names, and :func:`layer_members` gives the captured nodes
of each layer.
"""
from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import checkpoint

from autopar.capture import layer_of


class RecomputeError(ValueError):
    """A recompute= request names no layer, or a layer that cannot be recomputed."""


def repeated_layers(gm: GraphModule) -> dict[str, list[str]]:
    """Layer name -> captured node names, for every container with at least two layers."""
    by_container: dict[str, dict[int, list[str]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            lay = layer_of(node)
            if lay is not None:
                by_container.setdefault(lay[0], {}).setdefault(lay[1], []).append(node.name)
    return {f"{c}.{i}": names for c, layers in by_container.items() if len(layers) >= 2
            for i, names in sorted(layers.items())}


def select_layers(gm: GraphModule, spec: "str | Sequence[str] | None") -> tuple[str, ...]:
    """The layers a ``recompute=`` pin names, in graph order: ``"full"`` (or True) for every
    repeated layer, ``None`` / ``"none"`` / ``()`` for none, or layer names (a unique
    suffix on a dot boundary, ``"h.0"`` for ``"transformer.h.0"``, is enough)."""
    if spec is None or spec is False or spec == "none" or (not isinstance(spec, str) and not spec
                                                            and spec is not True):
        return ()
    layers = repeated_layers(gm)
    if spec is True or spec == "full":
        nodes = {n.name: n for n in gm.graph.nodes}
        # "full" leaves out layers that update a tensor in place (BatchNorm in training)
        ok = tuple(lay for lay, names in layers.items()
                   if not any(_mutates(nodes[m]) for m in names))
        if not ok:
            raise RecomputeError("recompute='full' but the model has no repeated layers (an "
                                 "nn.ModuleList / nn.Sequential of two or more blocks) that "
                                 "can be recomputed")
        return ok
    if isinstance(spec, str):
        raise RecomputeError(f"recompute={spec!r}: use 'full', None, or a list of layer "
                             f"names such as {list(layers)[:2]}")
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes_of = lambda lay: [by_name[m] for m in layers[lay]]  # noqa: E731
    chosen = []
    for name in spec:
        hits = [lay for lay in layers if lay == name or lay.endswith("." + name)]
        if len(hits) != 1:
            why = "matches no repeated layer" if not hits else f"is ambiguous ({hits})"
            raise RecomputeError(f"recompute: {name!r} {why}; layers are {list(layers)}")
        bad = [n for n in nodes_of(hits[0]) if _mutates(n)]
        if bad:
            raise RecomputeError(
                f"recompute: layer {hits[0]!r} cannot be recomputed: node {bad[0].name} "
                f"({bad[0].target}) updates a tensor in place (BatchNorm's running statistics "
                "would be updated twice); leave this layer out of recompute=")
        if hits[0] not in chosen:
            chosen.append(hits[0])
    order = list(layers)
    return tuple(sorted(chosen, key=order.index))


def layer_members(gm: GraphModule, layers: Iterable[str]) -> dict[str, set[str]]:
    """Layer name -> the set of its captured node names."""
    all_layers = repeated_layers(gm)
    out = {}
    for lay in layers:
        if lay not in all_layers:
            raise RecomputeError(f"recompute: no layer {lay!r} in this graph; layers are "
                                 f"{list(all_layers)}")
        out[lay] = set(all_layers[lay])
    return out


def recompute_nodes(gm: GraphModule, layers: Iterable[str]) -> tuple[frozenset, frozenset]:
    """(captured nodes of ``layers``, those of them read outside their layer): what the cost
    model runs twice, and what recomputation still keeps."""
    members = layer_members(gm, layers)
    nodes = {n.name: n for n in gm.graph.nodes}
    every, kept = set(), set()
    for names in members.values():
        every |= names
        kept |= {m for m in names if any(u.name not in names for u in nodes[m].users)}
    return frozenset(every), frozenset(kept)


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
            raise RecomputeError(f"recompute: layers {la!r} and {lb!r} interleave in the "
                                 "per-rank graph; recompute one of them only")
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
            body, ins, outs = _extract(body_nodes, layer)
            name = f"recompute_{k}"
            k += 1
            root[name] = CheckpointedRegion(body, layer)
            call = g.call_module(name, tuple(env[a] for a in ins))
            call.meta["recompute"] = layer
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
    out.meta["recompute"] = tuple(layer for _, _, layer in spans)
    return out


def _extract(body_nodes: list[Node], layer: str) -> tuple[GraphModule, list[Node], list[Node]]:
    """(region GraphModule, outer nodes it reads, its nodes read after it)."""
    inside = set(body_nodes)
    for n in body_nodes:
        if _mutates(n):
            raise RecomputeError(
                f"recompute: layer {layer!r} cannot be recomputed: node {n.name} "
                f"({n.target}) updates a tensor in place (BatchNorm's running statistics "
                "would be updated twice); leave this layer out of recompute=")
        if n.op not in ("call_function", "call_method"):
            raise RecomputeError(f"recompute: layer {layer!r} holds a {n.op} node ({n.name}); "
                                 "only op nodes can be recomputed")
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


def _mutates(node: Node) -> bool:
    """The op writes into an input: a mutable schema (``add_``), or ``batch_norm`` in
    training, whose schema does not say it updates its running statistics."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    if node.target is torch.ops.aten.batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        return bool(training)
    return False


def _fetch(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["RecomputeError", "repeated_layers", "select_layers", "layer_members", "recompute_nodes",
           "checkpoint_layers", "CheckpointedRegion"]
