"""Stage-cut DP against brute force, its step-time model against the simulator, its errors.

The brute force enumerates every cut of the chain and takes each stage's in-flight
micro-batches from the simulator's timeline, so it shares no formula with the DP."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from autopar.schedule import schedule_actions, stage_ranks
from autopar.pricing.simulate import simulate
from autopar.solver.stage_dp import LayerCosts, StagePins, _candidates, plan_stages, simulate_plan, stage_dp
from autopar.solver.stage_tables import cut_latency, in_flight, receive_in_flight

GiB = 2**30


def costs_of(time, state=None, act=None, boundary=None, fixed=None, sync=None, **kw) -> LayerCosts:
    n = len(time)
    return LayerCosts(time=time, state_bytes=state if state is not None else [0.0] * n,
                      activation_bytes=act if act is not None else [0.0] * n,
                      boundary_bytes=boundary if boundary is not None else [0.0] * (n - 1),
                      fixed_time=fixed, sync_bytes=sync, **kw)


def simulated_in_flight(schedule, p, m, v):
    """Activations (in micro-batches) each stage holds at its peak, from the simulator;
    a rank's peak is shared evenly by its v stages, as the planner's memory check does,
    but for the last stage's single micro-batch (its own peak, which the simulator says),
    its rank's other stages sharing the rest."""
    sim = simulate(schedule_actions(schedule, p, m, v), forward=1.0, backward=2.0, weight=1.0)
    if v == 1 or schedule == "dualpipev":         # DualPipeV: each stage its own peak
        return np.array(sim.peak_in_flight, dtype=float)
    held = np.array([sim.rank_peak_in_flight[k % p] / v for k in range(p * v)])
    last = sim.peak_in_flight[-1]
    held[p - 1::p] = (sim.rank_peak_in_flight[p - 1] - last) / (v - 1)
    held[-1] = last
    return held


def brute_force(costs, p, v, m, schedule, n_devices, batch, limit, per_rank=False):
    """Least bottleneck over every feasible cut, or inf. A stage pays its cuts' messages
    (``cut_latency``, the one function the DP prices them with). Feasible: each stage
    within ``limit / v`` (the DP's first view), or, ``per_rank``, each rank's v stages
    together within ``limit`` (what a device holds)."""
    t, s, a, fx = (np.asarray(x, float) for x in (costs.time, costs.state_bytes, costs.activation_bytes,
                                                  costs.fixed_time))
    n = [0.0, *costs.boundary_tensors, 0.0]
    L, S = len(t), p * v
    d, b = n_devices // p, batch / m
    held = simulated_in_flight(schedule, p, m, v)
    ranks = stage_ranks(schedule, p, v)
    best = math.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        times, ok, rank_bytes = [], True, np.zeros(p)
        for k in range(S):
            j, i = bounds[k], bounds[k + 1]
            held_bytes = s[j:i].sum() + held[k] * a[j:i].sum() * b / d
            rank_bytes[ranks[k]] += held_bytes
            if (rank_bytes[ranks[k]] if per_rank else held_bytes) > \
                    (limit if per_rank else limit / v) * (1 + 1e-12):
                ok = False
                break
            times.append(t[j:i].sum() * b / d + fx[j:i].sum()
                         + cut_latency(n[j], costs.message_time) + cut_latency(n[i], costs.message_time))
        if ok:
            best = min(best, max(times))
    return best


