"""A plan's graph as data: the captured nodes labelled with their placements, and the
collectives the rewrite inserts drawn as nodes of their own.

Where an edge's producer placement differs from what the consumer reads (or a replicated
parameter needs its gradient summed), ``autopar.sharding.redistribute.plan_steps`` says
which collectives run there; each becomes a node between the two. Nodes inside repeated
layers (``h.0``, ``h.1``, ...) carry their layer, so :func:`fold` can collapse every
instance after the first into one box.

The plan file holds placements but not edges, so drawing the graph needs the captured
model (the CLI's ``--factory``). A pipeline plan's nodes carry their stage (from the plan's
cuts, as the runtime splits them); a parameter or a collective takes its consumer's.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

from autopar.analysis.stages import assign_stages
from autopar.capture import Captured, layer_of
from autopar.placement import Replicate, parse_placements
from autopar.plan import Plan
from autopar.sharding.redistribute import Unsupported, plan_steps
from autopar.pricing.problem import tensor_args
from autopar.schedule import stage_ranks


@dataclass
class GNode:
    id: str
    label: str                     # first line: name; further lines: op, placements
    kind: str                      # "param" | "buffer" | "input" | "op" | "loss" | "collective" | "fold"
    layer: tuple[str, int] | None = None
    sharded: bool = False
    detail: str = ""
    sig: str = ""                  # op and placements: equal sigs = the same choice
    stage: int | None = None       # pipeline stage (plans with a pipeline axis)


@dataclass
class Graph:
    nodes: dict[str, GNode] = field(default_factory=dict)
    edges: list[tuple[str, str, str]] = field(default_factory=list)   # (src, dst, label)
    mesh_axes: tuple[str, ...] = ()
    folded_layers: dict[str, int] = field(default_factory=dict)      # box id -> ops inside
    stage_ranks: tuple[int, ...] = ()  # pipeline rank of each stage; empty without a pipeline

    @property
    def collectives(self) -> list[GNode]:
        return [n for n in self.nodes.values() if n.kind == "collective"]


def grad_partial(consumer_in: str, consumer_outs: tuple[str, ...]) -> tuple[bool, ...]:
    """Per mesh axis: the consumer reads its input replicated while one of its outputs is
    not replicated, so the input's gradient comes back partial (as the solver costs it)."""
    ins = parse_placements(consumer_in)
    outs = [parse_placements(o) for o in consumer_outs]
    return tuple(isinstance(p, Replicate) and any(not isinstance(o[a], Replicate) for o in outs)
                 for a, p in enumerate(ins))


def step_label(step, mesh_axes) -> str:
    axis = mesh_axes[step.axis] if step.axis < len(mesh_axes) else f"axis{step.axis}"
    fwd, bwd = step.forward_collective(), step.backward_collective()
    extra = {"all_gather": f" dim {step.dim}", "scatter": f" dim {step.dim}",
             "reduce_scatter": f" dim {step.dim}",
             "all_to_all": f" {step.dim}->{step.dim2}"}.get(step.kind, "")
    when = (f"fwd {fwd}" if fwd else "fwd -") + (f" / bwd {bwd}" if bwd else "")
    return f"{step.kind}@{axis}{extra}\n{when}"


def _layer_of_name(name: str) -> tuple[str, int] | None:
    """("transformer.h", 1) for a parameter named ``transformer.h.1.ln_1.weight``."""
    m = re.match(r"^(.*?)\.(\d+)\.", name)
    return (m.group(1), int(m.group(2))) if m else None


def _stages(cap: Captured, plan: Plan) -> dict[str, int]:
    """Stage of every op node of a pipeline plan (empty without a pipeline)."""
    if plan.pipeline_stages <= 1:
        return {}
    return assign_stages(cap, plan.stage_cuts, plan.pipeline_stages * plan.virtual_stages)


def build_graph(cap: Captured, plan: Plan) -> Graph:
    """Every placed node of ``cap``'s graph, with a node per collective on its edges."""
    g = Graph(mesh_axes=tuple(plan.mesh_axes))
    stage_of = _stages(cap, plan)
    if stage_of:
        # k mod p, or DualPipeV's V
        g.stage_ranks = tuple(stage_ranks(plan.schedule, plan.pipeline_stages, plan.virtual_stages))
    alias, loss = _add_nodes(g, cap, plan, stage_of)
    if loss in g.nodes:
        g.nodes[loss].kind = "loss"
    for i, b in enumerate(plan.branches):      # branch parallelism: which group runs a node
        for group, names in enumerate(b.groups):
            for name in names:
                if name in g.nodes:
                    g.nodes[name].label += f"\nbranch group {group}"
        for name, role in ((b.fork, "fork"), (b.join, "join: all_reduce@branch")):
            if name in g.nodes:
                g.nodes[name].label += f"\nbranches {i} {role}"
    _add_edges(g, cap, plan, alias)
    return g


