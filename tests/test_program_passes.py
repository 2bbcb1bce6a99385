"""The rewrite of a rank's programs as a declared list (``autopar.runtime.program_passes``):
the runtime runs the passes the list declares, in its order and under its conditions, and
no pass changes the program it is given."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from torch.fx import GraphModule

import autopar.runtime.program_passes as pp
from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.runtime.shards import shard_model
from autopar.runtime.thread_ranks import simulate

TRAIN = ("insert_collectives", "check_grad_sync")
LAST = ("place_on", "fast_bindings")
KINDS = {
    # plan pins: (train program's passes, forward program's)
    "plain": ({}, TRAIN + LAST, ("insert_collectives",) + LAST),
    "zero3-bf16": ({"data": 2, "zero": 3, "precision": "bf16"},
                   TRAIN + ("low_precision_gathers", "prefetch_gathers") + LAST,
                   ("insert_collectives", "low_precision_gathers", "prefetch_gathers") + LAST),
    "zero3-fp8": ({"data": 2, "zero": 3, "precision": "fp8", "fp8_layers": "all"},
                  TRAIN + ("low_precision_gathers", "fp8_linear_calls", "fp8_experts_calls",
                           "fp8_weight_gathers",
                           "prefetch_gathers") + LAST,
                  ("insert_collectives", "low_precision_gathers", "fp8_linear_calls",
                   "fp8_experts_calls", "fp8_weight_gathers", "prefetch_gathers") + LAST),
    "recompute": ({"data": 2, "recompute": "full"}, TRAIN + ("checkpoint_layers",) + LAST,
                  ("insert_collectives",) + LAST),
    "zero3-recompute": ({"data": 2, "zero": 3, "recompute": "full"},       # fp32: no 16-bit gathers
                        TRAIN + ("checkpoint_layers",) + LAST, ("insert_collectives",) + LAST),
    "zero3-offload": ({"data": 2, "zero": 3, "offload_activations": ["h.0"]},   # no prefetch
                      TRAIN + ("offload_layers",) + LAST, ("insert_collectives",) + LAST),
}
"""Plan kinds and the passes each program goes through, written out by hand."""

_FUNCTIONS = {"insert_collectives": "insert_collectives", "check_grad_sync": "check_grad_sync",
              "low_precision_gathers": "low_precision_gathers", "fp8_linear_calls": "fp8_linear_calls",
              "fp8_experts_calls": "fp8_experts_calls", "fp8_weight_gathers": "fp8_weight_gathers",
              "prefetch_gathers": "prefetch_gathers",
              "checkpoint_layers": "checkpoint_layers", "offload_layers": "offload_layers",
              "keep_branches": "keep_branches",
              "place_on": "place_on", "fast_bindings": "fast_bindings"}
"""Each pass's name -> the function of ``passes/`` it calls (a name in program_passes)."""


def test_every_declared_pass_names_its_function():
    assert [p.name for p in pp.PASSES] == list(_FUNCTIONS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_runtime_runs_the_declared_passes(captured, monkeypatch, kind):
    """The functions a ParallelModule's build calls, in order, are the hand-written list of
    its plan kind, and what ``pm.program_passes`` reports."""
    pins, train, forward = KINDS[kind]
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster(f"cpu:{pins.get('data', 1)}"), pins.get("data", 1),
                         pins=pins)
    called: dict[int, list[str]] = {}      # by thread: each simulated rank builds its own

    def record(name, real):
        def call(*a, **k):
            called.setdefault(threading.get_ident(), []).append(name)
            return real(*a, **k)
        return call
    for name, fn in _FUNCTIONS.items():
        monkeypatch.setattr(pp, fn, record(name, getattr(pp, fn)))

    def step(pm, comm):
        loss = pm.train_step(*ex.inputs, target=ex.target)
        return pm.program_passes, torch.isfinite(loss).item()

    ranks = simulate(cap, plan, ex.model, step)
    assert len(called) == len(ranks) == plan.world_size
    for names in called.values():       # the train program's passes, then the forward's
        assert names == list(train + forward), names
    for passes, finite in ranks:
        assert passes == {"train": train, "forward": forward} and finite


