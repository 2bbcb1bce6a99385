"""The free pipeline search tries every pipeline degree that divides the node count (not
only powers of two), at most one stage per layer, with tensor parallelism dividing a node
(``autopar.solver.pipeline_free``). Plans without processes."""
from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.solver.driver import solve
from autopar.solver.ilp import InfeasibleError
from autopar.solver.pipeline_free import pipeline_degrees, stage_meshes
from examples.models import gpt_factory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from step_terms import step_terms  # noqa: E402  (benchmarks/plan_quality.py's gain tables)


@functools.cache
def nine_layers():
    """A 9-layer GPT captured in a second (on the meta device), and its graph. Wide enough
    (1024, 48 sequences of 512 tokens) that an A100's device time binds, not the host's
    dispatch of its ATen calls (``cost_models.host``: ~130 a layer per micro-batch at
    16.7 us): at width 64 and 128 tokens each stage's micro-batch was its host's, and the
    1F1B fill and drain of host-bound stages, not the device's schedule, made the step."""
    with torch.device("meta"):
        ex = gpt_factory(batch=48, n_layer=9, n_embd=1024, n_head=8, block_size=512, vocab_size=256)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def test_degrees_are_the_divisors_of_the_node_count_up_to_the_layers():
    _, cap = nine_layers()
    # 315 DGX nodes (MT-NLG's 2,520 GPUs): every divisor up to the 9 layers
    assert pipeline_degrees(cap, parse_cluster("315xdgx-a100"), 2520) == [3, 5, 7, 9]
    assert pipeline_degrees(cap, parse_cluster("6x8xA100"), 48) == [2, 3, 6]
    assert pipeline_degrees(cap, parse_cluster("128xdgx-a100"), 1024) == [2, 4, 8]
    # one node: stages of single devices
    assert pipeline_degrees(cap, parse_cluster("1x6xA100"), 6) == [2, 3, 6]
    # tensor parallelism divides a node's devices; data takes the rest of the stage
    assert stage_meshes(parse_cluster("315xdgx-a100"), 72, {}) == [(72, 1), (36, 2), (18, 4), (9, 8)]
    assert stage_meshes(parse_cluster("2x6xA100"), 6, {}) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    assert stage_meshes(parse_cluster("315xdgx-a100"), 72, {"tensor": 8}) == [(9, 8)]


def test_three_devices_pipeline_three_stages():
    """Three A100s, a budget no unpipelined plan fits (the whole batch's activations;
    ``accumulate=1``): the search pipelines over three stages, a degree no power of two
    reaches, and the plan fits. Its step broken into terms (benchmarks/step_terms.py, priced
    again from the plan's placements) gives the estimate's compute and communication."""
    ex, cap = nine_layers()
    budget = 2**30       # no unpipelined plan fits (below); the 3-stage pipeline holds 0.86 GiB
    plan, mcap = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x3xA100",
                       pins={"accumulate": 1}, memory_budget=budget, captured=cap)
    assert plan.pipeline_stages == 3 and plan.mesh_shape == (3, 1)
    assert plan.estimate.memory_total <= budget
    assert 0 < plan.estimate.host_s < 0.75 * plan.estimate.step_time_s    # the device binds
    with pytest.raises(InfeasibleError):
        solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x3xA100",
              pins={"accumulate": 1, "pipeline": 1}, memory_budget=budget, captured=cap)
    terms = step_terms(mcap, plan, parse_cluster("1x3xA100"))
    assert terms["compute"] > 0 and terms["pipeline p2p"] > 0 and terms["pipeline bubble"] > 0
    assert terms["compute"] + terms["recompute"] == pytest.approx(plan.estimate.compute_s, rel=1e-9)
    comm = ("tensor-parallel comm", "data-parallel comm", "grad sync (exposed)", "pipeline p2p")
    assert sum(terms[k] for k in comm) == pytest.approx(plan.estimate.comm_s, rel=1e-9)
    # the bubble is what the schedule leaves idle: less than the compute it waits around
    assert terms["pipeline bubble"] < terms["compute"]


def test_stage_meshes_shard_gradients_when_they_are_reduced_in_fp32():
    """Under mixed precision gradients are reduced in fp32 (the runtime's ``grad_reduce``
    default): ZeRO-2's reduce-scatter and 16-bit gather move less than an fp32 all-reduce,
    so the degree search plans its stage meshes with ZeRO-2; reduced in 16 bits, memory to
    spare, it keeps them unsharded."""
    from autopar.options import as_options
    from autopar.solver.pipeline_free import _DegreeSearch
    from autopar.solver.spec import SearchSpec

    ex, cap = nine_layers()
    cl = parse_cluster("2x4xA100")
    for pins, zero in (({"precision": "bf16"}, 2), ({"precision": "bf16", "grad_reduce": "bf16"}, None)):
        search = _DegreeSearch(SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target, cl, 8,
                                          as_options(pins), time_limit_s=30.0), cap)
        assert search.batch == 48
        intra, _ = search._solve(2, 4, 1)
        assert intra.pins.get("zero") == zero, pins
