"""The planning-speed shortcuts give the figures of the long way: the stage DP's tables
held once per distinct in-flight count (``stage_tables.Stack``) equal the per-stage
tables built from the formula, and the DP's answer on them is the answer on the full
arrays; ``simulate.makespan`` is ``simulate(...).makespan``."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.options import Options
from autopar.schedule import schedule_actions
from autopar.pricing.simulate import makespan, simulate
from autopar.solver.spec import SearchSpec
from autopar.solver.stage_dp import LayerCosts, stage_dp
from autopar.solver.stage_tables import INF, Candidate, Tables, in_flight

CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 6, 1), ("zero-bubble", 4, 8, 1),
         ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 3, 6, 3)]


def _costs(rng, n=12) -> LayerCosts:
    return LayerCosts(time=rng.random(n), state_bytes=rng.random(n) * 5, activation_bytes=rng.random(n),
                      boundary_bytes=rng.random(n - 1), fixed_time=rng.random(n) * 0.1,
                      boundary_tensors=rng.integers(1, 3, n - 1).astype(float), message_time=0.01)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_stacked_tables_equal_the_per_stage_formula(schedule, p, m, v):
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    costs = _costs(rng)
    tables = Tables(costs)
    n_devices, batch, bandwidth = 2 * p, 4 * m, 10.0
    c = Candidate(p, m, schedule, v)
    # a limit that leaves some stages over memory and others not
    limit = float(np.median(tables.state[tables.valid])) * 1.5
    cost, tie, memory, share, comm = tables.arrays(c, n_devices, batch, limit, bandwidth, False)
    d, b = n_devices // p, batch / m
    n_k = in_flight(schedule, p, m, v)
    time = np.where(tables.valid, tables.time * b / d + tables.fixed + tables.latency
                    + (3 if schedule == "zero-bubble" else 2) * costs.action_time, INF)
    want_memory = tables.state[None] + n_k[:, None, None] * (tables.act * b / d)[None]
    want_cost = np.where(want_memory <= share * (1 + 1e-9), time[None], INF)
    want_tie = want_cost + 2 * comm[None, None, :]
    assert cost.shape == want_cost.shape == (p * v, costs.n_layers + 1, costs.n_layers + 1)
    for got, want in ((cost, want_cost), (tie, want_tie), (memory, want_memory)):
        assert np.array_equal(np.asarray(got), want)
        for k in range(p * v):
            assert np.array_equal(got[k], want[k])
            assert got[k, 0, 3] == want[k, 0, 3]
    assert np.isinf(want_cost[:, tables.valid]).any() and np.isfinite(want_cost).any()
    assert stage_dp(cost, tie) == stage_dp(want_cost, want_tie)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_makespan_is_the_simulated_makespan(schedule, p, m, v):
    rng = np.random.default_rng(7 + p + m + v)
    S = p * v
    f = rng.random(S)
    b = f * (1 + rng.random(S))
    w = b * rng.random(S) * 0.5
    p2p = rng.random(max(S - 1, 1)) * 0.2
    actions = schedule_actions(schedule, p, m, v)
    assert makespan(actions, f, b, w, p2p) == simulate(actions, f, b, w, p2p).makespan


def _reference_makespan(actions, f, b, w, p2p) -> float:
    """The timeline worked out the plain way: sweep the ranks, each running its next
    action once what it waits for has ended (``simulate``'s rules), until all have run."""
    rank_of = {a.stage: r for r, acts in enumerate(actions) for a in acts}
    n_stages = max(rank_of) + 1
    dur = {"F": f, "B": b, "I": b - w, "W": w}
    split = any(a.kind == "I" for acts in actions for a in acts)
    end, pos, free = {}, [0] * len(actions), [0.0] * len(actions)
    while any(k < len(acts) for k, acts in zip(pos, actions)):
        moved = False
        for r, acts in enumerate(actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s, i = a.stage, a.microbatch
                if a.kind == "F":
                    deps = [((s - 1, "F", i), s - 1)] if s > 0 else []
                elif a.kind in ("B", "I"):
                    deps = [((s, "F", i), None)]
                    if s < n_stages - 1:     # the next stage's gradient (B, or I when split)
                        deps.append(((s + 1, "I" if split else "B", i), s))
                else:
                    deps = [((s, "I", i), None)]
                if any(d not in end for d, _ in deps):
                    break
                t = free[r]
                for d, boundary in deps:
                    cross = boundary is not None and rank_of[d[0]] != r
                    t = max(t, end[d] + (p2p[boundary] if cross else 0.0))
                end[(s, a.kind, i)] = free[r] = t + dur[a.kind][s]
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(end.values())


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_one_compiled_schedule_times_every_set_of_durations(schedule, p, m, v):
    """``stage_dp.simulate_plan`` keeps one dependency structure per schedule
    (``simulate.compile_schedule``) and times every cut with it: each set of durations
    gives exactly the makespan of a plain sweep of the schedule (and ``simulate``'s)."""
    from autopar.pricing.simulate import compile_schedule, makespan_compiled
    comp = compile_schedule(schedule_actions(schedule, p, m, v))
    rng = np.random.default_rng(11 * p + m + v)
    S = p * v
    for _ in range(3):
        f = rng.random(S)
        b = f * (1 + rng.random(S))
        w = b * rng.random(S) * 0.5
        p2p = rng.random(max(S - 1, 1)) * rng.choice([0.0, 0.2, 5.0])
        actions = schedule_actions(schedule, p, m, v)
        want = _reference_makespan(actions, f, b, w if "I" in {a.kind for x in actions for a in x}
                                   else np.zeros(S), p2p)
        assert makespan_compiled(comp, f, b, w, p2p) == want
        assert simulate(actions, f, b, w, p2p).makespan == want


def test_simulate_plan_makespan_is_its_timeline_end():
    """The cached path (``timeline=False``) and the full simulation agree on a plan, also
    when the same schedule is timed again under other stage times."""
    from autopar.solver.stage_dp import plan_stages, simulate_plan
    rng = np.random.default_rng(3)
    for schedule in ("1f1b", "zero-bubble", "interleaved-1f1b"):
        for _ in range(2):
            sp = plan_stages(_costs(rng), n_devices=4, global_batch=16, memory_limit=1e9,
                             bandwidth=10.0, n_stages=4, micro_batches=8, schedule=schedule,
                             virtual_stages=2 if schedule == "interleaved-1f1b" else None)
            assert simulate_plan(sp, timeline=False) == simulate_plan(sp).makespan


def test_deadlocked_schedule_raises_from_the_compiled_path():
    from autopar.schedule import Action
    from autopar.pricing.simulate import compile_schedule, makespan_compiled
    # rank 0 runs B before the F it needs
    actions = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        makespan_compiled(compile_schedule(actions), 1.0, 2.0)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(actions, 1.0, 2.0)


def test_meshes_the_bound_skipped_are_priced_from_their_kept_solution(monkeypatch):
    """``pipeline_free._DegreeSearch``: a stage mesh the bound prunes keeps its intra-stage
    solution, so ``unpruned`` prices it without solving its ILP again, and gives what a
    search that pruned nothing gives."""
    import torch

    from autopar.capture import capture
    from autopar.cost_models.hardware import parse_cluster
    from autopar.solver import pipeline_free
    from examples.models import gpt_factory
    with torch.device("meta"):
        ex = gpt_factory(batch=16, n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    cl, world = parse_cluster("2x2xA100"), 4
    solved = []
    real = pipeline_free.solve_intra
    monkeypatch.setattr(pipeline_free, "solve_intra",
                        lambda *a, **k: solved.append(a[1].pins) or real(*a, **k))
    # the bound after solving, alone: the compute floor before solving would skip every mesh
    # unsolved (tests/test_stage_floor.py is about that one)
    monkeypatch.setattr(pipeline_free._DegreeSearch, "compute_floor", lambda self, *mesh: 0.0)

    def search():
        return pipeline_free._DegreeSearch(SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target,
                                                      cl, world, Options()), cap)
    listed = search().figures(2)
    want = listed[0]
    n_meshes = len(solved)
    assert n_meshes > 1 and [g[0] for g in listed] == sorted(g[0] for g in listed)
    pruning = search()
    pruning.bound = 1e-30               # nothing beats it: every mesh solved, then pruned
    assert pruning.figures(2) == [] and len(pruning.pruned) == n_meshes == len(solved) - n_meshes
    solved.clear()
    got = pruning.unpruned()            # every mesh's best, priced in full
    assert solved == []                 # no ILP solved again
    assert len(got) == n_meshes and all(g[1] == 2 for g in got)
    best = min(got, key=lambda g: g[0])
    assert best[0] == want[0] and best[2] == want[2] and best[3] == want[3]


def test_configurations_of_one_micro_batch_count_share_its_capture(monkeypatch):
    """``search_pipelines`` plans several configurations for real when the first falls
    short of its prediction; those with the same micro-batch count plan on one capture."""
    from types import SimpleNamespace as NS

    import torch

    from autopar.solver import pipeline_free
    steps = {3: (80.0, 166.0, 4), 12: (84.0, 88.0, 4), 24: (85.0, 87.0, 8), 48: (86.0, 86.5, 4)}

    class Search:
        def __init__(self, *a, **k):
            pass

        def figures(self, p):
            return [(steps[p][0], p, NS(virtual_stages=1, micro_batches=steps[p][2], schedule="1f1b"), {})]

        def unpruned(self):
            return []
    captures, planned = [], []
    monkeypatch.setattr(pipeline_free, "pipeline_degrees", lambda cap, cl, world: sorted(steps))
    monkeypatch.setattr(pipeline_free, "_DegreeSearch", Search)
    monkeypatch.setattr(pipeline_free, "capture_microbatch",
                        lambda *a: captures.append(a[-1]) or f"graph at m={a[-1]}")
    monkeypatch.setattr(pipeline_free, "SECOND_LOOKS", 0)
    monkeypatch.setattr(pipeline_free, "plan_pipeline", lambda mcap, ask, config, **kw:
                        planned.append((config[0], mcap)) or
                        NS(estimate=NS(step_time_s=steps[config[0]][1]), p=config[0], recompute=(),
                           options=Options()))
    spec = SearchSpec(None, (torch.zeros(8, 2),), None, None, NS(device=NS(memory_bytes=1.0)), 8,
                      Options())
    plan, mcap = pipeline_free.search_pipelines(spec, None)
    assert planned == [(3, "graph at m=4"), (12, "graph at m=4"), (24, "graph at m=8"),
                       (48, "graph at m=4")]
    assert captures == [4, 8]
    assert plan.p == 48 and mcap == "graph at m=4"


def test_memory_fitting_counts_the_tables_within_the_limit():
    """``stage_tables.Memory.fitting`` (each entry's crossing count, checked either side)
    equals counting the full memory tables within the limit, also at a limit equal to
    one of their floats and with layers that hold no activations."""
    from autopar.solver.stage_tables import Memory, _interval
    rng = np.random.default_rng(7)
    for trial in range(40):
        n = 9
        act = rng.random(n) * (trial % 3)            # trial % 3 == 0: no activations at all
        act[rng.random(n) < 0.3] = 0.0
        state = _interval(np.concatenate([[0.0], np.cumsum(rng.random(n) * 3)]))
        act = _interval(np.concatenate([[0.0], np.cumsum(act)]))
        counts = np.unique(rng.integers(1, 9, 5).astype(float) / rng.integers(1, 4))
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        if trial % 2:       # received values' buffers, min(n + 1, top) of them
            recv = _interval(np.concatenate([[0.0], np.cumsum(rng.random(n))]))
            memory = Memory(state, act, counts, np.arange(len(counts)), recv,
                            np.minimum(counts + 1, counts.max()))
        else:
            memory = Memory(state, act, counts, np.arange(len(counts)))
        full = np.asarray(memory)
        limit = float(rng.choice(full[:, valid].ravel()))
        want = np.where(valid, (full <= limit).sum(axis=0), 0)
        assert np.array_equal(memory.fitting(limit, valid), want)
        assert memory[1, 0, 3] == full[1, 0, 3]


def test_planned_memo_follows_every_input():
    """``plan_stages`` keeps each candidate's plan (``stage_dp._PLANNED``): asked again
    with the same inputs it answers from the memo, and a change to any field of the costs
    or to the limit or bandwidths gives the plan a cleared memo gives (fails when the key
    leaves one out: the first plan would come back)."""
    import dataclasses

    from autopar.solver import stage_dp as dp
    rng = np.random.default_rng(11)
    base = dataclasses.replace(_costs(rng, n=10), sync_bytes=rng.random(10), action_time=0.01)
    kw = dict(n_devices=8, global_batch=16, memory_limit=40.0, bandwidth=10.0, n_stages=4,
              micro_batches=8, schedule="zero-bubble")
    dp._PLANNED.clear()
    first = dp.plan_stages(base, **kw)
    assert dp.plan_stages(base, **kw) is first and len(dp._PLANNED) == 1

    def scaled(name):
        value = getattr(base, name)
        if name == "parameters":               # the first plan's stage 1 then reads none
            arr = np.ones(base.n_layers)
            arr[first.cuts[0]:first.cuts[1]] = 0.0
            return dataclasses.replace(base, parameters=arr)
        if name == "time_floors":              # layer 2 holds an op of 5 s a micro-batch at least
            return dataclasses.replace(base, time_floors=([2], [0.0], [5.0]))
        if value is None:                      # grad_boundary_bytes: the receive buffers counted
            return dataclasses.replace(base, **{name: np.full(base.n_layers - 1, 0.01)})
        if np.ndim(value) == 0:
            return dataclasses.replace(base, **{name: value * 0.5 + 0.01})
        arr = np.asarray(value, dtype=float).copy()
        arr[2] = arr[2] * 3 + 1                # layer 2, and the cut after it
        return dataclasses.replace(base, **{name: arr})

    variants = [(scaled(f.name), kw) for f in dataclasses.fields(LayerCosts)]
    variants += [(base, {**kw, "memory_limit": 15.0}), (base, {**kw, "bandwidth": 0.5}),
                 (base, {**kw, "sync_bandwidth": 0.1}), (base, {**kw, "n_devices": 4}),
                 (base, {**kw, "shard_state": True})]
    for i, (costs, args) in enumerate(variants):
        got = dp.plan_stages(costs, **args)
        dp._PLANNED.clear()
        fresh = dp.plan_stages(costs, **args)
        assert got == fresh and got != first, (i, args)
        dp.plan_stages(base, **kw)          # the first plan back in the memo