def check_against_brute_force(costs, p, v, m, schedule, n_devices, batch, limit):
    """The DP's plan against the brute force's: never over a device's memory, never slower
    than the best with each stage within ``limit / v`` (what its first DP searches), never
    faster than the best with each rank within ``limit`` (a second DP weighs shares of a
    rank's memory in proportion to its stages' needs: ``stage_dp._by_need``)."""
    expected = brute_force(costs, p, v, m, schedule, n_devices, batch, limit)
    least = brute_force(costs, p, v, m, schedule, n_devices, batch, limit, per_rank=True) \
        if v > 1 else expected
    kwargs = dict(n_devices=n_devices, global_batch=batch, memory_limit=limit, bandwidth=1e9,
                  n_stages=p, micro_batches=m, schedule=schedule, virtual_stages=v)
    if math.isinf(least):
        with pytest.raises(ValueError, match="no pipeline plan fits"):
            plan_stages(costs, **kwargs)
        return None
    try:
        plan = plan_stages(costs, **kwargs)
    except ValueError:
        assert math.isinf(expected), "the first DP's view had a plan"
        return None
    slowest = max(plan.stage_times)
    assert max(plan.memory_per_stage) <= limit * (1 + 1e-9), (plan.cuts, plan.memory_per_stage)
    assert slowest <= expected * 1.05 + 1e-12, (plan.cuts, slowest, expected)
    assert slowest >= least * (1 - 1e-9)          # brute force is optimal: sanity of both
    # the cuts the plan reports really give those stage times
    t, fx = np.asarray(costs.time), np.asarray(costs.fixed_time)
    n = [0.0, *costs.boundary_tensors, 0.0]
    scale = batch / m / (n_devices // p)
    for (j, i), got in zip(plan.stage_layers, plan.stage_times):
        assert got == pytest.approx(t[j:i].sum() * scale + fx[j:i].sum()
                                    + 2 * (n[j] + n[i]) * costs.message_time)
    return plan


layer_values = st.integers(0, 20).map(float)


@given(data=st.data(), L=st.integers(2, 10), schedule=st.sampled_from(["gpipe", "1f1b", "zero-bubble",
                                                                        "interleaved-1f1b", "dualpipev"]))
@settings(max_examples=70, deadline=None)
def test_dp_matches_brute_force(data, L, schedule):
    v = data.draw(st.integers(2, 3)) if schedule == "interleaved-1f1b" else 2 if schedule == "dualpipev" else 1
    p = data.draw(st.integers(1, max(1, L // v)))
    assume(p * v <= L)
    m = data.draw(st.sampled_from([2 * p, 3 * p] if schedule == "dualpipev" else
                                  [p, 2 * p, 3 * p] if schedule != "gpipe" else [1, 2, p, 2 * p]))
    d = data.draw(st.sampled_from([1, 2]))
    costs = costs_of(
        time=data.draw(st.lists(layer_values.map(lambda x: x + 1), min_size=L, max_size=L)),
        state=data.draw(st.lists(layer_values, min_size=L, max_size=L)),
        act=data.draw(st.lists(st.integers(0, 5).map(float), min_size=L, max_size=L)),
        fixed=data.draw(st.lists(st.integers(0, 3).map(float), min_size=L, max_size=L)),
        boundary_tensors=data.draw(st.lists(st.integers(1, 3).map(float), min_size=L - 1, max_size=L - 1)),
        message_time=data.draw(st.sampled_from([0.0, 0.5, 2.0])))
    limit = float(data.draw(st.integers(10, 150)))
    check_against_brute_force(costs, p, v, m, schedule, n_devices=p * d, batch=m * d * 2, limit=limit)


@pytest.mark.parametrize("wide", [0, 3, 7])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_unbalanced_model_one_layer_four_times_wider(wide, p, schedule):
    time = [1.0] * 8
    time[wide] = 4.0
    state = [1.0] * 8
    state[wide] = 4.0                                  # 4x wider: 4x the parameters too
    costs = costs_of(time, state=state, act=[0.5] * 8)
    plan = check_against_brute_force(costs, p, 1, 2 * p, schedule, n_devices=p, batch=2 * p, limit=8.0)
    if plan is not None:
        # the wide layer sits alone (or nearly) and sets the bottleneck when p >= 3
        assert max(plan.stage_times) >= 4.0


def test_stage_dp_on_raw_arrays_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        L, S = int(rng.integers(2, 8)), 0
        S = int(rng.integers(1, L + 1))
        cost = rng.uniform(0, 10, (S, L + 1, L + 1))
        j, i = np.indices((L + 1, L + 1))
        cost[:, j >= i] = np.inf
        cost[rng.uniform(size=cost.shape) < 0.2] = np.inf   # some stages over memory
        best = min((max(cost[k, a, b] for k, (a, b) in enumerate(zip((0, *c), (*c, L))))
                    for c in itertools.combinations(range(1, L), S - 1)), default=np.inf)
        got, cuts = stage_dp(cost)
        assert got == best
        if np.isfinite(best):
            bounds = (0, *cuts, L)
            assert max(cost[k, bounds[k], bounds[k + 1]] for k in range(S)) == best


def test_banded_dp_gives_the_full_dps_cuts(monkeypatch):
    """Where no stage may hold more than a band of layers (each table's own width), the DP
    runs on the bands (``stage_dp._banded_dp``): the same bottleneck and the same cuts,
    ties included (integer times tie often), as the DP over the whole tables."""
    from autopar.solver import stage_dp as dp
    from autopar.solver.stage_tables import FitStack, Tiebreak
    rng = np.random.default_rng(1)
    banded = 0
    for _ in range(60):
        L, S, U = int(rng.integers(8, 40)), int(rng.integers(2, 8)), int(rng.integers(1, 4))
        j, i = np.indices((L + 1, L + 1))
        time = rng.integers(1, 6, (L + 1, L + 1)).astype(float)
        widths = rng.integers(1, max(2, L // 3), U)
        fits = np.stack([np.where((j < i) & (i - j <= w), 1 + u, 0) for u, w in enumerate(widths)]).max(0)
        which = rng.integers(0, U, S)
        cost = FitStack(time, [fits], [(u, 0) for u in range(U)], which)
        tie = Tiebreak(cost, time, rng.integers(0, 3, L + 1).astype(float))
        monkeypatch.setattr(dp, "BAND_AT_MOST", 0.0)
        full = dp.stage_dp(cost, tie)
        monkeypatch.setattr(dp, "BAND_AT_MOST", 0.5)
        banded += dp._band_width(cost, tie) is not None
        assert dp.stage_dp(cost, tie) == full
    assert banded > 40


# ---- the step-time model against the simulator ----------------------------------------------------


@pytest.mark.parametrize("schedule,p,v,m", [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 6),
                                            ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 3, 8),
                                            ("zero-bubble", 4, 1, 8), ("zero-bubble", 3, 1, 3),
                                            ("dualpipev", 2, 2, 4), ("dualpipev", 4, 2, 8),
                                            ("dualpipev", 3, 2, 10)])
def test_predicted_step_equals_simulation_for_uniform_layers(schedule, p, v, m):
    L = p * v * 2
    costs = costs_of([3.0] * L)
    plan = plan_stages(costs, n_devices=p, global_batch=m, memory_limit=1e9, bandwidth=1e9,
                       n_stages=p, micro_batches=m, schedule=schedule, virtual_stages=v)
    sim = simulate_plan(plan)
    assert plan.predicted_step_time == pytest.approx(sim.makespan)
    assert plan.bubble_fraction == pytest.approx(sim.bubble_fraction)
    if schedule in ("gpipe", "1f1b"):
        assert plan.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_gpipe_prediction_is_exact_for_unbalanced_stages_and_transfers():
    costs = costs_of([1.0, 5.0, 2.0, 1.0, 3.0], boundary=[1e9, 2e9, 5e8, 1e9])
    plan = plan_stages(costs, n_devices=3, global_batch=6, memory_limit=1e9, bandwidth=1e9,
                       n_stages=3, micro_batches=6, schedule="gpipe")
    assert plan.boundary_times and all(b > 0 for b in plan.boundary_times)
    assert plan.predicted_step_time == pytest.approx(simulate_plan(plan).makespan)


def test_cuts_prefer_small_boundaries_when_the_bottleneck_ties():
    # cutting before layer 1 or before layer 2 gives stages (1, 1) either way (layer 1 is
    # free); 8 bytes cross the first point and 1 byte the second.
    costs = costs_of([1.0, 0.0, 1.0], boundary=[8.0, 1.0])
    plan = plan_stages(costs, n_devices=2, global_batch=2, memory_limit=1e9, bandwidth=1.0,
                       n_stages=2, micro_batches=2, schedule="gpipe")
    assert plan.cuts == (2,)
    costs = costs_of([1.0, 0.0, 1.0], boundary=[1.0, 8.0])
    assert plan_stages(costs, n_devices=2, global_batch=2, memory_limit=1e9, bandwidth=1.0,
                       n_stages=2, micro_batches=2, schedule="gpipe").cuts == (1,)


def test_each_tensor_crossing_a_cut_costs_a_message_each_way():
    """Mid-block a residual and a norm's output both cross (2 tensors), at a block boundary
    only the residual (1): the stage time charges 2 x alpha per tensor per micro-batch at
    each of a stage's cuts, so a cut that balances the stages slightly better but sends
    twice the messages loses to the block boundary."""
    time = [1.0, 0.9, 0.2, 1.0, 1.0]        # the boundary is before layer 2 (the norm)
    tensors = [2.0, 1.0, 2.0, 2.0]
    kw = dict(n_devices=2, global_batch=2, memory_limit=1e9, bandwidth=1e9, n_stages=2,
              micro_batches=2, schedule="1f1b")
    assert plan_stages(costs_of(time, boundary_tensors=tensors), **kw).cuts == (3,)  # 2.1 / 2.0
    plan = plan_stages(costs_of(time, boundary_tensors=tensors, message_time=0.1), **kw)
    assert plan.cuts == (2,)                # 1.9 + 0.2 / 2.2 + 0.2 against 2.1 + 0.4
    assert plan.stage_times == pytest.approx((2.1, 2.4))
    assert plan.predicted_step_time == pytest.approx(simulate_plan(plan).makespan)


def test_memory_follows_the_schedule():
    L, p, m = 8, 4, 8
    costs = costs_of([1.0] * L, state=[10.0] * L, act=[1.0] * L)
    common = dict(n_devices=p, global_batch=m, memory_limit=1e9, bandwidth=1e9, n_stages=p, micro_batches=m)
    gpipe = plan_stages(costs, schedule="gpipe", **common)
    one = plan_stages(costs, schedule="1f1b", **common)
    # 2 layers per stage: state 20, activations 2 per micro-batch (micro-batch of 1 sample)
    assert gpipe.memory_per_stage == pytest.approx([20 + m * 2] * p)
    assert one.memory_per_stage == pytest.approx([20 + (p - s) * 2 for s in range(p)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"])
def test_receive_buffers_hold_the_micro_batches_in_flight(schedule):
    """With ``grad_boundary_bytes`` given, a stage also holds the runtime's receive buffers
    (``runtime.receive_buffers``): the values crossing its first cut for its micro-batches
    in flight plus one, min(n_k + 1, m), and the gradients crossing its last for as many
    micro-batches as the schedule's fullest stage holds them (GPipe, 1F1B: 2; zero bubble:
    1 + the weight halves pending, rank r's r + 1); under interleaved 1F1B as torch's
    lowered program holds them (``receive_in_flight``), the values of a stage as the most
    of any stage with its activations in flight. None before the first stage or after the
    last; without it the memory is as before."""
    L, p, batch = 8, 4, 8
    v = 2 if schedule == "interleaved-1f1b" else 1
    common = dict(n_devices=p, global_batch=batch, memory_limit=1e9, bandwidth=1e9, n_stages=p,
                  schedule=schedule, virtual_stages=v)
    plain = costs_of([1.0] * L, state=[10.0] * L, act=[1.0] * L, boundary=[3.0] * (L - 1))
    held = costs_of([1.0] * L, state=[10.0] * L, act=[1.0] * L, boundary=[3.0] * (L - 1),
                    grad_boundary_bytes=[2.0] * (L - 1))
    S = p * v
    for m in (4, 8):
        before = plan_stages(plain, micro_batches=m, **common)
        after = plan_stages(held, micro_batches=m, **common)
        assert after.cuts == before.cuts
        extra = np.subtract(after.memory_per_stage, before.memory_per_stage)
        n = in_flight(schedule, p, m, v)
        held_values, held_grads = receive_in_flight(schedule, p, m, v)
        values = [max(held_values[i] for i in range(S) if n[i] <= n[k]) if v > 1
                  else min(n[k] + 1, m) for k in range(S)]
        grads = max(held_grads) if v > 1 else {"gpipe": 2, "1f1b": 2, "zero-bubble": p - 1}[schedule]
        b = batch / m       # 3 bytes a sample in (k > 0), 2 of gradients (k < S - 1)
        per_stage = [b * ((3.0 * values[k] if k else 0.0) + (2.0 * grads if k < S - 1 else 0.0))
                     for k in range(S)]
        want = [sum(per_stage[r::p]) for r in range(p)]        # a rank's v stages together
        assert extra == pytest.approx(want), (m, extra, want)
        if v == 1 and m == 8:       # fewer than the whole batch at the cuts
            assert sum(extra) < batch * (3.0 + 2.0) * (S - 1)
    # a limit the plain stages meet and the buffers break: no cut fits
    need = max(plan_stages(plain, micro_batches=4, **common).memory_per_stage)
    with pytest.raises(ValueError, match="fits"):
        plan_stages(held, micro_batches=4, **{**common, "memory_limit": need * v + 1e-6})


def test_interleaved_loss_head_counts_one_micro_batch():
    """Interleaved 1F1B's last stage runs each micro-batch's backward right after its
    forward: a loss head's activations (logits, 20 bytes a sample here against 1 per layer)
    are held for one micro-batch, not for its rank's depth / v (5 / 2 at p = 4, m = 8), so
    the last rank holds its head's one layer and one micro-batch (21) beside its other
    stage's layer and 4 micro-batches (5): a limit of 26 plans, one under it does not
    (each stage's share of 26 is no longer 13: ``_by_need``)."""
    L, p, m, v = 8, 4, 8, 2
    costs = costs_of([1.0] * L, state=[1.0] * L, act=[1.0] * (L - 1) + [20.0])
    common = dict(n_devices=p, global_batch=m, bandwidth=1e9, n_stages=p, micro_batches=m,
                  schedule="interleaved-1f1b", virtual_stages=v)
    n = in_flight("interleaved-1f1b", p, m, v)
    assert (n[p - 1], n[-1]) == (4, 1) and n[p - 1] + n[-1] == n[0] + n[p] - 2 * (p - 1)
    plan = plan_stages(costs, memory_limit=26.0, **common)
    assert plan.cuts == tuple(range(1, L))     # a layer a stage: the head alone on the last
    assert plan.memory_per_stage[p - 1] == pytest.approx(1 + 4 + 1 + 20)
    with pytest.raises(ValueError, match="fits"):
        plan_stages(costs, memory_limit=26.0 * 0.99, **common)


def test_a_ranks_stages_share_its_memory_by_need():
    """DualPipeV's rank 0 holds stage 0 (2p = 4 micro-batches in flight) and stage 3 (1):
    with a layer each of 1 byte a micro-batch, 4 + 1 = 5 bytes on the device, and rank 1
    3 + 2. Each stage within half the device (the DP's first view) needs 8; the second DP
    (``_by_need``: shares in proportion to the closest cuts' needs) plans at 5, not under."""
    costs = costs_of([1.0] * 4, state=[0.0] * 4, act=[1.0] * 4)
    common = dict(n_devices=2, global_batch=4, bandwidth=1e9, n_stages=2, micro_batches=4,
                  schedule="dualpipev", virtual_stages=2)
    plan = plan_stages(costs, memory_limit=5.0, **common)
    assert plan.cuts == (1, 2, 3) and plan.memory_per_stage == pytest.approx((5.0, 5.0))
    with pytest.raises(ValueError, match="fits .* its rank's 2 stages together hold"):
        plan_stages(costs, memory_limit=4.99, **common)


def test_dualpipev_memory_places_the_v():
    """DualPipeV's rank r holds stages r and 2p - 1 - r, which hold 2p - r and r + 1
    micro-batches at their peaks: every rank 2p + 1 stage-micro-batches of activations
    (DeepSeek-V3 report, Table 2: PP + 1 for PP = 2p stages) and the state of its two stages."""
    L, p, m = 16, 4, 8
    costs = costs_of([1.0] * L, state=[10.0] * L, act=[1.0] * L)
    plan = plan_stages(costs, n_devices=p, global_batch=m, memory_limit=1e9, bandwidth=1e9,
                       n_stages=p, micro_batches=m, schedule="dualpipev")
    assert plan.virtual_stages == 2 and len(plan.cuts) == 2 * p - 1
    # 2 layers per stage: state 2 x 20, activations 2 per stage-micro-batch
    assert plan.memory_per_stage == pytest.approx([40 + (2 * p + 1) * 2] * p)
    # the middle boundary (stages p - 1 and p, both on rank p - 1) sends nothing
    sent = plan_stages(costs_of([1.0] * L, state=[10.0] * L, act=[1.0] * L, boundary=[1.0] * (L - 1)),
                       n_devices=p, global_batch=m, memory_limit=1e9, bandwidth=1.0, n_stages=p,
                       micro_batches=m, schedule="dualpipev").boundary_times
    assert [t == 0 for t in sent] == [k == p - 1 for k in range(2 * p - 1)]


def test_search_weighs_dualpipev_where_it_can_run():
    """Unpinned, the search weighs DualPipeV wherever m >= 2p; on a uniform chain with free
    sends it has the least fill and drain (``test_pipeline_schedule``) and is chosen, its
    predicted step the simulated one. Below 2p micro-batches it is not a candidate; and it
    memory decides its cuts: the stage DP gives each of a rank's two stages half the memory
    (as interleaved 1F1B's v stages 1/v each), and the V's first stages hold the most
    micro-batches (2p - k), so under a tight limit they get fewer layers."""
    L, p = 16, 4
    costs = costs_of([1.0] * L, state=[1.0] * L, act=[1.0] * L)
    common = dict(n_devices=p, global_batch=8, bandwidth=1e9, n_stages=p)
    chosen = plan_stages(costs, memory_limit=1e9, micro_batches=8, **common)
    assert chosen.schedule == "dualpipev"
    assert chosen.predicted_step_time == pytest.approx(simulate_plan(chosen).makespan)
    for kind in ("1f1b", "zero-bubble", "interleaved-1f1b"):
        other = plan_stages(costs, memory_limit=1e9, micro_batches=8, schedule=kind, **common)
        assert chosen.predicted_step_time < other.predicted_step_time
    assert "dualpipev" not in {c.schedule for c in _candidates(L, p, 8, StagePins(p, 4))}
    assert plan_stages(costs, memory_limit=1e9, micro_batches=4, **common).schedule != "dualpipev"
    limit = 30.0
    tight = plan_stages(costs, memory_limit=limit, micro_batches=8, schedule="dualpipev", **common)
    layers = [i - j for j, i in tight.stage_layers]
    for k, n in enumerate(layers):          # state n + (2p - k) micro-batches of n layers
        assert n + (2 * p - k) * n <= limit / 2
    assert layers[0] < layers[-1]
    # one layer on stage 0 needs 1 + 8 = 9 <= limit / 2: below 18 nothing fits
    with pytest.raises(ValueError, match="no pipeline plan fits"):
        plan_stages(costs, memory_limit=17.0, micro_batches=8, schedule="dualpipev", **common)


def test_search_is_no_worse_than_any_pin():
    rng = np.random.default_rng(1)
    L = 12
    costs = costs_of(list(rng.uniform(1, 3, L)), state=[1.0] * L, act=[0.1] * L,
                     boundary=list(rng.uniform(0, 1, L - 1)), fixed=[0.05] * L)
    common = dict(n_devices=4, global_batch=8, memory_limit=100.0, bandwidth=10.0)
    best = plan_stages(costs, **common)
    for p, m, kind in itertools.product([1, 2, 4], [1, 2, 4, 8], ["gpipe", "1f1b", "zero-bubble", "dualpipev"]):
        try:
            pinned = plan_stages(costs, n_stages=p, micro_batches=m, schedule=kind, **common)
        except ValueError:
            continue
        assert best.predicted_step_time <= pinned.predicted_step_time * (1 + 1e-12)
    assert best.devices_per_stage * best.n_stages == 4


def test_state_sharding_and_tight_memory_force_more_stages():
    L = 8
    costs = costs_of([1.0] * L, state=[4.0] * L, act=[0.0] * L, fixed=[0.01] * L)
    plan = plan_stages(costs, n_devices=4, global_batch=4, memory_limit=9.0, bandwidth=1.0)
    assert plan.n_stages * plan.virtual_stages >= 4       # 32 bytes of state, 9 per device
    assert max(plan.memory_per_stage) <= 9.0
    sharded = plan_stages(costs, n_devices=4, global_batch=4, memory_limit=9.0, bandwidth=1.0,
                          shard_state=True, n_stages=1)
    assert sharded.memory_per_stage == pytest.approx([8.0])


# ---- errors -----------------------------------------------------------------------------------------


BASE = dict(n_devices=4, global_batch=8, memory_limit=1e9, bandwidth=1e9)


def test_more_stages_than_cut_points():
    with pytest.raises(ValueError, match=r"n_stages=4 is more stages than the chain can hold: 3 layers "
                                         r"have 2 cut points, so at most 3 stages"):
        plan_stages(costs_of([1.0] * 3), **BASE, n_stages=4)


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"micro_batches=3 does not divide the global batch 8; "
                                         r"choose one of \[1, 2, 4, 8\]"):
        plan_stages(costs_of([1.0] * 8), **BASE, micro_batches=3)


def test_stages_must_divide_devices():
    with pytest.raises(ValueError, match=r"n_stages=3 must divide n_devices=4"):
        plan_stages(costs_of([1.0] * 8), **BASE, n_stages=3)


def test_interleaved_needs_p_times_v_layers():
    with pytest.raises(ValueError, match=r"'interleaved-1f1b' with 2 stages x 3 virtual stages cuts the "
                                         r"chain into 6 stages, more than its 5 layers \(4 cut points\)"):
        plan_stages(costs_of([1.0] * 5), **BASE, n_stages=2, schedule="interleaved-1f1b", virtual_stages=3)


def test_pinned_schedule_the_stage_count_cannot_run():
    with pytest.raises(ValueError, match=r"'1f1b' needs at least as many micro-batches as pipeline "
                                         r"stages: got 2 micro-batches for 4 stages"):
        plan_stages(costs_of([1.0] * 8), **BASE, n_stages=4, micro_batches=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"'zero-bubble' needs at least as many micro-batches"):
        plan_stages(costs_of([1.0] * 8), **BASE, n_stages=4, micro_batches=1, schedule="zero-bubble")
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule 'interleaved-1f1b'; the "
                                         r"planner runs 'zero-bubble' with one stage per rank"):
        plan_stages(costs_of([1.0] * 8), **BASE, schedule="zero-bubble", virtual_stages=2)


def test_nothing_fits_memory_names_the_stage_and_the_excess():
    costs = costs_of([1.0, 1.0], state=[10 * GiB, 10 * GiB])
    with pytest.raises(ValueError, match=r"no pipeline plan fits 15.00 GiB per device: the closest, n_stages=1, "
                                         r"virtual_stages=1, .* needs 20.00 GiB on stage 0 \(layers 0\.\.1\), over "
                                         r"its 15.00 GiB by 5.00 GiB"):
        plan_stages(costs, n_devices=1, global_batch=2, memory_limit=15 * GiB, bandwidth=1e9)
    # with two devices the two layers split and fit; with one activation too many they do not
    costs = costs_of([1.0, 1.0], state=[10 * GiB, 10 * GiB], act=[3 * GiB, 3 * GiB])
    with pytest.raises(ValueError, match=r"needs 16.00 GiB on stage 0 \(layers 0\.\.0\), over its 15.00 GiB by 1.00 GiB"):
        plan_stages(costs, n_devices=2, global_batch=2, memory_limit=15 * GiB, bandwidth=1e9,
                    n_stages=2, schedule="1f1b")


def test_bad_layer_arrays():
    with pytest.raises(ValueError, match=r"boundary_bytes needs one entry per cut point \(2 for 3 layers\), got 3"):
        LayerCosts(time=[1, 1, 1], state_bytes=[0, 0, 0], activation_bytes=[0, 0, 0], boundary_bytes=[0, 0, 0])
    with pytest.raises(ValueError, match=r"LayerCosts.time must be finite and >= 0"):
        costs_of([1.0, -1.0])
    with pytest.raises(ValueError, match=r"boundary_tensors needs one entry per cut point \(1 for 2 layers\), got 2"):
        costs_of([1.0, 1.0], boundary_tensors=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"LayerCosts.message_time must be finite and >= 0, got -1"):
        costs_of([1.0, 1.0], message_time=-1.0)


def test_gradient_sync_prices_the_sub_mesh():
    # 4 layers of 1 s per sample, 1 byte of gradient each, 4 devices, batch 4.
    costs = costs_of([1.0] * 4, sync=[1.0] * 4)
    common = dict(n_devices=4, global_batch=4, memory_limit=1e9, bandwidth=1e9, sync_bandwidth=1.0,
                  micro_batches=4, schedule="gpipe")
    flat = plan_stages(costs, n_stages=1, **common)
    # one stage on 4 devices: compute 4 micro-batches x 4 layers x 1/4 sample; ring
    # all-reduce of 4 bytes over 4 devices moves 2 * 3/4 * 4 = 6 bytes at 1 B/s.
    assert flat.sync_time == pytest.approx(6.0)
    assert flat.predicted_step_time == pytest.approx(4.0 + 6.0)
    deep = plan_stages(costs, n_stages=4, **common)
    assert deep.sync_time == 0.0                       # one device per stage: nothing to reduce
    assert deep.predicted_step_time == pytest.approx((4 + 4 - 1) * 1.0)
    assert plan_stages(costs, **{k: v for k, v in common.items() if k != "schedule"}).n_stages > 1


def test_runtime_cost_per_action_is_paid_per_stage_and_micro_batch():
    """``action_time`` adds to every stage's time per micro-batch, once per action (two
    under 1F1B, three under zero bubble), so it makes many small micro-batches cost what
    they cost on a host that runs every action itself."""
    base = costs_of([4.0] * 8)
    for schedule, actions in (("1f1b", 2), ("zero-bubble", 3)):
        kw = dict(n_devices=2, global_batch=8, memory_limit=1e9, bandwidth=1e9, n_stages=2,
                  micro_batches=8, schedule=schedule)
        plain = plan_stages(base, **kw)
        slow = plan_stages(costs_of([4.0] * 8, action_time=0.25), **kw)
        assert np.allclose(np.array(slow.stage_times) - plain.stage_times, actions * 0.25)
        assert slow.predicted_step_time == pytest.approx(simulate_plan(slow).makespan)
    # free to choose m: the per-action cost pushes towards fewer, larger micro-batches
    free = dict(n_devices=2, global_batch=16, memory_limit=1e9, bandwidth=1e9, n_stages=2,
                schedule="1f1b")
    m_cheap = plan_stages(costs_of([1.0] * 8), **free).micro_batches
    m_dear = plan_stages(costs_of([1.0] * 8, action_time=0.5), **free).micro_batches
    assert m_dear < m_cheap


def test_interleaving_tries_one_layer_per_virtual_stage():
    """Beyond 2-4 virtual stages the planner tries 8 (one layer per virtual stage here): on a
    bubble-bound chain with free sends it is the fastest, and no pinned count beats it."""
    costs = costs_of([1.0] * 16)
    common = dict(n_devices=2, global_batch=2, memory_limit=1.0, bandwidth=1.0, n_stages=2,
                  micro_batches=2, schedule="interleaved-1f1b")
    free = plan_stages(costs, **common)
    assert free.virtual_stages == 8
    for v in (2, 4, 8):
        pinned = plan_stages(costs, **common, virtual_stages=v)
        assert free.predicted_step_time <= pinned.predicted_step_time * (1 + 1e-12)
    assert plan_stages(costs, **common, virtual_stages=4).predicted_step_time > free.predicted_step_time
