"""Infeasibility in one screen (issue 11 part 4): when no plan fits, the error names the
closest plan of each mesh family the search tried, its memory per device and the binding
term, and the smallest changes that fit, each worked out from the search's figures. Every
suggestion is applied here and planned again: it must fit."""
from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.options import Options
from autopar.solver.accumulate import plan_accumulated
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import plan_captured
from autopar.solver.spec import SearchSpec
from examples.models import EXAMPLES

CLUSTER, WORLD = "cpu:4", 4


def _infeasible(cap, budget):
    with pytest.raises(InfeasibleError) as info:
        plan_captured(cap, parse_cluster(CLUSTER), WORLD, memory_budget=budget)
    return info.value


def _fits(plan, budget):
    assert plan.estimate.memory_total <= budget, (plan.estimate.memory_bytes, budget)


def _mlp(batch, hidden):
    ex = EXAMPLES["mlp"](batch=batch, hidden=hidden)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


@pytest.mark.parametrize("batch,hidden,share,binding,kinds", [
    (64, 256, 0.6, "optimizer state", {"memory_budget", "devices"}),    # the training state binds
    (1024, 32, 0.9, "activations", {"memory_budget", "accumulate"}),    # a large batch's activations
])
def test_one_screen_names_families_binding_term_and_fixes_that_fit(batch, hidden, share, binding, kinds):
    ex, cap = _mlp(batch, hidden)
    # a budget below the least any mesh needs: share of the smallest plan's memory
    probe = _infeasible(cap, 1.0)
    budget = share * min(r["need"] for r in probe.meshes)
    err = _infeasible(cap, budget)
    msg = str(err)
    assert len(msg.splitlines()) <= 25, msg
    for family in {r["family"] for r in err.meshes}:
        assert family in msg, (family, msg)
    assert {"1-D (data/tensor per op)", "2-D", "data only"} <= {r["family"] for r in err.closest}
    assert "zero=3" in msg                         # the ZeRO-3 row on the data axis
    best = min(err.closest, key=lambda r: r["need"])
    assert f"binding: {binding}" in msg and best["need"] > budget, msg
    got = set()
    for s in err.suggestions:
        assert s["change"] in msg
        if "world_size" in s:
            got.add("devices")
            plan = plan_captured(cap, s["cluster"], s["world_size"], memory_budget=budget, pins=s["pins"])
            _fits(plan, budget)
            assert plan.world_size > WORLD
        elif "accumulate" in s["pins"]:
            got.add("accumulate")
            k = s["pins"]["accumulate"]
            spec = SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target, parse_cluster(CLUSTER), WORLD,
                              Options.from_pins(dict(s["pins"])), memory_budget=budget)
            plan, _ = plan_accumulated(spec, k)
            _fits(plan, budget)
            assert plan.accumulate == k
        else:
            got.add("memory_budget")
            new = s["memory_budget"]
            assert new > budget
            _fits(plan_captured(cap, parse_cluster(CLUSTER), WORLD, memory_budget=new, pins=s["pins"]), new)
    assert kinds <= got, (got, msg)