def _add_nodes(g: Graph, cap: Captured, plan: Plan, stage_of: dict[str, int]
               ) -> tuple[dict[str, tuple[str, int]], str | None]:
    """A :class:`GNode` per placed node; returns the aliases (``getitem`` node -> (its
    source, output index)) and the loss node with aliases resolved."""
    alias: dict[str, tuple[str, int]] = {}
    loss = cap.loss
    for node in cap.gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src, k = node.args[0], node.args[1]
            base = alias.get(src.name, (src.name, 0))
            alias[node.name] = (base[0], k if base[1] == 0 else base[1])
            if node.name == loss:
                loss = base[0]
            continue
        if node.name in plan.nodes:
            g.nodes[node.name] = _gnode(node, plan.nodes[node.name], cap, stage_of)
    return alias, loss


def _gnode(node, pl, cap: Captured, stage_of: dict[str, int]) -> GNode:
    """The drawn node of a placeholder (parameter, buffer, input) or op with placement ``pl``."""
    if node.op == "placeholder":
        kind = ("param" if node.name in cap.params else
                "buffer" if node.name in cap.buffers else "input")
        title = cap.params[node.name][0] if kind == "param" else (
            cap.buffers[node.name] if kind == "buffer" else node.name)
        shape = list(node.meta["val"].shape)
        label = f"{title}\n{shape} {pl.outputs[0]}"
    else:
        kind = "op"
        op = str(node.target).replace("aten.", "").replace(".default", "")
        label = f"{node.name}\n{op}\n{pl}"
    sharded = any(c in "SP" for c in str(pl))
    sig = f"{node.target if node.op == 'call_function' else kind}|{pl}"
    layer = layer_of(node) if node.op == "call_function" else _layer_of_name(title)
    stage = stage_of.get(node.name)
    if stage is not None:
        label += f"\nstage {stage}"
    return GNode(node.name, label, kind, layer, sharded, sig=sig, stage=stage)


def _add_edges(g: Graph, cap: Captured, plan: Plan, alias: dict[str, tuple[str, int]]) -> None:
    """An edge per tensor input of every drawn op, through a node per collective that
    redistributes the producer's placement to what the consumer reads."""
    n_coll = 0
    for node in cap.gm.graph.nodes:
        if node.name not in g.nodes or node.op != "call_function":
            continue
        dst_pl = plan.nodes[node.name]
        for k, a in enumerate(tensor_args(node)):
            src, out = alias.get(a.name, (a.name, 0))
            if src not in g.nodes or k >= len(dst_pl.inputs):
                continue
            src_pl = plan.nodes[src].outputs[out] if out < len(plan.nodes[src].outputs) else None
            want = dst_pl.inputs[k]
            if src_pl is None:
                continue
            stage = g.nodes[node.name].stage
            if g.nodes[src].stage is None and stage is not None:
                g.nodes[src].stage = stage        # a parameter or input: its (first) reader's
            try:
                steps = plan_steps(parse_placements(src_pl), parse_placements(want),
                                   grad_partial(want, dst_pl.outputs))
            except Unsupported:
                steps = []
            prev = src
            for step in steps:
                n_coll += 1
                cid = f"coll{n_coll}"
                g.nodes[cid] = GNode(cid, step_label(step, g.mesh_axes), "collective",
                                     g.nodes[node.name].layer or g.nodes[src].layer,
                                     detail=f"{src} -> {node.name}", sig=str(step), stage=stage)
                g.edges.append((prev, cid, src_pl if prev == src else ""))
                prev = cid
            g.edges.append((prev, node.name, want if steps else src_pl))


def fold(g: Graph) -> Graph:
    """Collapse every repeated-layer instance after the first of its family into one box
    (``h.1 … same choices as h.0``); edges are rewired to the boxes."""
    firsts: dict[str, int] = {}
    for n in g.nodes.values():
        if n.layer is not None:
            fam, i = n.layer
            firsts[fam] = min(firsts.get(fam, i), i)
    out = Graph(mesh_axes=g.mesh_axes, stage_ranks=g.stage_ranks)
    where: dict[str, str] = {}
    counts: dict[str, list[int]] = {}
    sigs: dict[tuple[str, int], list[str]] = {}
    for n in g.nodes.values():
        if n.layer is not None and n.kind != "collective":
            sigs.setdefault(n.layer, []).append(n.sig)
    for n in g.nodes.values():
        if n.layer is not None and n.layer[1] != firsts[n.layer[0]]:
            fam, i = n.layer
            box = f"fold_{fam}_{i}".replace(".", "_")
            c = counts.setdefault(box, [0, 0])
            c[0 if n.kind != "collective" else 1] += 1
            where[n.id] = box
            if box not in out.nodes:
                out.nodes[box] = GNode(box, "", "fold", n.layer, stage=n.stage)
        else:
            where[n.id] = n.id
            out.nodes[n.id] = n
    for box, (ops, colls) in counts.items():
        b = out.nodes[box]
        fam, i = b.layer
        same = sigs[(fam, i)] == sigs[(fam, firsts[fam])]
        b.label = (f"{fam}.{i} (folded)\n{ops} nodes, {colls} collectives\n"
                   + (f"same placements as {fam}.{firsts[fam]}" if same
                      else f"placements differ from {fam}.{firsts[fam]}: unfold to see"))
        out.folded_layers[box] = ops
    seen = set()
    for s, d, lab in g.edges:
        s2, d2 = where[s], where[d]
        if s2 == d2 or (s2, d2) in seen:
            continue
        seen.add((s2, d2))
        out.edges.append((s2, d2, lab if (s2, d2) == (s, d) else ""))
    return out
