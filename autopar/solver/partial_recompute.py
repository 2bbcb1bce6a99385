"""Partial recomputation of a pipeline plan: per rank, the fewest repeated layers to recompute
so that the rank fits its memory (Megatron-LM's ``--recompute-num-layers``, block method),
instead of every layer of the model.

Given a pipeline configuration (p ranks, v virtual stages, m micro-batches, a schedule), the
cuts, and the per-node prices of an intra-stage plan *without* recomputation
(``pipeline_costs.NodeCosts``), rank r holds stages K_r = {r, r + p, ...}; stage k holds
``n_k`` micro-batches of activations at its peak (``stage_tables.in_flight``: 1F1B's first
rank holds p, its last one 1). For a layer l (``analysis.layers``) let

    s_l = sum_{x in l, x not kept} n_{k(x)} a_x      (bytes rank r(l) saves by recomputing l)
    t_l = sum_{x in l} m (f_x + g_x)                 (seconds it adds to r(l)'s step)

where ``a_x`` is what node x keeps for backward per micro-batch, ``f_x`` its forward seconds
and ``g_x`` those of the forward collectives into it (both run again in backward), and
k(x) is the stage of x. Rank r's memory with layers R recomputed is

    M_r(R) = M_r(0) - sum_{l in R, r(l) = r} s_l + [R meets r] T

(T: one layer's activations rebuilt at a time in backward, ``NodeCosts.recompute_bytes``).
The choice solves, for every rank apart (ranks share no layer's bytes),

    minimize sum_{l in R_r} t_l   subject to   M_r(R_r) <= budget

Layers of a transformer are alike (t_l equal), so taking layers in decreasing s_l / t_l
order until the rank fits is optimal up to the last layer taken: a rank recomputes the
layers of its stages with the most micro-batches in flight first (under interleaving, its
first virtual stage), and an earlier rank, which holds more in flight, recomputes at least
as many layers as a later one. The sums above are the model; the result is then checked
against the exact prices (``NodeCosts.with_recompute`` and ``rank_memory``, what
``pipeline_price.pipeline_estimate`` reports) and a rank still over takes its next layer.

``partial_pipeline`` applies it to an intra-stage solution that recomputes every layer and
its cut: the same per-node choices priced without recomputation, under the cuts of the
fully recomputed plan (which fit) and under the fastest cuts regardless of memory, each
with its fewest layers; the fastest by the simulated schedule (``pipeline_estimate``) of
those and the plan it was given is returned, its plan's ``recompute`` naming the layers.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import replace

import numpy as np

from autopar.analysis.layers import repeated_layers, select_layers
from autopar.analysis.stages import chain_index
from autopar.solver.flat import Solved, recompute_rest
from autopar.solver.pipeline_price import pipeline_estimate, price_plan
from autopar.solver.stage_dp import plan_stages
from autopar.solver.stage_plan import StagesDoNotFit
from autopar.schedule import rank_stages as schedule_rank_stages, stage_ranks
from autopar.solver.stage_tables import in_flight


def rank_stages(p: int, v: int, schedule: str = "1f1b") -> list[list[int]]:
    """The stages of each rank: stage k runs on rank k mod p, or in DualPipeV's V
    (``schedule.rank_stages``)."""
    return schedule_rank_stages(schedule, p, v)


def rank_bytes(nc, config, cuts) -> np.ndarray:
    """Bytes per device of every rank under ``nc``'s prices (``NodeCosts.rank_memory``)."""
    p, v, m, schedule = config
    bounds = (0, *cuts, len(nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    return np.array([sum(mem.values()) for mem in nc.rank_memories(stages, schedule, p, m, v)])


_LAYER_NODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layer_nodes(cap) -> dict[str, tuple[tuple, frozenset]]:
    """Layer -> (its captured nodes in graph order, those read outside it):
    ``recompute_nodes`` of each repeated layer alone, worked out once per graph."""
    got = _LAYER_NODES.get(cap.gm)
    if got is None:
        nodes = {n.name: n for n in cap.gm.graph.nodes}
        got = {}
        for lay, names in repeated_layers(cap.gm).items():
            inside = set(names)
            got[lay] = (tuple(names), frozenset(
                x for x in inside if any(u.name not in inside for u in nodes[x].users)))
        _LAYER_NODES[cap.gm] = got
    return got


def layer_terms(cap, nc, layers, config, cuts) -> list[tuple[str, int, float, float, float]]:
    """(layer, rank, bytes saved s_l, seconds added t_l, activations rebuilt per micro-batch)
    of every layer in ``layers`` under cuts ``cuts`` (chain indices); a layer across a cut
    is counted on the rank of its first node."""
    p, v, m, schedule = config
    where = chain_index(cap, nc.units)
    held = in_flight(schedule, p, m, v)
    stage_rank = stage_ranks(schedule, p, v)
    cut_arr = np.asarray(cuts, dtype=int)
    out = []
    members = layer_nodes(cap)
    for lay in layers:
        rec, kept = members[lay]
        # summed in graph order: in a set's order the sums, and so which of alike layers
        # a rank recomputes first (their s_l / t_l tie), changed with the hash seed
        placed = [(where[x], x) for x in rec if x in where]
        if not placed:
            continue
        saved = rebuilt = added = 0.0
        # each node's stage, all at once (the sums stay one node at a time, in graph order)
        stage = np.searchsorted(cut_arr, [i for i, _ in placed], side="right").tolist()
        for (i, x), k in zip(placed, stage):
            added += m * (nc.node_forward.get(x, 0.0) + nc.node_forward_comm.get(x, 0.0))
            if x not in kept:
                a = nc.node_activations.get(x, 0.0)
                saved += held[k] * a
                rebuilt += a
        rank = stage_rank[int(np.searchsorted(cut_arr, min(placed)[0], side="right"))]
        out.append((lay, rank, saved, added, rebuilt))
    return out


def fewest_layers(cap, nc, layers, config, cuts, budget: float):
    """(the layers (graph order) of least added time whose recomputation brings every rank
    within ``budget`` bytes under cuts ``cuts`` (module docstring), ``nc`` with them
    recomputed); ((), nc) when every rank fits as it is, None when some rank does not fit
    even recomputing all of its layers."""
    base = rank_bytes(nc, config, cuts)
    if float(base.max()) <= budget:
        return (), nc
    terms = layer_terms(cap, nc, layers, config, cuts)
    if not terms:
        return None
    transient = max(max(t[4] for t in terms), nc.recompute_bytes)
    order = {lay: k for k, lay in enumerate(layers)}
    queue = {r: sorted([t for t in terms if t[1] == r],
                       key=lambda t: (-t[2] / max(t[3], 1e-30), order[t[0]]))
             for r in range(config[0])}
    chosen: set[str] = set()
    for r, mine in queue.items():      # the model: take layers until the rank fits
        need = float(base[r]) - budget
        if need <= 0:
            continue
        need += transient
        while mine and need > 0:
            lay, _, s, _, _ = mine.pop(0)
            chosen.add(lay)
            need -= s
        if need > 0:
            return None
    while True:                        # the exact prices: a rank still over takes one more
        rec = tuple(sorted(chosen, key=order.get))
        priced = nc.with_recompute(cap, rec)
        got = rank_bytes(priced, config, cuts)
        over = [r for r in range(config[0]) if got[r] > budget]
        if not over:
            return rec, priced
        for r in over:
            if not queue[r]:
                return None
            chosen.add(queue[r].pop(0)[0])


_BARE: dict = {}


def without_recompute(solved):
    """``solved`` (a ``flat.Solved``) priced with nothing recomputed: the same choice per
    node, its cost model without the recomputed layers. The same object for the same
    ``solved`` while it is among the last few asked (so ``pipeline_price.price_plan``
    prices it once)."""
    hit = _BARE.get(id(solved))
    if hit is not None and hit[0] is solved:
        return hit[1]
    cost = replace(solved.cost, recompute=frozenset(), recompute_kept=frozenset())
    bare = Solved(solved.problem, cost, solved.choice)
    if len(_BARE) >= 4:
        _BARE.pop(next(iter(_BARE)))
    _BARE[id(solved)] = (solved, bare)
    return bare


def fewest_step(cap, pr, layers, config, cuts, budget: float):
    """(the layers chosen, ``pr`` repriced with them, its predicted step) under ``cuts`` with
    per rank the fewest of ``layers`` recomputed that fit ``budget`` (``fewest_layers``), or
    None when none fit."""
    got = fewest_layers(cap, pr.nc, layers, config, cuts, budget)
    if got is None:
        return None
    pr = replace(pr, nc=got[1])
    return got[0], pr, pipeline_estimate(pr, config, cuts).step_time_s


def partial_pipeline(cap, fitted, cl, world: int, config, budget: float):
    """``fitted`` = ((Plan, Solved), Priced, StagePlan), an intra-stage solution that
    recomputes layers and its cut, or the same with, per rank, only the fewest layers
    recomputed that fit ``budget`` (module docstring) when that is predicted faster."""
    p, v, m, schedule = config
    solved, pr_full, sp_full = fitted
    # every repeated layer, but those the plan offloads (a layer is one or the other)
    layers = select_layers(cap.gm, recompute_rest(cap, solved[0].options) or ())
    bare = without_recompute(solved[1])
    pr0 = price_plan(cap, solved[0], bare, cl, world, p, p * v, pr_full.starts)
    if len(pr0.bounds) != len(pr_full.bounds) or (pr0.bounds != pr_full.bounds).any():
        return fitted                      # (the cut points are the same: not recomputed)
    full_cuts = tuple(int(pr_full.bounds[c]) for c in sp_full.cuts)
    best = (pipeline_estimate(pr_full, config, full_cuts).step_time_s, fitted)
    plans = [sp_full]
    try:
        plans.append(_cut(pr0, config, math.inf))      # the fastest cuts, memory aside
    except StagesDoNotFit:
        pass
    for sp in plans:
        cuts = tuple(int(pr0.bounds[c]) for c in sp.cuts)
        got = fewest_step(cap, pr0, layers, config, cuts, budget)
        if got is None:
            continue
        chosen, pr, step = got
        if step < best[0]:
            rec = frozenset().union(*(layer_nodes(cap)[lay][0] for lay in chosen))
            kept = frozenset().union(*(layer_nodes(cap)[lay][1] for lay in chosen))
            again = Solved(bare.problem, replace(bare.cost, recompute=frozenset(rec),
                                                 recompute_kept=frozenset(kept)), bare.choice)
            best = (step, ((replace(solved[0], recompute=chosen), again),
                           replace(pr, solved=again), sp))
    return best[1]


def _cut(pr, config, limit: float):
    p, v, m, schedule = config
    return plan_stages(pr.layer_costs(), n_devices=p, global_batch=pr.nc.batch * m,
                       memory_limit=max(limit, 1.0), bandwidth=pr.bandwidth, n_stages=p,
                       micro_batches=m, schedule=schedule, virtual_stages=v, explain=False,
                       fixed_cuts=pr.fixed_cuts)
