"""Pipeline stage cuts by dynamic programming, and the search around it.

A chain of L layers (or cut-able graph segments) is cut into S = p * v consecutive stages
(p pipeline ranks, v virtual stages per rank; stage k runs on rank k mod p). For a stage k
holding layers j .. i-1 (0 <= j < i <= L) let c[k, j, i] be its time for one micro-batch,
infinite where it does not fit its memory or none of its layers reads a parameter (such a
stage trains nothing: ``LayerCosts.parameters``). The DP (``stage_dp``) solves

    minimize    max_k c[k, j_k, j_{k+1}]            (the bottleneck stage)
    over        0 = j_0 < j_1 < ... < j_S = L        (cuts j_1 .. j_{S-1})

    best[k, i] = min_{k <= j < i} max(best[k-1, j], c[k, j, i]),   best[0, i] = c[0, 0, i]

then, among the cuts whose every stage is within that bottleneck, the one of least total
``c + boundary transfers`` (a second DP of the same shape with sum instead of max), so cuts
land where few bytes cross. ``plan_stages`` wraps the DP: for every pipeline degree p that
divides the device count (each stage gets d = n_devices / p devices as its data/tensor
sub-mesh), every micro-batch count m dividing the global batch, every schedule and v, it
builds c from per-layer arrays and prices the cuts:

    step = m * max_r R_r + rho * (sum_r R_r - max_r R_r) + 2 * sum_boundaries x_b / bandwidth
           + max_r sync_r                                  (gradient all-reduce, see below)

R_r is rank r's time for one micro-batch (its stages' times added); for v = 1 the first two
terms are "sum of stage times + (m - 1) x the slowest stage". rho is the schedule's bubble
per unit of pipeline fill, exact for uniform stages with m >= p against ``simulate``:

- gpipe, 1f1b: rho = 1, bubble (p - 1) / (m + p - 1) of the step;
- interleaved-1f1b: rho = 1 / v (Megatron-LM: bubble time / ideal time = (p - 1) / (v m));
- zero-bubble (ZB-H1, v = 1): rho = max(F + I - W, I, F) / (F + I + W), for forward F,
  input-gradient I and weight-gradient W times (= 1/3 when F = I = W);
- dualpipev (v = 2, V placement): rho measured on the schedule's own timeline for uniform
  stages (``stage_tables.dualpipev_rho``; 1/6 when F = I = W, m >= 2p).

Transfers (activation forward, its gradient back) are counted once per boundary each way,
on the fill and drain; steady-state transfers are taken as overlapped with compute (GPipe
meets this exactly, interleaved 1F1B in the cases checked; 1F1B with slow links is
latency-bound, each steady-state step waiting a round trip: ``simulate_plan`` shows it).
Their bytes are overlapped, not their messages: every tensor crossing a cut is a send and
a receive of its own per micro-batch each way, whose latency alpha (``message_time``, the
link's) the ranks at both ends pay in their stage time (``stage_tables.cut_latency``, see
the time model). A cut mid-block, where a residual and a norm's output both cross, costs
two messages where a block boundary costs one.

Memory per device of stage k on layers j .. i-1 with micro-batch size b:

    state[j, i] (/ d if shard_state) + n_k * act[j, i] * b / d
        + (r_k * in_j + g * grad_i) * b / d                        <=  limit / v

The last term is the pipeline runtime's receive buffers, counted where ``LayerCosts``
gives ``grad_boundary_bytes``: autopar's ``PipelineStage`` (``runtime.receive_buffers``)
receives each micro-batch's values (in_j, the bytes per sample crossing its first cut; 0
for the first stage) and the gradients of its outputs (grad_i; 0 for the last stage) into
buffers of their own, held until torch has read them (``stage_tables.receive_in_flight``):
r_k values, min(n_k + 1, m) under GPipe and 1F1B (the micro-batch's activations plus the
next receive posted), and g gradients, the most any stage of the schedule holds (2 under
GPipe and 1F1B); under interleaved 1F1B, zero bubble and DualPipeV both are counted on the
program torch's runtime lowers (``stage_tables.lowered_holds``: up to 2p values a stage
under interleaved 1F1B, the weight halves pending plus one gradient under zero bubble),
r_k the most of any stage with n_k's count (``stage_tables.value_buffers``).

``limit / v`` is a stage's share of its rank's device where the rank holds v stages
(interleaved 1F1B, DualPipeV). Where a rank's stages need not hold alike (a V's first stage
holds 2p - r micro-batches, its partner r + 1; an embedding's or a loss head's stage more
state or activations than a layer's), a second DP is run on each stage's own share:
its rank's limit in proportion to what each stage holds under the first DP's cuts (the
cuts of least excess where nothing fit), ``stage_tables.shares_by_need``. The first cuts
fit those shares, so the second plan is kept only when faster; a rank's stages always sum
to at most the limit. (The exact constraint, each rank's stages together, couples stages
p apart in the chain, which a DP over the chain cannot carry.)

n_k is the micro-batches whose activations the stage holds at its peak: m (GPipe),
min(p - r, m) (1F1B), p (zero-bubble, W keeps them until it runs), and for interleaved
1F1B (min((v - 1) * m_round + 2 (p - 1 - r) + 1, m v)) / v per stage, the rank's
warm-up depth shared evenly by its v stages (checked per rank by ``simulate``), but 1 for
the last stage, whose backward follows each forward, its rank's other v - 1 stages sharing
the rest of its depth (a loss head's activations counted once); DualPipeV
(2 stages per rank in a V, stage k on rank min(k, 2p - 1 - k)): 2p - k for stage k, the
rank's two stages peaking together at 2p + 1.

Time model (replaced by the per-stage intra-operator plan once the core solver provides
it): a stage's compute divides evenly over its d devices and scales linearly with b, plus
a fixed per-micro-batch part (``LayerCosts.fixed_time``) that does neither, the runtime's
cost per action and its cuts' messages:

    c[k, j, i] = b / d * sum_{l=j}^{i-1} t_l + sum_{l=j}^{i-1} f_l + A * a
                 + 2 alpha (n_j + n_i) + sum_{ops o in j..i-1} max(0, w_o - s_o b / d)
                                                              (inf where over memory)

where the last sum is each op's floor (``LayerCosts.time_floors``: a GEMM reads its weights
w_o seconds however few its rows, counted in t at s_o a sample), for A actions per
micro-batch (2; 3 under zero bubble) of ``action_time`` a each, n_j
tensors crossing the cut before layer j (``boundary_tensors``; n_0 = n_L = 0: no cut) and
alpha = ``message_time``; once per step each rank all-reduces its layers' ``sync_bytes``
over its sub-mesh (ring, not overlapped), which is what makes a data-parallel sub-mesh cost
something against a deeper pipeline.

Host time (eager programs on GPUs, ``cost_models.host``): a pipeline rank's CPU dispatches
the ATen calls of its stages once per micro-batch, forward and backward, while its GPU runs
the kernels queued before (the same overlap as an unpipelined step's,
``cost_models.step.step_time``), and its optimizer's foreach calls once a step:

    c[k, j, i] = max(device c[k, j, i], sum_{l=j}^{i-1} h_l)       (each micro-batch)
    host_r = m * sum_{k on r} sum_{l in stage k} h_l + h_opt,    step = max(step, max_r host_r)
    step = pipeline end + max(sync, h_opt)        (the optimizer's calls after the last backward)

for ``LayerCosts.host_time`` h (seconds per micro-batch) and ``host_step_time`` h_opt: a
stage's micro-batch (its F and B actions, in the split above) takes the longer of its
device time and its host's dispatch, so the DP balances the host where it binds, the
closed form and the simulated timeline see it in every action (fill and drain too: a
host-bound rank's late sends delay its neighbours), and the step is at least the busiest
rank's host total with its optimizer's calls (``StagePlan.host_time``,
``predicted_step_time``; ``pipeline_price.pipeline_estimate`` for the plan). The optimizer's
calls are dispatched where they happen, after the rank's last backward: its host queues
them while its device runs the exposed gradient reduction, so the step ends
``max(sync, h_opt)`` after the pipeline (an unpipelined step pays them in its host total
the same way; without this a one-micro-batch pipeline, whose stages run one after the
other, would be priced the optimizer's calls faster than the same graph unpipelined).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from autopar.errors import PinError
from autopar.report import fmt_bytes

from autopar.schedule import SCHEDULES, check_schedule, schedule_actions, stage_ranks
from autopar.pricing.simulate import compile_schedule, makespan_compiled, simulate
from autopar.solver.stage_plan import LayerCosts, StagePlan, StagesDoNotFit
from autopar.solver.stage_tables import (
    INF, Candidate, Stack, Tables, Tiebreak, bubble_rho, in_flight, price, rank_times, ring_factor,
    shares_by_need, value_buffers,
)

__all__ = ["LayerCosts", "StagePlan", "StagesDoNotFit", "stage_dp", "plan_stages", "simulate_plan",
           "in_flight"]

DEFAULT_VIRTUAL = (2, 3, 4, 8)
"""Virtual stages the planner tries on an interleaved schedule. Megatron-LM runs 2-4 on most
models and one or two layers per virtual stage on deep ones, whose bubble keeps shrinking
(Llama 3 405B on 16 stages, ``benchmarks/published_runs.py`` row 15: pinned, v=8 predicts
14.3 s a step against v=4's 15.3 s; left free, the search ranks the counts by simulating
one intra-stage plan, solved for the reference count's memory, and keeps 4). More would
grow the stage DP's tables (p v stages by the chain squared) for a bubble already under
1/8 of 1F1B's."""


# ---- the DP ---------------------------------------------------------------------------------


def stage_dp(cost: np.ndarray, tiebreak: np.ndarray | None = None) -> tuple[float, tuple[int, ...]]:
    """Cut a chain of L layers into S stages minimizing the slowest stage.

    ``cost[k, j, i]`` (shape (S, L+1, L+1)) is stage k's time when it holds layers
    j .. i-1, ``inf`` where that is not allowed (j >= i, or over memory). Among the cuts
    that reach the least bottleneck, returns the one of least ``sum_k tiebreak[k, j, i]``
    (default ``cost``). Returns (bottleneck, cuts); bottleneck is ``inf`` and cuts empty
    when no cut is feasible.
    """
    n_stages, rows, cols = cost.shape
    if rows != cols:
        raise ValueError(f"cost must have shape (S, L+1, L+1), got {cost.shape}")
    n_layers = rows - 1
    if n_stages > n_layers:
        return INF, ()
    tie = cost if tiebreak is None else tiebreak
    widths = _band_width(cost, tie)
    if widths is not None:
        return _banded_dp(cost, tie, widths)
    # best[k, i]: least bottleneck of stages 0..k holding exactly layers 0..i-1.
    best = np.full((n_stages, rows), INF)
    best[0] = cost[0, 0]
    work = np.empty((rows, cols))      # one scratch table for every stage (no allocation each)
    for k in range(1, n_stages):
        np.maximum(best[k - 1][:, None], cost[k], out=work)
        work.min(axis=0, out=best[k])
    bottleneck = float(best[-1, n_layers])
    if not math.isfinite(bottleneck):
        return INF, ()

    # total[k, i]: least sum of tiebreak over stages 0..k holding layers 0..i-1, every
    # stage within the bottleneck; arg[k, i]: first layer of stage k in that optimum.
    # (stage by stage: the tables may be ``stage_tables.Stack``s, one table per in-flight count)
    within = bottleneck + 1e-9 * max(abs(bottleneck), 1e-30)
    total = np.full((n_stages, rows), INF)
    arg = np.zeros((n_stages, rows), dtype=np.int64)
    total[0] = np.where(cost[0, 0] <= within, tie[0, 0], INF)
    allowed = _within(cost, tie, within)
    columns = np.arange(rows)
    for k in range(1, n_stages):
        np.add(total[k - 1][:, None], allowed(k), out=work)
        work.argmin(axis=0, out=arg[k])
        total[k] = work[arg[k], columns]
    return bottleneck, _cuts(arg)


def _cuts(arg: np.ndarray) -> tuple[int, ...]:
    """The cuts read back from ``arg[k, i]`` (stage k's first layer where stages 0..k hold
    layers 0..i-1), from the last stage ending at the chain's end."""
    cuts = []
    i = arg.shape[1] - 1
    for k in range(arg.shape[0] - 1, 0, -1):
        i = int(arg[k, i])
        cuts.append(i)
    return tuple(reversed(cuts))


BAND_AT_MOST = 0.5
"""``stage_dp`` runs on bands (:func:`_banded_dp`) where no stage may hold more than this
share of the chain's layers."""


def _band_width(cost, tie) -> np.ndarray | None:
    """Per table of ``cost`` (a ``Stack``, ``tie`` over the same tables), the most layers a
    stage may hold, where at most :data:`BAND_AT_MOST` of the chain for every one; else
    None."""
    if not (isinstance(cost, Stack) and isinstance(tie, Stack)
            and np.array_equal(cost.which, tie.which)):
        return None
    rows = cost.shape[1]
    widths = np.maximum(cost.widths(), 1)
    return widths if widths.max() <= BAND_AT_MOST * (rows - 1) else None


def _band(table: np.ndarray, width: int) -> np.ndarray:
    """An (L+1, L+1) table as an (L+1, width) band: ``band[i, t] = table[i - width + t,
    i]`` (a stage ending before layer i and starting at i - width + t), INF before the
    chain."""
    i = np.arange(table.shape[0])[:, None]
    j = i - width + np.arange(width)[None, :]
    return np.where(j >= 0, table[np.maximum(j, 0), np.broadcast_to(i, j.shape)], INF)


def _banded_dp(cost, tie, widths: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """``stage_dp`` on bands: where a stage of table u may hold at most ``widths[u]``
    layers (memory, or the stage count), every start farther back is INF, so the same
    recurrences over the band alone give the same bottleneck, totals and cuts (starts
    tried in the same ascending order, the first among equals kept): Llama 3 405B's 128
    stages of about 2 of 260 layers each read a band of their table."""
    n_stages, rows = cost.shape[0], cost.shape[1]
    n_layers = rows - 1
    i = np.arange(rows)
    which = cost.which
    starts, before, starts_at = {}, {}, {}
    for w in set(int(x) for x in widths):
        j = i[:, None] - w + np.arange(w)[None, :]
        starts[w], before[w], starts_at[w] = j, j < 0, np.maximum(j, 0)
    bands = [_band(cost.table(u), int(w)) for u, w in enumerate(widths)]
    best = np.full((n_stages, rows), INF)
    best[0] = cost[0, 0]
    for k in range(1, n_stages):
        w = int(widths[which[k]])
        np.maximum(np.where(before[w], INF, best[k - 1][starts_at[w]]), bands[which[k]]).min(
            axis=1, out=best[k])
    bottleneck = float(best[-1, n_layers])
    if not math.isfinite(bottleneck):
        return INF, ()
    within = bottleneck + 1e-9 * max(abs(bottleneck), 1e-30)
    allowed = [np.where(b <= within, _band(t, int(w)), INF)
               for b, t, w in zip(bands, map(tie.table, range(len(widths))), widths)]
    total = np.full((n_stages, rows), INF)
    arg = np.zeros((n_stages, rows), dtype=np.int64)
    total[0] = np.where(cost[0, 0] <= within, tie[0, 0], INF)
    for k in range(1, n_stages):
        w = int(widths[which[k]])
        work = np.where(before[w], INF, total[k - 1][starts_at[w]]) + allowed[which[k]]
        t = work.argmin(axis=1)
        arg[k] = starts[w][i, t]
        total[k] = work[i, t]
    return bottleneck, _cuts(arg)


def _within(cost, tie, within: float):
    """k -> ``tie[k]`` where ``cost[k]`` is within the bottleneck, INF elsewhere; worked out
    once per distinct table when both are ``Stack``s over the same tables (an interleaved
    schedule's p * v stages share p tables)."""
    if isinstance(tie, Tiebreak) and tie.cost is cost:
        return tie.within(within)
    if isinstance(cost, Stack) and isinstance(tie, Stack) and len(cost.tables) < len(cost.which) \
            and np.array_equal(cost.which, tie.which):
        tables, which = np.where(cost.tables <= within, tie.tables, INF), cost.which
        return lambda k: tables[which[k]]
    return lambda k: np.where(cost[k] <= within, tie[k], INF)


# ---- the search -----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class StageMachine:
    """What the stage search plans on: ``n_devices`` for a ``global_batch``, ``memory_limit``
    bytes per device, ``bandwidth`` (bytes/s) between neighbouring stages,
    ``sync_bandwidth`` (default ``bandwidth``) within a stage's sub-mesh, and whether a
    stage's state is divided over its sub-mesh (``shard_state``)."""
    n_devices: int
    global_batch: int
    memory_limit: float
    bandwidth: float
    sync_bandwidth: float | None = None
    shard_state: bool = False


@dataclass(frozen=True)
class StagePins:
    """What a caller fixes (``n_stages``, ``micro_batches``, ``schedule``,
    ``virtual_stages``) or narrows (``micro_batch_options``, ``schedule_options``) of the
    stage search's configurations."""
    n_stages: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    micro_batch_options: Sequence[int] | None = None
    schedule_options: Sequence[str] | None = None


def _stage_ask(keywords: dict) -> tuple[StageMachine, StagePins]:
    """``plan_stages``' keywords as its two values; an unknown name is a TypeError."""
    machine_names = {f.name for f in fields(StageMachine)}
    pin_names = {f.name for f in fields(StagePins)}
    unknown = sorted(set(keywords) - machine_names - pin_names)
    if unknown:
        raise TypeError(f"plan_stages() got unexpected keyword argument(s) {unknown}; it takes "
                        f"{sorted(machine_names)} and {sorted(pin_names)}")
    return (StageMachine(**{k: v for k, v in keywords.items() if k in machine_names}),
            StagePins(**{k: v for k, v in keywords.items() if k in pin_names}))


def plan_stages(costs: LayerCosts, *, explain: bool = True, above: float = INF, fixed_cuts=None,
                **keywords) -> StagePlan | None:
    """Choose pipeline degree, cuts, micro-batch count and schedule of least predicted step.

    ``keywords``: :class:`StageMachine`'s fields (``n_devices``, ``global_batch``,
    ``memory_limit``, ``bandwidth`` required) and :class:`StagePins`'.
    ``memory_limit`` is bytes per device; ``bandwidth`` bytes/s of the link between
    neighbouring stages; ``sync_bandwidth`` (default ``bandwidth``) bytes/s of a stage's
    sub-mesh, for the once-per-step all-reduce of ``sync_bytes``. Pins (``n_stages``, ``micro_batches``, ``schedule``,
    ``virtual_stages``) fix one choice each. ``shard_state`` divides each stage's state
    over its sub-mesh (ZeRO-3 / tensor parallel) instead of replicating it.
    ``micro_batch_options`` and ``schedule_options`` narrow what an unpinned micro-batch
    count (default: every divisor of the batch) and schedule (default: all) may be.
    ``explain=False`` skips working out, when nothing fits, which configuration came
    closest (the error then says only that nothing fits).
    ``above``: a search's best step so far. A configuration whose busiest rank alone works
    at least that long (``_busiest_floor``: m micro-batches of at least 1/p of every layer
    and of the longest layer; the simulated step cannot be shorter) is not planned; None
    is returned when every configuration is such (an error when one below ``above`` does
    not fit: a caller may then recompute, which only adds time).
    ``fixed_cuts``: S -> the cuts (layer indices) of S stages, in place of the DP's (the
    ``stage_split="even-layers"`` pin, ``autopar.solver.even_split``); the configurations
    (m, schedule, virtual stages) are searched as before, each priced at those cuts.

    >>> costs = LayerCosts(time=[1.0] * 8, state_bytes=[1.0] * 8, activation_bytes=[1.0] * 8,
    ...                    boundary_bytes=[0.0] * 7)
    >>> plan = plan_stages(costs, n_devices=4, global_batch=8, memory_limit=1e9,
    ...                    bandwidth=1e9, n_stages=4, micro_batches=8, schedule="1f1b")
    >>> plan.cuts, plan.stage_times
    ((2, 4, 6), (2.0, 2.0, 2.0, 2.0))
    """
    machine, pins = _stage_ask(keywords)
    n_devices, global_batch, memory_limit = machine.n_devices, machine.global_batch, machine.memory_limit
    bandwidth, sync_bandwidth, shard_state = machine.bandwidth, machine.sync_bandwidth, machine.shard_state
    L = costs.n_layers
    if n_devices < 1 or global_batch < 1:
        raise ValueError(f"n_devices ({n_devices}) and global_batch ({global_batch}) must be >= 1")
    if memory_limit <= 0 or bandwidth <= 0:
        raise ValueError(f"memory_limit ({memory_limit}) and bandwidth ({bandwidth}) must be > 0")
    candidates = _candidates(L, n_devices, global_batch, pins, learned=costs.n_learned)
    tables = Tables(costs)
    split = costs.split()
    sync_bw = bandwidth if sync_bandwidth is None else sync_bandwidth
    if sync_bw <= 0:
        raise ValueError(f"sync_bandwidth must be > 0, got {sync_bw}")
    args = (n_devices, global_batch, memory_limit, bandwidth, shard_state)
    fingerprint = _fingerprint(costs)
    lower_bound = functools.partial(_lower_bound, costs=costs, n_devices=n_devices,
                                    global_batch=global_batch, split=split, sync_bw=sync_bw)
    cannot_fit = functools.partial(_cannot_fit, costs=costs, n_devices=n_devices,
                                   global_batch=global_batch, memory_limit=memory_limit,
                                   shard_state=shard_state)

    best: tuple[float, StagePlan] | None = None
    tried = False          # a configuration that could beat ``above`` was tried
    uneven = None          # fixed_cuts' error for a stage count it cannot cut
    for c in sorted(candidates, key=lower_bound):
        if best is not None and lower_bound(c) >= best[0] * (1 - 1e-12):
            break
        try:
            fixed = None if fixed_cuts is None else tuple(int(x) for x in fixed_cuts(c.p * c.v))
        except PinError as e:          # this many stages do not split the layers evenly
            uneven = uneven or e
            continue
        if above < INF and _busiest_floor(c, costs, n_devices, global_batch) >= above:
            continue
        tried = True
        if cannot_fit(c):
            continue
        key = (fingerprint, c, *args, sync_bw) + (() if fixed is None else (fixed,))
        plan = _PLANNED.pop(key, _UNPLANNED)
        if plan is _UNPLANNED:
            arrays = tables.arrays(c, *args)
            cost, tiebreak, memory, share, comm = arrays
            bottleneck, cuts = stage_dp(cost, tiebreak) if fixed is None else \
                (_fixed_bottleneck(cost, fixed, L), fixed)
            plan = _make_plan(c, cuts, tables, (cost, memory, comm), split, n_devices, sync_bw) \
                if math.isfinite(bottleneck) else None
            if fixed is None and c.v > 1:
                plan = _by_need(c, plan, tables, arrays, args, (split, sync_bw))
        _PLANNED[key] = plan                          # most recent last
        if len(_PLANNED) > PLANNED_SIZE:
            del _PLANNED[next(iter(_PLANNED))]
        if plan is None:
            continue
        if best is None or plan.predicted_step_time < best[0]:
            best = (plan.predicted_step_time, plan)
    if best is None and not tried and uneven is not None \
            and all(_cannot_cut(fixed_cuts, c) for c in candidates):
        raise uneven                 # no candidate's stage count splits the layers evenly
    if best is None and not tried and above < INF:
        return None
    if best is None:
        raise StagesDoNotFit(_no_fit_message(candidates, tables, args) if explain else
                             f"no pipeline plan fits {memory_limit / 2**30:.3g} GiB per device")
    return best[1]


def _by_need(c: Candidate, plan: StagePlan | None, tables: Tables, arrays, args, timing
             ) -> StagePlan | None:
    """``plan`` (None where nothing fit), or the plan of the DP run again with each stage's
    share of its rank's memory in proportion to what it holds under ``plan``'s cuts (the
    closest cuts where nothing fit: least excess over ``memory_limit / v``):
    ``stage_tables.shares_by_need``, when faster. ``plan``'s cuts stay within those shares,
    so the DP's plan is at least as fast. A rank holds v stages (interleaved 1F1B,
    DualPipeV) that need not hold alike: a V's first stage holds 2p - r micro-batches of
    activations, its partner r + 1; an embedding's or a loss head's stage far more state
    or activations than its rank's layer stages (Mixtral 8x22B's EP 8 x PP 8 x VP 7:
    stage 0's embedding and first layer 11.7 GiB against 78 / 7 = 11.1 GiB).
    ``arrays``: the first DP's (``Tables.arrays``); ``timing``: (split, sync_bw)."""
    _, _, memory, share, _ = arrays
    n_devices, memory_limit = args[0], args[2]
    if plan is not None:
        cuts = plan.cuts
        if not _memory_binds(memory, share, cuts, tables.L):
            return plan
    else:
        _, cuts = stage_dp(_excess(memory, tables.valid, share))
        if len(cuts) != c.p * c.v - 1:
            return None
    bounds = (0, *cuts, tables.L)
    need = np.array([memory[k, j, i] for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:]))])
    shares = shares_by_need(c, need, memory_limit)
    if shares is None:
        return plan
    cost, tiebreak, memory, _, comm = tables.arrays(c, *args, shares=shares)
    bottleneck, cuts = stage_dp(cost, tiebreak)
    if not math.isfinite(bottleneck):
        return plan
    again = _make_plan(c, cuts, tables, (cost, memory, comm), timing[0], n_devices, timing[1])
    return again if plan is None or again.predicted_step_time < plan.predicted_step_time else plan


