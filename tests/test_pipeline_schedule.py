"""Schedules as data and the timeline simulator, checked against torch's own schedule
orders and against closed forms derived independently of the simulator."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.schedule import (
    Action, check_schedule, overlap_pairs, rank_stages, schedule_actions, stage_ranks,
    torch_schedule_class,
)
from autopar.pricing.simulate import format_grid, simulate
from autopar.solver.stage_dp import in_flight

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def compute_only(actions):
    """torch's compute actions as strings; an ``OVERLAP_F_B`` pair as its sub-actions, in
    the order ``_PipelineScheduleRuntime`` runs them (one after the other)."""
    out = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type == torch_schedules.OVERLAP_F_B:
            out += [str(x) for x in a.sub_actions]
        elif a.computation_type.value in "FBIW":
            out.append(str(a))
    return out


# ---- actions ---------------------------------------------------------------------------------


def test_action_prints_and_parses_like_torch():
    a = Action(2, "F", 0)
    assert str(a) == "2F0"
    assert Action.from_str("12W3") == Action(12, "W", 3)
    assert str(torch_schedules._Action.from_str(str(Action(3, "I", 7)))) == "3I7"
    with pytest.raises(ValueError, match="cannot parse action 'F0'"):
        Action.from_str("F0")


# ---- orders equal torch's ----------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_gpipe_order_is_torchs(p, m):
    order = torch_schedules.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    ours = schedule_actions("gpipe", p, m)
    for r in range(p):
        assert [str(a) for a in ours[r]] == compute_only(order[r])


@pytest.mark.parametrize("p,m", [(2, 3), (4, 4), (4, 9), (3, 6)])
def test_1f1b_order_is_torchs(p, m):
    order = torch_schedules.Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    ours = schedule_actions("1f1b", p, m)
    # torch's IR for the last rank skips micro-batch 0 (an off-by-one in its debug order;
    # Schedule1F1B._step_microbatches runs min(m, p - s) = 1 warm-up forward there), so the
    # last rank is checked against that rule: strict alternation F0 B0 F1 B1 ...
    for r in range(p - 1):
        assert [str(a) for a in ours[r]] == compute_only(order[r])
    last = p - 1
    assert [str(a) for a in ours[last]] == [f"{last}{k}{i}" for i in range(m) for k in "FB"]


@pytest.mark.parametrize("kind,cls", [("interleaved-1f1b", "ScheduleInterleaved1F1B"),
                                      ("zero-bubble", "ScheduleInterleavedZeroBubble")])
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (4, 6, 2), (4, 3, 2), (3, 9, 4), (4, 8, 1)])
def test_multi_stage_orders_are_torchs(kind, cls, p, m, v):
    rounds = max(1, m // p)
    fake = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                           microbatches_per_round=m // rounds)
    try:
        ours = schedule_actions(kind, p, m, v)
    except ValueError:
        assert kind == "zero-bubble" and m < p
        return
    for r in range(p):
        theirs = getattr(torch_schedules, cls)._calculate_single_rank_operations(fake, r)
        assert [str(a) for a in ours[r]] == compute_only(theirs), f"rank {r}"


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 5), (2, 8), (3, 6), (3, 11), (4, 8), (4, 13), (5, 10)])
def test_dualpipev_order_is_torchs(p, m):
    """Every rank's order, action by action, against torch 2.13's
    ``ScheduleDualPipeV._calculate_single_rank_operations`` (its F/B pairs as F then B)."""
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    ours = schedule_actions("dualpipev", p, m, 2)
    saw_pair = False
    for r in range(p):
        theirs = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
        saw_pair |= any(a is not None and a.computation_type == torch_schedules.OVERLAP_F_B for a in theirs)
        assert [str(a) for a in ours[r]] == compute_only(theirs), f"rank {r}"
    assert saw_pair                      # the steady state's pairs were flattened, not missed


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 8), (3, 6), (3, 11), (4, 8), (5, 10)])
def test_dualpipev_pairs_are_torchs(p, m):
    """``overlap_pairs``: every rank's ``OVERLAP_F_B`` actions as torch 2.13 lists them (the
    last rank's first steady-state F/B unpaired), each its F then its B next to each other
    in ``schedule_actions``; none for the other schedules."""
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    ours, order = overlap_pairs("dualpipev", p, m), schedule_actions("dualpipev", p, m, 2)
    for r in range(p):
        theirs = [tuple(str(x) for x in a.sub_actions) for a in
                  torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
                  if a is not None and a.computation_type == torch_schedules.OVERLAP_F_B]
        assert [(str(f), str(b)) for f, b in ours[r]] == theirs, f"rank {r}"
        for f, b in ours[r]:
            assert order[r][order[r].index(f) + 1] == b
    assert overlap_pairs("1f1b", 2, 4) == [[], []]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_v_placement_is_torchs(p):
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    assert stage_ranks("dualpipev", p, 2) == [generate_stage_to_rank_mapping(p, 2 * p, style="v")[k]
                                              for k in range(2 * p)]
    assert stage_ranks("interleaved-1f1b", p, 2) == [generate_stage_to_rank_mapping(p, 2 * p)[k]
                                                     for k in range(2 * p)]
    assert rank_stages("dualpipev", p, 2) == [[r, 2 * p - 1 - r] for r in range(p)]
    # each rank's actions touch exactly its two stages
    for r, acts in enumerate(schedule_actions("dualpipev", p, 2 * p, 2)):
        assert {a.stage for a in acts} == {r, 2 * p - 1 - r}


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"])
def test_torch_schedule_class(kind):
    cls = torch_schedule_class(kind)
    import torch.distributed.pipelining as pipelining

    assert cls is getattr(pipelining, cls.__name__)
    assert issubclass(cls, torch_schedules._PipelineSchedule)
    assert {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
            "zero-bubble": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}[kind] == cls.__name__


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("interleaved-1f1b", 4, 8, 3),
                                        ("zero-bubble", 3, 6, 1), ("zero-bubble", 2, 4, 2)])
def test_every_stage_and_microbatch_runs_once(kind, p, m, v):
    acts = [str(a) for rank in schedule_actions(kind, p, m, v) for a in rank]
    kinds = "FIW" if kind == "zero-bubble" else "FB"
    expected = sorted(f"{s}{k}{i}" for s in range(p * v) for k in kinds for i in range(m))
    assert sorted(acts) == expected


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 7), (4, 8), (4, 12)])
def test_dualpipev_runs_every_backward_once(p, m):
    """Each (stage, micro-batch): one F, and either one full B or one I and one W (torch's
    DualPipeV splits only the backwards of its tail)."""
    acts = [a for rank in schedule_actions("dualpipev", p, m, 2) for a in rank]
    assert len(acts) == len(set(acts))
    for s in range(2 * p):
        for i in range(m):
            kinds = sorted(a.kind for a in acts if (a.stage, a.microbatch) == (s, i))
            assert kinds in (["B", "F"], ["F", "I", "W"]), (s, i, kinds)
    assert any(a.kind == "I" for a in acts)


# ---- bubbles against closed forms ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 6), (4, 16), (8, 8), (8, 20), (3, 5)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0)])
def test_bubble_fraction_uniform(kind, p, m, f, b):
    sim = simulate(schedule_actions(kind, p, m), forward=f, backward=b)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert sim.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 6), (3, 9), (8, 16), (4, 5)])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0)])
def test_interleaving_cuts_bubble_as_megatron_predicts(p, m, v, f, b):
    """Megatron-LM (Narayanan et al. 2021, sec. 2.2.2): with v model chunks per rank, each
    taking 1/v of the rank's time, bubble time / ideal time = (p - 1) / (v m). Exact in the
    simulator for m >= p, whether B = 2F (Megatron's assumption) or F = B."""
    sim = simulate(schedule_actions("interleaved-1f1b", p, m, v), forward=f / v, backward=b / v)
    ideal = m * (f + b)
    assert (sim.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)
    plain = simulate(schedule_actions("1f1b", p, m), forward=f, backward=b)
    assert (sim.makespan - ideal) == pytest.approx((plain.makespan - ideal) / v)


def test_interleaving_formula_needs_m_at_least_p():
    p, m, v = 4, 3, 2
    sim = simulate(schedule_actions("interleaved-1f1b", p, m, v), forward=0.5, backward=1.0)
    ideal = m * 3.0
    assert (sim.makespan - ideal) / ideal > (p - 1) / (v * m) + 0.1


@given(p=st.integers(2, 6), extra=st.integers(0, 12),
       f=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), i=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
       w=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]))
