"""The follower picks' early stop (``pricing.prices.PRUNE_PICKS``) changes how many edge
prices a table computes, never a price, a pick or a plan: on small graphs the picks equal a
brute-force argmin written here, and the program with the stop solves to the same choice and
objective as without it."""
from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.pricing import prices
from autopar.pricing.costing import INF, grad_partial_flags
from autopar.sharding.registry import input_placements, output_placements
from autopar.solver import ilp
from autopar.solver.flat import solve_captured
from examples.models import EXAMPLES

CASES = {"gpt-cpu2-tensor2": ("gpt", "cpu:2", 2, {"tensor": 2}),
         "llama-2x2-h100": ("llama", "1x4xH100", 4, {"data": 2, "tensor": 2})}


@pytest.fixture(scope="module", params=sorted(CASES))
def solved(request):
    name, cluster, world, pins = CASES[request.param]
    ex = EXAMPLES[name]()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    _, sol = solve_captured(cap, parse_cluster(cluster), world, pins=pins)
    return sol


def _table(sol, prune: bool, monkeypatch) -> prices.PriceTable:
    """A fresh price table of ``sol``'s program, its picks made with or without the stop."""
    monkeypatch.setattr(prices, "PRUNE_PICKS", prune)
    sol.cost._prices = None
    pt = prices.price_table(sol.problem, sol.cost)
    pt.follow     # the picks are worked out on first use: under this setting
    return pt


def _brute_force_picks(pt: prices.PriceTable) -> dict:
    """Each follower's option of least (input edge + compute) for each option of its root,
    the first in option order among equals, every option priced: what the picks must be."""
    problem = pt.problem
    into = {e.dst: k for k, e in enumerate(problem.edges)}
    out = {}
    for name, (root, _) in pt.follow.items():
        k = into[name]
        e = problem.edges[k]
        u, v = problem.vars[e.src], problem.vars[name]
        sig = pt.signature(k, follower=True)
        picks = []
        for i in range(len(problem.vars[root].options)):
            p = pt.number(output_placements(u.options[pt.option_of(e.src, i)], e.src_out))
            totals = [pt.pair(sig, p, pt.number((input_placements(c, 0), grad_partial_flags(c, 0))))[1][0]
                      + pt.compute_s(name, j) for j, c in enumerate(v.options)]
            best = min(totals)
            assert best < INF
            picks.append(totals.index(best))
        out[name] = (root, picks)
    return out


def test_picks_are_the_brute_force_argmin(solved, monkeypatch):
    pt = _table(solved, True, monkeypatch)
    assert pt.follow, "no followers: the test would check nothing"
    assert pt.follow == _brute_force_picks(pt)


def test_the_stop_prices_fewer_pairs_and_changes_no_plan(solved, monkeypatch):
    got = {}
    for prune in (False, True):
        pt = _table(solved, prune, monkeypatch)
        n_priced = len(pt._pairs)           # the picks' pairs: the ILP has priced none yet
        tab = ilp.tabulate(solved.problem, solved.cost)
        sol = ilp.solve(solved.problem, solved.cost, None, 60.0)
        got[prune] = (dict(pt.follow), tab, sol, n_priced)
    (f0, t0, s0, n0), (f1, t1, s1, n1) = got[False], got[True]
    assert f0 == f1
    assert n1 <= n0
    assert t0.node_cost == t1.node_cost and t0.edges == t1.edges and t0.self_comm == t1.self_comm
    assert s0.status == s1.status == "OPTIMAL"
    assert s0.choice == s1.choice
    assert s0.objective_s == s1.objective_s


def test_a_negative_conversion_price_is_an_error(solved, monkeypatch):
    """The stop rests on every conversion costing >= 0 seconds: a price below is refused."""
    from autopar.pricing.costing import Collective
    pt = _table(solved, True, monkeypatch)
    key = next(iter(pt._pairs))
    del pt._pairs[key]
    negative = (Collective("all_reduce", 0, False, -1.0, False, False),)
    monkeypatch.setattr(type(solved.cost), "edge_steps", lambda self, *a, **k: negative)
    with pytest.raises(RuntimeError, match="must be >= 0"):
        pt.pair(*key)
