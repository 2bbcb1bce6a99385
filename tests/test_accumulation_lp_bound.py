"""The gradient-accumulation stage's programs bounded by their LP relaxation
(``solver.lp_bound``, ``MeshAsk.cutoff_s``, issue 40): the relaxation is below every
program's optimum and counts what the compute floor does not; a search with a cutoff
returns the plan the search without one returns wherever that plan is below the cutoff,
and solves fewer programs where the cutoff is below it."""
from __future__ import annotations

import math

import pytest
import torch

from autopar.options import check_optimizer
from autopar.pricing.costing import StepView
from autopar.pricing.prices import compute_floor
from autopar.solver import accumulate, flat
from autopar.solver.driver import _spec
from autopar.solver.flat import BeyondCutoff, MeshAsk, solve_ask
from autopar.solver.ilp import InfeasibleError, solve as solve_ilp
from autopar.solver.lp_bound import lp_bound
from autopar.solver.meshes import mesh_candidates
from autopar.solver.spec import Settings
from examples.models import gpt_factory

CLUSTER = "8xA100"


def _spec_of(budget: float | None, pins=None):
    """GPT (hidden 256, 2 layers, sequence 256, batch 32) on 8 A100s, under ``budget``
    bytes per device (as ``test_accumulation_bound``'s, without its data pin: every mesh)."""
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=2, n_embd=256, n_head=4, block_size=256, vocab_size=256)
    return _spec(ex.model, ex.inputs, ex.loss_fn, ex.target, CLUSTER, None, pins or {"zero": 0},
                 Settings(memory_budget=budget))


@pytest.fixture(scope="module")
def spec_and_budget():
    """A budget half-way between the whole batch's plan and 2 micro-batches', so that the
    stage plans at least k = 2 and memory binds on some meshes."""
    free = _spec_of(None)
    whole = accumulate.plan_accumulated(free, 1)[0]
    two = accumulate.plan_accumulated(free, 2)[0]
    budget = (whole.estimate.memory_total + two.estimate.memory_total) / 2
    return _spec_of(budget), budget


def _programs(spec, k: int):
    """Every (problem, cost) the accumulation's search at ``k`` may solve on the first
    ZeRO stage: each mesh, without and with every layer recomputed."""
    cap = accumulate.capture_accumulated(spec.model, spec.example_inputs, spec.loss_fn,
                                         spec.target, k)
    n_states = check_optimizer("adamw")
    out = []
    for shape, _, roles in mesh_candidates(spec.world, spec.options, None,
                                           spec.cluster.devices_per_node):
        for rec in (None, "full"):
            job = flat.MeshJob(shape, roles, rec, spec.options, n_states, spec.budget)
            problem = flat._problem(cap, shape, roles, spec.options.zero_stage, n_states)
            cost = flat._cost_model(cap, spec.cluster, job, view=StepView(grad_sync_scale=1 / k))
            out.append((shape, rec, problem, cost))
    return out


def test_lp_bound_is_below_every_optimum_and_above_the_compute_floor(spec_and_budget):
    spec, budget = spec_and_budget
    tighter = 0
    for shape, rec, problem, cost in _programs(spec, 2):
        bound = lp_bound(problem, cost, budget)
        try:
            sol = solve_ilp(problem, cost, budget, 60.0, explain=False)
        except InfeasibleError:
            continue                       # an infeasible program has no optimum to be below
        assert math.isfinite(bound), (shape, rec)
        assert bound <= sol.objective_s, (shape, rec, bound, sol.objective_s)
        floor = compute_floor(problem, cost)
        assert bound >= floor * (1 - 1e-6), (shape, rec, bound, floor)
        tighter += bound > floor * 1.01
    assert tighter, "the relaxation counts communication on some mesh: above its compute floor"


def test_an_infeasible_relaxation_means_nothing_fits(spec_and_budget):
    spec, _ = spec_and_budget
    _, _, problem, cost = _programs(spec, 2)[0]
    assert lp_bound(problem, cost, 1.0) == math.inf         # one byte per device
    with pytest.raises(InfeasibleError):
        solve_ilp(problem, cost, 1.0, 60.0, explain=False)


def _ask(spec, k: int, cutoff: float = math.inf, pruned=None) -> MeshAsk:
    return MeshAsk(spec.cluster, spec.world, spec.options, spec.settings,
                   view=StepView(grad_sync_scale=1.0 / k), explain=False, cutoff_s=cutoff,
                   pruned=pruned if pruned is not None else [])