@settings(max_examples=40, deadline=None)
def test_zero_bubble_h1_bubble(p, extra, f, i, w):
    """ZB-H1 (Qi et al. 2024): bubble (p - 1)(F + I - W) when W <= F, I (the paper's case);
    in general, for m >= p, (p - 1) max(F + I - W, I, F)."""
    m = p + extra
    try:
        acts = schedule_actions("zero-bubble", p, m)
    except ValueError:
        return                          # m not a multiple of its rounds: torch refuses too
    sim = simulate(acts, forward=f, backward=i + w, weight=w)
    assert sim.makespan - m * (f + i + w) == pytest.approx((p - 1) * max(f + i - w, i, f))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5, 16])
def test_dualpipev_bubble_f_i_w_equal(p, extra):
    """DualPipeV as torch runs it (each F/B pair one after the other), uniform stages with
    F = I = W = 1: the step is each rank's 2m (F + B) of work plus (p - 1) F of fill and
    drain, whatever m >= 2p (the steady state has no bubble). A measurement of the
    simulator on torch's order, not a published closed form: DeepSeek's Table 2 gives
    DualPipeV (PP/2 - 1)(F&B + B - 3W) for an overlapped F&B, which torch does not run.
    The DP's rho (``stage_tables.dualpipev_rho``) reproduces it."""
    from autopar.solver.stage_tables import bubble_rho

    m = 2 * p + extra
    sim = simulate(schedule_actions("dualpipev", p, m, 2), forward=1.0, backward=2.0, weight=1.0)
    rank = 2 * 3.0                          # two stages of F + B a rank, one micro-batch
    assert sim.makespan - m * rank == pytest.approx(1.0 * (p - 1))
    assert bubble_rho("dualpipev", 2, (1 / 3, 1 / 3, 1 / 3), p) * (p - 1) * rank == pytest.approx(p - 1)


