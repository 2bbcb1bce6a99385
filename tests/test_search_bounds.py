"""Bounds of the free search that skip work without changing the plan
(``autopar.solver.flat``, ``autopar.solver.free_search``):

- ``prices.compute_floor``: no solution of a sharding program predicts less than the sum of
  every node's least compute; a program whose floor is at least the best objective found so
  far in its search is not solved (``flat._search``);
- ``lp_bound.best_first``: large programs are bounded by their LP relaxation first and
  solved in the order of those bounds, each skipped whose bound is not below the best;
- where nothing fits unpipelined, how far from fitting each mesh is (least-memory ILPs) is
  worked out only if no other stage of the free search finds a plan either
  (``solve_captured(explain="later")``).

Each holds the plan to the one the search makes without it. Plans on the meta device."""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.mesh_roles import MeshRoles
from autopar.options import Options
from autopar.pricing.prices import compute_floor
from autopar.solver import flat
from autopar.solver.driver import solve
from autopar.solver.errors import InfeasibleError
from autopar.solver.ilp import solve as solve_ilp
from autopar.solver.meshes import mesh_candidates
from examples.models import gpt_factory


@functools.cache
def _gpt(batch: int = 16, layers: int = 2, hidden: int = 1024, seq: int = 256):
    with torch.device("meta"):
        ex = gpt_factory(batch=batch, n_layer=layers, n_embd=hidden, n_head=8, block_size=seq,
                         vocab_size=1000)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _chosen(plan) -> dict:
    """Everything the plan chose (placements, mesh, options, estimate), not the solver's
    report of how long it took."""
    return {k: v for k, v in plan.to_dict().items() if k != "solver"}


# ---- the compute floor ----------------------------------------------------------------------

@pytest.mark.parametrize("cluster,world,precision", [("1x8xA100", 8, None), ("2x8xA100", 16, "bf16")])
def test_compute_floor_is_below_every_solved_objective(cluster, world, precision):
    """On every mesh the search tries, with and without recomputation, and ZeRO-3 on the
    data axis: the floor is positive and at most the ILP's optimum (here 40-85% of it).

    Checked against CBC's proven bound (``Solution.bound_s``: at most the optimum, the
    optimum itself once solved), so a 2-second search suffices: proving the 2-D meshes'
    optima took 46-91 s each, and ``floor <= bound <= optimum`` says as much."""
    _, cap = _gpt()
    cl = parse_cluster(cluster)
    pins = Options.from_pins({"precision": precision} if precision else {})
    programs = [(shape, roles, 0) for shape, _, roles in mesh_candidates(world, pins, None, cl.devices_per_node)]
    programs.append(((world,), MeshRoles(data=0), 3))
    for shape, roles, zero in programs:
        for rec in flat._recompute_choices(cap, pins):
            zpins = pins.replace(zero=zero) if zero else pins
            problem = flat._problem(cap, shape, roles, zero, 2)
            cost = flat._cost_model(cap, cl, flat.MeshJob(shape, roles, rec, zpins, 2))
            floor = compute_floor(problem, cost)
            sol = solve_ilp(problem, cost, None, 2.0)
            assert sol.bound_s <= sol.objective_s * (1 + 1e-9)
            assert 0 < floor <= sol.bound_s * (1 + 1e-9), (shape, rec, zero, floor, sol.bound_s)


# ---- pruning in the mesh search --------------------------------------------------------------

def _plan_counting(monkeypatch, ex, cap, cluster, pins, prune=True, floors=None):
    """The free search's plan, and the meshes whose ILP it solved; ``prune=False``: with
    the bound switched off; ``floors``: {mesh shape: seconds} in place of the real floor."""
    solved = []
    real_solve = flat._solve_program

    def counting(problem, cost, *a, **k):
        solved.append(tuple(problem.mesh_shape))
        return real_solve(problem, cost, *a, **k)
    monkeypatch.setattr(flat, "_solve_program", counting)
    if floors is not None:
        monkeypatch.setattr(flat, "compute_floor",
                            lambda problem, cost: floors.get(tuple(problem.mesh_shape), 0.0))
    if not prune:
        monkeypatch.setattr(flat, "_cannot_beat", lambda *a: False)
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                    captured=cap, pins=pins)
    monkeypatch.undo()
    return plan, solved


@pytest.mark.parametrize("cluster,pins,model", [
    ("1x8xA100", {}, {}),
    # narrower and longer: the 2-D meshes' bf16 ILPs of the 1024-wide model take CBC 1-4 min
    # to prove optimal, on both sides of the comparison
    ("2x8xA100", {"precision": "bf16", "pipeline": 1, "accumulate": 1}, {"hidden": 256, "batch": 64}),
    ("1x8xA100", {"precision": "bf16"}, {"hidden": 256, "batch": 64}),
])
def test_pruning_plans_what_the_unpruned_search_plans(monkeypatch, cluster, pins, model):
    ex, cap = _gpt(**model)
    pruned, _ = _plan_counting(monkeypatch, ex, cap, cluster, pins)
    unpruned, _ = _plan_counting(monkeypatch, ex, cap, cluster, pins, prune=False)
    assert _chosen(pruned) == _chosen(unpruned)


