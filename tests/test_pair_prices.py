"""The sharding ILP's price memos give the prices they stand for.

- ``PriceTable.pair`` (a pair of classes priced once per edge signature) equals
  ``PriceTable.edge``'s own price of every pair of every edge, under recomputation (edges
  rerun), repeated layers (edges counted), parameters (bucketed) and a gradient-sync
  scale below 1; and edges of one signature do share pairs (else the memo saves nothing).
- ``build_problem`` walks a graph once (``GraphIndex.walk``) and builds each mesh's
  problem from it: a mesh built again after another equals its first build, and the two
  problems share no mutable state.
- ``local_shape`` (which skips work when nothing is sharded) equals its plain definition.
"""
from __future__ import annotations

import random

import pytest

from autopar.analysis.layers import recompute_nodes, repeated_layers
from autopar.cost_models.hardware import parse_cluster
from autopar.mesh_roles import MeshRoles
from autopar.placement import Partial, Replicate, Shard, local_shape
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import CostModel, StepView, grad_partial_flags
from autopar.pricing.prices import PriceTable
from autopar.pricing.problem import build_problem
from conftest import example_and_capture


@pytest.fixture(scope="module")
def gpt():
    return example_and_capture("gpt")[1]


def test_pair_prices_equal_edge_prices(gpt):
    mesh = (2, 2)
    problem = build_problem(gpt, mesh, MeshRoles(data=0, tensor=1))
    layers = sorted(repeated_layers(gpt.gm))
    assert layers, "the premise: a model with repeated layers (edges counted, recomputed)"
    cost = CostModel.for_pins(parse_cluster("1x4xH100"), mesh, {"precision": "bf16"}, data_axis=0,
                              recompute=recompute_nodes(gpt.gm, layers[:1]),
                              view=StepView(grad_sync_scale=0.5))
    pt = PriceTable(problem, cost)
    pairs = checked = 0
    kinds = set()
    for k, e in enumerate(problem.edges):
        sig = pt.signature(k)
        u, v = problem.vars[e.src], problem.vars[e.dst]
        kinds.add((u.kind == "param", e.count > 1, pt._rerun(e.dst) > 0))
        for p in {output_placements(c, e.src_out) for c in u.options}:
            for q, gp in {(input_placements(c, e.dst_in), grad_partial_flags(c, e.dst_in)) for c in v.options}:
                price = pt.edge(k, p, q, gp)
                assert pt.pair(sig, pt.number(p), pt.number((q, gp)))[1:] == (
                    price.priced(0.5), price.hidden(0.5)), (e, p, q, gp)
                checked += 1
    pairs = len(pt._pairs)
    assert {(True, True), (False, True)} <= {(b, c) for b, c, _ in kinds}, kinds
    assert any(r for *_, r in kinds), "some edge reruns (recomputation)"
    assert pairs < checked, "edges of one signature share their pairs' prices"


def test_problem_rebuilt_from_the_walk_is_equal(gpt):
    def summary(problem):
        return ({n: (v.kind, v.options, v.members, v.kept) for n, v in problem.vars.items()},
                problem.edges, problem.sink, problem.rep)

    first = build_problem(gpt, (4,), MeshRoles(data=0))
    want = summary(first)
    other = build_problem(gpt, (2, 2), MeshRoles(data=0, tensor=1))
    first_vars = {n: v for n, v in first.vars.items()}
    again = build_problem(gpt, (4,), MeshRoles(data=0))
    assert summary(again) == want
    assert summary(other) != want
    name = next(iter(first_vars))
    assert again.vars[name] is not first_vars[name]
    assert again.vars[name].members is not first_vars[name].members
    assert again.edges is not first.edges


def _local_shape_plain(shape, placements, mesh_shape):
    """``local_shape``'s plain definition (as it was written before its fast path)."""
    out = list(shape)
    sharded, strided = {}, set()
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            d = p.dim % len(out) if out else 0
            if not out or out[d] % (n * p.groups):
                return None
            sharded[d] = sharded.get(d, 0) + 1
            if p.groups > 1:
                strided.add(d)
            out[d] //= n
    if any(sharded[d] > 1 for d in strided):
        return None
    return tuple(out)


def test_local_shape_equals_its_plain_definition():
    rng = random.Random(0)
    seen = set()
    for _ in range(4000):
        shape = tuple(rng.choice([1, 2, 3, 4, 6, 8, 12]) for _ in range(rng.randint(0, 3)))
        mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 3)))
        placements = tuple(rng.choice([Replicate(), Partial(), Shard(rng.randint(-2, 2)),
                                       Shard(rng.randint(0, 2), rng.choice([2, 3]))]) for _ in mesh)
        got = local_shape(shape, placements, mesh)
        assert got == _local_shape_plain(shape, placements, mesh), (shape, placements, mesh)
        seen.add(got is None)
    assert seen == {True, False}