def test_dualpipev_fill_and_drain_against_the_other_schedules():
    """p = 4, m = 8, the same work a rank (a 1F1B stage of F = 1, B = 2 is two V stages of
    half that): fill and drain 1F1B (p - 1)(F + B) = 9, interleaved 1F1B (v = 2) half of
    that, ZB-H1 (p - 1) F = 3 (I = W = 1), DualPipeV (p - 1) x its stage's F = 1.5."""
    p, m = 4, 8
    dual = simulate(schedule_actions("dualpipev", p, m, 2), forward=0.5, backward=1.0, weight=0.5)
    plain = simulate(schedule_actions("1f1b", p, m), forward=1.0, backward=2.0)
    inter = simulate(schedule_actions("interleaved-1f1b", p, m, 2), forward=0.5, backward=1.0)
    zb = simulate(schedule_actions("zero-bubble", p, m), forward=1.0, backward=2.0, weight=1.0)
    ideal = m * 3.0
    assert plain.makespan - ideal == pytest.approx(9.0)
    assert inter.makespan - ideal == pytest.approx(4.5)
    assert zb.makespan - ideal == pytest.approx(3.0)
    assert dual.makespan - ideal == pytest.approx(1.5)


def test_zero_bubble_is_a_third_of_1f1b_when_f_i_w_equal():
    p, m = 4, 8
    zb = simulate(schedule_actions("zero-bubble", p, m), forward=1, backward=2, weight=1)
    plain = simulate(schedule_actions("1f1b", p, m), forward=1, backward=2)
    assert zb.makespan - 3 * m == pytest.approx((plain.makespan - 3 * m) / 3)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("c", [0.1, 0.5, 2.0])
