"""The arrays the stage DP reads: interval sums of the per-layer costs, each candidate
configuration's stage-time and memory tables, activations in flight per schedule, and the
price of a cut: its transfer, and its messages' latency in the stage time (``cut_latency``)
(formulas in ``stage_dp``'s docstring)."""
from __future__ import annotations

from dataclasses import dataclass

import functools

import numpy as np

from autopar.pricing.simulate import makespan
from autopar.schedule import LOWERED, lowered_program, schedule_actions, stage_ranks
from autopar.solver.stage_plan import LayerCosts

INF = float("inf")


def _interval(prefix: np.ndarray) -> np.ndarray:
    """m[j, i] = prefix[i] - prefix[j]: the sum over layers j .. i-1."""
    return prefix[None, :] - prefix[:, None]


def in_flight(schedule: str, n_stages: int, micro_batches: int, virtual: int) -> np.ndarray:
    """Micro-batches of activations each of the S = p * v stages holds at its peak."""
    p, m, v = n_stages, micro_batches, virtual
    ranks = np.arange(p * v) % p
    if schedule == "dualpipev":
        # stage k holds 2p - k: stage r's 2 (p - 1 - r) + r + 1 warm-up forwards ((1) and
        # (2) of ``schedule._dual_pipe_v``) plus the step-4 forward before its first backward,
        # and its partner 2p - 1 - r holds r + 1; the pair peaks together at 2p + 1 per rank
        # (both F and release of a stage run on its rank, so the count follows the rank's
        # order whatever the durations; ``simulate`` checks it)
        return (2.0 * p - np.arange(2 * p)).astype(float)
    if schedule == "gpipe":
        return np.full(p * v, float(m))
    if schedule == "1f1b":
        return np.minimum(p - ranks, m).astype(float)
    if schedule == "zero-bubble":
        return np.full(p * v, float(min(p, m)))
    # interleaved 1F1B: a rank's warm-up depth (its peak, micro-batch stages held at once)
    # shared by its v stages, but for the last stage: it runs each micro-batch's backward
    # right after its forward (the loss is its own) and holds one, the rest of its rank's
    # depth held by the rank's v - 1 others (torch's lowered program, walked: rank sums the
    # depths and the last stage 1 in all 87 (p, m, v) of p <= 8, v <= 4; a loss head's
    # logits counted once, not depth / v times: Qwen3-235B's PP 32 x VPP 3 head held
    # 21.7 micro-batches' logits, 33 GiB, and the published layout did not fit)
    per_round = m // max(1, m // p)
    depth = np.minimum((v - 1) * per_round + 2 * (p - 1 - ranks) + 1, m * v)
    held = depth / v
    if v > 1:
        held[ranks == p - 1] = (depth[-1] - 1) / (v - 1)
        held[-1] = 1.0
    return held


