"""The free pipeline search's compute floor of a stage mesh, before its ILP
(``pipeline_free._DegreeSearch.compute_floor``), and the price table's node prices without
its edges (``prices.PriceTable.follow``, worked out on first use).

- the floor is below the pipeline step floor of the solved mesh (``step_floor``), and so
  below every predicted step of it, on every stage mesh of every degree;
- pruning by it plans what the search plans without it (same digest), and a mesh whose
  floor is at least the best found is neither built nor solved;
- ``compute_floor`` prices no edge. Plans on the meta device."""
from __future__ import annotations

import functools
import math

import torch

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.options import as_options
from autopar.pricing.prices import compute_floor, price_table
from autopar.solver import flat, pipeline_free
from autopar.solver.driver import solve
from autopar.solver.pipeline_price import batch_degree, price_plan
from autopar.solver.pipeline_search import (_allowed_micro_batches, most_stages, stage_limit,
                                            step_floor)
from autopar.solver.spec import SearchSpec
from examples.models import gpt_factory

CLUSTER = "4x4xA100"
"""Four nodes: the free search weighs pipelines of 2 and 4 stages, each on meshes of 1, 2
and 4 tensor-parallel ranks."""


@functools.cache
def _gpt():
    """A 4-layer GPT wide enough that device time binds (as ``test_pipeline_degrees``)."""
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=4, n_embd=1024, n_head=8, block_size=512, vocab_size=256)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _search(ex, cap, pins=None):
    cl = parse_cluster(CLUSTER)
    spec = SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target, cl, cl.world_size,
                      as_options(pins or {"precision": "bf16"}), time_limit_s=30.0)
    return pipeline_free.degree_search(spec, cap)


def test_stage_floor_is_below_the_solved_meshs_step_floor():
    """On every stage mesh of every degree: 0 < floor <= ``step_floor`` of its intra-stage
    solution (itself below every step ``_choose`` predicts), here 60-100% of it."""
    ex, cap = _gpt()
    search = _search(ex, cap)
    assert len(search.meshes) >= 6
    for p, data, tensor, expert in search.meshes:
        floor = search.compute_floor(p, data, tensor, expert)
        intra, sol = search._solve(p, data, tensor, expert)
        pr = price_plan(cap, intra, sol, search.cl, search.world, p,
                        most_stages(search.pins, p, stage_limit(cap)))
        allowed = _allowed_micro_batches(search.batch, batch_degree(cap, intra))
        above = step_floor(pr, p, search.batch, search.pins, allowed)
        assert 0 < floor <= above * (1 + 1e-9), (p, data, tensor, floor, above)
        got = search._on_mesh(p, data, tensor, expert)
        assert got is None or floor <= got[0], (p, data, tensor, floor, got)


@functools.cache
def _tight():
    """An 8-layer GPT of width 64 (16 heads) on one node of 8 A100s with 6 MiB a device: no
    unpipelined plan fits, so the free search weighs pipelines of 2, 4 and 8 stages on
    every stage mesh (no gradient accumulation: ``accumulate=1``)."""
    with torch.device("meta"):
        ex = gpt_factory(batch=48, n_layer=8, n_embd=64, n_head=16, block_size=128, vocab_size=256)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _free_plan(monkeypatch, ex, cap, floor=None):
    """The free search's plan and the stage meshes it solved; ``floor``: stands in for the
    stage floor (None: the real one)."""
    solved = []
    real = pipeline_free._DegreeSearch._solve

    def counting(self, p, data, tensor, expert=1):
        solved.append((p, data, tensor, expert))
        return real(self, p, data, tensor, expert)
    monkeypatch.setattr(pipeline_free._DegreeSearch, "_solve", counting)
    if floor is not None:
        monkeypatch.setattr(pipeline_free._DegreeSearch, "compute_floor",
                            lambda self, *mesh: floor(mesh))
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "0")
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x8xA100",
                    captured=cap, pins={"accumulate": 1}, memory_budget=6 * 2**20,
                    time_limit_s=30.0)
    monkeypatch.undo()
    return plan, solved


def test_pruning_by_the_stage_floor_plans_the_same(monkeypatch):
    """The search with the floor (real), without it (-inf: nothing pruned) and with a floor
    above every best on the meshes that lose: one plan (digest), and those meshes are not
    solved; the winner's mesh is."""
    ex, cap = _tight()
    pruned, solved = _free_plan(monkeypatch, ex, cap)
    unpruned, every = _free_plan(monkeypatch, ex, cap, floor=lambda mesh: -math.inf)
    assert pruned.pipeline_stages > 1, "the case must plan a pipeline"
    assert pruned.digest() == unpruned.digest()
    assert set(solved) <= set(every)
    axes = dict(zip(unpruned.mesh_axes, unpruned.mesh_shape))
    winner = (axes["pipeline"], axes.get("data", 1), axes.get("tensor", 1), axes.get("expert", 1))
    assert winner in every, (unpruned.mesh_axes, unpruned.mesh_shape, every)
    first = every[0]
    losers = {m for m in every if m != winner and m != first}
    assert losers, "the case must solve meshes that lose"
    got, solved = _free_plan(monkeypatch, ex, cap,
                             floor=lambda mesh: math.inf if mesh in losers else -math.inf)
    assert got.digest() == unpruned.digest()
    assert not losers & set(solved) and winner in solved


def test_compute_floor_prices_no_edge():
    """The floor reads node prices only: the followers' picks (which price edges) are left
    to the ILP, which builds them on first use, alike."""
    _, cap = _gpt()
    cl = parse_cluster("1x8xA100")
    pins = as_options({"precision": "bf16"})
    problem = flat._problem(cap, (8,), flat.MeshRoles(data=0), 0, 2)
    cost = flat._cost_model(cap, cl, flat.MeshJob((8,), flat.MeshRoles(data=0), None, pins, 2))
    floor = compute_floor(problem, cost)
    pt = price_table(problem, cost)
    assert floor > 0 and pt._follow is None and not pt._pairs
    assert pt.follow and pt._pairs            # built when asked


def test_each_pipeline_degree_reaches_the_reporter(monkeypatch):
    """The pipeline search tells the open reporter each degree it begins and ends (a long
    first stage says where it is), inside the stage "pipeline search"."""
    from autopar.solver import progress
    ex, cap = _tight()
    seen = []
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "0")
    with progress.reporting(lambda *a: seen.append(a)):
        solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x8xA100", captured=cap,
              pins={"accumulate": 1}, memory_budget=6 * 2**20, time_limit_s=30.0)
    began = [s for s, sec, _ in seen if sec is None]
    ended = [s for s, sec, _ in seen if sec is not None]
    degrees = [s for s in began if s.startswith("pipeline search p=")]
    assert degrees == [f"pipeline search p={p}" for p in (2, 4, 8)]
    assert degrees == [s for s in ended if s.startswith("pipeline search p=")]
    assert began.index("pipeline search") < began.index(degrees[0])