def test_gpipe_transfers_add_to_fill_and_drain(p, m, c):
    sim = simulate(schedule_actions("gpipe", p, m), forward=1.0, backward=2.0, p2p=c)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


# ---- memory: in-flight micro-batches against the planner's model -----------------------------


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 3, 1),
                                        ("zero-bubble", 4, 8, 1), ("zero-bubble", 3, 3, 1),
                                        ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 6, 3),
                                        ("interleaved-1f1b", 2, 4, 4), ("dualpipev", 2, 4, 2),
                                        ("dualpipev", 3, 9, 2), ("dualpipev", 4, 8, 2)])
def test_in_flight_matches_planner_memory_model(kind, p, m, v):
    sim = simulate(schedule_actions(kind, p, m, v), forward=1.0, backward=2.0, weight=1.0)
    expected = in_flight(kind, p, m, v)                 # per stage; a rank holds v of them
    rank_expected = [expected[ks].sum() for ks in rank_stages(kind, p, v)]
    assert list(sim.rank_peak_in_flight) == pytest.approx(list(rank_expected))
    if kind == "dualpipev":                             # per stage too: 2p - k, 2p + 1 a rank
        assert list(sim.peak_in_flight) == list(expected) == [2 * p - k for k in range(2 * p)]
        assert list(sim.rank_peak_in_flight) == [2 * p + 1] * p
    if kind == "1f1b":
        assert list(sim.peak_in_flight) == [min(p - s, m) for s in range(p)]
    if kind == "gpipe":
        assert list(sim.peak_in_flight) == [m] * p


def test_interleaved_in_flight_on_torchs_lowered_program():
    """Interleaved 1F1B's activations walked on the program torch's runtime runs
    (``schedule.lowered_program``: a micro-batch's activations on a stage from its F to its
    last backward there): each rank's peak is the model's sum over the rank's stages, and
    the last stage (the loss) holds one micro-batch, as the model counts it, whatever p, m
    and v (its rank's other stages share the rest: a loss head's logits counted once)."""
    from autopar.schedule import lowered_program
    for p, v in ((2, 2), (3, 3), (4, 2), (4, 4), (8, 3)):
        for m in (p, 2 * p, 4 * p):
            check_schedule("interleaved-1f1b", p, m, v)
            S, model = p * v, in_flight("interleaved-1f1b", p, m, v)
            peak, rank_peak = np.zeros(S), np.zeros(p)
            for r, ops in enumerate(lowered_program("interleaved-1f1b", p, m, v)):
                last = {(s, mb): k for k, (op, s, mb) in enumerate(ops) if op in ("B", "I", "W")}
                live = np.zeros(S)
                for k, (op, s, mb) in enumerate(ops):
                    if op == "F":
                        live[s] += 1
                    elif last.get((s, mb)) == k:
                        live[s] -= 1
                    peak = np.maximum(peak, live)
                    rank_peak[r] = max(rank_peak[r], live.sum())
            sums = [model[ks].sum() for ks in rank_stages("interleaved-1f1b", p, v)]
            assert list(rank_peak) == pytest.approx(sums), (p, m, v)
            assert peak[-1] == model[-1] == 1, (p, m, v, peak)
            assert (model <= m).all()


# ---- the simulator honours every dependency -------------------------------------------------------


@given(kind=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"]),
       p=st.integers(1, 4), m=st.integers(1, 8), v=st.integers(1, 3), seed=st.integers(0, 2**16))
