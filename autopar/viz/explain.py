"""Why a node got its placement: every option the solver had for it, priced the way the
solver prices it, against its neighbours' placements in the plan (held fixed).

For node ``v`` and option ``i`` (``autopar.solver.ilp`` module docstring):

    compute[i]  = n_v · (forward + backward time of v under i)
    reshard[i]  = Σ_(u->v) n_uv · t_comm[plan's out(u) -> in_i(v)]
                + Σ_(v->w) n_vw · t_comm[out_i(v) -> plan's in(w)]   (+ the loss ending replicated)
    memory[i]   = n_v · bytes kept on a device under i

The chosen option minimises the whole program, not this sum alone, so a cheaper row here
can lose for reasons elsewhere (the memory budget, a neighbour that would have to change);
the table says when.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from autopar.capture import Captured
from autopar.placement import Replicate, parse_placements, placements_str
from autopar.plan import Plan
from autopar.sharding.registry import input_placements, output_placements
from autopar.solver.costing import INF, CostModel, grad_partial_flags
from autopar.viz.graph import grad_partial


@dataclass
class OptionCost:
    index: int
    placement: str                 # "in,in->out" like NodePlacement's str
    compute_s: float
    reshard_s: float
    memory_bytes: float
    edges: list[tuple[str, str, float]] = field(default_factory=list)   # (neighbour, "in"/"out", s)
    chosen: bool = False

    @property
    def total_s(self) -> float:
        return self.compute_s + self.reshard_s


@dataclass
class Explanation:
    node: str
    op: str
    representative: str
    members: list[str]
    follows: str | None            # producer whose choice this node follows, if merged
    options: list[OptionCost]      # sorted by total, cheapest first
    chosen_placement: str

    @property
    def chosen(self) -> OptionCost | None:
        return next((o for o in self.options if o.chosen), None)


class UnknownNode(ValueError):
    pass


def roles(plan: Plan) -> dict:
    axes = list(plan.mesh_axes)
    out = {}
    if "data" in axes:
        out["data_axis"] = axes.index("data")
    if "tensor" in axes:
        out["tensor_axis"] = axes.index("tensor")
    return out


def explain(cap: Captured, plan: Plan, node: str, optimizer: str = "adamw") -> Explanation:
    from autopar.api import OPTIMIZER_STATES
    from autopar.cost_models.hardware import parse_cluster
    from autopar.solver.ilp import _followers
    from autopar.solver.problem import build_problem
    problem = build_problem(cap, plan.mesh_shape, zero=plan.pins.get("zero") or 0,
                            optimizer_states=OPTIMIZER_STATES.get(optimizer, 2), **roles(plan))
    rep = problem.rep.get(node, node)
    if rep not in problem.vars or node not in plan.nodes:
        known = [n for n in plan.nodes]
        close = difflib.get_close_matches(node, known, n=3)
        raise UnknownNode(f"node {node!r} is not a decision of this plan"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + " (autopar show PLAN --all-nodes lists the nodes)")
    v = problem.vars[rep]
    cost = CostModel(parse_cluster(plan.cluster), tuple(plan.mesh_shape))
    n = len(v.members)
    chosen_pl = plan.nodes[rep]
    rows = []
    for i, combo in enumerate(v.options):
        n_in = len(v.call.inputs) if v.call else 0
        ins = tuple(placements_str(input_placements(combo, k)) for k in range(n_in))
        outs = tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs)))
        f, b = cost.node_time(v, combo)
        mem = sum(cost.node_memory(v, combo, problem.optimizer_states).values()) * n
        row = OptionCost(i, (f"{','.join(ins)}->{','.join(outs)}" if ins else ",".join(outs)),
                         n * (f + b), 0.0, mem, chosen=(ins == chosen_pl.inputs and outs == chosen_pl.outputs))
        for e in problem.edges:
            if e.dst == rep and e.src == rep:          # layer i's output feeds layer i+1
                src, dst = output_placements(combo, e.src_out), input_placements(combo, e.dst_in)
                t, _ = cost.edge_time(e.meta, src, dst, grad_partial_flags(combo, e.dst_in))
                row.edges.append((rep + " (next layer)", "self", t * e.count))
            elif e.dst == rep:
                src = parse_placements(plan.nodes[e.src].outputs[e.src_out])
                t, _ = cost.edge_time(e.meta, src, input_placements(combo, e.dst_in),
                                      grad_partial_flags(combo, e.dst_in))
                row.edges.append((e.src, "in", t * e.count))
            elif e.src == rep:
                w = plan.nodes[e.dst]
                dst = parse_placements(w.inputs[e.dst_in])
                t, _ = cost.edge_time(e.meta, output_placements(combo, e.src_out), dst,
                                      grad_partial(w.inputs[e.dst_in], w.outputs))
                row.edges.append((e.dst, "out", t * e.count))
        if problem.sink and problem.sink[0] == rep:
            k = problem.sink[1]
            t, _ = cost.edge_time(v.outputs[k], output_placements(combo, k),
                                  (Replicate(),) * len(plan.mesh_shape),
                                  (False,) * len(plan.mesh_shape))
            row.edges.append(("loss must end replicated", "out", t))
        row.reshard_s = sum(t for _, _, t in row.edges) if all(t != INF for _, _, t in row.edges) else INF
        rows.append(row)
    seen = False
    for r in rows:                     # several options can share placements: mark one
        r.chosen, seen = (r.chosen and not seen), seen or r.chosen
    rows.sort(key=lambda r: (r.total_s, not r.chosen))
    op = plan.node_ops.get(node, v.kind)
    follows = _followers(problem).get(rep)
    return Explanation(node, op, rep, list(v.members), follows, rows, str(chosen_pl))