def _memory_binds(memory, share: float, cuts, L: int) -> bool:
    """Whether a stage under ``cuts`` could not take its neighbour's next layer on either
    side within ``share``. Where every stage could, memory is taken not to have shaped the
    cuts, and the second DP (its cost: the 405B's free search runs it on 14 of 108) is not
    run; a cut that needs a stage two layers longer is the case this misses."""
    bounds = (0, *cuts, L)
    for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (j > 0 and memory[k, j - 1, i] > share) or (i < L and memory[k, j, i + 1] > share):
            return True
    return False


def _excess(memory, valid: np.ndarray, share: float) -> Stack:
    """The (S, L+1, L+1) table of each stage's bytes over ``share`` (INF where not
    ``valid``), one table per in-flight count: ``stage_dp`` on it finds the cuts of least
    excess."""
    firsts = [int(np.argmax(memory.which == u)) for u in range(len(memory.counts))]
    return Stack(np.stack([np.where(valid, memory[k] - share, INF) for k in firsts]), memory.which)


def _cannot_cut(fixed_cuts, c: Candidate) -> bool:
    """Whether ``fixed_cuts`` cannot cut candidate c's p * v stages (a PinError)."""
    try:
        fixed_cuts(c.p * c.v)
    except PinError:
        return True
    return False