def _program(ex, cap, plan, which: str = "train", **changes) -> pp.RankProgram:
    """Rank 0's ``which`` program of ``plan`` (its shards cut from ``ex.model``)."""
    root, shards = shard_model(cap, plan, (0,) * len(plan.mesh_shape), ex.model, torch.device("cpu"))
    p = pp.RankProgram(which, cap, plan, False, (0,) * len(plan.mesh_shape), torch.device("cpu"),
                       root, shards.attr_of)
    return replace(p, **changes)


def test_conditions_of_compiled_and_pipelined_programs(captured):
    """compile=True leaves out the eager-only passes; a pipelined plan's programs are cut
    into stages later (no prefetch, recomputation per stage)."""
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": 3, "recompute": "full"})
    compiled = replace(plan, options=plan.options.replace(compile=True))
    assert pp.applied(_program(ex, cap, compiled)) == TRAIN + ("checkpoint_layers", "place_on")
    assert pp.applied(_program(ex, cap, plan, pipelined=True)) == TRAIN + LAST
    zero3 = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": 3})
    assert pp.applied(_program(ex, cap, zero3, pipelined=True)) == TRAIN + LAST
    assert pp.applied(_program(ex, cap, zero3, "forward")) == ("insert_collectives", "prefetch_gathers") + LAST


def _text(gm: GraphModule) -> list[str]:
    """The code of ``gm`` and of every graph module it calls."""
    return [m.code for m in gm.modules() if isinstance(m, GraphModule)]


@pytest.mark.parametrize("pins", [{"data": 2, "zero": 3, "precision": "bf16"},
                                  {"data": 2, "zero": 3, "precision": "fp8", "fp8_layers": "all"},
                                  {"data": 2, "recompute": "full"}], ids=["zero3-bf16", "zero3-fp8", "recompute"])
def test_no_pass_changes_its_input(captured, pins):
    """Each pass, given the program the passes before it made, leaves that program's code
    as it was and returns one that reads the same parameter tensors. The rank's device is
    "meta" here, so that ``place_on`` has something to rewrite."""
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins=pins)
    p = _program(ex, cap, plan, device=torch.device("meta"))
    rw = None
    changed = []
    for ps in pp.PASSES:
        if not ps.applies(p):
            continue
        before = None if rw is None else _text(rw.gm)
        tensors = None if rw is None else {id(t) for t in rw.gm.parameters()}
        out = ps.run(rw, p)
        if rw is not None:
            assert _text(rw.gm) == before, f"{ps.name} changed its input"
            assert {id(t) for t in out.gm.parameters()} <= tensors, f"{ps.name} copied parameters"
            if _text(out.gm) != before:
                changed.append(ps.name)
        rw = out
    expected = {"place_on", "fast_bindings"} | ({"low_precision_gathers", "prefetch_gathers"}
                                                if pins.get("zero") else {"checkpoint_layers"})
    if pins.get("precision") == "fp8":
        expected |= {"fp8_linear_calls", "fp8_weight_gathers"}
    assert set(changed) == expected, changed       # each pass that ran did rewrite


def test_copy_program_shares_tensors_and_not_graphs(captured):
    from autopar.passes.copy_program import copy_program
    from autopar.passes.recompute import checkpoint_layers
    from autopar.analysis.layers import layer_members
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:1"), 1, pins={"recompute": "full"})
    gm = checkpoint_layers(pp.rewrite(_program(ex, cap, plan)).gm, layer_members(cap.gm, plan.recompute))
    out = copy_program(gm)
    inner = [m for m in out.modules() if isinstance(m, GraphModule)]
    assert len(inner) > 1                           # the recomputed layers' bodies, copied too
    assert not {id(m.graph) for m in inner} & {id(m.graph) for m in gm.modules() if isinstance(m, GraphModule)}
    assert [id(t) for t in out.parameters()] == [id(t) for t in gm.parameters()]
    assert _text(out) == _text(gm)
