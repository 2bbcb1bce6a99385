"""Training under every family of plans equals training on one device.

For each example model, world sizes 2, 4 and a 2x2 mesh, with the solver's own plan and
with each pinned family (data parallel, ZeRO-3, tensor parallel, a 2-D mix): the loss and
every gradient by parameter name at each of 3 SGD-with-momentum steps, and the weights after
them, match the single-device model (fp32: loss rel err < 1e-5, gradients < 1e-4, weights
< 1e-4 of how far each moved; ``autopar.verify``). The solver's own plan is made under a
memory budget that replication does not fit, so it really shards (a tiny model's free plan
replicates everything and would test nothing distributed). Ranks are simulated as threads
running the same per-rank modules as torchrun does (tests/test_gloo.py runs a subset on
real gloo processes). A planted fault, one LayerNorm gradient zeroed on one step, must fail.
"""
from __future__ import annotations

import pytest
import torch

from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.placement import parse_placements, Shard
from autopar.runtime.thread_ranks import simulate
from equivalence import (
    FAULT_PARAM, FAULT_STEP, WEIGHT_RTOL, compare, measure, parallel_run, reference_run,
    sharding_budget, zero_grad_on_step,
)

CONFIGS = [
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
    plan = sharding_solver_plan(cap, world) if not pins else \
        plan_captured(cap, parse_cluster(f"cpu:{world}"), world, pins=dict(pins))
    _check_pins_took_effect(plan, pins)
    full_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())

    def run(pm, comm):
        return parallel_run(pm, ex.inputs, ex.target), sum(p.numel() * p.element_size() for p in pm.parameters())

    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for rank, (got, local_bytes) in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"{model} on {plan.mesh_shape} {pins or 'solver'} rank {rank}")
        if not pins:
            assert local_bytes < full_bytes, \
                f"solver plan: rank {rank} holds {local_bytes} B of {full_bytes} B of parameters"


def sharding_solver_plan(cap, world):
    """The solver's own plan under a memory budget replication does not fit
    (``equivalence.sharding_budget``). One mesh axis and no recomputation keep the solve
    under a second or two (the solver would otherwise also try a 2x2 mesh and recomputing
    layers, which the budget makes slow: up to a minute for llama on 4)."""
    cl = parse_cluster(f"cpu:{world}")
    budget = sharding_budget(plan_captured(cap, cl, world, pins={"data": world}))
    plan = plan_captured(cap, cl, world, memory_budget=budget, mesh_shape=(world,),
                         pins={"recompute": "none"})
    assert plan.estimate.memory_total <= budget
    return plan


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

        def spy(grads, axes, *rest):
            started.append(sync._active)
            start(grads, axes, *rest)
        sync._start = spy
        return parallel_run(pm, ex.inputs, ex.target), started

    for rank, (got, started) in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"gpt data=2 small buckets rank {rank}")
        assert sum(started) > 3, f"rank {rank}: {sum(started)} of {len(started)} buckets started in backward"


def test_a_gradient_zeroed_on_one_step_fails_the_comparison(captured):
    """A fault planted through a gradient hook on the parallel module's LayerNorm weight,
    zeroed in step 2's backward only: the loss never sees it (it is the last step), a
    comparison of the first step's gradients would not either, and the weight moved by
    little next to its size (its relative-to-size error stays below the tolerance). The
    gradients of every step and the weights measured against how far they moved catch it."""
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2})
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)

    def run(pm, comm):
        zero_grad_on_step(pm)
        return parallel_run(pm, ex.inputs, ex.target)

    for rank, got in enumerate(simulate(cap, plan, ex.model, run)):
        assert got.grads[FAULT_STEP][FAULT_PARAM].abs().max() == 0, "the fault was not planted"
        c = measure(ref, got)
        assert (c.grad_worst, c.grad_step) == (FAULT_PARAM, FAULT_STEP) and c.grad_err > 0.99, c
        assert c.weight_worst == FAULT_PARAM and c.weight_err > WEIGHT_RTOL, c
        w, w_ref = got.weights[FAULT_PARAM], ref.weights[FAULT_PARAM]
        assert float((w - w_ref).norm() / w_ref.norm()) < WEIGHT_RTOL, \
            "the fault is visible against the weight's size: it no longer tests the measure"
        with pytest.raises(AssertionError, match=f"gradient mismatch for {FAULT_PARAM} at step {FAULT_STEP}"):
            compare(ref, got, f"planted fault rank {rank}")
