"""One conversion of a value per placement, for all its readers (issue 11): the runtime emits
one chain of collectives per (value, placement, partial-gradient flags) and the solver
prices it once.

Llama's tensor-parallel layer reads the normed hidden state in wq, wk and wv (and the FFN's
in w1 and w3): Megatron-LM converts it once per group, so does autopar. The multi-rank check
(a tiny Llama whose activations are sharded between the tensor-parallel regions, trained on
gloo: one gather per value, equal to one device) is a case of tests/test_zero.py's two-rank
spawn (``launch.register_cases``); here the prices, and the per-rank program built on one
process.
"""
from __future__ import annotations

import collections

import pytest
import torch
from ortools.linear_solver import pywraplp

from autopar.cost_models.hardware import parse_cluster
from autopar.ops import collectives
from autopar.passes.insert_collectives import insert_collectives
from autopar.runtime.shards import shard_model
from autopar.sharding.registry import input_placements, output_placements
from autopar.solver import ilp
from autopar.pricing.costing import grad_partial_flags
from autopar.solver.flat import solve_captured
from autopar.pricing.prices import price_table
from conftest import example_and_capture
from launch import case_result, register_cases, shared_cases

# the sharded-activations case: a budget 0.85 of Megatron's layout's memory (no recomputation)
SHARDED_CASE = {"id": "shared-conversions-sharded-activations-llama", "model": "llama",
                 "pins": {"tensor": 2, "recompute": "none"}, "budget": 0.85,
                 "shared_conversion_case": True}
register_cases("zero_worker.py", 2, [SHARDED_CASE])     # run in test_zero's spawn

_MOVES = {collectives.all_gather, collectives.all_reduce, collectives.grad_all_reduce,
          collectives.scatter, collectives.reduce_scatter, collectives.all_to_all,
          collectives.to_partial, collectives.shard_to_partial}


@pytest.fixture(scope="module")
def tensor_parallel_llama():
    """The tiny Llama planned with tensor=2 on 2 CPU ranks (Megatron's layout: the normed
    hidden state read replicated by wq, wk, wv, its gradient all-reduced in backward), and
    the value of the ILP's objective at its optimum."""
    ex, cap = example_and_capture("llama")
    made = []
    create = pywraplp.Solver.CreateSolver

    def keep(name):
        made.append(create(name))
        return made[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ilp.pywraplp.Solver, "CreateSolver", staticmethod(keep))
        plan, solved = solve_captured(cap, parse_cluster("cpu:2"), 2, pins={"tensor": 2})
    return ex, cap, plan, solved, made[-1].Objective().Value()


def test_the_ilp_prices_a_conversion_its_readers_share_once(tensor_parallel_llama):
    """The plan's communication is every edge's conversion at the chosen placements, each
    distinct (value, consumer placement, partial-gradient flags) once; the ILP's objective is
    the printed estimate. Priced per reader (the old way) the same plan costs more."""
    _, _, plan, solved, objective = tensor_parallel_llama
    pt = price_table(solved.problem, solved.cost)
    problem, choice, scale = solved.problem, solved.choice, solved.cost.grad_sync_scale
    per_reader, once, seen, repeats = 0.0, 0.0, set(), collections.Counter()
    for k, e in enumerate(problem.edges):
        cu, cv = problem.vars[e.src].options[choice[e.src]], problem.vars[e.dst].options[choice[e.dst]]
        pair = (output_placements(cu, e.src_out), input_placements(cv, e.dst_in),
                grad_partial_flags(cv, e.dst_in))
        t = pt.edge(k, *pair).priced(scale)[0]
        per_reader += t
        # the runtime shares an activation's conversion among readers with their own decision
        # (a follower's input and a parameter's read are priced on their own, as before)
        own = (e.dst in pt.follow or problem.vars[e.src].kind == "param"
               or pt.root(e.src) == pt.root(e.dst))
        key = (e.src, e.src_out, e.count, pair)
        if own or key not in seen or t == 0:
            once += t
        else:
            repeats[e.src] += 1
        seen.add(key)
    if problem.sink:
        sink = pt.sink(problem.sink[0], choice[problem.sink[0]]).priced(scale)[0]
        per_reader, once = per_reader + sink, once + sink
    est = plan.estimate
    # the normed hidden states (of every layer, one decision): q, k, v read one, w1, w3 another
    assert sorted(repeats.values()) == [1, 2], repeats
    assert once < per_reader
    assert once + est.comm.get("overlapped", 0.0) == pytest.approx(est.comm_s, rel=1e-9, abs=1e-15)
    assert objective == pytest.approx(est.step_time_s, rel=1e-6)