def test_a_mesh_that_cannot_beat_the_best_is_not_solved_and_the_plan_stays(monkeypatch):
    """A floor above the best found so far (stood in for here on the last mesh tried that
    does not win) skips that mesh's ILPs, with and without recomputation; the winner is
    still solved and chosen. A floor at most the best's proves nothing: the mesh is solved."""
    ex, cap = _gpt()
    unpruned, every = _plan_counting(monkeypatch, ex, cap, "1x8xA100", {}, prune=False)
    loser = [m for m in every if m != tuple(unpruned.mesh_shape)][-1]
    best_s = unpruned.solver.objective_s
    plan, solved = _plan_counting(monkeypatch, ex, cap, "1x8xA100", {}, floors={loser: 10 * best_s})
    assert loser not in solved and tuple(plan.mesh_shape) in solved
    assert _chosen(plan) == _chosen(unpruned)
    # the floor of the winner's own mesh never prunes it (it is at most its objective)
    plan, solved = _plan_counting(monkeypatch, ex, cap, "1x8xA100", {},
                                  floors={tuple(unpruned.mesh_shape): best_s})
    assert tuple(unpruned.mesh_shape) in solved and _chosen(plan) == _chosen(unpruned)


def test_best_first_orders_the_large_programs_by_their_bound():
    """Small programs first, in their order; then the large ones a cheaper bound settles
    (asked only once the small ones are out), unbounded; then the others by bound, ties in
    their order, a bound not worked out in time (-inf) last; no small or settled program's
    bound is worked out."""
    from autopar.solver.lp_bound import best_first
    items = [("a", 3.0, True), ("b", 9.0, False), ("c", float("-inf"), True), ("d", 1.0, True),
             ("e", 3.0, True), ("f", 0.5, False), ("g", 0.1, True)]
    asked, done = [], []
    got = best_first(items, lambda it: asked.append(it[0]) or it[1], lambda it: it[2],
                     settled=lambda it: done == ["b", "f"] and it[0] == "g")
    order = []
    for it, lp in got:
        order.append((it[0], lp))
        done.append(it[0])
    assert order == [("b", None), ("f", None), ("g", None), ("d", 1.0), ("a", 3.0), ("e", 3.0),
                     ("c", float("-inf"))]
    assert sorted(asked) == ["a", "c", "d", "e"]
    # one large program alone: its bound would order nothing, and is not worked out
    asked.clear()
    got = best_first([("x", 2.0, True), ("y", 1.0, False)], lambda it: asked.append(it[0]) or it[1],
                     lambda it: it[2])
    assert [(it[0], lp) for it, lp in got] == [("y", None), ("x", None)] and not asked


@pytest.mark.parametrize("cluster,pins", [("1x8xA100", {}), ("1x8xA100", {"precision": "bf16"})])
def test_lp_bounds_first_skip_meshes_and_keep_the_plan(monkeypatch, cluster, pins):
    """Every program taken as large (``LP_FIRST_ABOVE`` 0): the meshes are solved in the
    order of their relaxations and those bounded at or above the best are not solved; the
    plan is the one the search makes with no program large (the winner's objective is the
    least, so no bound below it was skipped), and fewer programs are solved."""
    _, cap = _gpt()
    ex, _ = _gpt()
    monkeypatch.setattr(flat, "LP_FIRST_ABOVE", float("inf"))
    plain, plain_solved = _plan_counting(monkeypatch, ex, cap, cluster, pins, prune=False)
    monkeypatch.setattr(flat, "LP_FIRST_ABOVE", 0)
    bounded, solved = _plan_counting(monkeypatch, ex, cap, cluster, pins, prune=False)
    assert _chosen(bounded) == _chosen(plain)
    assert len(solved) < len(plain_solved), (solved, plain_solved)


# ---- explaining infeasibility only when nothing else fits ------------------------------------

def test_no_least_memory_ilp_when_a_pipeline_fits(monkeypatch):
    """Three A100s, a budget no unpipelined plan fits: the pipeline search plans it, and the
    least-memory ILPs that would say how far each mesh is from fitting are never solved
    (they were, before the pipelines were weighed)."""
    with torch.device("meta"):
        ex = gpt_factory(batch=48, n_layer=9, n_embd=64, n_head=4, block_size=128, vocab_size=256)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    explained = []
    real = flat.explain_infeasible
    monkeypatch.setattr(flat, "explain_infeasible", lambda *a: explained.append(a) or real(*a))
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x3xA100",
                    pins={"accumulate": 1}, memory_budget=16 * 2**20, captured=cap)
    assert plan.pipeline_stages == 3 and not explained
    with pytest.raises(InfeasibleError) as info:    # unpipelined alone: nothing fits
        flat.plan_captured(cap, parse_cluster("1x3xA100"), 3, memory_budget=16 * 2**20,
                           pins={"accumulate": 1}, explain="later")
    assert info.value.explain_later is not None and not explained


def test_when_nothing_fits_the_error_is_explained_as_before():
    """Nothing fits at all (no pipeline, no accumulation, no offload can help a budget of
    1 MiB): the free search's error names the closest plans and the fixes, as the
    unpipelined search explaining at once does."""
    ex, cap = _gpt(batch=8, layers=2, hidden=64, seq=64)
    budget = 2**20
    with pytest.raises(InfeasibleError) as now:
        flat.plan_captured(cap, parse_cluster("cpu:4"), 4, memory_budget=budget, pins={})
    with pytest.raises(InfeasibleError) as later:
        flat.plan_captured(cap, parse_cluster("cpu:4"), 4, memory_budget=budget, pins={},
                           explain="later")
    got = later.value.explain_later()
    assert str(got) == str(now.value) and got.suggestions == now.value.suggestions
    with pytest.raises(InfeasibleError) as free:
        solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:4",
              memory_budget=budget, captured=cap, pins={"accumulate": 1})
    assert str(free.value).startswith(str(now.value)) and free.value.suggestions
