"""The receive buffers of the schedules torch runs from a lowered program (interleaved
1F1B, zero bubble, DualPipeV), counted on that program (``stage_tables.lowered_holds``);
the runtime's measured peaks against them are ``test_pipeline_runtime``'s."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.schedule import check_schedule, lowered_program, stage_ranks
from autopar.solver.stage_tables import (lowered_holds, receive_in_flight,
                                         steady_micro_batches)

KINDS = (("interleaved-1f1b", (2, 3)), ("zero-bubble", (1, 2)), ("dualpipev", (2,)))


def test_the_program_is_torchs_with_each_receive_before_its_use():
    """Every rank's program lists each of its stages' actions once per micro-batch, a
    receive on the rank that holds the stage, before the action that reads it (a
    forward reads RECV_F, a backward RECV_B), and nothing where a stage's neighbour is
    on the same rank (DualPipeV's middle pair)."""
    p, m = 3, 6
    for kind, vs in KINDS:
        for v in vs:
            ranks = stage_ranks(kind, p, v)
            for r, ops in enumerate(lowered_program(kind, p, m, v)):
                seen = set()
                for op, s, mb in ops:
                    assert ranks[s] == r, (kind, op, s)
                    if op == "F" and s > 0 and ranks[s - 1] != r:
                        assert ("RECV_F", s, mb) in seen, (kind, v, r, s, mb)
                    if op in ("B", "I") and s < p * v - 1 and ranks[s + 1] != r:
                        assert ("RECV_B", s, mb) in seen, (kind, v, r, s, mb)
                    if op == "RECV_F":
                        assert s > 0 and ranks[s - 1] != r
                    seen.add((op, s, mb))
                forwards = sorted((s, mb) for op, s, mb in ops if op == "F")
                assert forwards == sorted((s, mb) for s in range(p * v) if ranks[s] == r
                                          for mb in range(m))


def test_interleaved_holds_up_to_two_p_values_whatever_m():
    """Interleaved 1F1B's runtime posts each receive as its sender's action is placed, so
    a stage holds values for the micro-batches received ahead of its forwards as well as
    those in flight, but no more than 2p of them, and the count stops growing with m
    (where the model held m before: 128 a stage for Qwen3-235B's PP 8 x VPP 4 layout)."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p, 16 * p):
            values, grads = receive_in_flight("interleaved-1f1b", p, m, 4)
            assert values.max() == min(2 * p, m), (p, m, values)
            assert grads.max() <= min(p, m), (p, m, grads)
            assert values[0] == 0 and grads[-1] == 0


def test_the_steady_state_holds_what_the_whole_program_does():
    """``steady_micro_batches``: the program of that many micro-batches holds, stage by
    stage, what the full program holds (so a 512-micro-batch program is counted on two
    rounds)."""
    checked = 0
    for kind, vs in KINDS:
        for p in (2, 3, 4):
            for v in vs:
                for m in range(1, 10 * p + 1):
                    try:
                        check_schedule(kind, p, m, v)
                    except ValueError:
                        continue
                    steady = steady_micro_batches(kind, p, m)
                    if steady == m:
                        continue
                    full, short = lowered_holds(kind, p, m, v), lowered_holds(kind, p, steady, v)
                    assert np.array_equal(full[0], short[0]), (kind, p, m, v, steady)
                    assert np.array_equal(full[1], short[1]), (kind, p, m, v, steady)
                    checked += 1
    assert checked > 100


@pytest.mark.parametrize("kind,p,m,v", [("zero-bubble", 4, 8, 1), ("dualpipev", 2, 8, 2)])
def test_zero_bubble_and_dualpipev_as_measured_before(kind, p, m, v):
    """The walk gives what the closed forms it replaced gave where the runtime measured
    them: zero bubble's values min(n_k + 1, m) and gradients r + 1 (rank r), DualPipeV's
    first stage's 2 gradients (its order has 1 weight half pending, and one is received
    ahead)."""
    values, grads = receive_in_flight(kind, p, m, v)
    if kind == "zero-bubble":
        assert values.tolist() == [0, p + 1, p + 1, p + 1]
        assert grads.tolist() == [1, 2, 3, 0]
    else:
        assert grads[0] == 2 and values[1] > 0 and values[p] == 0 and grads[p - 1] == 0