@functools.lru_cache(maxsize=256)
def receive_in_flight(schedule: str, n_stages: int, micro_batches: int,
                      virtual: int) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batches whose receive buffers each of the S = p * v stages holds at its peak:
    (values it receives, gradients sent back to it), S each (``runtime.receive_buffers``:
    a buffer per receive, held until torch has read it; read-only arrays).

    - GPipe and 1F1B (torch's ``PipelineScheduleSingle``): a received value lives as the
      stage's activations do, plus the next receive posted before the oldest is released:
      min(n_k + 1, m) (``in_flight``); gradients, one for the backward running and the one
      received before (torch's loop still holds the last receive's ops): min(2, m);
    - interleaved 1F1B, zero bubble and DualPipeV (``schedule.LOWERED``): counted on the
      program torch's runtime runs (:func:`lowered_holds`), where each receive is posted as
      early as torch's lowering places it, often well before its forward (interleaved
      1F1B: up to 2p values a stage whatever m, against its ~p activations in flight).

    Stage 0 receives no value and the last stage no gradient; DualPipeV's middle pair
    (stages p - 1 and p, one rank) hands both over in place: no buffers.
    """
    p, m, v = n_stages, micro_batches, virtual
    if schedule in LOWERED:
        values, grads = lowered_holds(schedule, p, steady_micro_batches(schedule, p, m), v)
    else:
        values = np.minimum(in_flight(schedule, p, m, v) + 1, m)
        grads = np.full(p * v, float(min(2, m)))
        values[0], grads[p * v - 1] = 0.0, 0.0
    values.flags.writeable = grads.flags.writeable = False
    return values, grads


def steady_micro_batches(schedule: str, p: int, m: int) -> int:
    """The fewest micro-batches whose lowered program holds, at every stage, the receive
    buffers m micro-batches' does (:func:`lowered_holds`; the steady state repeats): for
    interleaved 1F1B and zero bubble, two rounds of ``per_round = m // max(1, m // p)``
    micro-batches once m has more than two; for DualPipeV 4p. Checked against the full
    program for every m up to 10p, p in 2, 3, 4 (``tests/test_receive_holds.py``; once up
    to 12p with p in 2, 3, 4, 5, 8: 471 cases); a 16 x 8-stage, 512 micro-batch program
    takes torch 3 s to lower, its two rounds 0.1."""
    if schedule == "dualpipev":
        return min(m, 4 * p)
    rounds = max(1, m // p)
    return m if rounds <= 2 else 2 * (m // rounds)


@functools.lru_cache(maxsize=256)
def lowered_holds(schedule: str, p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, gradients): per stage, the most receive buffers alive at once on torch's
    lowered program (``schedule.lowered_program``), walked rank by rank in its order. A
    buffer is made when its receive is posted (``RECV_F`` / ``RECV_B``:
    ``InFlightBuffers.get_fwd_recv_ops``) and freed at its micro-batch's last backward on
    that stage, B or, where the backward is split, W: until then the autograd graph holds
    the received value (saved by the stage's first ops) and torch's ``backward_state`` the
    received gradient (for the weight half)."""
    values, grads = np.zeros(p * v), np.zeros(p * v)
    for ops in lowered_program(schedule, p, m, v):
        last = {(s, mb): k for k, (op, s, mb) in enumerate(ops) if op in ("B", "I", "W")}
        live = {"RECV_F": np.zeros(p * v), "RECV_B": np.zeros(p * v)}
        peak = {"RECV_F": values, "RECV_B": grads}
        held: dict[tuple[int, int], list[str]] = {}
        for k, (op, s, mb) in enumerate(ops):
            if op in live:
                live[op][s] += 1
                peak[op][s] = max(peak[op][s], live[op][s])
                held.setdefault((s, mb), []).append(op)
            elif last.get((s, mb)) == k:
                for got in held.pop((s, mb), ()):
                    live[got][s] -= 1
    return values, grads


def bubble_rho(schedule: str, virtual: int, split: tuple[float, float, float],
               n_stages: int = 2) -> float:
    """Fill/drain cost per unit of ``sum R - max R`` (see the module docstring); ``n_stages``
    (pipeline ranks p) matters to ``dualpipev`` only (:func:`dualpipev_rho`)."""
    if schedule == "dualpipev":
        return dualpipev_rho(n_stages, *split)
    if schedule == "interleaved-1f1b":
        return 1.0 / virtual
    if schedule == "zero-bubble":
        f, i, w = split
        return max(f + i - w, i, f) / (f + i + w)
    return 1.0


@functools.lru_cache(maxsize=256)
def dualpipev_rho(p: int, f: float, i: float, w: float) -> float:
    """DualPipeV's fill/drain per unit of ``sum R - max R`` for uniform stages of forward
    ``f``, input-gradient ``i`` and weight-gradient ``w``: measured on its own timeline
    (``simulate`` of ``schedule_actions("dualpipev", p, 2p)``, free transfers), since
    torch runs each F/B pair one after the other (``autopar.schedule``) and DeepSeek's
    closed form (arXiv 2412.19437 Table 2, ``(PP/2 - 1)(F&B + B - 3W)``) assumes the pair
    overlapped. The excess over ``m R`` does not grow with m past 2p (the steady state
    has no bubble), so one m serves every m; 0 for p = 1 (nothing to fill)."""
    if p < 2:
        return 0.0
    m = 2 * p
    rank = 2 * (f + i + w)                               # two stages per rank, one micro-batch
    excess = makespan(schedule_actions("dualpipev", p, m, 2), forward=f, backward=i + w,
                      weight=w) - m * rank
    return float(excess / ((p - 1) * rank))


def rank_times(schedule: str, n_stages: int, virtual: int, per_stage) -> np.ndarray:
    """Per pipeline rank, the sum of its stages' entries of ``per_stage`` (placement by
    ``schedule.stage_ranks``: loop, or DualPipeV's V)."""
    ranks = stage_ranks(schedule, n_stages, virtual)
    return np.bincount(ranks, weights=np.asarray(per_stage, dtype=float), minlength=n_stages)


@dataclass(frozen=True)
class Candidate:
    p: int
    m: int
    schedule: str
    v: int


