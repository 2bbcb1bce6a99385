"""Activation offload (``offload_activations=``): plans that keep layers' saved tensors in
host memory train to the single-device numbers on real gloo ranks (loss, every gradient by
name, the weights after 3 steps), with the tensors really packed and unpacked by the hooks;
the pass is pure; bad requests are errors."""
from __future__ import annotations

import copy

import pytest

import autopar
from autopar.analysis.layers import layer_members
from autopar.errors import PinError
from autopar.passes.offload_activations import offload_layers
from autopar.plan import Plan
from test_gloo import check, torchrun


def test_offloaded_plans_match_one_device_on_gloo_ranks(tmp_path):
    cases = [
        {"model": "gpt", "pins": {"data": 2, "offload_activations": "full"}},
        {"model": "gpt", "pins": {"data": 2, "zero": 3, "offload_activations": ["h.0"]}},
        {"model": "llama", "pins": {"offload_activations": "full"}},       # the free plan
    ]
    results = torchrun(2, cases, tmp_path)
    check(results)
    for r in results:
        # 3 steps of forward and backward: every tensor packed came back once
        assert r["packed"] > 0 and r["unpacked"] == r["packed"], r
    assert results[0]["mesh"] == [2] and results[1]["mesh"] == [2]


def test_pass_is_pure_and_plan_round_trips(captured, tmp_path):
    ex, cap = captured("gpt")
    plan = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                        data=2, offload_activations=["h.1"])
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).options.offload_activations == ("h.1",)
    gm = copy.deepcopy(cap.gm)
    for n in gm.graph.nodes:
        n.meta["source"] = n.name
    before = gm.code
    out = offload_layers(gm, layer_members(gm, ["transformer.h.1"]), "cpu")
    assert gm.code == before
    assert [n.target for n in out.graph.nodes if n.op == "call_module"] == ["offload_0"]
    assert out.meta["offload"] == ("transformer.h.1",)


@pytest.mark.parametrize("pins,match", [
    ({"offload_activations": 3}, "offload_activations=3"),
    ({"offload_activations": "full", "recompute": "full"}, "offloaded or recomputed"),
    ({"offload_activations": ["h.0"], "recompute": ["h.0"]}, "both name"),
    ({"offload_activations": "full", "pipeline": 2}, "not supported yet"),
])
def test_bad_offload_requests_are_errors(captured, pins, match):
    ex, _ = captured("gpt")
    with pytest.raises(PinError, match=match):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", **pins)