def _counting(monkeypatch) -> list:
    solved = []
    real = flat._solve_program

    def counted(problem, cost, *a, **kw):
        # the program: its mesh, whether it recomputes, its micro-batch's share of a step
        solved.append((tuple(problem.mesh_shape), bool(cost.recompute), cost.grad_sync_scale))
        return real(problem, cost, *a, **kw)
    monkeypatch.setattr(flat, "_solve_program", counted)
    return solved


def test_a_cutoff_above_the_plan_keeps_it(spec_and_budget, monkeypatch):
    spec, _ = spec_and_budget
    cap = accumulate.capture_accumulated(spec.model, spec.example_inputs, spec.loss_fn,
                                         spec.target, 2)
    solved = _counting(monkeypatch)
    plain, _ = solve_ask(cap, _ask(spec, 2))
    n_plain = len(solved)
    objective = plain.solver.objective_s
    pruned: list = []
    kept, _ = solve_ask(cap, _ask(spec, 2, objective * (1 + 1e-6), pruned))
    assert kept.digest() == plain.digest()
    assert len(solved) - n_plain <= n_plain
    # at the plan's own objective nothing is below: every program that fits is left unsolved
    with pytest.raises(BeyondCutoff):
        solve_ask(cap, _ask(spec, 2, objective * (1 - 1e-6)))


def test_bounded_stage_picks_the_unbounded_plan(spec_and_budget, monkeypatch):
    """The stage with the caller's best just above its plan returns that plan. With a best
    the relaxation proves some 2-micro-batch program cannot beat (one whose compute floor
    could not), that program is not solved, and no plan below that best is returned."""
    spec, budget = spec_and_budget
    solved = _counting(monkeypatch)
    unbounded = accumulate.search_accumulation(spec)
    assert unbounded is not None, "the test needs a plan that accumulates"
    unbounded_solved = list(solved)
    step = unbounded[0].estimate.step_time_s
    del solved[:]
    got = accumulate.search_accumulation(spec, step * (1 + 1e-9))
    assert got is not None and got[0].digest() == unbounded[0].digest()
    # the largest relaxation among 2-micro-batch programs it is tighter than the floor on
    bounds = [(lp_bound(p, c, budget), compute_floor(p, c), (shape, rec is not None, 0.5))
              for shape, rec, p, c in _programs(spec, 2)]
    tighter = [b for b in bounds if math.isfinite(b[0]) and b[0] > b[1] * 1.01
               and b[2] in unbounded_solved]
    assert tighter, "the test needs a program the unbounded stage solves, its relaxation tighter"
    lp, _, program = max(tighter)
    best_s = 2 * lp * (1 - 1e-12)
    assert best_s < step, "a best the stage's plan would beat is no test of pruning"
    del solved[:]
    notes: list = []
    got = accumulate.search_accumulation(spec, best_s, notes)
    # a program whose relaxation is below the cutoff is solved, and may still give a step at
    # or above it: the caller (the least step wins, the first of equals) does not take it
    assert got is None or got[0].estimate.step_time_s >= best_s
    assert program not in solved, (program, solved)
    assert notes and "not solved" in notes[0], notes


def test_the_note_names_the_counts():
    note = accumulate.pruned_note({2: [((8,), None, "")] * 3, 4: []})
    assert note == ["gradient accumulation: 3 sharding programs not solved (3 at 2 micro-batches): "
                    "their LP relaxation gives no step below the best plan found (exact); the "
                    "fewest-layers probes and activation offload of those programs not tried"]
    assert accumulate.pruned_note({2: []}) == []


def test_a_count_is_settled_by_a_1d_program_without_recomputation(spec_and_budget, monkeypatch):
    """``fits_unrecomputed`` solves only unsolved programs without recomputation on 1-D
    meshes (cheap to price), and ``Unsolved.fits`` is their ILP's feasibility."""
    spec, budget = spec_and_budget
    shape, rec, problem, cost = next(p for p in _programs(spec, 2) if p[1] is None)
    assert flat.Unsolved(shape, None, "", problem, cost, math.inf, 60.0).fits()
    assert not flat.Unsolved(shape, None, "", problem, cost, 1.0, 60.0).fits()
    asked = []
    monkeypatch.setattr(flat.Unsolved, "fits", lambda self: asked.append(self.shape) or True)
    some = [flat.Unsolved((2, 4), None, "", None, None, budget, 60.0),
            flat.Unsolved((8,), "full", "", None, None, budget, 60.0),
            ((8,), None, "")]                      # a count settled before: prices freed
    assert not accumulate.fits_unrecomputed(some) and asked == []
    assert accumulate.fits_unrecomputed(some + [flat.Unsolved((8,), None, "", None, None,
                                                              budget, 60.0)])
    assert asked == [(8,)]
