"""Cut a captured graph into pipeline stages, and a per-rank graph into stage programs.

Two halves, one idea:

- Where to cut, on the **global** captured graph, is ``autopar.analysis.stages``.
- On the **per-rank** graph that ``passes.insert_collectives`` made for the intra-stage
  mesh: ``split_stages`` gives each stage its own GraphModule. A value made in stage ``q``
  and read in stage ``t``:

  * ``t == q + 1``: an output of ``q`` and an input of ``t`` (torch.distributed.pipelining
    sends it over the pipeline axis, rank at intra coordinate c to the rank at the same c:
    both stages use the same intra mesh, so the local shard has the same layout on both);
  * ``t > q + 1``: a *skip* edge: ``q`` sends it straight to ``t``'s rank
    (``skip_send``/``skip_recv``, their own point-to-point messages), the stages between
    never see it. Its gradient rides on the backward of a differentiable regular output of
    ``q`` and input of ``t``; where one of them has none, the value goes down the chain
    instead (an output and input of every stage between);
  * parameters and buffers are read where they are used (a tied weight used in two stages
    is held by both), user inputs other than stage 0's are read from the step's batch by
    the stage itself (``side_input``; every rank has the global batch), and nodes that
    depend on no input or parameter (masks, position tables) are recomputed where needed,
    as are the collectives that place a user input (its data-parallel share).

The functions the stage graphs call (``side_input``, ``skip_send``, ``skip_recv``,
``stage_input``, ``stage_output``) live in ``autopar.ops.stage_ops``; the graphs name them,
the runtime supplies the context.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.analysis.stages import SplitError, free_nodes
from autopar.ops import collectives
from autopar.ops import stage_ops as rt


@dataclass
class SkipEdge:
    """A value made in stage ``src`` and read in stage ``dst`` > src + 1, sent directly."""
    id: int
    value: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class StageGraph:
    """One stage's program. Its placeholders are the model inputs (stage 0) or the values
    from the stage before (``inputs``); it returns ``outputs`` (to the next stage) or, in
    the last stage, the per-rank graph's result."""
    index: int
    gm: GraphModule
    inputs: list[str]
    outputs: list[str]
    input_meta: list[tuple[tuple[int, ...], torch.dtype, bool]]
    output_meta: list[tuple[tuple[int, ...], torch.dtype, bool]]
    side_inputs: list[str] = field(default_factory=list)
    skips_in: list[int] = field(default_factory=list)
    skips_out: list[int] = field(default_factory=list)


def split_stages(gm: GraphModule, stage_of: dict[str, int], n_stages: int, model_inputs: list[str],
                 meta_of: Callable[[Node], tuple[tuple[int, ...], torch.dtype]],
                 root: torch.nn.Module, no_grad: frozenset[str] = frozenset(),
                 ) -> tuple[list[StageGraph], list[SkipEdge]]:
    """Split the per-rank graph ``gm`` (from ``insert_collectives``) into ``n_stages`` stage
    GraphModules over ``root``'s parameters. ``stage_of`` maps global node names to stages
    (``assign_stages``); ``meta_of(node)`` gives a crossing value's local shape and dtype;
    ``no_grad`` names the global ops whose outputs carry no gradient
    (``analysis.stages.no_grad_ops``)."""
    nodes = list(gm.graph.nodes)
    params = {name for name, _ in root.named_parameters()}
    for n in nodes:
        if n.op == "get_attr":
            n.meta["is_buffer"] = n.target not in params
    cut = _Cut(nodes, _stages_of(nodes, stage_of, n_stages), free_nodes(gm.graph) | _input_moves(nodes),
               _requires_grad(nodes, root, no_grad), meta_of, n_stages)
    crossing, far = cut.crossings()
    skips: list[SkipEdge] = []
    for v, ts in far.items():
        shape, dtype, rg = cut.meta(v)
        for t in ts:
            skips.append(SkipEdge(len(skips), v.name, cut.st[v], t, shape, dtype, rg))
    out = [cut.stage_graph(s, crossing, skips, model_inputs, root) for s in range(n_stages)]
    return out, skips


