"""The same graph on every rank: each rank's capture put in rank 0's order, with its names.

Every rank captures the model itself, and the plan names the graph's nodes. Python code that
iterates a set of strings runs in an order that depends on the process's hash seed
(``PYTHONHASHSEED``, random per process unless set), and torchrun starts each rank with its
own: transformers builds one attention mask per layer kind from ``set(config.layer_types)``,
so Llama 4, Gemma 3 or Qwen3-Next captured on two ranks can hold the same computation in two
orders, under other node names (``zeros`` on one rank is ``zeros_1`` on the other). A plan
made on rank 0 then names other nodes on those ranks (its fingerprint does not match there).

:func:`same_graph_on_every_rank` gathers the ranks' fingerprints; where they differ, rank 0
sends each node's name, structural key and the names it reads, in its order, and every other
rank moves, renames and rewires its nodes to match. A node's key is a hash of its op, its
target, its value's shape and dtype, its constant arguments and its arguments' keys (a
Merkle hash over the graph): two nodes with one key compute the same value from the same
inputs, so which of them takes which name does not matter (each node is then made to read
the nodes its twin on rank 0 reads). A rank whose graph has a node rank 0's lacks (another
model, other shapes) cannot be matched: every rank raises the same error, none waits for
the others.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict, deque

import torch
import torch.distributed as dist
from torch.fx.node import map_arg

from autopar.capture.graph import _PER_GRAPH, Captured, CaptureError, fingerprint


def structure_keys(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    """Each node's structural key (module docstring), in the graph's order."""
    keys: dict[torch.fx.Node, str] = {}
    for n in graph.nodes:
        val = n.meta.get("val")
        value = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else type(val).__name__
        if n.op == "placeholder":       # named by what they hold: a parameter, an input
            text = f"placeholder|{n.target}"
        else:
            args = map_arg((n.args, n.kwargs), lambda a: keys[a])
            text = f"{n.op}|{n.target}|{value}|{args!r}"
        keys[n] = hashlib.sha1(text.encode()).hexdigest()[:20]
    return keys


def layout(cap: Captured) -> list[tuple[str, str, list[str]]]:
    """(name, structural key, the names its arguments read, in order) of every node, in
    order: what rank 0 sends."""
    keys = structure_keys(cap.gm.graph)
    return [(n.name, k, _inputs(n)) for n, k in keys.items()]


def _inputs(n: torch.fx.Node) -> list[str]:
    names: list[str] = []
    map_arg((n.args, n.kwargs), lambda a: names.append(a.name))
    return names


def align(cap: Captured, reference: list[tuple[str, str, list[str]]]) -> None:
    """Put ``cap``'s graph in ``reference``'s order, under its names, each node reading the
    nodes its twin reads (in place). Nodes with one key are the same value, so a node may
    be given its twin's argument where it read another of them: in any order some user
    would otherwise come before the node it reads. A CaptureError names the first node
    either graph has and the other lacks."""
    graph = cap.gm.graph
    by_key: dict[str, deque] = defaultdict(deque)
    for n, k in structure_keys(graph).items():
        by_key[k].append(n)
    order, twin = [], {}
    for name, key, _ in reference:
        if not by_key.get(key):
            raise CaptureError(f"rank 0's graph has node {name!r} that this rank's capture lacks "
                               f"(another model, other input shapes or another version of its code?)")
        twin[name] = by_key[key].popleft()
        order.append((twin[name], name))
    extra = [n.name for q in by_key.values() for n in q]
    if extra:
        raise CaptureError(f"this rank's capture has node {extra[0]!r} that rank 0's graph lacks "
                           f"({len(extra)} such nodes)")
    for (node, _), (_, _, inputs) in zip(order, reference):
        if inputs:
            read = iter(inputs)
            node.args, node.kwargs = map_arg((node.args, node.kwargs), lambda a: twin[next(read)])
    renamed = {}
    namespace = graph._graph_namespace
    for i, (node, name) in enumerate(order):
        if i:
            order[i - 1][0].append(node)       # moves ``node`` right after the one before
        if node.name != name:
            renamed[node.name] = name
            node.name = name
            namespace._obj_to_name[node] = name
            namespace._used_names.add(name)
    graph.lint()
    cap.gm.recompile()
    _PER_GRAPH.pop(graph, None)           # its fingerprint and op names, worked out again
    cap.loss = renamed.get(cap.loss, cap.loss)
    cap.output = [renamed.get(o, o) for o in cap.output]
    for term in getattr(cap.microbatch_loss, "terms", ()):
        term.node = renamed.get(term.node, term.node)
    cap.__post_init__()


def same_graph_on_every_rank(cap: Captured) -> None:
    """Align every rank's ``cap`` to rank 0's (module docstring); every rank calls it: one
    collective where the fingerprints agree (their gather), three where they do not."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    prints: list = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint(cap))
    if len(set(prints)) == 1:
        return
    box = [layout(cap) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    error = None
    if prints[dist.get_rank()] != prints[0]:
        try:
            align(cap, box[0])
        except Exception as e:  # noqa: BLE001 - every rank raises it, none waits
            error = f"{type(e).__name__}: {e}"[:2000]
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    bad = [r for r, e in enumerate(errors) if e]
    if bad:
        raise CaptureError(f"ranks {bad} captured another graph than rank 0 ({errors[bad[0]]}): "
                           "every rank must run the same model on inputs of the same shapes")


__all__ = ["align", "layout", "same_graph_on_every_rank", "structure_keys"]
