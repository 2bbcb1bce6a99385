"""Planning shortcuts give what the long way gives:

- capture records no Python stack per node (``torch.fx.config.do_not_emit_stack_traces``)
  and its graph is the one captured with them, node for node; a refused graph is exported
  again with them, so its message can name the source line. A torch without that flag
  (2.11: ``export.STACK_TRACE_SWITCH`` False, forced on the others) records the stacks in
  the one export: the same graph, and a refused graph is not exported twice;
- the free pipeline search's bound (``stage_dp.plan_stages(above=)``,
  ``pipeline_search._choose(bound=)``): a configuration is skipped only when its busiest
  rank alone (``stage_dp._busiest_floor``) is at least the bound, and that floor is never
  above the simulated step; below the bound the answer is the unbounded one;
- ``solve`` runs the garbage collector less often while it plans and restores it after.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import autopar.solver.driver as driver
from autopar.capture import CaptureError, capture
from autopar.capture import export as export_mod
from autopar.schedule import SCHEDULES
from autopar.solver.stage_dp import (LayerCosts, StagePins, _busiest_floor, _candidates, plan_stages,
                                     simulate_plan)
from autopar.solver.stage_tables import Candidate
from examples.models import gpt_factory


def _graph(cap):
    return [(n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs),
             tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None,
             repr(n.meta.get("nn_module_stack")))
            for n in cap.gm.graph.nodes]


@pytest.fixture(params=["this torch", "no switch"])
def switch(request, monkeypatch):
    """Both branches of ``export.STACK_TRACE_SWITCH``: this torch's own, and a torch without
    ``do_not_emit_stack_traces`` (2.11); the first is the second where this torch is one."""
    if request.param == "no switch":
        monkeypatch.setattr(export_mod, "STACK_TRACE_SWITCH", False)
    return export_mod.STACK_TRACE_SWITCH


def test_the_switch_is_whether_torch_has_the_flag():
    assert export_mod.STACK_TRACE_SWITCH == hasattr(torch.fx.config, "do_not_emit_stack_traces")


def test_capture_without_stack_traces_is_the_same_graph(switch):
    ex = gpt_factory(batch=2, n_layer=1, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    fast = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    assert any(n.meta.get("stack_trace") for n in fast.gm.graph.nodes) == (not switch)
    if switch:
        assert not torch.fx.config.do_not_emit_stack_traces        # restored
    wrapper = export_mod._WithLoss(ex.model, ex.loss_fn, 1)
    slow = export_mod._from_program(export_mod._export(wrapper, (*ex.inputs, ex.target), stack_traces=True),
                                    wrapper, 1, True, "torch.export")
    assert any(n.meta.get("stack_trace") for n in slow.gm.graph.nodes)
    assert _graph(fast) == _graph(slow)
    assert (fast.params, fast.buffers, fast.inputs, fast.loss, fast.output) == \
        (slow.params, slow.buffers, slow.inputs, slow.loss, slow.output)


def test_refused_graph_is_exported_again_with_stack_traces(switch, monkeypatch):
    """The first export has no stacks; a graph refused (CaptureError) is exported again
    with them, so the message (``hops._where``) can name the source line. Without the
    switch the first export has them: refused once, not exported again."""
    seen = []
    real = export_mod._from_program

    def refuse_without_stacks(ep, *a):
        stacks = any(n.meta.get("stack_trace") for n in ep.graph.nodes)
        seen.append(stacks)
        if not stacks:
            raise CaptureError("refused")
        return real(ep, *a)

    monkeypatch.setattr(export_mod, "_from_program", refuse_without_stacks)
    cap = capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    assert seen == ([False, True] if switch else [True])
    assert any(n.meta.get("stack_trace") for n in cap.gm.graph.nodes)

    def refuse(ep, *a):
        seen.append(any(n.meta.get("stack_trace") for n in ep.graph.nodes))
        raise CaptureError("refused")

    seen.clear()
    monkeypatch.setattr(export_mod, "_from_program", refuse)
    with pytest.raises(CaptureError, match="refused"):
        capture(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    assert seen == ([False, True] if switch else [True])


def _costs(rng, n=10) -> LayerCosts:
    return LayerCosts(time=rng.random(n) * rng.choice([1, 10], n), state_bytes=rng.random(n),
                      activation_bytes=rng.random(n), boundary_bytes=rng.random(n - 1),
                      fixed_time=rng.random(n) * 0.05, action_time=0.01,
                      boundary_tensors=np.ones(n - 1), message_time=0.003)


@pytest.mark.parametrize("seed", range(3))
def test_busiest_floor_is_a_floor_of_the_simulated_step(seed):
    rng = np.random.default_rng(seed)
    costs = _costs(rng)
    for c in _candidates(costs.n_layers, 4, 8, StagePins(n_stages=4)):
        try:
            sp = plan_stages(costs, n_devices=4, global_batch=8, memory_limit=1e9, bandwidth=5.0,
                             n_stages=c.p, micro_batches=c.m, schedule=c.schedule,
                             virtual_stages=c.v)
        except ValueError:
            continue
        assert simulate_plan(sp, timeline=False) >= _busiest_floor(c, costs, 4, 8) * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_bound_skips_only_what_cannot_beat_it(seed):
    rng = np.random.default_rng(100 + seed)
    costs = _costs(rng)
    kw = dict(n_devices=4, global_batch=16, bandwidth=5.0, n_stages=4)
    limit = 6.0 if seed % 2 else 1e9          # some configurations over memory
    skipped = 0
    for kind in SCHEDULES:
        try:
            full = plan_stages(costs, memory_limit=limit, schedule=kind, **kw)
        except ValueError:
            full = None
        floors = sorted(_busiest_floor(c, costs, 4, 16)
                        for c in _candidates(costs.n_layers, 4, 16, StagePins(4, schedule=kind)))
        for above in (floors[0] * 0.5, *floors, floors[-1] * 2):
            try:
                got = plan_stages(costs, memory_limit=limit, schedule=kind, above=above, **kw)
            except ValueError:
                got = "raised"
            if full is None:
                assert got in ("raised", None)   # nothing fits; None: every one was over the bound
                assert got == "raised" or floors[0] >= above
                continue
            floor = _busiest_floor(_as_candidate(full), costs, 4, 16)
            if floor < above:
                assert got == full               # the unbounded answer could beat it: kept
            elif got is None:
                skipped += 1
                assert all(f >= above for f in floors)
            elif got != "raised":                # only configurations over the bound skipped
                assert _busiest_floor(_as_candidate(got), costs, 4, 16) < above
            # raised: one under the bound does not fit (a caller may recompute and retry)
    assert skipped > 0


def _as_candidate(sp):
    return Candidate(sp.n_stages, sp.micro_batches, sp.schedule, sp.virtual_stages)


def test_solve_runs_the_collector_less_often_and_restores_it(monkeypatch):
    seen = []
    planned = driver.solve(torch.nn.Linear(2, 2), (torch.randn(2, 2),))
    monkeypatch.setattr(driver, "_solve", lambda *a, **kw: seen.append(gc.get_threshold()) or planned)
    before = gc.get_threshold()
    assert before[0] < driver.PLANNING_GC_THRESHOLD
    assert driver.solve(torch.nn.Linear(2, 2), (torch.randn(2, 2),)).plan.digest() == planned.plan.digest()
    assert seen == [(driver.PLANNING_GC_THRESHOLD, *before[1:])] and gc.get_threshold() == before

    def fails(*a, **kw):
        raise ValueError("no plan")
    monkeypatch.setattr(driver, "_solve", fails)
    with pytest.raises(ValueError, match="no plan"):
        driver.solve(torch.nn.Linear(2, 2), (torch.randn(2, 2),))
    assert gc.get_threshold() == before and gc.isenabled()


def test_plans_in_threads_at_once_restore_the_collector():
    """Thread ranks that each solve (``parallelize(comm=...)`` without a plan): plan A
    starts, plan B starts, A ends, B ends; the thresholds from before A come back (B must
    not restore the planning threshold it found)."""
    import threading
    before = gc.get_threshold()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def plan_a():
        with driver._collector_paused():
            a_in.set()
            b_in.wait(timeout=30)
        a_out.set()

    def plan_b():
        a_in.wait(timeout=30)
        with driver._collector_paused():
            b_in.set()
            a_out.wait(timeout=30)
    threads = [threading.Thread(target=plan_a), threading.Thread(target=plan_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = gc.get_threshold()
    gc.set_threshold(*before)
    assert after == before