_MOVES = frozenset({collectives.scatter, collectives.all_gather, collectives.all_to_all})


def _input_moves(nodes: list[Node]) -> set[str]:
    """The collectives that place a user input as the plan asks (a scatter to this rank's
    share of the batch): recomputed in every stage that reads them, from the step's batch
    (``side_input``) like the input itself, never sent. (A model that returns its own loss
    reads its labels in the first stage, to shift them, and in the last, for the loss.)"""
    moves: set[str] = set()
    for n in nodes:
        if n.op == "call_function" and n.target in _MOVES and len(n.all_input_nodes) == 1:
            a = n.all_input_nodes[0]
            if a.op == "placeholder" or a.name in moves:
                moves.add(n.name)
    return moves


def _stages_of(nodes: list[Node], stage_of: dict[str, int], S: int) -> dict[Node, int]:
    """The stage of every per-rank op: its global node's, else its first reader's."""
    st: dict[Node, int] = {}
    for n in nodes:
        if n.op == "call_function" and n.meta.get("source") in stage_of:
            st[n] = stage_of[n.meta["source"]]
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in st:
            st[n] = st[n.args[0]]
    for n in reversed(nodes):
        if n.op == "call_function" and n not in st:
            us = [S - 1 if u.op == "output" else st[u] for u in n.users if u.op == "output" or u in st]
            st[n] = min(us) if us else S - 1
    for n in nodes:     # a producer never lands after its reader
        if n in st:
            for a in n.all_input_nodes:
                if a in st and st[a] > st[n]:
                    raise SplitError(f"node {n.name} (stage {st[n]}) reads {a.name} from the later "
                                     f"stage {st[a]}: the cuts do not follow the graph's order")
    return st


