"""Activation offload (``offload_activations=``): plans that keep layers' saved tensors in
host memory train to the single-device numbers on real gloo ranks (loss, every gradient by
name, the weights after 3 steps), with the tensors really packed and unpacked by the hooks;
the pass is pure; bad requests are errors."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.cost_models.gpus import H100_80GB
from autopar.cost_models.hardware import parse_cluster
from autopar.cost_models.offload import HOST_LINKS as host_links, HostLink, host_link
from autopar.pricing.activation_offload import copy_s, exposed_s, in_flight_layers
from autopar.runtime.thread_ranks import simulate
from autopar.verify import parallel_run
from examples.models import gpt_factory
from autopar.analysis.layers import layer_members
from autopar.errors import PinError
from autopar.passes.offload_activations import offload_layers
from autopar.plan import Plan
from test_gloo import check, torchrun


def test_offloaded_plans_match_one_device_on_gloo_ranks(tmp_path):
    cases = [
        {"model": "gpt", "pins": {"data": 2, "offload_activations": "full"}, "optimizer": "adamw"},
        {"model": "gpt", "pins": {"data": 2, "zero": 3, "offload_activations": ["h.0"]},
         "optimizer": "adamw"},
        {"model": "llama", "pins": {"offload_activations": "full"}, "optimizer": "adamw"},  # free
        # pipelined: each stage's program offloads its share, every micro-batch's forward its
        # own saved tensors (1F1B holds two in flight on the first stage, GPipe all four)
        *({"model": "gpt", "pins": {"pipeline": 2, "schedule": s, "micro_batch_size": 2,
                                    "offload_activations": "full"}, "optimizer": "adamw"}
          for s in PIPELINE_SCHEDULES),
    ]
    results = torchrun(2, cases, tmp_path)
    check(results)
    flat, piped = results[:3], results[3:]
    for r in flat:
        # 3 steps of forward and backward: every tensor packed came back once
        assert r["packed"] > 0 and r["unpacked"] == r["packed"], r
    assert results[0]["mesh"] == [2] and results[1]["mesh"] == [2]
    for r, schedule in zip(piped, PIPELINE_SCHEDULES):
        assert (r["mesh"], r["schedule"], r["microbatches"]) == ([2, 1], schedule, 4), r
        assert sorted(r["stages"]) == ["0", "1"], r        # (JSON keys)
        for packed, unpacked, moved in r["stages"].values():
            # on each stage: tensors went to the host and came back, the same count for each
            # of the 3 steps x 4 micro-batches
            assert packed > 0 and moved > 0 and unpacked == packed and packed % 12 == 0, r


PIPELINE_SCHEDULES = ("1f1b", "gpipe")
"""The pipeline schedules the gloo launch trains with offload (interleaved 1F1B, zero bubble
and DualPipeV run the same stage programs: checked by hand, docs/measured.md)."""


def test_offload_changes_no_number(captured):
    """Nothing is computed twice or in another order: the offloaded plan's losses, gradients
    and AdamW weights are bit for bit those of the same plan without offload (2 ranks
    simulated as threads)."""
    ex, cap = captured("gpt")
    runs = []
    for off in ("none", "full"):
        plan = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                            data=2, recompute="none", offload_activations=off)
        runs.append(simulate(cap, plan, ex.model, lambda pm, comm: (
            "offload_0" in pm.code("train"), parallel_run(pm, ex.inputs, ex.target, optimizer="adamw")))[0])
    (ran0, base), (ran1, off) = runs
    assert (ran0, ran1) == (False, True)       # the pass ran in the offloaded plan only
    assert base.losses == off.losses
    for g0, g1 in zip(base.grads, off.grads):
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert all(torch.equal(base.weights[k], off.weights[k]) for k in base.weights)


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
    ({"offload_activations": "full", "compile": True}, "not supported yet"),
])
def test_bad_offload_requests_are_errors(captured, pins, match):
    ex, _ = captured("gpt")
    with pytest.raises(PinError, match=match):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", **pins)


# ---- the price ---------------------------------------------------------------------------

def test_exposed_copy_is_what_the_neighbouring_layer_does_not_hide():
    h100, cpu = H100_80GB, parse_cluster("cpu:1").device
    bw = host_link(h100).bandwidth
    s = 2e9                                   # bytes saved by a layer: 2 GB, S/bw each way
    one_way = s / bw
    assert copy_s(s, h100) == pytest.approx(2 * one_way)
    assert exposed_s(s, 2 * one_way, 2 * one_way, h100) == 0.0          # hidden both ways
    assert exposed_s(s, 0.5 * one_way, 2 * one_way, h100) == pytest.approx(0.5 * one_way)
    assert exposed_s(s, 0.0, 0.0, h100) == pytest.approx(copy_s(s, h100))
    # a CPU rank copies on the cores that compute: nothing hidden, one layer in flight
    assert exposed_s(s, 10.0, 10.0, cpu) == copy_s(s, cpu)
    assert (in_flight_layers(h100), in_flight_layers(cpu)) == (2, 1)


def test_estimate_prices_the_copies_and_frees_the_bytes():
    """On a CPU rank (nothing hidden): the offloaded plan's compute is the plan's without
    offload plus 2 S / bw of the bytes it puts on the host, and its device activations are
    those of full recomputation (one layer in flight on a CPU rank, as one rebuilt) less the
    layer outputs the next offloaded layer saves (recomputation keeps every layer's input;
    offload keeps only the last layer's output, which the final norm reads)."""
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    plan = lambda **k: autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,  # noqa: E731
                                    cluster="cpu:1", **k)
    base, off, one, rec = (plan(), plan(offload_activations="full"),
                           plan(offload_activations=["h.0"]), plan(recompute="full"))
    host = off.host_memory_bytes["activations"]
    boundary = ex.inputs[0].numel() * 64 * 4          # one layer's output: tokens x hidden, fp32
    # h.0's output stays when h.1 is not offloaded; under "full" h.0-h.2's go with h.1-h.3
    assert host > 0 and host == pytest.approx(4 * one.host_memory_bytes["activations"] + 3 * boundary)
    device = parse_cluster(off.cluster).device
    assert off.estimate.compute_s - base.estimate.compute_s == pytest.approx(copy_s(host, device), rel=1e-6)
    m0, m1, mr = base.estimate.memory_bytes, off.estimate.memory_bytes, rec.estimate.memory_bytes
    assert m1["activations"] == pytest.approx(mr["activations"] - 3 * boundary)
    assert m1["offload"] == pytest.approx(mr["recompute"] + boundary)     # a layer with its input
    assert m1["activations"] + host == pytest.approx(m0["activations"])     # moved, not lost


