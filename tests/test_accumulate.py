"""Gradient accumulation without a pipeline (issue 13 part 2, issue 11 part 3).

Single process: the pins (``accumulate=k``, ``micro_batch_size=`` without ``pipeline=``,
both must agree), the plan file, the summary, the cost model (activations of one
micro-batch, compute ``k`` micro-batches, the gradient sync once) and the free search
choosing ``k > 1`` when the full batch's activations do not fit the memory budget.

Distributed (``tests/accumulate_worker.py``, ONE torchrun launch of 2 gloo ranks): every
loss of ``tests/test_losses.py`` (mean, sum, padded targets, label smoothing, class
weights, a target shifted inside the loss) under data 2 with 2 micro-batches, tensor 2,
ZeRO-3, bf16, ``micro_batch_size=`` from a saved plan, the free search's own ``k`` under a
budget, and per-rank data (``batch="per_rank"``); each equal to one device on the whole
batch, with every data-parallel gradient bucket launched in the last micro-batch of its
step (never once per micro-batch).
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

import autopar
from autopar.capture import fingerprint
from autopar.plan import Plan, PlanError
from autopar.solver.driver import capture_for_plan
from autopar.solver.errors import InfeasibleError
from autopar.pricing.prices import plan_prices
from autopar.viz.explain import explain
from examples.models import gpt_factory
from launch import torchrun_cases
from loss_worker import example

LOSSES = ("mean", "sum", "ignore", "smoothing", "weight", "shifted")
STEPS = 3                       # accumulate_worker.STEPS


def _plan(kind: str = "ignore", cluster: str = "cpu:2", **pins) -> Plan:
    model, inputs, target, loss_fn = example(kind)
    return autopar.plan(model, inputs, loss_fn, target=target, cluster=cluster, **pins)


@pytest.fixture(scope="module")
def token_plans():
    """The token classifier (batch 8) on data 2 (state replicated): the whole batch, 2 and 4
    micro-batches."""
    return ({k: _plan(data=2, zero=0, accumulate=k) for k in (1, 2)}
            | {4: _plan(data=2, zero=0, micro_batch_size=2)})


@pytest.fixture(scope="module")
def budget(token_plans):
    """Bytes per device between what the whole batch and 2 micro-batches need (state
    replicated: ``zero=0``, so that the budget binds on activations)."""
    full, two = (token_plans[k].estimate.memory_total for k in (1, 2))
    assert two < full
    return (full + two) / 2


# ---- pins ----------------------------------------------------------------------------------

def test_pins_accumulate_and_micro_batch_size_agree(token_plans):
    assert token_plans[2].accumulate == token_plans[2].n_microbatches == 2
    assert token_plans[2].pipeline is None and token_plans[2].pins["accumulate"] == 2
    assert token_plans[4].accumulate == 4          # a batch of 8 in micro-batches of 2
    assert token_plans[1].accumulate == 1          # accumulate=1: the whole batch at once
    both = _plan(data=2, accumulate=4, micro_batch_size=2)
    assert both.accumulate == 4 and both.fingerprint == token_plans[4].fingerprint


@pytest.mark.parametrize("pins,message", [
    ({"accumulate": 2, "micro_batch_size": 2}, r"accumulate=2 and micro_batch_size=2 disagree: .* "
                                               r"is 4 micro-batches; pin one of them"),
    ({"micro_batch_size": 3}, r"micro_batch_size=3 does not divide the global batch 8.*\[1, 2, 4, 8\]"),
    ({"accumulate": 3}, r"accumulate=3 does not divide the global batch 8"),
    ({"accumulate": 0}, r"pin accumulate=0 must be a positive integer"),
    ({"accumulate": 2, "pipeline": 2}, r"pin micro_batch_size= with pipeline= instead"),
    ({"schedule": "gpipe"}, r"schedule= needs pipeline parallelism"),
])
def test_bad_pins_say_what_to_pin(pins, message):
    with pytest.raises(ValueError, match=message):
        _plan(**pins)


def test_accumulation_needs_the_loss_in_the_graph():
    model, inputs, target, loss_fn = example("mean")
    with pytest.raises(ValueError, match="needs the loss in the graph: pass loss_fn and target="):
        autopar.plan(model, inputs, loss_fn, cluster="cpu:2", accumulate=2)


# ---- the plan file and the summary ---------------------------------------------------------

def test_plan_file_round_trip_and_summary(token_plans):
    p = token_plans[2]
    d = json.loads(p.to_json())
    assert d["accumulate"] == 2 and Plan.from_dict(d) == p
    old = dict(d)
    del old["accumulate"]                  # written before the field: no accumulation
    assert Plan.from_dict(old).accumulate == 1
    bad = dict(d, mesh_shape=[2], mesh_axes=["pipeline"],
               pipeline={"stages": 2, "virtual_stages": 1, "n_microbatches": 2,
                         "schedule": "gpipe", "stage_cuts": []})
    with pytest.raises(PlanError, match=r"plan field accumulate: 2 .*pipeline.n_microbatches"):
        Plan.from_dict(bad)
    with pytest.raises(PlanError, match=r"plan field accumulate: 0 is below the minimum 1"):
        Plan.from_dict(dict(d, accumulate=0))
    assert "gradient accumulation: 2 micro-batches per step" in p.summary()
    assert "gradient accumulation" not in token_plans[1].summary()
    # explain prices the graph of one micro-batch, its gradient sync a 1/k share, as solved
    model, inputs, target, loss_fn = example("ignore")
    cap = capture_for_plan(model, inputs, loss_fn, target, p)
    assert fingerprint(cap) == p.fingerprint
    assert plan_prices(cap, p).cost.grad_sync_scale == 0.5
    x = explain(cap, p, p.params["head.weight"])
    assert sum(r.chosen for r in x.options) == 1


# ---- the cost model ------------------------------------------------------------------------

def test_cost_model_one_micro_batch_of_activations_one_gradient_sync():
    """GPT (hidden 1024) on 8 A100s, data 8: 4 micro-batches hold a quarter of the
    activations, compute a little more than the whole batch at once (each micro-batch's
    kernel launches, smaller GEMMs), and reduce the gradients once: a reduction per
    micro-batch would add three more (3 x 0.8 ms here)."""
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=2, n_embd=1024, n_head=8, block_size=128, vocab_size=512)
    one, four = (autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="8xA100",
                              data=8, accumulate=k) for k in (1, 4))
    m1, m4 = one.estimate.memory_bytes, four.estimate.memory_bytes
    # (one micro-batch of a step prices every term at once: the loss's gradients join the
    # activations; the whole step's keep them apart, cost_models.memory.step_phases)
    assert m4["activations"] == pytest.approx((m1["activations"] + m1["loss_grads"]) / 4, rel=0.05)
    for term in ("params", "grads", "optimizer"):
        assert m4[term] == m1[term]
    assert one.estimate.compute_s < four.estimate.compute_s < 1.2 * one.estimate.compute_s
    sync1, sync4 = one.estimate.comm["all_reduce@data"], four.estimate.comm["all_reduce@data"]
    assert sync4 < 2 * sync1, (sync1, sync4)
    # the host dispatches every micro-batch's calls (cost_models/host.py); the step is the
    # larger of the device side and the host's (cost_models/step.step_time)
    # (the micro-batch graph's loss, rewritten into its term of the batch's, has a few more nodes)
    assert four.estimate.host_s == pytest.approx(4 * one.estimate.host_s, rel=0.05) and one.estimate.host_s > 0
    assert four.estimate.step_time_s == pytest.approx(
        max(four.estimate.compute_s + four.estimate.comm_s, four.estimate.host_s))


# ---- the free search -----------------------------------------------------------------------

def test_free_search_accumulates_when_the_batch_does_not_fit(token_plans, budget):
    with pytest.raises(InfeasibleError):
        _plan(data=2, zero=0, accumulate=1, memory_budget=budget)   # k = 1 pinned: nothing fits
    chosen = _plan(data=2, zero=0, memory_budget=budget)
    assert chosen.accumulate == 2 and chosen.estimate.memory_total <= budget
    assert chosen.pins == {"data": 2, "zero": 0}
    assert chosen.estimate.step_time_s == pytest.approx(token_plans[2].estimate.step_time_s, rel=1e-6)
    assert _plan(data=2).accumulate == 1        # no budget: the whole batch at once


@pytest.fixture(scope="module")
def a100_plans():
    """GPT (hidden 1024, 4 layers, sequence 512) on 8 A100s, data 8, state replicated
    (``zero=0``), planned without a budget: the whole batch, 2 micro-batches, and the whole
    batch recomputing 1 and 2 layers; the budget half-way between the whole batch and the
    plan recomputing 2 layers."""
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=4, n_embd=1024, n_head=8, block_size=512, vocab_size=512)

    def plan(**pins):
        return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="8xA100",
                            data=8, zero=0, **pins)
    plans = {"none": plan(accumulate=1), "two micro-batches": plan(accumulate=2),
             "h.0": plan(accumulate=1, recompute=["h.0"]),
             "h.0, h.1": plan(accumulate=1, recompute=["h.0", "h.1"])}
    budget = (plans["none"].estimate.memory_total + plans["h.0, h.1"].estimate.memory_total) / 2
    return plan, plans, budget


def test_fewest_layers_below_the_bound_where_activations_are_not_the_peak(a100_plans):
    """Recomputing 2 of the 4 layers moves the peak to the gradients' phase (with their
    buffers), so one layer's rebuild R no longer bounds what each layer saves: the bound
    M(k) <= M(4) + (4 - k) R says every layer, and the solver probes below it for the
    fewest that fit (``flat._fewest_layers``). Under the budget it recomputes 2 layers; 1
    does not fit. (Offload pinned off: in fp32 on an A100 each layer's forward hides its
    copies to the host, so the free choice offloads instead, ``tests/test_activation_offload.py``.)"""
    plan, plans, budget = a100_plans
    chosen = plan(accumulate=1, memory_budget=budget, offload_activations="none")
    assert chosen.recompute == plans["h.0, h.1"].recompute, chosen.recompute
    assert chosen.estimate.memory_total <= budget
    assert plans["h.0"].estimate.memory_total > budget


def test_free_search_accumulates_rather_than_recompute_where_that_is_faster(a100_plans):
    """The whole batch fits only recomputed; 2 micro-batches fit without recomputation and
    are predicted faster (each micro-batch's launches and smaller GEMMs cost less than a
    layer's forward again), so the free search accumulates (``accumulate.may_accumulate``).
    (Offload pinned off, as above: with it the free search offloads, faster still.)"""
    plan, plans, budget = a100_plans
    two, recomputed = plans["two micro-batches"], plans["h.0, h.1"]
    assert two.estimate.memory_total <= budget < plans["none"].estimate.memory_total
    assert two.estimate.step_time_s < recomputed.estimate.step_time_s
    offloaded = plan(memory_budget=budget)
    assert offloaded.options.offload_activations and offloaded.estimate.memory_total <= budget
    assert offloaded.estimate.step_time_s < two.estimate.step_time_s
    chosen = plan(memory_budget=budget, offload_activations="none")
    assert (chosen.accumulate, chosen.recompute) == (2, ())
    assert chosen.estimate.step_time_s == pytest.approx(two.estimate.step_time_s, rel=1e-6)
    assert plan(memory_budget=budget, recompute="full").accumulate == 1   # pinned: no search


# ---- on gloo ranks -------------------------------------------------------------------------

CASES = ([{"id": f"{loss}-data2", "loss": loss, "pins": {"data": 2, "accumulate": 2}} for loss in LOSSES]
         + [{"id": "ignore-tensor2", "loss": "ignore", "pins": {"tensor": 2, "accumulate": 2}},
            {"id": "ignore-zero3", "loss": "ignore", "pins": {"data": 2, "zero": 3, "accumulate": 2}},
            {"id": "weight-bf16", "loss": "weight", "precision": "bf16",
             "pins": {"data": 2, "accumulate": 2, "precision": "bf16"}},
            {"id": "shifted-micro-batch-size-plan-file", "loss": "shifted", "plan_file": True,
             "pins": {"data": 2, "micro_batch_size": 2}},
            {"id": "ignore-free-budget", "loss": "ignore", "pins": {"data": 2, "zero": 0}},
            {"id": "ignore-data2-per-rank", "loss": "ignore", "batch": "per_rank",
             "pins": {"data": 2, "accumulate": 2}}])
EXPECTED_K = {c["id"]: 4 if "micro_batch_size" in c["pins"] else 2 for c in CASES}
BF16_LOSS_TOL, BF16_WEIGHT_TOL = 3e-4, 0.1      # tests/test_precision.py's


@pytest.fixture(scope="module")
def results(tmp_path_factory, budget):
    cases = [dict(c, budget=budget) if c["id"] == "ignore-free-budget" else c for c in CASES]
    out = tmp_path_factory.mktemp("accumulate") / "results.json"
    return torchrun_cases("accumulate_worker.py", 2, cases, out, timeout=600, case_timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_equal_to_one_device_one_sync_per_step(results, case):
    got, failed = results
    r = got.get(case["id"])
    assert r is not None, f"{case['id']}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{case['id']}: {r['error']}\n{r.get('trace', '')}"
    k = EXPECTED_K[case["id"]]
    assert r["accumulate"] == k and r["microbatches"] == STEPS * k, r
    if "data" in case["pins"] and not case["pins"].get("zero"):
        # every gradient's reduction (a bucket each) launched once per step, in the step's
        # last micro-batch: after k, 2k, ... micro-batches had begun
        assert r["synced"] >= 1
        assert len(r["launched_at"]) == STEPS * r["synced"], r["launched_at"]
        assert all(n % k == 0 for n in r["launched_at"]), r["launched_at"]
    if "tensor" in case["pins"] or case["pins"].get("zero"):
        assert r["local_fraction"] < 0.6, r["local_fraction"]       # really sharded
    if case.get("batch") == "per_rank":
        assert r["rows"] == 4, r          # each data rank passed half the batch of 8
    if case.get("precision") == "bf16":
        assert r["loss_err"] <= BF16_LOSS_TOL and r["weight_err"] <= BF16_WEIGHT_TOL, r
        assert r["loss_err"] < r["fp32_loss_dist"], r        # it computed in bf16
    else:
        print(f"{case['id']}: loss {r['worst']['loss']:.1e} grad {r['worst']['grad']:.1e} "
              f"weight {r['worst']['weight']:.1e} ({r['seconds']:.1f}s)", file=sys.stderr)
