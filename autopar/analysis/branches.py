"""Independent branches of a captured graph (branch parallelism's analysis).

A *branch set* is a fork node F, a join node J (``aten.cat`` or ``aten.add``) and, for each
tensor input of J, the branch computing it: the op nodes that input depends on and no
other input of J does. The set is independent when

- every branch reads, from outside itself, only F and parameters (no other value, no
  buffer, no user input besides F);
- nothing a branch computes is used outside it, except its result by J;
- each parameter a branch reads is read by no node outside that branch (parameters are
  disjoint between branches and from the rest of the graph);
- no branch mutates anything (no buffer update such as BatchNorm's running statistics);
- every branch reads F and holds at least one parameter (a branch of pure reshapes, such as
  attention's q / k / v views of one projection, is not worth a device group).

A residual ``x + f(x)`` is never a branch set: ``x`` is an ancestor of ``f(x)``. Branch sets
nested inside a branch of another are dropped (the outermost is kept). The graph is read as
a networkx DiGraph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import networkx as nx
import torch
from torch.fx import Node

from autopar.capture import Captured

aten = torch.ops.aten
JOINS = (aten.cat.default, aten.add.Tensor)
"""The ops that join branches: concatenation (Inception) and sum."""


@dataclass(frozen=True)
class BranchSet:
    """One fork, one join, and the branches between them. ``branches[k]``: the op nodes
    of the branch feeding the join's ``k``-th tensor input, in graph order; ``params[k]``:
    the parameter placeholders it alone reads."""
    fork: str
    join: str
    branches: tuple[tuple[str, ...], ...]
    params: tuple[tuple[str, ...], ...]

    def owned(self, k: int) -> tuple[str, ...]:
        """Every graph node branch ``k`` runs or stores: its op nodes and parameters."""
        return self.params[k] + self.branches[k]


def graph_of(cap: Captured) -> nx.DiGraph:
    """The captured graph as a DiGraph of node names (edges producer -> consumer)."""
    g = nx.DiGraph()
    for node in cap.gm.graph.nodes:
        if node.op == "output":
            continue
        g.add_node(node.name)
        for src in node.all_input_nodes:
            g.add_edge(src.name, node.name)
    return g


def _join_inputs(node: Node) -> list[Node] | None:
    if node.op != "call_function" or node.target not in JOINS:
        return None
    if node.target is aten.cat.default:
        ins = list(node.args[0])
    else:
        ins = [a for a in node.args[:2] if isinstance(a, Node)]
    ins = [a for a in ins if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return ins if len(ins) >= 2 and len({a.name for a in ins}) == len(ins) else None


def find_branches(cap: Captured) -> list[BranchSet]:
    """The independent branch sets of ``cap``'s graph, outermost only, in graph order of
    their joins."""
    g = None
    params = set(cap.params)
    found = []
    for node in cap.gm.graph.nodes:
        ins = _join_inputs(node)
        if ins is not None and _passes_locally(node, ins, params):
            g = graph_of(cap) if g is None else g
            got = _branch_set(cap, g, node, ins, params)
            if got is not None:
                found.append(got)
    inner = {n for s in found for b in s.branches for n in b}
    return [s for s in found if s.join not in inner]


def _passes_locally(join: Node, ins: list[Node], params: set[str]) -> bool:
    """What :func:`_branch_set` requires, checked from the join backwards without the
    graph's ancestor sets (each costs a walk of the graph up to its inputs, for every add of
    a residual stream): each input used by the join alone, and the ops that input depends
    on through values used only inside its branch reading, from outside, one fork shared by
    all branches and at least one parameter used only inside. A branch set passes (its
    branches are exactly those ops), so what fails here is no branch set; what passes is
    checked by ``_branch_set``."""
    forks = set()
    for a in ins:
        if a.op != "call_function" or any(u is not join for u in a.users):
            return False
        mine, todo = {a}, list(a.all_input_nodes)
        while todo:
            p = todo.pop()
            if p not in mine and p.op == "call_function" and all(u in mine for u in p.users):
                mine.add(p)
                todo.extend(p.all_input_nodes)
        reads = {s for n in mine for s in n.all_input_nodes if s not in mine}
        own = {r for r in reads if r.name in params and all(u in mine for u in r.users)}
        if not own or len(reads - own) != 1:
            return False
        forks |= reads - own
    return len(forks) == 1


def _branch_set(cap: Captured, g: nx.DiGraph, join: Node, ins: list[Node],
                params: set[str]) -> BranchSet | None:
    reach = [nx.ancestors(g, a.name) | {a.name} for a in ins]
    ops = {n.name for n in cap.gm.graph.nodes if n.op == "call_function"}
    branches = []
    for k in range(len(ins)):
        others = set().union(*(reach[j] for j in range(len(ins)) if j != k))
        mine = {n for n in reach[k] - others if n in ops}
        if ins[k].name not in mine:
            return None         # this input is computed from another's branch (a residual)
        branches.append(mine)
    forks, owned = set(), []
    for k, mine in enumerate(branches):
        reads = set()
        for name in mine:
            node = cap.node(name)
            if _mutates(node):
                return None
            for user in node.users:
                if user.name not in mine and not (user is join and name == ins[k].name):
                    return None         # a value of the branch escapes it
            for src in node.all_input_nodes:
                if src.name not in mine:
                    reads.add(src.name)
        mine_params = {r for r in reads if r in params}
        for p in mine_params:
            if any(u.name not in mine for u in cap.node(p).users):
                return None             # a parameter shared with the rest of the graph
        outside = reads - mine_params
        if len(outside) != 1 or not mine_params:
            return None
        forks |= outside
        owned.append(mine_params)
    if len(forks) != 1:
        return None
    order = {n.name: i for i, n in enumerate(cap.gm.graph.nodes)}
    return BranchSet(fork=forks.pop(), join=join.name,
                     branches=tuple(tuple(sorted(b, key=order.get)) for b in branches),
                     params=tuple(tuple(sorted(p, key=order.get)) for p in owned))


def _mutates(node: Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)