def test_bf16_weight_copies_go_to_the_host_and_are_priced(monkeypatch):
    """Under bf16 the offloaded layers also save their weights' 16-bit copies (autocast's
    casts, read only inside the layers): 2 bytes a parameter of the 4 layers more on the host
    than the same plan priced without them, and their copies on the step like the
    activations' (a CPU rank hides nothing): the offloaded plan's compute is the plain
    plan's plus ``2 S / bw`` of all it puts on the host."""
    from autopar.pricing.costing import CostModel
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    plan = lambda **k: autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,  # noqa: E731
                                    cluster="cpu:1", precision="bf16", **k)
    base, off = plan(), plan(offload_activations="full")
    host = off.host_memory_bytes["activations"]
    device = parse_cluster(off.cluster).device
    assert off.estimate.compute_s - base.estimate.compute_s == pytest.approx(copy_s(host, device), rel=1e-6)
    copies = 2 * sum(p.numel() for n, p in ex.model.named_parameters() if ".h." in n)
    # the copies leave the device's params; one layer's is back in flight ("offload")
    assert base.estimate.memory_bytes["params"] - off.estimate.memory_bytes["params"] == pytest.approx(copies)
    monkeypatch.setattr(CostModel, "_offloaded_params", lambda self, v: 0)
    without = plan(offload_activations="full")
    assert host - without.host_memory_bytes["activations"] == pytest.approx(copies)
    assert off.estimate.compute_s - without.estimate.compute_s == pytest.approx(copy_s(copies, device), rel=1e-6)


def test_pinned_offload_leaves_its_layers_out_of_recomputation():
    """Under a budget that binds, a plan pinned to offload h.0 recomputes other layers only
    (a layer is offloaded or recomputed, never both: its bytes would be freed twice)."""
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    plan = lambda **k: autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,  # noqa: E731
                                    cluster="cpu:1", **k)
    base, every = plan(offload_activations=["h.0"]), plan(offload_activations="full")
    budget = (base.estimate.memory_total + every.estimate.memory_total) / 2
    chosen = plan(offload_activations=["h.0"], memory_budget=budget)
    assert chosen.recompute and "transformer.h.0" not in chosen.recompute, chosen.recompute
    assert chosen.estimate.memory_total <= budget
    assert chosen.estimate.memory_bytes["activations"] >= 0


# ---- the choice --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def h100_gpt():
    """A GPT of hidden 16384 (4 layers, sequence 2048, batch 16) on the meta device, planned on
    8 H100s under data=8, ZeRO-3, bf16, plain SGD; the budget half-way between its plan
    without recomputation and its plan recomputing every layer (which frees all that freeing
    activations can: gradients then bind). (Under AdamW its step's peak is the optimizer's,
    the gradients and one moment's square roots, which no activation choice lowers; at
    batch 8 the activations' phase is within 2 GiB of the gradients'.)"""
    with torch.device("meta"):
        ex = gpt_factory(batch=16, n_layer=4, n_embd=16384, n_head=128, block_size=2048,
                         vocab_size=512)

    def plan(**pins):
        return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="8xH100",
                            data=8, zero=3, precision="bf16", optimizer="sgd", **pins)
    base, full = plan(), plan(recompute="full")
    return plan, (base.estimate.memory_total + full.estimate.memory_total) / 2


def test_solver_offloads_where_the_host_link_hides_the_copies(h100_gpt):
    plan, budget = h100_gpt
    chosen = plan(memory_budget=budget)
    recomputing = plan(memory_budget=budget, offload_activations="none")
    assert recomputing.recompute and recomputing.estimate.memory_total <= budget
    # PCIe 5.0 behind a hidden-16384 layer's compute: every freed layer offloaded
    assert chosen.options.offload_activations and not chosen.recompute, chosen.options
    assert chosen.estimate.memory_total <= budget
    assert chosen.estimate.memory_bytes["offload"] > 0 and chosen.host_memory_bytes["activations"] > 0
    assert chosen.estimate.step_time_s < recomputing.estimate.step_time_s


def test_solver_recomputes_where_the_host_link_is_slow(h100_gpt, monkeypatch):
    plan, budget = h100_gpt
    link = host_links[H100_80GB.name]
    # a host link 16 times slower (PCIe 5.0 x16 at 80% / 16 = 3.2 GB/s): copies not hidden
    monkeypatch.setitem(host_links, H100_80GB.name, HostLink(link.bandwidth / 16, link.host_mem_bandwidth))
    chosen = plan(memory_budget=budget)
    assert chosen.recompute and chosen.options.offload_activations is None, chosen.options
    assert chosen.estimate.memory_total <= budget
