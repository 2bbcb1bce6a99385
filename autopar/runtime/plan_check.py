"""Does a plan fit the graph it is about to run? Checked before any rewrite, so that a plan
file edited by hand (DESIGN: plans are saved, inspected, edited, loaded) fails with a
PlanError naming the node and the fix, never with a KeyError or IndexError deep inside.

The fingerprint check (``autopar.api``) has already said the graph is the one the plan was
made for; this checks what the fingerprint does not cover: that every node the runtime
places has placements and that each shard's dim exists on its tensor (the options were
checked when the plan was made or loaded)."""
from __future__ import annotations

import math
import operator

import torch

from autopar.capture import Captured
from autopar.placement import Shard
from autopar.plan import Plan, PlanError

FIX = "make the plan again (autopar.plan or `autopar plan`) or undo the edit"


def check_plan_fits(plan: Plan, cap: Captured) -> None:
    """A PlanError for a mesh whose axes, names and world size disagree (its options were
    checked when it was made: ``Plan.options``), or the first node of ``cap`` that ``plan`` does not place or places on
    a dim its tensor does not have."""
    if len(plan.mesh_axes) != len(plan.mesh_shape):
        raise PlanError(f"plan field mesh_axes: {list(plan.mesh_axes)} names {len(plan.mesh_axes)} "
                        f"axes of the mesh {list(plan.mesh_shape)}; {FIX}")
    if math.prod(plan.mesh_shape) != plan.world_size:
        raise PlanError(f"plan field world_size: {plan.world_size}, but the mesh "
                        f"{list(plan.mesh_shape)} has {math.prod(plan.mesh_shape)} devices; {FIX}")
    for n in cap.gm.graph.nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or n.op not in ("placeholder", "call_function") \
                or n.target is operator.getitem:
            continue
        node = plan.nodes.get(n.name)
        if node is None:
            raise PlanError(f"plan field nodes: no placements for graph node {n.name!r} "
                            f"({n.target}); {FIX}")
        if not node.outputs:
            raise PlanError(f"plan field nodes.{n.name}.outputs: empty, but {n.name} returns a "
                            f"tensor of shape {list(val.shape)}; {FIX}")
        for p in node.output(0):
            if isinstance(p, Shard) and not -val.ndim <= p.dim < max(val.ndim, 1):
                raise PlanError(f"plan field nodes.{n.name}.outputs[0]: {node.outputs[0]!r} "
                                f"shards dim {p.dim}, but {n.name} is a tensor of "
                                f"{val.ndim} dims {list(val.shape)}; {FIX}")