class Tables:
    """Prefix sums of the per-layer arrays, shared by every candidate."""

    def __init__(self, costs: LayerCosts):
        self.costs = costs
        self.L = costs.n_layers
        zero = np.zeros(1)
        self.time = _interval(np.concatenate([zero, np.cumsum(costs.time)]))
        self.fixed = _interval(np.concatenate([zero, np.cumsum(costs.fixed_time)]))
        self.state = _interval(np.concatenate([zero, np.cumsum(costs.state_bytes)]))
        self.act = _interval(np.concatenate([zero, np.cumsum(costs.activation_bytes)]))
        self.sync = _interval(np.concatenate([zero, np.cumsum(costs.sync_bytes)]))
        self.host = _interval(np.concatenate([zero, np.cumsum(costs.host_time)]))
        self._floors: dict = {}        # samples per micro-batch -> ``floors``' table
        j, i = np.indices((self.L + 1, self.L + 1))
        # a stage holds layers j .. i-1 (j < i), one of which reads a parameter: a stage with
        # none trains nothing (``LayerCosts.parameters``)
        learned = _interval(np.concatenate([zero, np.cumsum(costs.parameters > 0)]))
        self.valid = (j < i) & (learned > 0)
        # boundary[i]: bytes per sample crossing a cut before layer i (0 at i = L).
        self.boundary = np.concatenate([zero, costs.boundary_bytes, zero])
        # per sample, what the runtime receives into for a stage on layers j .. i-1: its
        # inputs (recv_values[j, i]) and the gradients of its outputs (recv_grads), a buffer
        # per micro-batch in flight (``stage_dp``'s memory model); zeros where not counted
        grads = costs.grad_boundary_bytes
        counted = grads is not None
        self.recv_values = np.broadcast_to((self.boundary if counted else 0 * self.boundary)[:, None],
                                           (self.L + 1, self.L + 1))
        self.recv_grads = np.broadcast_to(
            np.concatenate([zero, grads, zero])[None, :] if counted else np.zeros((1, self.L + 1)),
            (self.L + 1, self.L + 1))
        # latency[j, i]: the messages of a stage on layers j .. i-1 at its two cuts
        at = cut_latency(np.concatenate([zero, costs.boundary_tensors, zero]), costs.message_time)
        self.latency = at[:, None] + at[None, :]

    def floors(self, samples: float):
        """[j, i]: what layers j .. i-1 take beyond their linear time for a micro-batch of
        ``samples`` samples per device (``LayerCosts.floor_excess``); 0 without floors."""
        if self.costs.time_floors is None:
            return 0.0
        got = self._floors.get(samples)
        if got is None:
            if len(self._floors) >= 8:
                self._floors.pop(next(iter(self._floors)))
            excess = self.costs.floor_excess(samples)
            got = self._floors[samples] = _interval(np.concatenate([np.zeros(1), np.cumsum(excess)]))
        return got

    def buffer_base(self, c: Candidate) -> np.ndarray:
        """Per sample of a micro-batch, the receive buffers a stage on layers j .. i-1 holds
        whatever its activations in flight: the most gradients any stage of the schedule
        holds (``receive_in_flight``; the values' buffers go with the activations in
        flight: :func:`value_buffers`)."""
        return self.recv_grads * float(receive_in_flight(c.schedule, c.p, c.m, c.v)[1].max())

    def arrays(self, c: Candidate, n_devices: int, global_batch: int, memory_limit: float,
               bandwidth: float, shard_state: bool, shares: np.ndarray | None = None):
        """(cost, tiebreak, memory, share, comm) for candidate c; see the module docstring.
        ``shares``: each stage's bytes (its rank's ``memory_limit`` split by
        ``shares_by_need``) in place of ``memory_limit / v`` each (:func:`_by_share`'s
        tables)."""
        d = n_devices // c.p
        b = global_batch / c.m
        # a stage's tables depend on it only through its micro-batches in flight: one
        # table per distinct count (one for GPipe and zero bubble), shared by its stages
        counts, which = np.unique(in_flight(c.schedule, c.p, c.m, c.v), return_inverse=True)
        which = which.reshape(-1)
        actions = 3 if c.schedule == "zero-bubble" else 2
        # a stage's micro-batch takes its device time or its host's dispatch of its calls,
        # whichever is longer (``stage_dp``'s host rule; 0 host on CPU ranks)
        time = np.where(self.valid, np.maximum(self.time * b / d + self.fixed + self.floors(b / d)
                                               + self.latency + actions * self.costs.action_time,
                                               self.host), INF)
        values = value_buffers(c, counts, which)
        memory = Memory(self.state / (d if shard_state else 1) + self.buffer_base(c) * b / d,
                        self.act * b / d, counts, which, self.recv_values * b / d, values)
        comm = self.boundary * b / d / bandwidth          # one way, per micro-batch
        if shares is not None:
            cost = _by_share(time, memory, self.valid, which, shares)
            return cost, Tiebreak(cost, time, 2 * comm), memory, shares, comm
        share = memory_limit / c.v
        # float sums at the limit fit; table u holds where the u-th least count fits
        fits = memory.fitting(share * (1 + 1e-9), self.valid)
        cost = FitStack(time, [fits], [(u, 0) for u in range(len(counts))], which)
        return cost, Tiebreak(cost, time, 2 * comm), memory, share, comm


