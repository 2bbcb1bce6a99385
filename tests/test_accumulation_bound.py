"""The free search's gradient-accumulation stage bounded by each micro-batch count's compute
floor (``accumulate.accumulation_floor``, ``search_accumulation(spec, best_s)``, issue 40):
the floor is below every plan of its count, and the bounded search returns the unbounded
one's plan wherever that plan could win, skipping the counts that cannot."""
from __future__ import annotations

import pytest
import torch

from autopar.solver import accumulate
from autopar.solver.driver import _spec
from autopar.solver.spec import Settings
from examples.models import gpt_factory

CLUSTER = "8xA100"


def _spec_of(budget: float | None):
    """GPT (hidden 256, 2 layers, sequence 256, batch 32) on 8 A100s, data 8, state
    replicated (``zero=0``, so that activations bind), under ``budget`` bytes per device."""
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=2, n_embd=256, n_head=4, block_size=256, vocab_size=256)
    return _spec(ex.model, ex.inputs, ex.loss_fn, ex.target, CLUSTER, None, {"data": 8, "zero": 0},
                 Settings(memory_budget=budget))


@pytest.fixture(scope="module")
def planned():
    """The budget half-way between the whole batch's plan and 2 micro-batches' (so the
    search plans at least k = 2), the unbounded search's plan, and each count's plan."""
    free = _spec_of(None)
    whole = accumulate.plan_accumulated(free, 1)[0]        # k = 1: the whole batch
    two = accumulate.plan_accumulated(free, 2)[0]
    budget = (whole.estimate.memory_total + two.estimate.memory_total) / 2
    spec = _spec_of(budget)
    unbounded = accumulate.search_accumulation(spec)
    assert unbounded is not None, "the test needs a plan that accumulates"
    per_k = {}
    for k in (2, 4):
        plan, cap = accumulate.plan_accumulated(spec, k, explain=False)
        per_k[k] = (plan, accumulate.accumulation_floor(spec, cap, k))
    return spec, unbounded, per_k


def test_floor_is_below_every_plan_of_its_count(planned):
    _, _, per_k = planned
    for k, (plan, floor) in per_k.items():
        assert 0 < floor <= plan.estimate.step_time_s, (k, floor, plan.estimate.step_time_s)
    # more micro-batches, more per-micro-batch work: the floors grow with k here
    assert per_k[4][1] > per_k[2][1]


def _counting(monkeypatch) -> list:
    planned_ks = []
    real = accumulate.plan_accumulated

    def counted(spec, k, *a, **kw):
        planned_ks.append(k)
        return real(spec, k, *a, **kw)
    monkeypatch.setattr(accumulate, "plan_accumulated", counted)
    return planned_ks


def test_bounded_search_returns_the_plan_that_could_win(planned, monkeypatch):
    spec, unbounded, _ = planned
    step = unbounded[0].estimate.step_time_s
    planned_ks = _counting(monkeypatch)
    got = accumulate.search_accumulation(spec, step * (1 + 1e-9))     # it would win: kept
    assert got is not None and got[0].digest() == unbounded[0].digest()
    assert planned_ks, "the counts below the bound are planned"


def test_counts_that_cannot_win_are_not_planned(planned, monkeypatch):
    spec, _, per_k = planned
    below = min(floor for _, floor in per_k.values()) / 2
    planned_ks = _counting(monkeypatch)
    # a best step below every count's floor: no plan of the stage could be taken
    assert accumulate.search_accumulation(spec, below) is None
    assert planned_ks == []
    # at the least count's floor exactly: it cannot beat it either (the caller keeps the first
    # of equal steps), so nothing is planned
    least = min(per_k.items())[1][1]
    assert accumulate.search_accumulation(spec, least) is None or planned_ks == []
