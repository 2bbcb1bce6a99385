"""The memory peak model (``cost_models.memory.step_phases`` / ``peak_bytes``): an unpipelined
step of one micro-batch holds its activations with the loss's gradients at the loss's
backward, its activations with a rebuilt or fetched layer at a layer's backward, and its
gradients (with GradSync's flat buffers) at the end of backward, one at a time; the
estimate is the largest phase beside the rest and the ILP bounds each phase. Pipelines and accumulation keep earlier
micro-batches' gradients beside later activations: every term adds. Measured against the
runtime's peak by ``benchmarks/precision_memory.py`` (the tiny models here are too small
for their transients not to dominate)."""
from __future__ import annotations

import pytest

from autopar.cost_models.hardware import parse_cluster
from autopar.cost_models.memory import peak_bytes, step_phases
from autopar.options import Options
from autopar.pricing.costing import CostModel
from autopar.solver.flat import plan_captured
from autopar.solver.ilp import InfeasibleError


@pytest.fixture(scope="module")
def gpt_dp2(request):
    from conftest import example_and_capture
    _, cap = example_and_capture("gpt")
    cl = parse_cluster("cpu:2")
    return cap, cl, plan_captured(cap, cl, 2, pins={"data": 2})


def test_the_estimate_is_the_larger_phase(gpt_dp2):
    _, _, plan = gpt_dp2
    m = plan.estimate.memory_bytes
    assert plan.estimate.memory_phases == step_phases(False)
    # every parameter replicated over the data axis: GradSync sums all gradients in flat
    # buckets that live until the step ends
    assert m["grad_buffers"] == m["grads"]
    always = m["params"] + m["optimizer"] + m.get("inputs", 0.0)
    ends = (m["activations"] + m.get("loss_grads", 0.0), m["activations"] + m.get("recompute", 0.0),
            m["grads"] + m["grad_buffers"])
    assert plan.estimate.memory_total == pytest.approx(always + max(ends), rel=1e-12)
    assert plan.estimate.memory_total < sum(m.values()) - min(ends) * 0.99


def test_the_ilp_bounds_each_phase_not_their_sum(gpt_dp2):
    """A budget between the peak and the sum of every term fits the replicated plan (the
    old additive constraint refused it); just under the peak, nothing replicated fits."""
    cap, cl, plan = gpt_dp2
    peak, every = plan.estimate.memory_total, sum(plan.estimate.memory_bytes.values())
    between = plan_captured(cap, cl, 2, pins={"data": 2, "zero": 0}, memory_budget=(peak + every) / 2)
    assert between.estimate.memory_total <= (peak + every) / 2 < sum(between.estimate.memory_bytes.values())
    with pytest.raises(InfeasibleError):
        plan_captured(cap, cl, 2, pins={"data": 2, "zero": 0, "recompute": "none"},
                      memory_budget=peak * 0.98)


def test_micro_batches_keep_every_term(gpt_dp2):
    """A pipeline stage's view (memory weights) and one of several accumulated micro-batches
    (gradient-sync share < 1) price with no phases: all terms at once, and no flat-buffer
    term, which the pipeline's per-stage weights do not scale."""
    _, cl, _ = gpt_dp2
    assert CostModel(cl, (2,), memory_weights={"params": 0.5}).memory_phases == ()
    assert CostModel(cl, (2,), grad_sync_scale=0.25).memory_phases == ()
    assert CostModel(cl, (2,), Options(precision="bf16")).memory_phases == step_phases(True)
    assert "params" in step_phases(True)[0]       # 16-bit weight copies freed with the activations
    assert peak_bytes({"params": 1.0, "activations": 5.0, "grads": 3.0}) == 9.0
