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
from autopar.errors import AutoparInputError
from autopar.ops.experts import EXPERTS_OP
from autopar.placement import parse_placements, placements_str
from autopar.plan import Plan
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import INF, grad_partial_flags
from autopar.pricing.prices import PriceTable, plan_prices
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
    fp8: str = ""                  # under precision="fp8", an eligible linear: how it runs

    @property
    def chosen(self) -> OptionCost | None:
        return next((o for o in self.options if o.chosen), None)


class UnknownNode(AutoparInputError):
    pass


def explain(cap: Captured, plan: Plan, node: str, optimizer: str = "adamw",
            prices: PriceTable | None = None) -> Explanation:
    """Every option of ``node``'s decision, priced from ``prices`` (default: the plan's own
    table, :func:`plan_prices`), against the neighbours' placements in the plan."""
    pt = prices if prices is not None else plan_prices(cap, plan, optimizer)
    problem = pt.problem
    rep = problem.rep.get(node, node)
    if rep not in problem.vars or node not in plan.nodes:
        close = difflib.get_close_matches(node, list(plan.nodes), n=3)
        raise UnknownNode(f"node {node!r} is not a decision of this plan"
                          + (f"; did you mean {', '.join(close)}?" if close else "")
                          + " (autopar show PLAN --all-nodes lists the nodes)")
    v = problem.vars[rep]
    chosen_pl = plan.nodes[rep]
    rows = []
    for i, combo in enumerate(v.options):
        n_in = len(v.call.inputs) if v.call else 0
        ins = tuple(placements_str(input_placements(combo, k)) for k in range(n_in))
        outs = tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs)))
        row = OptionCost(i, (f"{','.join(ins)}->{','.join(outs)}" if ins else ",".join(outs)),
                         pt.compute_s(rep, i), 0.0, sum(pt.memory(rep, i).values()),
                         edges=_edges(pt, plan, rep, i),
                         chosen=(ins == chosen_pl.inputs and outs == chosen_pl.outputs))
        row.reshard_s = sum(t for _, _, t in row.edges) if all(t != INF for _, _, t in row.edges) else INF
        rows.append(row)
    seen = False
    for r in rows:                     # several options can share placements: mark one
        r.chosen, seen = (r.chosen and not seen), seen or r.chosen
    rows.sort(key=lambda r: (r.total_s, not r.chosen))
    op = plan.node_ops.get(node, v.kind)
    follows = pt.follow[rep][0] if rep in pt.follow else None
    return Explanation(node, op, rep, list(v.members), follows, rows, str(chosen_pl),
                       fp8=_fp8_note(plan, problem, rep))


def _fp8_note(plan: Plan, problem, rep: str) -> str:
    """Under ``precision="fp8"``, for an fp8-eligible linear: whether the plan runs it in fp8
    and why (its ``fp8_layers``: pinned, "all", or chosen by price); "" otherwise."""
    o = plan.options
    if o.precision != "fp8" or rep not in problem.fp8:
        return ""
    layers = o.fp8_layers
    v = problem.vars.get(rep)
    if o.compile and v is not None and v.call is not None and v.call.op is EXPERTS_OP:
        return "it runs in bf16: a compiled program's experts op keeps bf16 GEMMs (analysis.fp8_layers)"
    if layers is None or layers == "all":
        return "its GEMMs run in fp8 (every linear but the head, and the experts)"
    on = [m for m in problem.fp8[rep] if m in set(layers)]
    return (f"its GEMMs run in fp8 ({o.fp8_scaling or 'tensorwise'}); the compute column prices "
            "them so" if on else
            "it runs in bf16: under its placement its fp8 GEMMs and casts price slower (or "
            "fp8_layers leaves it out); the compute column prices it in bf16")


def _edges(pt: PriceTable, plan: Plan, rep: str, i: int) -> list[tuple[str, str, float]]:
    """(neighbour, direction, seconds) of every edge of ``rep`` under option ``i``, the
    neighbours at their placements in the plan, priced as the solver priced them."""
    problem, scale = pt.problem, pt.cost.grad_sync_scale
    combo = problem.vars[rep].options[i]
    shared = pt.shared()

    def pair(k):       # edge k's (source, consumer placements, partial flags): rep at option i
        e = problem.edges[k]
        src = (output_placements(combo, e.src_out) if e.src == rep
               else parse_placements(plan.nodes[e.src].outputs[e.src_out]))
        if e.dst == rep:
            return src, input_placements(combo, e.dst_in), grad_partial_flags(combo, e.dst_in)
        w = plan.nodes[e.dst]
        return src, parse_placements(w.inputs[e.dst_in]), grad_partial(w.inputs[e.dst_in], w.outputs)

    def seconds(k) -> float:   # a conversion an earlier reader of its group makes is free here
        here = pair(k)
        g = shared.get(k)
        if g is not None and any(shared.get(j) == g and pair(j) == here for j in range(g, k)):
            return 0.0
        return pt.edge(k, *here).priced(scale)[0]

    out = []
    for k, e in enumerate(problem.edges):
        if e.dst == rep and e.src == rep:          # layer i's output feeds layer i+1
            out.append((rep + " (next layer)", "self", seconds(k)))
        elif e.dst == rep:
            out.append((e.src, "in", seconds(k)))
        elif e.src == rep:
            out.append((e.dst, "out", seconds(k)))
    if problem.sink and problem.sink[0] == rep:
        out.append(("loss must end replicated", "out", pt.sink(rep, i).priced(scale)[0]))
    return out
