"""``precision="fp8"``'s graph rewrite: the plan's fp8 linears call ``ops.fp8.fp8_linear``.

Every ``aten.linear`` of a rank's program whose captured node the plan runs in fp8
(its options' ``fp8_layers``: ``autopar.analysis.fp8_layers.planned_fp8_linears``) calls :func:`autopar.ops.fp8.fp8_linear` instead, given
the recipe (``fp8_scaling``) and, from the plan, the mesh axes on which this rank holds a
shard of x, of W and of the output (whose gradient is sharded as the output is): the axes
its amaxes are max-reduced over (``ops.fp8``'s module docstring). An operand the plan
leaves Partial (a sum still to be made) has no amax of its own: a ``PlanError`` naming it.

The plan's fp8 experts ops (``planned_fp8_experts``: a mixture of experts' experts modules,
``autopar.ops.fp8_experts``) are called with their ``key`` marked fp8 (``fp8_key``: the
recipe, and the mesh axes on which the plan splits each expert, whose amaxes are reduced
there), whichever form the plan runs (``run_whole``, ``run_experts``).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.analysis.fp8_layers import planned_fp8_experts, planned_fp8_linears
from autopar.capture import Captured
from autopar.ops.experts import EXPERTS_OP, run_experts, run_whole
from autopar.ops.fp8 import fp8_linear
from autopar.ops.fp8_experts import fp8_key
from autopar.placement import Partial, Shard
from autopar.plan import Plan, PlanError

aten = torch.ops.aten


def _shards(placements, ndim: int, mesh: tuple[int, ...], what: str, node: str) -> tuple:
    out = []
    for axis, p in enumerate(placements):
        if mesh[axis] == 1:
            continue
        if isinstance(p, Partial):
            raise PlanError(f"precision='fp8': the plan leaves {what} of linear {node!r} partial on "
                            f"mesh axis {axis}, and an fp8 scale needs the whole value; pin "
                            "precision='bf16', or a plan that sums it first")
        if isinstance(p, Shard):
            out.append((axis, p.dim % ndim))
    return tuple(out)


def fp8_linear_calls(gm: GraphModule, cap: Captured, plan: Plan) -> list[str]:
    """Rewrite ``gm``'s fp8 linears in place (module docstring); returns the nodes changed."""
    chosen = planned_fp8_linears(cap, plan.options)
    scaling = plan.options.fp8_scaling or "tensorwise"
    mesh = tuple(plan.mesh_shape)
    changed = []
    for n in gm.graph.nodes:
        src = n.meta.get("source")
        if n.op != "call_function" or n.target is not aten.linear.default or src not in chosen:
            continue
        node, np_ = cap.node(src), plan.nodes[src]
        x_nd, w_nd = node.args[0].meta["val"].dim(), node.args[1].meta["val"].dim()
        x_sh = _shards(np_.input(0), x_nd, mesh, "its input", src)
        w_sh = _shards(np_.input(1), w_nd, mesh, "its weight", src)
        out = tuple(a for a, p in enumerate(np_.output(0)) if mesh[a] > 1 and isinstance(p, Shard))
        out_sh = tuple((a, np_.output(0)[a].dim % x_nd) for a in out)
        args = tuple(n.args) + (None,) * (3 - len(n.args))
        n.target = fp8_linear
        n.args = args[:3]
        n.kwargs = {"scaling": scaling, "x_shards": x_sh, "w_shards": w_sh, "out_shards": out_sh}
        changed.append(n.name)
    if changed:
        gm.recompile()
    return changed


def fp8_experts_calls(gm: GraphModule, cap: Captured, plan: Plan) -> list[str]:
    """Mark ``gm``'s fp8 experts calls in place (module docstring); returns the nodes changed."""
    chosen = planned_fp8_experts(cap, plan.options)
    scaling = plan.options.fp8_scaling or "tensorwise"
    mesh = tuple(plan.mesh_shape)
    changed = []
    for n in gm.graph.nodes:
        src = n.meta.get("source")
        if n.op != "call_function" or n.target not in (run_whole, run_experts, EXPERTS_OP) or src not in chosen:
            continue
        stacks = plan.nodes[src].input(3)
        tensor_axes = tuple(a for a, p in enumerate(stacks)
                            if mesh[a] > 1 and isinstance(p, Shard) and p.dim != 0)
        args = list(n.args)
        args[4] = fp8_key(args[4], scaling, tensor_axes)
        n.args = tuple(args)
        changed.append(n.name)
    if changed:
        gm.recompile()
    return changed