@settings(max_examples=50, deadline=None)
def test_timeline_respects_dependencies(kind, p, m, v, seed):
    v = 2 if kind == "dualpipev" else v if kind in ("interleaved-1f1b", "zero-bubble") else 1
    assume(not (kind == "dualpipev" and m < 2 * p))
    # the schedules torch can run (written out here, so a valid one that raises fails)
    assume(not (kind in ("1f1b", "zero-bubble") and m < p))
    assume(not (kind in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // p)))
    acts = schedule_actions(kind, p, m, v)
    rng = np.random.default_rng(seed)
    n = p * v
    f, b = rng.uniform(0.1, 2, n), rng.uniform(0.2, 3, n)
    w, c = b * rng.uniform(0, 1, n), rng.uniform(0, 1, max(n - 1, 1))
    sim = simulate(acts, forward=f, backward=b, weight=w, p2p=c)
    ev = {e["action"]: e for e in sim.timeline}
    rank_of = stage_ranks(kind, p, v)
    for e in sim.timeline:
        s, i, k = e["stage"], e["microbatch"], e["kind"]
        want = {"F": f[s], "B": b[s], "I": b[s] - w[s], "W": w[s]}[k]
        assert e["end"] - e["start"] == pytest.approx(want)
        deps = []
        if k == "F" and s > 0:
            deps.append((f"{s - 1}F{i}", c[s - 1] if rank_of[s - 1] != rank_of[s] else 0))
        if k in "BI":
            deps.append((f"{s}F{i}", 0))
            if s < n - 1:       # the next stage's backward of i: its I when split, else its B
                nxt = f"{s + 1}I{i}" if f"{s + 1}I{i}" in ev else f"{s + 1}B{i}"
                deps.append((nxt, c[s] if rank_of[s + 1] != rank_of[s] else 0))
        if k == "W":
            deps.append((f"{s}I{i}", 0))
        for name, lag in deps:
            assert e["start"] >= ev[name]["end"] + lag - 1e-9, f"{e['action']} before {name}"
    for r in range(p):
        mine = sorted((e["start"], e["end"]) for e in sim.timeline if e["rank"] == r)
        assert all(a[1] <= b_[0] + 1e-9 for a, b_ in zip(mine, mine[1:])), f"rank {r} overlaps"
    busy = sum(e["end"] - e["start"] for e in sim.timeline)
    assert sim.utilization == pytest.approx(busy / (p * sim.makespan))


# ---- printing and errors ---------------------------------------------------------------------------


def test_format_grid():
    assert format_grid(schedule_actions("1f1b", 2, 2), error_step=2) == (
        "        Rank 0  Rank 1\n"
        "Step 0: 0F0\n"
        "Step 1: 0F1     1F0\n"
        "Step 2:         1B0 <-- ERROR HERE\n"
        "Step 3: 0B0     1F1\n"
        "Step 4:         1B1\n"
        "Step 5: 0B1")


def test_deadlock_is_reported_with_the_waiting_actions():
    bad = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    with pytest.raises(ValueError, match=r"deadlocks after 1 actions: rank 0 waits at 0B0; rank 1 waits at 1B0"):
        simulate(bad, forward=1.0, backward=1.0)


def test_missing_dependency_is_named():
    with pytest.raises(ValueError, match="action 1F0 on rank 1 depends on 0F0, which no rank runs"):
        simulate([[], [Action(1, "F", 0), Action(1, "B", 0)]], forward=1.0, backward=1.0)


def test_split_backward_needs_weight_times():
    with pytest.raises(ValueError, match="pass weight="):
        simulate(schedule_actions("zero-bubble", 2, 2), forward=1.0, backward=2.0)


@pytest.mark.parametrize("args,message", [
    (("1f1b", 4, 3), r"'1f1b' needs at least as many micro-batches as pipeline stages: got 3 micro-batches for 4"),
    (("zero-bubble", 4, 2), r"'zero-bubble' needs at least as many micro-batches"),
    (("interleaved-1f1b", 4, 9, 2), r"multiple of its rounds max\(1, m // p\) = 2: got m=9 for p=4"),
    (("gpipe", 2, 4, 2), r"'gpipe' runs one stage per rank, got virtual=2"),
    (("pipedream", 2, 4), r"unknown schedule 'pipedream'"),
    (("dualpipev", 2, 3, 2), r"'dualpipev' needs at least as many micro-batches as stages \(2 per rank\): "
                             r"got 3 micro-batches for 4 stages on 2 ranks \(use m >= 4\)"),
    (("dualpipev", 2, 8, 1), r"'dualpipev' runs exactly two stages per rank \(V placement\), got virtual=1"),
])
def test_schedule_errors(args, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)
    with pytest.raises(ValueError, match=message):
        schedule_actions(*args)
