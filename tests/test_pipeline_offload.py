"""Activation offload inside pipeline stages, priced (issue 44 item 2). A pipeline rank holds
the activations of every micro-batch in flight in its stages (1F1B: up to ``p`` on the first
stage); an offloaded layer's saved bytes are host memory there, each micro-batch's, and the
device holds only the layers in flight in backward (``pricing.activation_offload``). The
runtime's side (each stage's program offloading its share, equal to one device) is
``tests/test_activation_offload.py``'s gloo launch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import autopar
from autopar.analysis.layers import repeated_layers
from autopar.analysis.stages import chain_index
from autopar.cost_models.hardware import parse_cluster
from autopar.ops.host_activations import HostActivations
from autopar.pricing.activation_offload import copy_s, in_flight_layers
from autopar.solver.flat import MeshAsk
from autopar.solver.pipeline_price import price_plan
from autopar.solver.pipeline_search import capture_microbatch, solve_intra
from capture_reuse import same_model
from examples.models import gpt_factory


def _plans(cluster: str, **pins):
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    return [autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                         pipeline=2, schedule="1f1b", micro_batch_size=2, recompute="none",
                         offload_activations=off, **pins) for off in ("none", "full")]


@pytest.mark.parametrize("cluster", ["cpu:2", "1x2xH100"])
def test_pinned_pipeline_offload_holds_less_on_the_device(cluster):
    """The same pipeline (cuts, micro-batches, schedule) with every layer offloaded: fewer
    device bytes on its fullest rank (the activations of the micro-batches in flight leave,
    the layers in flight in backward stay as ``offload``), the rest on the host, and the
    copies on the step (a CPU rank hides none of them)."""
    base, off = _plans(cluster)
    assert off.pipeline == base.pipeline and off.options.offload_activations == "full"
    mb, mo = base.estimate.memory_bytes, off.estimate.memory_bytes
    assert off.estimate.memory_total < base.estimate.memory_total, (mb, mo)
    assert mo["activations"] < mb["activations"] and mo["offload"] > 0 and "offload" not in mb
    assert off.host_memory_bytes["activations"] > 0 and not base.host_memory_bytes
    assert off.estimate.compute_s >= base.estimate.compute_s
    if cluster.startswith("cpu"):
        assert off.estimate.compute_s > base.estimate.compute_s


def test_offloaded_nodes_move_their_bytes_to_the_host_and_pay_their_copies():
    """Per chain node of a 2-layer GPT cut into 2 stages: what the offloaded nodes keep moves
    from device to host bytes per micro-batch, nothing lost; each pays ``2 S / bw`` (a CPU
    rank: nothing hidden); the device holds back one layer's bytes in backward
    (``in_flight_layers`` of a CPU rank), the first layer's (whose output the second saves:
    it goes with it, where the last layer's output, read by the final norm, stays)."""
    small = gpt_factory(batch=8, n_layer=2, n_embd=32)
    cl = parse_cluster("cpu:2")
    with same_model("gpt-2-layers"):
        cap = capture_microbatch(small.model, small.inputs, small.loss_fn, small.target, 2)
    plain, solved_plain = solve_intra(cap, MeshAsk(cl, 2, {"recompute": "none"}), 2)
    off, solved_off = solve_intra(cap, MeshAsk(cl, 2, {"recompute": "none",
                                                      "offload_activations": "full"}), 2)
    a = price_plan(cap, plain, solved_plain, cl, 2, 2, 2).nc
    b = price_plan(cap, off, solved_off, cl, 2, 2, 2).nc
    assert b.offloaded.any() and b.host_activations.sum() > 0 and not a.host_activations.any()
    assert b.activations + b.host_activations == pytest.approx(a.activations)
    assert b.compute - a.compute == pytest.approx(copy_s(b.host_activations, cl.device))
    assert in_flight_layers(cl.device) == 1
    h0 = repeated_layers(cap.gm)["transformer.h.0"]
    where = chain_index(cap, b.units)
    first = sorted({where[n] for n in h0 if n in where})
    assert b.offload_bytes == pytest.approx(float(np.sum(b.host_activations[first])))
    # a rank holding an offloaded node holds the layer in flight once, whatever the
    # micro-batches in flight; its host holds each micro-batch's
    stages, held = [(0, len(b.units))], np.array([3])
    assert b.rank_memory(stages, held)["offload"] == b.offload_bytes
    assert b.rank_host_memory(stages, held) == pytest.approx(3 * b.host_activations.sum())