def _fixed_bottleneck(cost, cuts: tuple[int, ...], L: int) -> float:
    """The slowest stage of the chain cut at ``cuts`` (``inf`` when one does not fit)."""
    bounds = (0, *cuts, L)
    return max(float(cost[k, j, i]) for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:])))


PLANNED_SIZE = 1024
_PLANNED: dict = {}
"""A candidate's plan (None: nothing fits) by (the costs' ``_fingerprint``, candidate, mesh,
batch, limit, bandwidths, shard_state), the last ``PLANNED_SIZE`` planned: a search plans
one priced chain under the same candidate again (another bound, schedule or micro-batch
options), which is its tables and DP again (GPT-175B: 54 of 284)."""
_UNPLANNED = object()


def _fingerprint(costs: LayerCosts) -> bytes:
    """A digest of everything in ``costs`` a plan depends on."""
    h = hashlib.blake2b(digest_size=16)
    for name in ("time", "state_bytes", "activation_bytes", "boundary_bytes", "fixed_time",
                 "sync_bytes", "boundary_tensors", "parameters"):
        arr = np.asarray(getattr(costs, name), dtype=float)
        h.update(len(arr).to_bytes(8, "little"))
        h.update(arr.tobytes())
    h.update(np.asarray(costs.host_time, dtype=float).tobytes())
    grads = costs.grad_boundary_bytes
    h.update(b"-" if grads is None else b"g" + np.asarray(grads, dtype=float).tobytes())
    for arr in costs.time_floors or ():
        h.update(b"f" + np.asarray(arr).tobytes())
    h.update(np.array([costs.action_time, costs.message_time, costs.forward_fraction,
                       costs.weight_fraction, costs.host_step_time], dtype=float).tobytes())
    return h.digest()


