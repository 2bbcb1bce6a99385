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
import torch

from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.placement import parse_placements, Shard
from autopar.runtime.thread_ranks import simulate
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


def test_fused_qkv_strided_shard_matches_one_device(captured):
    """GPT's fused c_attn projection column-sharded with a strided shard S(0/3): each rank
    holds its block of q, of k and of v, so the split into q, k, v stays head-aligned with
    no communication. The plan is edited by hand (the solver's own choice depends on costs)."""
    import dataclasses

    from autopar.plan import NodePlacement
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"tensor": 2})
    nodes = dict(plan.nodes)
    linears = set()
    for ph in [ph for name, ph in plan.params.items() if "c_attn" in name]:
        nodes[ph] = NodePlacement((), ("S(0/3)",))
        linears |= {u for u in cap.node(ph).users if "linear" in str(u.target)}
    for lin in linears:
        nodes[lin.name] = NodePlacement(("R", "S(0/3)", "S(0/3)"), ("S(2/3)",))
        for split in lin.users:
            nodes[split.name] = NodePlacement(("S(2/3)",), ("S(2)",) * 3)
    assert len(linears) == 2, "expected one fused projection per layer"
    plan = dataclasses.replace(plan, nodes=nodes)
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    name = "transformer.h.0.attn.c_attn.weight"
    full = dict(ex.model.named_parameters())[name].detach()

    def body(pm, comm):
        local = dict(pm.module.named_parameters())[name].detach().clone()
        return parallel_run(pm, ex.inputs, ex.target), local, comm.coord[0]

    h = full.shape[0] // 3
    for rank, (got, local, c) in enumerate(simulate(cap, plan, ex.model, body)):
        compare(ref, got, f"strided c_attn rank {rank}")
        want = torch.cat([full[g * h + c * h // 2: g * h + (c + 1) * h // 2] for g in range(3)])
        torch.testing.assert_close(local, want, msg=lambda m: f"rank {rank} holds the wrong rows: {m}")


def test_a_one_rank_mesh_axis_runs_no_collective(captured):
    """Placements on an axis of size 1 are all the same tensor: the per-rank program must
    not call a collective there (each costs a gloo call and a copy for nothing), and it
    still trains like one device."""
    import re
    from dataclasses import replace

    from autopar.plan import NodePlacement
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, mesh_shape=(1, 2))
    # shard every weight on the one-rank axis 0 as well, so the program has a reason to move
    # tensors there
    nodes = {}
    for name, np_ in plan.nodes.items():
        if name.startswith("p_") and np_.outputs and np_.outputs[0].startswith("R"):
            out = "S(0)" + np_.outputs[0][1:]
            nodes[name] = NodePlacement(np_.inputs, (out,) + np_.outputs[1:])
        else:
            nodes[name] = np_
    plan = replace(plan, nodes=nodes)
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)

    def run(pm, comm):
        code = pm.code("train")
        assert not re.search(r"axis\s*=\s*0\b", code), \
            "a collective on the one-rank axis 0:\n" + code[:3000]
        return parallel_run(pm, ex.inputs, ex.target)

    for r, got in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"mesh (1, 2) rank {r}")


def test_gradient_buckets_start_during_backward(captured):
    """With small buckets, data-parallel reductions start from inside backward (as autograd
    finishes each bucket's gradients), several of them, and training still equals one device."""
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2})
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)

    def run(pm, comm):
        sync = pm._grad_sync
        sync.bucket_bytes = 4096
        started = []                    # whether each bucket started before backward ended
        start = sync._start

        def spy(grads, axes):
            started.append(sync._active)
            start(grads, axes)
        sync._start = spy
        return parallel_run(pm, ex.inputs, ex.target), started

    for rank, (got, started) in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"gpt data=2 small buckets rank {rank}")
        assert sum(started) > 3, f"rank {rank}: {sum(started)} of {len(started)} buckets started in backward"
