"""benchmarks/frontier.py: every configuration pins a mesh that covers its GPUs with the
published micro-batch; a case past its budget is killed with its process group and reported
(not hung); the verdict compares the free plan with the best pinned one. Planning the rows
takes minutes to hours (the benchmark); this checks what can be checked in seconds."""
import time

import pytest
import torch

from autopar.options import Options
from autopar.solver.accumulate import accumulation_pin
from autopar.solver.pipeline_search import pipeline_config
from benchmarks import frontier
from benchmarks.published_runs import pins_of

CASES = [(name, i) for name, row in frontier.ROWS.items() for i in range(len(row.configs))]


@pytest.mark.parametrize("name,index", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_config_covers_the_gpus_with_the_published_micro_batch(name, index):
    run = frontier._case_run(frontier.ROWS[name], index)
    assert run.tensor * run.pipeline * run.data * run.expert * run.context == run.gpus
    pins = Options.from_pins(pins_of(run))
    batch = [torch.empty(run.batch, 1)]
    per_rank = run.batch // (run.data * run.expert)
    if run.pipeline > 1:
        p, v, m, _ = pipeline_config(batch, pins)
        assert (p, m) == (run.pipeline, per_rank // run.micro)
        assert run.virtual == 1 or v == run.virtual     # 1: the schedule's own default
    else:
        assert (accumulation_pin(pins, batch) or 1) == per_rank // run.micro


def test_a_case_past_its_budget_is_killed_and_reported():
    t0 = time.perf_counter()
    res = frontier.run_case("llama3-70b", -1, budget_s=1.0, time_limit_s=1.0)
    assert res["status"] == "budget" and res["last_stage"]
    assert time.perf_counter() - t0 < 30


def _planned(step, wall):
    return {"status": "planned", "step_s": step, "wall_s": wall}


def test_verdict_names_what_keeps_a_row_from_its_goals():
    row = frontier.ROWS["mixtral-8x7b"]
    pinned = {"0": _planned(2.0, 50), "1": _planned(2.5, 50)}
    assert frontier.verdict(row, {"free": _planned(1.9, 12), **pinned}) == \
        "free >= best pinned; planned in 12 s (goal met)"
    assert frontier.verdict(row, {"free": _planned(3.0, 40), **pinned}) == \
        "free 1.50x the best pinned; planned in 40 s (goal 30 s; no stage times recorded)"
    # a row over its time goal names its longest search stages, from the case's phases
    slow = {**_planned(1.9, 100), "phases": {"total": 100.0, "capture": 2.0, "unpipelined": 8.0,
                                             "pipeline search": 70.0, "ilp (8, 8)": 60.0,
                                             "accumulation": 20.0}}
    assert frontier.verdict(row, {"free": slow, **pinned}) == (
        "free >= best pinned; planned in 100 s (goal 30 s; longest: pipeline search 70 s "
        "(70%), accumulation 20 s (20%), unpipelined 8 s (8%))")
    late = {"status": "budget", "wall_s": 900, "last_stage": "pipeline p=4 300.0s"}
    assert "pipeline p=4" in frontier.verdict(row, {"free": late, **pinned})
    assert frontier.verdict(row, pinned) == "incomplete"


def _plan_config(name: str, index: int, **extra):
    from autopar.solver.driver import solve
    from benchmarks import published_runs as pr
    run = frontier._case_run(frontier.ROWS[name], index)
    ex = pr.build(run, run.batch)
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=pr.run_cluster(run),
                    pins={**pins_of(run), **extra}, time_limit_s=30.0)
    return plan


def test_published_interleaved_layouts_fit_and_recompute_where_it_pays():
    """Layouts that trained, planned as pinned on the meta device (seconds each): Qwen3-235B's
    TP 2 x EP 8 x PP 32 x VPP 3 fits once its loss head's logits are counted for the one
    micro-batch its last stage holds (33 GiB on that stage before); Mixtral 8x22B's
    EP 8 x PP 8 x VP 7 once a rank's stages share its memory by need (its first stage, the
    embedding and a layer, 11.7 GiB against 78 / 7); and Mixtral 8x22B's reference layout,
    which fits without recomputing, is planned recomputing the few layers that let its
    intra-stage plan choose faster placements (``pipeline_search._Cutter._recomputing_too``)."""
    assert _plan_config("qwen3-235b", 0).pipeline_stages == 32
    assert _plan_config("mixtral-8x22b", 1).pipeline.virtual_stages == 7
    free = _plan_config("mixtral-8x22b", 0)
    none = _plan_config("mixtral-8x22b", 0, recompute="none")
    assert not none.recompute and free.recompute
    assert free.estimate.step_time_s < 0.97 * none.estimate.step_time_s
