"""The repeated layers of a captured graph, and which of them to recompute.

A layer is a repeated module of the captured graph, named ``"<container>.<index>"``
(``"transformer.h.3"``), or one call of a module called several times, named
``"<module>.<call>"`` (ALBERT's shared layer: ``"albert.encoder.albert_layer_groups.0.1"``
for its second call); see :func:`autopar.capture.layer_of`. :func:`select_layers` turns
the ``recompute=`` pin ("full": every repeated layer; or a list of layer names, where a
unique suffix such as ``"h.0"`` is enough) into layer names, :func:`layer_members` gives
the captured nodes of each layer and :func:`recompute_nodes` what the cost model counts
twice. The rewrite itself is ``autopar.passes.recompute``.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch
from torch.fx import GraphModule, Node

from autopar.capture import layer_of
from autopar.errors import AutoparInputError


class RecomputeError(AutoparInputError):
    """A recompute= request names no layer, or a layer that cannot be recomputed."""


_LAYERS: "weakref.WeakKeyDictionary[GraphModule, tuple]" = weakref.WeakKeyDictionary()


def repeated_layers(gm: GraphModule) -> dict[str, list[str]]:
    """Layer name -> captured node names, for every container with at least two layers.
    Kept per graph while its node names stay the same (the planner asks ~100 times per
    plan of a deep model; each reading of every node's module stack is ~0.3 s at 126
    layers)."""
    names = tuple(n.name for n in gm.graph.nodes)
    hit = _LAYERS.get(gm)
    if hit is None or hit[0] != names:
        by_container: dict[str, dict[int, list[str]]] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                lay = layer_of(node)
                if lay is not None:
                    by_container.setdefault(lay[0], {}).setdefault(lay[1], []).append(node.name)
        hit = _LAYERS[gm] = (names, {f"{c}.{i}": members for c, layers in by_container.items()
                                     if len(layers) >= 2 for i, members in sorted(layers.items())})
    return {layer: list(members) for layer, members in hit[1].items()}


def most_blocks(gm: GraphModule) -> int:
    """The layer count of the container with the most repeated layers (a transformer's
    blocks: 126 in Llama 3 405B), 0 for a graph without repeated layers. Nested containers
    (a block's experts) count apart; the outer one holds the graph's depth."""
    counts: dict[str, int] = {}
    for layer in repeated_layers(gm):
        container = layer.rsplit(".", 1)[0]
        counts[container] = counts.get(container, 0) + 1
    return max(counts.values(), default=0)


def select_layers(gm: GraphModule, spec: "str | Sequence[str] | None",
                  pin: str = "recompute") -> tuple[str, ...]:
    """The layers a ``recompute=`` pin names, in graph order: ``"full"`` (or True) for every
    repeated layer, ``None`` / ``"none"`` / ``()`` for none, or layer names (a unique
    suffix on a dot boundary, ``"h.0"`` for ``"transformer.h.0"``, is enough). ``pin``: the
    pin ``spec`` is (``"offload_activations"`` takes the same layers), named in a refusal."""
    if spec is None or spec is False or spec == "none" or (not isinstance(spec, str) and not spec
                                                            and spec is not True):
        return ()
    layers = repeated_layers(gm)
    if spec is True or spec == "full":
        nodes = {n.name: n for n in gm.graph.nodes}
        # "full" leaves out layers that update a tensor in place (BatchNorm in training)
        ok = tuple(lay for lay, names in layers.items()
                   if not any(mutates(nodes[m]) for m in names))
        if not ok and layers:
            raise RecomputeError(
                f"{pin}='full' but every repeated layer ({', '.join(list(layers)[:3])}"
                f"{', ...' if len(layers) > 3 else ''}) updates a tensor in place in training "
                "(BatchNorm's running statistics, which a recomputation would update twice"
                + ("; offload takes the layers recompute='full' takes" if pin != "recompute" else "")
                + f"): leave {pin}= unset, or put the model in eval mode")
        if not ok:
            raise RecomputeError(f"{pin}='full' but the model has no repeated layers (an "
                                 "nn.ModuleList / nn.Sequential of two or more blocks, or a "
                                 "module called more than once) that can be recomputed")
        return ok
    if isinstance(spec, str):
        raise RecomputeError(f"{pin}={spec!r}: use 'full', None, or a list of layer "
                             f"names such as {list(layers)[:2]}")
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes_of = lambda lay: [by_name[m] for m in layers[lay]]  # noqa: E731
    chosen = []
    for name in spec:
        hits = [lay for lay in layers if lay == name or lay.endswith("." + name)]
        if len(hits) != 1:
            why = "matches no repeated layer" if not hits else f"is ambiguous ({hits})"
            raise RecomputeError(f"{pin}: {name!r} {why}; layers are {list(layers)}")
        bad = [n for n in nodes_of(hits[0]) if mutates(n)]
        if bad:
            raise RecomputeError(
                f"{pin}: layer {hits[0]!r} cannot be recomputed: node {bad[0].name} "
                f"({bad[0].target}) updates a tensor in place (BatchNorm's running statistics "
                f"would be updated twice); leave this layer out of {pin}=")
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


def offload_nodes(gm: GraphModule, layers: Iterable[str], params: Iterable[str] = ()) -> tuple[frozenset, frozenset]:
    """(captured nodes of ``layers`` and the parameters of ``params`` only they read, those
    nodes read outside every one of ``layers``): what activation offload puts on the host,
    and what stays. A layer's output that only the other offloaded layers read is saved
    inside their regions, so their hooks put it on the host too (the next layer's norm saves
    its input); one read by anything else (the final norm, a recomputed or kept layer)
    stays. A parameter's 16-bit copy under mixed precision is a tensor the layers save (the
    hooks leave parameters alone, not their copies): it goes with them."""
    every = frozenset().union(*layer_members(gm, layers).values())
    users = {n.name: n.users for n in gm.graph.nodes}
    kept = frozenset(m for m in every if any(u.name not in every for u in users[m]))
    params = set(params)
    only = frozenset(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in params
                     and n.users and all(u.name in every for u in n.users))
    return every | only, kept


def mutates(node: Node) -> bool:
    """The op writes into an input: a mutable schema (``add_``), or ``batch_norm`` in
    training, whose schema does not say it updates its running statistics."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    if node.target is torch.ops.aten.batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        return bool(training)
    return False
