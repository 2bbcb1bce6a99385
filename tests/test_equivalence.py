"""Training under every family of plans equals training on one device.

For each example model, world sizes 1, 2, 4 and a 2x2 mesh, with the solver's own plan and
with each pinned family (data parallel, ZeRO-3, tensor parallel, a 2-D mix): the loss, every
gradient by parameter name and the weights after 3 SGD-with-momentum steps match the
single-device model (fp32: loss rel err < 1e-5, gradients < 1e-4). Ranks are simulated as
threads running the same per-rank modules as torchrun does (tests/test_gloo.py runs a
subset on real gloo processes).
"""
from __future__ import annotations

import pytest

from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.placement import parse_placements, Shard
from autopar.runtime.simulate import simulate
from equivalence import compare, parallel_run, reference_run

CONFIGS = [
    (1, {}),
    (2, {}),
    (2, {"data": 2}),
    (2, {"data": 2, "zero": 2}),
    (2, {"data": 2, "zero": 3}),
    (2, {"tensor": 2}),
    (4, {}),
    (4, {"data": 4}),
    (4, {"data": 4, "zero": 3}),
    (4, {"tensor": 4}),
    (4, {"data": 2, "tensor": 2}),
]
MODELS = ["gpt", "llama", "resnet", "mlp"]


def _id(case):
    world, pins = case
    return f"w{world}-" + ("-".join(f"{k}{v}" for k, v in pins.items()) or "solver")


@pytest.mark.parametrize("case", CONFIGS, ids=_id)
@pytest.mark.parametrize("model", MODELS)
def test_training_matches_one_device(model, case, captured):
    world, pins = case
    ex, cap = captured(model)
    plan = plan_captured(cap, parse_cluster(f"cpu:{world}"), world, pins=dict(pins))
    _check_pins_took_effect(plan, pins)
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    results = simulate(cap, plan, ex.model, lambda pm, comm: parallel_run(pm, ex.inputs, ex.target))
    for rank, got in enumerate(results):
        compare(ref, got, f"{model} on {plan.mesh_shape} {pins or 'solver'} rank {rank}")


def _check_pins_took_effect(plan, pins):
    """A pinned family must really be that family, not a replicated plan in disguise."""
    axes = plan.mesh_axes
    params = {name: parse_placements(plan.nodes[ph].outputs[0]) for name, ph in plan.params.items()}
    if pins.get("zero"):
        a = axes.index("data")
        assert any(isinstance(p[a], Shard) for p in params.values()), "zero= sharded no parameter"
    if "tensor" in pins and pins["tensor"] > 1:
        a = axes.index("tensor")
        assert any(isinstance(p[a], Shard) for p in params.values()), "tensor= sharded no parameter"
    if "data" in pins and pins["data"] > 1:
        a = axes.index("data")
        assert plan.inputs and all(parse_placements(plan.nodes[n].outputs[0])[a] == Shard(0)
                                   for n in plan.inputs), "data= left an input unsplit" 
