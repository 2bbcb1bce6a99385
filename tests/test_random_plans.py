"""Any plan, not only the solver's, must train like one device.

Each node gets a random option from its sharding rules (seeded), so the rewrite meets
conversions between arbitrary placements that no cost model would choose: gathers into
partial sums, all-to-alls between dims, strided shards next to plain ones, nested shards
on a 2-D mesh. The numbers must still match the single-device model.
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from autopar.api import node_placements, plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.runtime.thread_ranks import simulate
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import INF, CostModel, grad_partial_flags
from autopar.pricing.problem import build_problem
from equivalence import compare, parallel_run, reference_run

SEEDS = [int(s) for s in __import__("os").environ.get("AUTOPAR_RANDOM_PLAN_SEEDS", "0,1").split(",")]


def random_plan(cap, world, mesh, seed):
    base = plan_captured(cap, parse_cluster(f"cpu:{world}"), world, mesh_shape=mesh)
    problem = build_problem(cap, mesh)
    cost = CostModel(parse_cluster(f"cpu:{world}"), mesh)
    rng = random.Random(seed)
    choice = {}
    incoming = {}
    for e in problem.edges:
        incoming.setdefault(e.dst, []).append(e)
    for name, v in problem.vars.items():      # graph order: producers first
        options = list(range(len(v.options)))
        rng.shuffle(options)
        for i in options:
            combo = v.options[i]
            ok = all(cost.edge_time(e.meta, output_placements(problem.vars[e.src].options[choice[e.src]], e.src_out),
                                    input_placements(combo, e.dst_in),
                                    grad_partial_flags(combo, e.dst_in))[0] != INF
                     for e in incoming.get(name, []) if e.src in choice)
            if ok:
                choice[name] = i
                break
        else:
            choice[name] = 0                  # all-replicated always converts
    nodes = {**base.nodes, **node_placements(problem, choice)}
    return dataclasses.replace(base, nodes=nodes)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model, world, mesh", [
    ("gpt", 2, (2,)), ("gpt", 4, (2, 2)), ("llama", 4, (2, 2)), ("resnet", 2, (2,)), ("mlp", 4, (2, 2)),
])
def test_random_plan_matches_one_device(model, world, mesh, seed, captured):
    ex, cap = captured(model)
    plan = random_plan(cap, world, mesh, seed)
    sharded = sum(1 for p in plan.nodes.values() if any(c in "SP" for c in str(p)))
    assert sharded > len(plan.nodes) // 4, "the random plan shards too little to test anything"
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for rank, got in enumerate(simulate(cap, plan, ex.model, lambda pm, c: parallel_run(pm, ex.inputs, ex.target))):
        compare(ref, got, f"{model} random plan seed {seed} on {mesh}, rank {rank}")