def value_buffers(c: Candidate, counts: np.ndarray, which: np.ndarray) -> np.ndarray:
    """Micro-batches of received values a stage holds beside ``counts[which[k]]``
    micro-batches of activations in flight (stage k): per count, the most any stage of it
    holds (``receive_in_flight``), raised to the most of every lower count (the table
    wants them non-decreasing with the counts: :class:`Memory`)."""
    values = receive_in_flight(c.schedule, c.p, c.m, c.v)[0]
    out = np.zeros(len(counts))
    np.maximum.at(out, which, values)
    return np.maximum.accumulate(out)


class Memory:
    """The (S, L+1, L+1) memory table ``state + n_k * act + r_k * recv`` of S stages whose
    in-flight counts n_k are ``counts[which[k]]`` (``counts`` ascending) and whose received
    values' buffers r_k are ``recv_counts[which[k]]`` (non-decreasing with the counts; none
    without ``recv``), without building it: indexes (and converts by ``np.asarray``) as the
    full array would, with its floats."""

    def __init__(self, state: np.ndarray, act: np.ndarray, counts: np.ndarray, which: np.ndarray,
                 recv: np.ndarray | None = None, recv_counts: np.ndarray | None = None):
        self.state, self.act, self.counts = state, act, np.asarray(counts, dtype=float)
        self.recv = np.zeros_like(act) if recv is None else recv
        self.recv_counts = (np.zeros_like(self.counts) if recv_counts is None
                            else np.asarray(recv_counts, dtype=float))
        self.which = np.asarray(which).reshape(-1)
        self.shape = (len(self.which), *state.shape)

    def __getitem__(self, key):
        k, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        u = self.which[k]
        if np.ndim(u) == 0:
            return self.state[rest] + self.counts[u] * self.act[rest] + self.recv_counts[u] * self.recv[rest]
        return np.asarray(self)[key]

    def __array__(self, dtype=None, copy=None):
        w = self.which
        out = (self.state[None] + self.counts[w][:, None, None] * self.act[None]
               + self.recv_counts[w][:, None, None] * self.recv[None])
        return out if dtype is None else out.astype(dtype)

    def fitting(self, limit: float, valid: np.ndarray) -> np.ndarray:
        """fits[j, i]: how many of the counts (least first) keep layers j .. i-1 within
        ``limit`` where ``valid`` (0 elsewhere), exactly as comparing the table's floats
        would: there they grow with the count (a product and a sum of non-negative floats
        are monotone), so each entry's crossing count is found by a division (as if each
        received value's buffer came with an activation) and checked against the counts
        either side of it."""
        n, counts, rc = len(self.counts), self.counts, self.recv_counts
        state, act, recv = self.state[valid], self.act[valid], self.recv[valid]
        with np.errstate(divide="ignore", invalid="ignore"):
            crossing = (limit - state) / (act + recv)
        fits = np.searchsorted(counts, np.nan_to_num(crossing, nan=np.inf), side="right")

        def at(u):
            return state + counts[u] * act + rc[u] * recv
        for _ in range(2 * n + 2):
            low_ok = (fits == 0) | (at(np.maximum(fits - 1, 0)) <= limit)
            high_fits = (fits < n) & (at(np.minimum(fits, n - 1)) <= limit)
            if low_ok.all() and not high_fits.any():
                out = np.zeros(self.state.shape, dtype=np.int64)
                out[valid] = fits
                return out
            fits = fits - ~low_ok + high_fits
        raise AssertionError("stage memory is not monotone in the in-flight count")