def test_a_stage_leaves_its_weight_casts_and_tells_micro_batches_apart():
    """A pipeline stage's hooks (``keep_weight_casts``) leave autocast's 16-bit weight casts
    on the device (the step-long cache keeps them alive anyway): a linear under bf16 saves
    its input's cast and its weight's, and only the first goes to the host. Two forwards of
    one layer (two micro-batches in flight) are two layers to the hooks, each brought back
    by its own backward."""
    lin = torch.nn.Linear(8, 8)
    packed = {}
    for keep in (False, True):
        host = HostActivations(torch.device("cpu"), keep_weight_casts=keep)
        outs = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16), host.layer(0):
                x = torch.randn(4, 8, requires_grad=True) * 2     # (not a leaf: not cached)
                outs.append(lin(x))
        assert sorted(host._by_layer) == [(0, 0), (1, 0)]
        for y in outs:
            y.float().sum().backward()
        assert host.unpacked == host.packed
        packed[keep] = host.packed
    assert packed == {False: 4, True: 2}


def test_a_pipeline_recomputes_only_layers_it_does_not_offload():
    """Where memory binds with some layers offloaded (pinned), the pipeline search recomputes
    others, never those (a layer is one or the other): a GPT of hidden 4096, 8 layers, on
    the meta device, 2 of its layers offloaded, on 4 H100s under pipeline=2 and a 12 GiB
    budget, recomputes 2 of the other 6 (it recomputed the offloaded two as well before).
    (10 GiB until the bf16 activations were counted as autocast keeps them: fp32 values and
    each projection's own 16-bit copy, ``analysis.autocast``.)"""
    with torch.device("meta"):
        big = gpt_factory(batch=8, n_layer=8, n_embd=4096, n_head=32, block_size=2048, vocab_size=32000)
    plan = autopar.plan(big.model, big.inputs, big.loss_fn, target=big.target, cluster="1x4xH100",
                        precision="bf16", memory_budget=12 * 2**30, pipeline=2, schedule="1f1b",
                        micro_batch_size=4, offload_activations=["h.0", "h.1"])
    assert plan.options.offload_activations == ("h.0", "h.1")
    assert plan.recompute and not {"transformer.h.0", "transformer.h.1"} & set(plan.recompute), plan.recompute
    assert plan.estimate.memory_total <= 12 * 2**30


class _BatchNormBlocks(torch.nn.Module):
    """Two repeated blocks, each with a BatchNorm (running statistics updated in place)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU())
            for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("pipeline", [1, 2])
def test_offload_refusal_names_the_offload_pin(pipeline):
    """``offload_activations="full"`` on a model whose every repeated layer updates BatchNorm's
    statistics is refused naming ``offload_activations`` and its fix (it said "recompute='full'
    ... leave recompute= unset", a pin the user never gave: the sweep's
    mobilevit:pp-offload:370942:gloo)."""
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pins = dict(pipeline=2, schedule="gpipe", micro_batch_size=4) if pipeline > 1 else {}
    with pytest.raises(autopar.AutoparInputError,
                       match=r"offload_activations='full' but every repeated layer .* leave "
                             r"offload_activations= unset") as e:
        autopar.plan(_BatchNormBlocks(), (x,), torch.nn.functional.mse_loss, target=y,
                     cluster="cpu:2", offload_activations="full", **pins)
    assert "recompute=" not in str(e.value).replace("recompute='full' takes", ""), str(e.value)