def _lower_bound(c: Candidate, *, costs: LayerCosts, n_devices: int, global_batch: int,
                 split: tuple[float, float, float], sync_bw: float) -> float:
    """Lower bound of candidate c's step (perfect balance, no transfers) to prune with: the
    step grows with the slowest rank R, which is at least the mean and the largest layer."""
    layer = costs.micro_batch_time(global_batch / c.m / (n_devices // c.p))
    busy = float(layer.sum())
    slowest = max(busy / c.p, float(layer.max()))
    sync = ring_factor(n_devices // c.p) * float(costs.sync_bytes.sum()) / c.p / sync_bw
    return max(c.m * slowest + bubble_rho(c.schedule, c.v, split, c.p) * (busy - slowest) + sync,
               costs.host_floor(c.p, c.m))


def _busiest_floor(c: Candidate, costs: LayerCosts, n_devices: int, global_batch: int) -> float:
    """A floor of any simulated timeline of candidate c (``simulate_plan``): its busiest
    rank runs m micro-batches of its stages one action at a time, and holds at least 1/p
    of the layers' time and at least the longest layer (a stage's time is at least its
    layers'; transfers, latency and the bubble only add)."""
    layer = costs.micro_batch_time(global_batch / c.m / (n_devices // c.p))
    return max(c.m * max(float(layer.sum()) / c.p, float(layer.max())), costs.host_floor(c.p, c.m))


def _cannot_fit(c: Candidate, *, costs: LayerCosts, n_devices: int, global_batch: int,
                memory_limit: float, shard_state: bool) -> bool:
    """Candidate c's stages cannot fit even with its memory spread perfectly evenly, or its
    largest layer alone overflows a device: skip it without building its arrays.

    The stages hold at least the state and, of the activations, each layer's times the
    least count of a stage that may hold it: the fewest in flight of any stage, but where
    the last stage alone holds fewer (interleaved 1F1B's one micro-batch), the least of the
    others for all but the chain's last L - S + 1 layers (the most the last stage can
    take, every other stage holding one)."""
    d, b = n_devices // c.p, global_batch / c.m
    counts = in_flight(c.schedule, c.p, c.m, c.v)
    n = float(counts.min())
    state_div = d if shard_state else 1
    act = costs.activation_bytes * b / d
    held = n * float(act.sum())
    if len(counts) > 1 and counts[-1] < counts[:-1].min():
        tail = float(act[len(counts) - 1:].sum())    # the chain's last L - S + 1 layers
        held = float(counts[:-1].min()) * (float(act.sum()) - tail) + float(counts[-1]) * tail
    spread = (float(costs.state_bytes.sum()) / state_div + held) / (c.p * c.v)
    layer = costs.state_bytes / state_div + n * act
    # (a stage of v may take more than 1 / v of its rank's memory: ``_by_need``)
    share = memory_limit / c.v
    return spread > share * (1 + 1e-9) or float(layer.max()) > memory_limit * (1 + 1e-9)


def _candidates(L, n_devices, global_batch, pins: StagePins, learned=None):
    """The configurations (p, m, schedule, v) the pins leave; ``learned``: the layers that
    read a parameter (default all L), the most stages that can each hold one."""
    learned = L if learned is None else learned
    n_stages, micro_batches, schedule, virtual = (pins.n_stages, pins.micro_batches, pins.schedule,
                                                  pins.virtual_stages)
    micro_batch_options, schedule_options = pins.micro_batch_options, pins.schedule_options
    if n_stages is not None:
        if n_stages < 1 or n_devices % n_stages:
            raise PinError(f"n_stages={n_stages} must divide n_devices={n_devices} so every stage "
                           f"gets an equal sub-mesh; choose one of {_divisors(n_devices)}")
        if n_stages > L:
            raise PinError(f"n_stages={n_stages} is more stages than the chain can hold: {L} layers "
                           f"have {L - 1} cut points, so at most {L} stages")
        if n_stages > learned:
            raise PinError(f"n_stages={n_stages} is more stages than can each hold a parameter: "
                           f"{learned} of the chain's {L} layers read one, so at most {learned} "
                           "stages (a stage without one trains nothing)")
    if micro_batches is not None and (micro_batches < 1 or global_batch % micro_batches):
        raise PinError(f"micro_batches={micro_batches} does not divide the global batch "
                       f"{global_batch}; choose one of {_divisors(global_batch)}")
    if schedule is not None and schedule not in SCHEDULES:
        raise PinError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if virtual is not None:
        if virtual < 1:
            raise PinError(f"virtual_stages must be >= 1, got {virtual}")
        if schedule == "dualpipev" and virtual != 2:
            raise PinError(f"schedule 'dualpipev' runs exactly 2 stages per rank (V placement), "
                           f"got virtual_stages={virtual}; drop the virtual_stages pin or set it to 2")
        if virtual > 1 and schedule not in (None, "interleaved-1f1b", "dualpipev"):
            raise PinError(f"virtual_stages={virtual} needs schedule 'interleaved-1f1b'; the "
                           f"planner runs {schedule!r} with one stage per rank")
        if schedule is None and virtual > 1:
            schedule = "interleaved-1f1b"
    ps = [n_stages] if n_stages is not None else [p for p in _divisors(n_devices) if p <= learned]
    ms = [micro_batches] if micro_batches is not None else \
        [m for m in _divisors(global_batch) if micro_batch_options is None or m in micro_batch_options]
    kinds = [schedule] if schedule is not None else \
        [k for k in SCHEDULES if schedule_options is None or k in schedule_options]

    out, first_error = [], None
    for p, m, kind in itertools.product(ps, ms, kinds):
        if kind == "interleaved-1f1b":
            vs = [virtual] if virtual is not None else list(DEFAULT_VIRTUAL) if p > 1 else []
        elif kind == "dualpipev":
            vs = [2]
        else:
            vs = [1]
        for v in vs:
            try:
                check_schedule(kind, p, m, v)
                if p * v > L:
                    raise PinError(f"schedule {kind!r} with {p} stages x {v} virtual stages cuts "
                                   f"the chain into {p * v} stages, more than its {L} layers "
                                   f"({L - 1} cut points) allow")
                if p * v > learned:
                    raise PinError(f"schedule {kind!r} with {p} stages x {v} virtual stages cuts "
                                   f"the chain into {p * v} stages, more than can each hold a "
                                   f"parameter ({learned} of its {L} layers read one)")
            except ValueError as e:
                first_error = first_error or e
                continue
            out.append(Candidate(p, m, kind, v))
    if not out:
        pins = ", ".join(f"{k}={v!r}" for k, v in [("n_stages", n_stages), ("micro_batches", micro_batches),
                         ("schedule", schedule), ("virtual_stages", virtual)] if v is not None)
        raise PinError(f"no pipeline configuration satisfies the pins ({pins or 'none'}): "
                       f"{first_error}") from first_error
    return out


def _make_plan(c, cuts, tables, arrays, split, n_devices, sync_bw) -> StagePlan:
    """The StagePlan of candidate c cut at ``cuts``; ``arrays``: its (time, memory, boundary
    transfer) tables (``Tables.arrays``)."""
    cost, memory, comm = arrays
    costs = tables.costs
    bounds = (0, *cuts, tables.L)
    stages = list(zip(bounds[:-1], bounds[1:]))
    stage_times = np.array([cost[k, j, i] for k, (j, i) in enumerate(stages)])
    # a boundary between two stages of one rank (DualPipeV's middle one) sends nothing
    ranks = stage_ranks(c.schedule, c.p, c.v)
    comm_cuts = np.array([0.0 if ranks[k] == ranks[k + 1] else comm[i] for k, i in enumerate(cuts)])
    step, bubble = price(c, stage_times, comm_cuts, split)
    stage_memory = np.array([memory[k, j, i] for k, (j, i) in enumerate(stages)])
    rank_sync = rank_times(c.schedule, c.p, c.v, [tables.sync[j, i] for j, i in stages])
    sync = ring_factor(n_devices // c.p) * float(rank_sync.max()) / sync_bw
    host = rank_host(costs, stages, c)
    return StagePlan(
        cuts=tuple(int(x) for x in cuts), n_stages=c.p, micro_batches=c.m, schedule=c.schedule,
        virtual_stages=c.v, devices_per_stage=n_devices // c.p,
        stage_times=tuple(float(x) for x in stage_times),
        boundary_times=tuple(float(x) for x in comm_cuts),
        predicted_step_time=max(step + max(sync, costs.host_step_time), host),
        bubble_fraction=bubble, sync_time=sync,
        host_time=host,
        memory_per_stage=tuple(float(x) for x in rank_times(c.schedule, c.p, c.v, stage_memory)),
        forward_fraction=costs.forward_fraction, weight_fraction=costs.weight_fraction,
        n_layers=tables.L)


def rank_host(costs: LayerCosts, stages, c: Candidate) -> float:
    """The busiest rank's host seconds a step with the layers ``[j, i)`` of each stage in
    ``stages``, placed as candidate c's schedule places them (``rank_times``), for its m
    micro-batches (the module's host rule)."""
    h = costs.host_time
    if not h.any():
        return costs.host_step_time if len(stages) else 0.0
    per_rank = rank_times(c.schedule, c.p, c.v, [float(h[j:i].sum()) for j, i in stages])
    return c.m * float(np.max(per_rank)) + costs.host_step_time


def _no_fit_message(candidates, tables, args) -> str:
    """Which configuration comes closest to fitting, which stage overflows and by how much."""
    closest = None
    for c in candidates:
        _, _, memory, share, _ = tables.arrays(c, *args)
        over = np.where(tables.valid[None], np.asarray(memory) - share, INF)
        excess, cuts = stage_dp(over)
        if closest is None or excess * c.v < closest[0] * closest[1].v:   # compare per rank
            closest = (excess, c, cuts, memory, share)
    excess, c, cuts, memory, share = closest
    bounds = (0, *cuts, tables.L)
    worst = max(range(len(bounds) - 1), key=lambda k: memory[k, bounds[k], bounds[k + 1]])
    j, i = bounds[worst], bounds[worst + 1]
    n_devices, global_batch, limit = args[0], args[1], args[2]
    # the runtime's receive buffers of that stage (its micro-batches in flight)
    counts, which = np.unique(in_flight(c.schedule, c.p, c.m, c.v), return_inverse=True)
    which = which.reshape(-1)
    values = float(value_buffers(c, counts, which)[which[worst]])
    buffers = float(tables.buffer_base(c)[j, i] + values * tables.recv_values[j, i]) \
        * global_batch / c.m / (n_devices // c.p)
    held = (f", {fmt_bytes(buffers)} of it the buffers torch's PipelineStage receives "
            "into (one per micro-batch in flight at each cut)") \
        if buffers > 0.01 * memory[worst, j, i] else ""
    rank_note = ""
    if c.v > 1:     # why a share by need (``_by_need``) did not fit either
        ranks = stage_ranks(c.schedule, c.p, c.v)
        together = sum(float(memory[k, bounds[k], bounds[k + 1]]) for k in range(len(bounds) - 1)
                       if ranks[k] == ranks[worst])
        rank_note = (f" (its share, 1/{c.v} of the device; its rank's {c.v} stages together "
                     f"hold {fmt_bytes(together)} at these cuts)")
    return (f"no pipeline plan fits {fmt_bytes(limit)} per device: the closest, n_stages={c.p}, "
            f"virtual_stages={c.v}, micro_batches={c.m}, schedule {c.schedule!r}, still needs "
            f"{fmt_bytes(memory[worst, j, i])} on stage {worst} (layers {j}..{i - 1}){held}, "
            f"over its {fmt_bytes(share)} by {fmt_bytes(excess)} "
            f"({excess:.0f} bytes){rank_note}; raise memory_limit, add devices, use more micro-batches "
            f"or shard_state=True")


# ---- timing a plan --------------------------------------------------------------------------


def simulate_plan(plan: StagePlan, timeline: bool = True):
    """Per-rank timeline of ``plan`` from ``autopar.pricing.simulate``; ``timeline=False``:
    its makespan alone (``simulate.makespan``, the same figure without the timeline)."""
    times = np.asarray(plan.stage_times)
    f = plan.forward_fraction
    p2p = plan.boundary_times if plan.boundary_times else 0.0
    kw = dict(forward=times * f, backward=times * (1 - f),
              weight=times * (1 - f) * plan.weight_fraction, p2p=p2p)
    if not timeline:
        return makespan_compiled(_compiled(plan.schedule, plan.n_stages, plan.micro_batches,
                                           plan.virtual_stages), **kw)
    return simulate(schedule_actions(plan.schedule, plan.n_stages, plan.micro_batches,
                                     plan.virtual_stages), **kw)


@functools.lru_cache(maxsize=32)
def _compiled(schedule: str, p: int, m: int, v: int):
    """The schedule's dependency structure (``simulate.compile_schedule``), built once per
    (schedule, p, m, v): a search simulates the same schedule under many cuts and meshes."""
    return compile_schedule(schedule_actions(schedule, p, m, v))