def shares_by_need(c: Candidate, need: np.ndarray, memory_limit: float) -> np.ndarray | None:
    """Each stage's share of its rank's ``memory_limit``, in proportion to ``need`` (the
    bytes each stage holds under some cuts), or None where a rank's stages need more than
    the limit together. Any cut whose every stage stays within its share fits: a rank's
    shares sum to at most the limit. (``memory_limit / v`` each, the DP's first view,
    leaves a stage that holds more than the others, a V's first stage or an embedding, no
    room its rank's lighter stages do not use.)"""
    ranks = stage_ranks(c.schedule, c.p, c.v)
    total = np.bincount(ranks, weights=need, minlength=c.p)
    if (total > memory_limit * (1 + 1e-9)).any():
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(total[ranks] > 0, need * memory_limit / total[ranks], memory_limit / c.v)
        # rounded down to a step of SHARE_STEP, not below the need (a rank's still sum to at
        # most its limit, and the first cuts still fit), so that stages alike share one table
        # (``_by_share``)
        step = np.log1p(SHARE_STEP)
        grid = np.where(exact > 0, np.exp(np.floor(np.log(exact) / step) * step), 0.0)
    return np.maximum(need, np.minimum(grid, exact))


SHARE_STEP = 1 / 64
"""``shares_by_need`` rounds each stage's share down to a power of 1 + 1/64 (never below
what it holds under the first cuts): a rank's stages alike (layers cut evenly) get one
share, and the second DP one table for them."""


def _by_share(time: np.ndarray, memory: "Memory", valid: np.ndarray, which: np.ndarray,
              shares: np.ndarray) -> "FitStack":
    """The (S, L+1, L+1) ``Stack`` of each stage's ``time`` where its ``memory`` is within its
    own ``shares[k]``, INF elsewhere: one table per distinct (in-flight count, share) of the
    stages (``shares_by_need``'s are few: a rank's stages alike share one)."""
    levels, level = np.unique(shares, return_inverse=True)
    fits = [memory.fitting(x * (1 + 1e-9), valid) for x in levels]
    pairs, stage_class = np.unique(np.stack([which, level.reshape(-1)], axis=1), axis=0,
                                   return_inverse=True)
    return FitStack(time, fits, pairs, stage_class)


class Stack:
    """An (S, L+1, L+1) table of S stages held as its distinct tables ``tables`` (U, L+1,
    L+1) and each stage's ``which`` (S,): indexes as the full array would."""

    def __init__(self, tables: np.ndarray, which: np.ndarray):
        self.tables, self.which = tables, np.asarray(which).reshape(-1)
        self.shape = (len(self.which), *tables.shape[1:])

    def __getitem__(self, key):
        if isinstance(key, tuple):
            return self.tables[(self.which[key[0]], *key[1:])]
        return self.tables[self.which[key]]

    def __array__(self, dtype=None, copy=None):
        out = self.tables[self.which]
        return out if dtype is None else out.astype(dtype)

    def table(self, u) -> np.ndarray:
        """Table u (of ``tables``)."""
        return self.tables[u]

    def widths(self) -> np.ndarray:
        """Per table, the most layers (i - j) of a finite entry, 0 where none."""
        rows = self.shape[1]
        span = np.arange(rows)[None, :] - np.arange(rows)[:, None]
        return np.array([int(span[np.isfinite(t)].max(initial=0)) for t in self.tables])


LAZY_TABLES = True
"""Whether a ``FitStack`` whose stages each have their own table works a table out when it
is read (False: all at once, as a ``Stack``; ``benchmarks/stage_tables_lazy.py`` times
both)."""


