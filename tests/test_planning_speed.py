"""The planning-speed shortcuts give the figures of the long way: the stage DP's tables
held once per distinct in-flight count (``stage_tables.Stack``) equal the per-stage
tables built from the formula, and the DP's answer on them is the answer on the full
arrays; ``simulate.makespan`` is ``simulate(...).makespan``."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.schedule import schedule_actions
from autopar.solver.simulate import makespan, simulate
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