def _program(cap, plan, model, stage_of=None):
    root, shards = shard_model(cap, plan, (0,) * len(plan.mesh_shape), model, torch.device("cpu"))
    return insert_collectives(cap, plan, root, shards.attr_of, "loss", stage_of=stage_of).gm


def _conversions(gm) -> collections.Counter:
    """(collective, the value it reads, its arguments) -> how many such nodes."""
    out = collections.Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _MOVES:
            out[(n.target.__name__, n.args[0].name, tuple(sorted(n.kwargs.items())))] += 1
    return out


def test_one_conversion_per_value_and_placement_within_a_stage(tensor_parallel_llama):
    """Each (value, collective) once in the per-rank program, read by every reader that
    needs it; cut into pipeline stages between wq and wk, the stage of wk converts its own."""
    ex, cap, plan, _, _ = tensor_parallel_llama
    gm = _program(cap, plan, ex.model)
    conv = _conversions(gm)
    assert conv and set(conv.values()) == {1}, conv
    # each layer's wq, wk, wv read one conversion of their input, w1 and w3 another
    linears = [n.name for n in cap.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 2 * 7 + 1
    local = {n.meta.get("source"): n for n in gm.graph.nodes}
    for layer in range(2):
        q, k, v, _, w1, w3, _ = linears[7 * layer: 7 * layer + 7]
        for group in ((q, k, v), (w1, w3)):
            moved = {local[name].args[0] for name in group}
            assert len(moved) == 1 and next(iter(moved)).target is collectives.grad_all_reduce, group
    # the first layer's q, k, v projections: q in stage 0, k and v (and the rest) in stage 1
    q, k = linears[0], linears[1]
    stage_of, stage = {}, 0
    for n in cap.gm.graph.nodes:
        stage = 1 if n.name == k else stage
        stage_of[n.name] = stage
    split = _program(cap, plan, ex.model, stage_of)
    twice = [key for key, c in _conversions(split).items() if c > 1]
    assert len(twice) == 1 and twice[0][0] == "grad_all_reduce", twice
    local = {n.meta.get("source"): n for n in split.graph.nodes}
    assert local[q].args[0] is not local[k].args[0] and local[k].args[0] is local[linears[2]].args[0]
    assert local[q].args[0].args[0].name == twice[0][1] == local[k].args[0].args[0].name


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return shared_cases("zero_worker.py", 2, tmp_path_factory.mktemp("zero"), timeout=600, case_timeout=120)


def test_sharded_activations_llama_gathers_once_per_value_on_gloo(results):
    """Under the budget the plan shards the activations between the tensor-parallel regions
    (below Megatron's memory: the norms' inputs and outputs split on the sequence or the
    batch, whichever the solver finds cheaper) and gathers the normed hidden states: each
    once, for all of wq, wk, wv (3 readers) or w1, w3 (2); no collective repeated on one
    value; 3 training steps equal one device (loss, every gradient, every weight)."""
    r = case_result(results, SHARDED_CASE["id"])
    assert r["memory"] < r["megatron_memory"], r
    assert r["moves"] and set(r["moves"].values()) == {1}, r["moves"]
    readers = sorted(n for _, dim, n in r["gathers"] if dim in (0, 1))    # [batch, sequence, dim]
    assert readers.count(3) >= 2 and readers.count(2) >= 2, r["gathers"]      # two layers