class FitStack(Stack):
    """The ``Stack`` whose table t is ``time`` where ``fits[level_t] > u_t``, INF elsewhere,
    ``pairs[t] = (u_t, level_t)``: :meth:`Tables.arrays`' cost (one ``fits``, table u for the
    u-th least in-flight count) and :func:`_by_share`'s (a ``fits`` per share). Where every
    stage has its own table (DualPipeV's 2p stages, each its own count: 64 tables of 1,025 x
    1,025 cut points, 537 MB, for Llama 3 405B's p = 32) a stage's table is worked out when
    read and not kept (:data:`LAZY_TABLES`); elsewhere, as a ``Stack``, all at once."""

    def __init__(self, time: np.ndarray, fits: list, pairs, which: np.ndarray):
        self.time, self.fits = time, fits
        self.pairs = [(int(u), int(lv)) for u, lv in pairs]
        self.which = np.asarray(which).reshape(-1)
        self.shape = (len(self.which), *time.shape)
        self.one_each = LAZY_TABLES and len(np.unique(self.which)) == len(self.which)
        self._tables = None

    def mask(self, t, rest=()) -> np.ndarray:
        """Where table t is finite but for ``time``: ``fits[level_t] > u_t`` (at ``rest``)."""
        u, lv = self.pairs[t]
        return self.fits[lv][rest] > u

    @property
    def tables(self):
        if self._tables is None:
            self._tables = np.stack([np.where(self.mask(t), self.time, INF)
                                     for t in range(len(self.pairs))])
        return self._tables

    def table(self, t) -> np.ndarray:
        if self._tables is not None or not self.one_each:
            return self.tables[t]
        return np.where(self.mask(t), self.time, INF)

    def __getitem__(self, key):
        if self._tables is not None or not self.one_each:
            return super().__getitem__(key)
        k, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        t = self.which[k]
        if np.ndim(t) == 0:
            return np.where(self.mask(t, rest), self.time[rest], INF)
        return np.asarray(self)[key]

    def widths(self) -> np.ndarray:
        """Per table, the most layers (i - j) of a finite entry, 0 where none, without the
        tables: per ``fits``, the widest finite entry of each fit count, then table t's is
        the widest of counts above u_t."""
        rows = self.time.shape[0]
        span = np.arange(rows)[None, :] - np.arange(rows)[:, None]
        finite = np.isfinite(self.time)
        widest = {}
        for lv in sorted({lv for _, lv in self.pairs}):
            n = max(u for u, x in self.pairs if x == lv) + 1
            keep = finite & (self.fits[lv] > 0)
            top = np.zeros(n + 1, dtype=np.int64)        # top[f]: widest entry of fit count f
            np.maximum.at(top, np.minimum(self.fits[lv][keep], n), span[keep])
            widest[lv] = np.maximum.accumulate(top[::-1])[::-1]
        return np.array([widest[lv][u + 1] for u, lv in self.pairs], dtype=np.int64)


class Tiebreak(Stack):
    """``cost + plus`` (``plus`` along the last axis) of a ``FitStack`` ``cost`` over
    ``time``: indexes as that array would, and is built whole only when converted (the DP
    reads it through ``within``)."""

    def __init__(self, cost: FitStack, time: np.ndarray, plus: np.ndarray):
        self.cost, self.time, self.plus = cost, time, plus
        self.which, self.shape = cost.which, cost.shape

    @property
    def tables(self):
        return self.cost.tables + self.plus

    def table(self, t) -> np.ndarray:
        return self.cost.table(t) + self.plus

    def __getitem__(self, key):
        k, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if np.ndim(self.which[k]) == 0:
            return self.table(self.which[k])[rest]
        return np.asarray(self)[key]

    def within(self, limit: float):
        """k -> this table where ``cost[k] <= limit``, INF elsewhere; one table per
        distinct ``cost`` table (worked out when read where each stage has its own), the
        mask from ``cost``'s fit counts and where ``time`` is within."""
        inside, lifted, which = self.time <= limit, self.time + self.plus, self.which

        def one(t):
            return np.where(inside & self.cost.mask(t), lifted, INF)
        if self.cost.one_each:
            return lambda k: one(which[k])
        tables = [one(t) for t in range(len(self.cost.pairs))]
        return lambda k: tables[which[k]]


def price(c: Candidate, stage_times: np.ndarray, comm_cuts: np.ndarray,
           split: tuple[float, float, float]) -> tuple[float, float]:
    """(pipeline time, bubble fraction) of stage times under candidate c."""
    rank_time = rank_times(c.schedule, c.p, c.v, stage_times)
    busy = rank_time.sum()
    step = c.m * rank_time.max() + bubble_rho(c.schedule, c.v, split, c.p) * (busy - rank_time.max()) \
        + 2 * comm_cuts.sum()
    bubble = 1 - c.m * busy / (c.p * step) if step > 0 else 0.0
    return float(step), float(bubble)


def cut_latency(tensors, message_time: float):
    """Seconds a stage pays per micro-batch at one of its cuts crossed by ``tensors``
    tensors: each is a message forward (the value) and one backward (its gradient), each
    the link's latency ``message_time``. Both stages of the cut pay it (one sends, the
    other receives)."""
    return 2.0 * np.asarray(tensors, dtype=float) * message_time


def ring_factor(d: int) -> float:
    """A ring all-reduce over d devices moves 2 (d - 1) / d of the bytes through each link."""
    return 2 * (d - 1) / d
