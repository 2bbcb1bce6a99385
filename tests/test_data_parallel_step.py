"""A data-parallel step runs no blocking collective that DDP does not (issue 13, point 6).

On ``data=2`` the GPT's per-rank training program scatters the batch and calls nothing else
across ranks: the cross-entropy's global count of non-ignored targets comes from the whole
target every rank holds (``passes/loss_count.py``), the loss is returned as this rank's term
and summed beside backward (``OneStage.loss_sync``), and the position embedding ``wpe``
(``wpe[arange]``, replicated, added to the batch-sharded token embedding) has its gradient
summed with the other parameters' by GradSync instead of an activation-gradient all-reduce.
Training still equals one device, with targets padded unevenly across the two data ranks
(their local counts differ, so a local count would give another loss and other gradients).

At world 1 a placement on the one-rank axis is the whole tensor: a loss placed
vocabulary-parallel there runs as the plain ATen op (it ran an all-gather and two
all-reduces over one rank every step).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.plan import NodePlacement
from autopar.runtime.thread_ranks import simulate
from equivalence import compare, parallel_run, reference_run


def test_data_parallel_gpt_step_has_no_blocking_collective(captured):
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2})
    target = ex.target.clone()
    half = target.shape[0] // 2
    target[:half, : target.shape[1] * 3 // 4] = -100      # rank 0's slice mostly ignored
    ref = reference_run(ex.model, ex.inputs, target, ex.loss_fn)

    def run(pm, comm):
        code = pm.code("train")
        called = set(re.findall(r"autopar_ops_collectives_(\w+)\(", code))
        assert called == {"scatter"}, f"collectives in the data-parallel program: {called}\n{code[-1500:]}"
        assert "global_target_count" in code
        assert pm.runner.loss_sync == (0,)
        assert "transformer.wpe.weight" in pm._grad_sync.params
        return parallel_run(pm, ex.inputs, target)

    losses = []
    for rank, got in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"gpt data=2 padded targets rank {rank}")
        losses.append(got.losses)
    assert losses[0] == losses[1], "the ranks return different losses"
    assert torch.isfinite(torch.tensor(losses)).all()


def test_world_one_runs_no_local_op_over_its_one_rank_axis(captured):
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:1"), 1)
    ce = next(n for n in plan.nodes if "cross_entropy" in n)
    plan = replace(plan, nodes={**plan.nodes, ce: NodePlacement(("S(1)", "R"), ("R",))})
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)

    def run(pm, comm):
        code = pm.code("train")
        called = re.findall(r"autopar_ops_\w+", code)
        assert not called, f"autopar ops at world 1: {called}"
        return parallel_run(pm, ex.inputs, ex.target)

    [got] = simulate(cap, plan, ex.model, run)
    compare(ref, got, "gpt world 1, the loss placed vocabulary-parallel on the one-rank axis")
