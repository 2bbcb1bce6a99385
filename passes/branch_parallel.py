"""Branch parallelism: a per-rank program (``insert_collectives``'s) keeps only this rank's
branches of each branch set of the plan (``Plan.branches``, mesh axis ``"branch"``).

For each set, on the ranks at coordinate ``c`` of the branch axis:

- the join (``cat`` / ``add``) reads its own group's branch results and zeros of the local
  shape in place of the others'; its result, partial over the branch axis, is summed there
  (``collectives.all_reduce``: forward all-reduce, backward identity: every rank holds the
  whole gradient of the join's result and each branch takes its part of it);
- the fork's value enters this rank's branches through ``collectives.grad_all_reduce``
  (forward identity, backward all-reduce), so its gradient, and every gradient above it,
  is the sum over all branches, the same on every rank. One per set and rank, so every
  rank of the axis runs the same collectives in the same order;
- the other groups' branches are dead code and go, with their parameters: the program
  no longer holds them (``drop_unused_attrs``), so the runtime stores and steps only its
  own group's.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from autopar.capture import Captured
from autopar.ops import collectives
from autopar.placement import local_shape
from autopar.plan import BranchGroups, Plan, PlanError

aten = torch.ops.aten
_MOVES = frozenset({collectives.all_gather, collectives.all_reduce, collectives.grad_all_reduce,
                    collectives.scatter, collectives.reduce_scatter, collectives.all_to_all,
                    collectives.to_partial, collectives.shard_to_partial})
"""The redistribution steps ``insert_collectives`` puts between a producer and a consumer."""

BRANCH_AXIS = "branch"


def keep_branches(gm: GraphModule, cap: Captured, plan: Plan, coord: tuple[int, ...],
                  attr_of: dict[str, str]) -> GraphModule:
    """Rewrite ``gm`` (in place, and returned) to run only the branches of the group at
    ``coord``'s place on the branch axis; drop the other groups' parameters from it."""
    axis = plan.mesh_axes.index(BRANCH_AXIS)
    mine = coord[axis]
    for bset in plan.branches:
        _keep(gm, cap, plan, bset, axis, mine)
    gm.graph.eliminate_dead_code()
    others = {n for bset in plan.branches for g, nodes in enumerate(bset.groups) if g != mine
              for n in nodes}
    left = [n.name for n in gm.graph.nodes if n.meta.get("source") in others]
    if left:
        raise PlanError(f"branch parallelism: nodes {left[:4]} of another group's branch are still "
                        "needed on this rank (a branch with side effects?); plan without branch=")
    drop_unused_attrs(gm, {attr_of[n] for n in others if n in attr_of})
    gm.recompile()
    return gm


def _origin(node: Node) -> Node:
    """The producer ``node`` moves (through redistribution steps), or ``node`` itself."""
    while node.op == "call_function" and node.target in _MOVES:
        node = node.args[0]
    return node


def _source(node: Node) -> str | None:
    if node.op == "call_function":
        return node.meta.get("source")
    return node.name if node.op == "placeholder" else None


def _tensor_args(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                          is_leaf=lambda x: isinstance(x, Node))
            if isinstance(a, Node)]


def _keep(gm: GraphModule, cap: Captured, plan: Plan, bset: BranchGroups, axis: int,
          mine: int) -> None:
    owner = bset.owner()
    g = gm.graph
    joins = [n for n in g.nodes if n.op == "call_function" and n.meta.get("source") == bset.join]
    if not joins:
        return          # this program does not compute the join (e.g. another output)
    join = joins[0]
    # the fork into this rank's branches: one gradient all-reduce over the branch axis
    fork = next((n for n in g.nodes if _source(n) == bset.fork), None)
    if fork is not None and cap.node(bset.fork).op != "placeholder":
        own_reads = [(n, a) for n in g.nodes if owner.get(n.meta.get("source")) == mine
                     for a in _tensor_args(n) if _origin(a) is fork]
        if own_reads:
            with g.inserting_after(fork):
                summed = g.call_function(collectives.grad_all_reduce, (fork,), {"axis": axis})
            for n, a in own_reads:
                if a is fork:
                    n.replace_input_with(fork, summed)
                    continue
                first = a          # the redistribution step that reads the fork
                while first.args[0] is not fork:
                    first = first.args[0]
                first.replace_input_with(fork, summed)
    # the join: zeros in place of the other groups' results, then summed over the axis
    ins = _tensor_args(join)
    gjoin = cap.node(bset.join)
    gins = [a for a in _tensor_args(gjoin) if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(ins) != len(gins):
        raise PlanError(f"branch parallelism: the join {bset.join!r} reads {len(gins)} tensors in "
                        f"the graph but {len(ins)} in the per-rank program")
    owned = [a for a in ins if owner.get(_source(_origin(a))) == mine]
    if not owned:
        raise PlanError(f"plan field branches: the group at coordinate {mine} of the branch axis "
                        f"runs no branch feeding the join {bset.join!r}")
    mesh = tuple(plan.mesh_shape)
    for k, (a, ga) in enumerate(zip(ins, gins)):
        src = _source(_origin(a))
        if src in owner and owner[src] != mine:
            shape = local_shape(tuple(ga.meta["val"].shape), plan.nodes[bset.join].input(k), mesh)
            with g.inserting_before(join):
                zeros = g.call_function(aten.new_zeros.default, (owned[0], list(shape)))
            join.replace_input_with(a, zeros)
    with g.inserting_after(join):
        summed = g.call_function(collectives.all_reduce, (join,), {"axis": axis})
    join.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)


def drop_unused_attrs(gm: GraphModule, attrs: set[str]) -> None:
    """Remove the tensors at ``attrs`` (dotted paths) from ``gm`` when no node reads them."""
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for path in attrs - read:
        *mods, leaf = path.split(".")
        m = gm
        for name in mods:
            m = getattr(m, name, None)
            if m is None:
                break
        if m is not None and hasattr(m, leaf):
            delattr(m, leaf)


def branch_owned(plan: Plan, attr_of: dict[str, str]) -> dict[str, int]:
    """Attribute path of each branch parameter -> the branch-axis coordinate storing it."""
    return {attr_of[n]: g for bset in plan.branches for n, g in bset.owner().items()
            if n in attr_of}


__all__ = ["BRANCH_AXIS", "branch_owned", "drop_unused_attrs", "keep_branches"]