class _Cut:
    """The per-rank graph with a stage for every op: what crosses where, and each stage's
    program."""

    def __init__(self, nodes, st, free, requires_grad, meta_of, S):
        self.nodes, self.st, self.free, self.rg, self.meta_of, self.S = nodes, st, free, requires_grad, meta_of, S
        self.by_name = {n.name: n for n in nodes}

    def readers(self, v: Node) -> set[int]:
        return {self.S - 1 if u.op == "output" else self.st[u] for u in v.users
                if u.op == "output" or u in self.st}

    def meta(self, v: Node):
        shape, dtype = self.meta_of(v)
        return (shape, dtype, self.rg[v] and (dtype.is_floating_point or dtype.is_complex))

    def crossings(self) -> tuple[list[list[Node]], dict[Node, list[int]]]:
        """Regular values ``s -> s+1`` per stage, and skip values with the stages > q + 1
        reading them."""
        crossing: list[list[Node]] = [[] for _ in range(self.S)]
        far: dict[Node, list[int]] = {}
        for n in self.nodes:
            if n not in self.st or n.name in self.free:
                continue
            q = self.st[n]
            for t in sorted(self.readers(n)):
                if t == q + 1:
                    crossing[q].append(n)
                elif t > q + 1:
                    far.setdefault(n, []).append(t)
        # A skip value that needs a gradient hangs its backward on a differentiable regular
        # output of its stage and a differentiable regular input of its reader. Where either
        # has none, the value goes down the chain instead, every stage between passing it on.
        changed = True
        while changed:
            changed = False
            for v, ts in list(far.items()):
                q = self.st[v]
                if self.meta(v)[2] and not (any(self.meta(u)[2] for u in crossing[q])
                                            and all(any(self.meta(u)[2] for u in crossing[t - 1]) for t in ts)):
                    for k in range(q, max(ts)):
                        if v not in crossing[k]:
                            crossing[k].append(v)
                    del far[v]
                    changed = True
        return crossing, far

    def stage_graph(self, s: int, crossing, skips: list[SkipEdge], model_inputs, root) -> StageGraph:
        """Stage ``s``'s program."""
        S, meta = self.S, self.meta
        g = Graph()
        env: dict[Node, Node] = {}
        sg = StageGraph(s, None, [v.name for v in crossing[s - 1]] if s else [],  # type: ignore[arg-type]
                        [v.name for v in crossing[s]] if s < S - 1 else [],
                        [meta(v) for v in crossing[s - 1]] if s else [],
                        [meta(v) for v in crossing[s]] if s < S - 1 else [])
        if s == 0:
            for name in model_inputs:
                ph = g.placeholder(name)
                if name in self.by_name and self.by_name[name].op == "placeholder":
                    env[self.by_name[name]] = ph
        else:
            for v in crossing[s - 1]:
                ph = g.placeholder(v.name)
                env[v] = g.call_function(rt.stage_input, (ph,)) if meta(v)[2] else ph
        anchor_in = next((env[v] for v in crossing[s - 1] if meta(v)[2]), None) if s else None
        skip_of = {(e.value, e.dst): e for e in skips}

        def bring(a: Node) -> Node:
            if a not in env:
                env[a] = self._bring(a, s, g, sg, skip_of, anchor_in, bring)
            return env[a]

        for n in self.nodes:
            if self.st.get(n) == s and n.op == "call_function":
                env[n] = g.node_copy(n, bring)
        if s < S - 1:
            outs = self._sends(s, g, sg, [env[v] for v in crossing[s]], crossing[s], skips, env)
            # contiguous (the schedule sends buffers as they are) and not aliasing a value the
            # stage saved for backward (see ops.stage_ops.stage_output)
            g.output(tuple(g.call_function(rt.stage_output, (o,)) for o in outs))
        else:
            out_node = next(n for n in self.nodes if n.op == "output")
            g.output(torch.fx.node.map_arg(out_node.args[0], bring))
        g.eliminate_dead_code()
        sg.gm = GraphModule(root, g)
        return sg

    def _bring(self, a: Node, s: int, g: Graph, sg: StageGraph, skip_of, anchor_in, bring) -> Node:
        """Value ``a`` read in stage ``s`` but not made there."""
        if a.op == "get_attr":
            return g.get_attr(a.target)
        if a.op == "placeholder":
            sg.side_inputs.append(a.name)
            return g.call_function(rt.side_input, (a.name, s))
        if a.name in self.free:
            return g.node_copy(a, bring)
        e = skip_of.get((a.name, s))
        if e is None:
            raise SplitError(f"stage {s} reads {a.name} (stage {self.st.get(a)}) but nothing "
                             "brings it there")
        if e.requires_grad and anchor_in is None:
            raise SplitError(f"the skip value {a.name} (stage {e.src} -> {s}) needs a "
                             f"gradient but stage {s} has no differentiable input to "
                             "hang its backward on")
        sg.skips_in.append(e.id)
        return g.call_function(rt.skip_recv, (anchor_in, e.id))

    def _sends(self, s: int, g: Graph, sg: StageGraph, outs: list, crossing_s, skips, env) -> list:
        """Stage ``s``'s skip sends, each hung on a differentiable regular output."""
        sends = [e for e in skips if e.src == s]
        if not sends:
            return outs
        k = next((i for i, v in enumerate(crossing_s) if self.meta(v)[2]), None)
        if k is None and any(e.requires_grad for e in sends):
            raise SplitError(f"stage {s} sends skip values but has no differentiable "
                             "output to hang their backward on")
        for e in sends:
            value = env[self.by_name[e.value]]
            if k is None:
                g.call_function(rt.skip_send, (value, None, e.id))
            else:
                outs[k] = g.call_function(rt.skip_send, (value, outs[k], e.id))
            sg.skips_out.append(e.id)
        return outs


def _requires_grad(nodes: list[Node], root: torch.nn.Module,
                   no_grad: frozenset[str]) -> dict[Node, bool]:
    params = dict(root.named_parameters())
    rg: dict[Node, bool] = {}
    for n in nodes:
        if n.op == "get_attr":
            p = params.get(n.target)
            rg[n] = p is not None and p.requires_grad
        elif n.op == "placeholder" or n.meta.get("source") in no_grad:
            rg[n] = False
        else:
            rg[n] = any(rg.get(a, False) for a in n.all_input_nodes)
    return rg
