"""Per-rank timeline of a pipeline schedule.

Each rank runs its actions in the schedule's order, one at a time, each as early as its
dependencies allow (stage ``s``, micro-batch ``i``):

- ``F(s, i)`` after ``F(s-1, i)`` has ended and its activation has crossed the link;
- ``B(s, i)`` / ``I(s, i)`` after ``F(s, i)``, and after ``B``/``I`` of ``(s+1, i)`` plus the
  transfer of its gradient back;
- ``W(s, i)`` after ``I(s, i)``.

A transfer costs ``p2p`` seconds when the two stages sit on different ranks and nothing on
the same rank; it occupies the link, not the ranks' compute. A stage holds a micro-batch's
activations from the start of its ``F`` to the end of its last backward (``B``, or ``W``
when the backward is split), which gives the in-flight count that sets activation memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.schedule import Action


@dataclass(frozen=True)
class Simulation:
    """Result of ``simulate``. Times in seconds from the start of the step."""

    makespan: float
    utilization: float                 # busy area / (ranks x makespan)
    bubble_fraction: float             # 1 - utilization
    busy: tuple[float, ...]            # compute time per rank
    peak_in_flight: tuple[int, ...]    # per stage: most micro-batches whose activations it holds
    rank_peak_in_flight: tuple[int, ...]  # per rank: most (stage, micro-batch) pairs held at once
    timeline: tuple[dict, ...]         # {"rank", "action", "stage", "kind", "microbatch", "start", "end"}


def _per_stage(values, n_stages: int, name: str) -> np.ndarray:
    arr = np.broadcast_to(np.asarray(values, dtype=float), (n_stages,)) if np.ndim(values) == 0 \
        else np.asarray(values, dtype=float)
    if arr.shape != (n_stages,):
        raise ValueError(f"{name} has {arr.shape[0]} entries for {n_stages} stages")
    if (arr < 0).any():
        raise ValueError(f"{name} must be >= 0, got {arr.tolist()}")
    return arr


def _stage_ranks(actions: Sequence[Sequence[Action]]) -> dict[int, int]:
    ranks: dict[int, int] = {}
    for r, rank_actions in enumerate(actions):
        for a in rank_actions:
            if ranks.setdefault(a.stage, r) != r:
                raise ValueError(f"stage {a.stage} has actions on ranks {ranks[a.stage]} and {r}")
    return ranks


def _dependencies(a: Action, n_stages: int) -> list[tuple[Action | tuple, int | None]]:
    """(action it waits for, boundary crossed or None) pairs; a tuple names 'B or I'."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [(Action(s - 1, "F", i), s - 1)] if s > 0 else []
    if a.kind in ("B", "I"):
        deps: list = [(Action(s, "F", i), None)]
        if s < n_stages - 1:
            deps.append((("grad", s + 1, i), s))
        return deps
    return [(Action(s, "I", i), None)]


@dataclass(frozen=True)
class Compiled:
    """A schedule's dependency structure, worked out once whatever the durations: actions
    numbered in rank order (``flat``), each one's predecessor on its rank (``prev``, -1 for
    the first), what it waits for (``dep``: the action before it, an F's on the previous
    stage, or a backward's F; ``grad``: a backward's next-stage gradient; -1 for none) and
    the boundary each crosses (``link``, ``grad_link``: -1 when the transfer is free), where its duration sits in the concatenated F, B, I, W per-stage
    arrays (``slot``), a topological order of the actions that can run (``order``) and how
    many of each rank's actions that is (``done``: fewer than it lists when it deadlocks).
    Timing along any topological order gives the same times, so one order serves every
    set of durations (``stage_dp.simulate_plan`` keeps one per schedule)."""
    actions: tuple
    flat: tuple
    n_stages: int
    kinds: frozenset
    prev: tuple
    dep: tuple
    link: tuple
    grad: tuple
    grad_link: tuple
    slot: tuple
    order: tuple
    done: tuple

    @property
    def deadlocked(self) -> bool:
        return any(d < len(x) for d, x in zip(self.done, self.actions))


_KINDS = "FBIW"


def compile_schedule(actions: Sequence[Sequence[Action]]) -> Compiled:
    """``actions``' :class:`Compiled` structure (raises on an action listed twice or one
    that waits for an action no rank runs). The dependencies are looked up in one array
    indexed by (kind, stage, micro-batch); only the topological order is a Python loop (sweeps
    over the ranks, no per-action successor lists)."""
    ranks = _stage_ranks(actions)
    n_stages = max(ranks) + 1 if ranks else 0
    flat = [a for rank_actions in actions for a in rank_actions]
    n_actions = len(flat)
    stage = np.fromiter((a.stage for a in flat), dtype=np.int64, count=n_actions)
    kind = np.fromiter((_KINDS.index(a.kind) for a in flat), dtype=np.int64, count=n_actions)
    micro = np.fromiter((a.microbatch for a in flat), dtype=np.int64, count=n_actions)
    rank_of = np.repeat(np.arange(len(actions)), [len(x) for x in actions])
    index = np.full((len(_KINDS), n_stages, int(micro.max(initial=-1)) + 1), -1, dtype=np.int64)
    number = np.arange(n_actions)
    index[kind, stage, micro] = number
    if (index[kind, stage, micro] != number).any():
        raise ValueError("schedule lists an action twice")
    first = np.zeros(n_actions, dtype=bool)
    first[np.cumsum([0] + [len(x) for x in actions])[:-1][[len(x) > 0 for x in actions]]] = True
    prev = np.where(first, -1, number - 1)
    stage_rank = np.array([ranks.get(s, -1) for s in range(n_stages)], dtype=np.int64)
    up, down = np.maximum(stage - 1, 0), np.minimum(stage + 1, max(n_stages - 1, 0))
    is_f, is_w = kind == 0, kind == 3
    is_bi = (kind == 1) | (kind == 2)
    # dependency 0: F <- F of the stage before (none on stage 0); B / I <- F; W <- I
    dep0 = np.where(is_f, index[0, up, micro], np.where(is_bi, index[0, stage, micro],
                                                        index[2, stage, micro]))
    has0 = ~(is_f & (stage == 0))
    free0 = ~is_f | (stage_rank[up] == rank_of)
    # dependency 1: B / I <- the next stage's gradient (its B, or I when split)
    grad = np.where(index[1, down, micro] >= 0, index[1, down, micro], index[2, down, micro])
    has1 = is_bi & (stage < n_stages - 1)
    free1 = stage_rank[down] == rank_of
    missing = (has0 & (dep0 < 0)) | (has1 & (grad < 0))
    if missing.any():
        n = int(np.argmax(missing))
        k = 0 if has0[n] and dep0[n] < 0 else 1
        dep = _dependencies(flat[n], n_stages)[k][0]
        raise ValueError(f"action {flat[n]} on rank {int(rank_of[n])} depends on {dep}, which no rank runs")
    # -1 (no dependency, or a free transfer) reads a sentinel past the end of every list
    d0 = np.where(has0, dep0, -1).tolist()
    d1 = np.where(has1, grad, -1).tolist()
    b0 = np.where(has0 & ~free0, stage - 1, -1).tolist()
    b1 = np.where(has1 & ~free1, stage, -1).tolist()
    prev = prev.tolist()

    # a topological order: sweep the ranks up (activations flow to later ranks) and down
    # (gradients to earlier ones), each running its next actions while their inputs ran
    ran = [False] * n_actions + [True]
    bounds = np.cumsum([0] + [len(x) for x in actions]).tolist()
    pos, ends = bounds[:-1], bounds[1:]
    sweep = list(range(len(actions))) + list(range(len(actions) - 1, -1, -1))
    order: list[int] = []
    progress = True
    while progress:
        progress = False
        for r in sweep:
            n, end = pos[r], ends[r]
            while n < end and ran[d0[n]] and ran[d1[n]]:
                ran[n] = True
                order.append(n)
                n += 1
            if n != pos[r]:
                pos[r] = n
                progress = True
    done = tuple(q - b for q, b in zip(pos, bounds))
    return Compiled(actions=tuple(tuple(x) for x in actions), flat=tuple(flat), n_stages=n_stages,
                    kinds=frozenset(a.kind for a in flat), prev=tuple(prev), dep=tuple(d0),
                    link=tuple(b0), grad=tuple(d1), grad_link=tuple(b1),
                    slot=tuple((kind * n_stages + stage).tolist()), order=tuple(order), done=done)


def _times(comp: Compiled, dur: dict[str, np.ndarray], p2p: np.ndarray,
           starts: bool = True, less: list[float] | None = None) -> tuple[list[float] | None, list[float]]:
    """(start, end) of every action of ``comp`` by number (unset for those a deadlock
    leaves unrun); ``starts=False`` skips the starts; ``less``: seconds off each action's
    duration, by number (:func:`simulate`'s ``hidden``)."""
    table = [float(x) for k in _KINDS
             for x in np.broadcast_to(np.asarray(dur.get(k, 0.0), dtype=float), (comp.n_stages,))]
    links = [float(x) for x in np.asarray(p2p, dtype=float).ravel()] + [0.0]   # [-1]: free
    prev, dep, link, grad, grad_link, slot = \
        comp.prev, comp.dep, comp.link, comp.grad, comp.grad_link, comp.slot
    t_start = [0.0] * len(slot) if starts else None
    t_end = [0.0] * (len(slot) + 1)            # [-1]: no predecessor, ended at 0
    for n in comp.order:
        t = max(t_end[prev[n]], t_end[dep[n]] + links[link[n]], t_end[grad[n]] + links[grad_link[n]])
        if starts:
            t_start[n] = t
        t_end[n] = t + table[slot[n]] - (less[n] if less is not None else 0.0)
    del t_end[-1]
    return t_start, t_end


def _run(actions: Sequence[Sequence[Action]], dur: dict[str, np.ndarray],
         p2p: np.ndarray) -> tuple[dict[Action, float], dict[Action, float], list[int]]:
    """Start/end of every action (Kahn's order over rank order + data dependencies).
    Actions are numbered in rank order and worked on by number (a large schedule has
    hundreds of thousands; hashing the dataclass each time was most of the cost)."""
    comp = compile_schedule(actions)
    t_start, t_end = _times(comp, dur, p2p)
    flat = comp.flat
    start = {flat[n]: t_start[n] for n in comp.order}
    end = {flat[n]: t_end[n] for n in comp.order}
    return start, end, list(comp.done)


def _deadlock_message(actions, done) -> str:
    blocked = [f"rank {r} waits at {actions[r][d]}" for r, d in enumerate(done) if d < len(actions[r])]
    ran = [list(rank_actions[:d]) for rank_actions, d in zip(actions, done)]
    step = sum(done)
    grid = format_grid(ran) if any(ran) else "(nothing ran)"
    return (f"schedule deadlocks after {step} actions: " + "; ".join(blocked) +
            f"\nactions that ran (unit steps):\n{grid}")


def unit_steps(actions: Sequence[Sequence[Action]]) -> list[list[int]]:
    """Step index of every action when each takes one step and transfers are free."""
    n_stages = max(_stage_ranks(actions)) + 1
    ones = {k: np.ones(n_stages) for k in "FBIW"}
    start, _, done = _run(actions, ones, np.zeros(max(n_stages - 1, 1)))
    if any(d < len(x) for d, x in zip(done, actions)):
        raise ValueError(_deadlock_message(actions, done))
    return [[int(start[a]) for a in rank_actions] for rank_actions in actions]


def simulate(actions: Sequence[Sequence[Action]], forward, backward, weight=None,
             p2p=0.0, hidden: dict[Action, float] | None = None) -> Simulation:
    """Time ``actions`` (per rank, as ``schedule_actions`` returns them).

    ``forward[s]`` and ``backward[s]`` are stage ``s``'s forward and full backward times for
    one micro-batch (scalars broadcast). A split backward runs ``I`` for
    ``backward - weight`` and ``W`` for ``weight``; ``weight`` is required when the schedule
    has ``I``/``W`` actions. ``p2p[s]`` (or a scalar) is the transfer time across the
    boundary between stages ``s`` and ``s + 1``, each way. ``hidden[a]``: seconds off action
    ``a``'s duration (at most its duration): the part of a DualPipeV pair that runs at once
    with the other half (``solver.pipeline_price.pair_hidden``).

    >>> from autopar.schedule import schedule_actions
    >>> sim = simulate(schedule_actions("gpipe", 4, 4), forward=1.0, backward=2.0)
    >>> round(sim.bubble_fraction, 4)   # (p - 1) / (m + p - 1)
    0.4286
    """
    start, end = _timed(actions, forward, backward, weight, p2p, hidden)
    ranks = _stage_ranks(actions)
    n_stages = max(ranks) + 1
    makespan = max(end.values())
    busy = tuple(float(sum(end[a] - start[a] for a in rank_actions)) for rank_actions in actions)
    area = len(actions) * makespan
    utilization = sum(busy) / area if area > 0 else 1.0
    timeline = tuple(
        {"rank": r, "action": str(a), "stage": a.stage, "kind": a.kind,
         "microbatch": a.microbatch, "start": start[a], "end": end[a]}
        for r, rank_actions in enumerate(actions) for a in rank_actions)
    return Simulation(makespan=float(makespan), utilization=float(utilization),
                      bubble_fraction=float(1.0 - utilization), busy=busy,
                      peak_in_flight=_peak_in_flight(start, end, [[s] for s in range(n_stages)]),
                      rank_peak_in_flight=_peak_in_flight(
                          start, end, [sorted(s for s, r in ranks.items() if r == rank)
                                       for rank in range(len(actions))]),
                      timeline=timeline)


def makespan(actions: Sequence[Sequence[Action]], forward, backward, weight=None,
             p2p=0.0) -> float:
    """``simulate(...).makespan`` alone (no timeline, no in-flight counts): what a search
    ranking many schedules reads."""
    return makespan_compiled(compile_schedule(actions), forward, backward, weight, p2p)


def makespan_compiled(comp: Compiled, forward, backward, weight=None, p2p=0.0) -> float:
    """:func:`makespan` of a :func:`compile_schedule` structure, kept by a caller that
    times one schedule under many durations."""
    if comp.deadlocked:
        raise ValueError(_deadlock_message(comp.actions, comp.done))
    dur, links = _durations(comp, forward, backward, weight, p2p)
    return float(max(_times(comp, dur, links, starts=False)[1]))


def _durations(comp: Compiled, forward, backward, weight, p2p):
    """({kind: per-stage seconds}, per-boundary transfer seconds), checked."""
    if not comp.flat:
        raise ValueError("empty schedule")
    n_stages = comp.n_stages
    f = _per_stage(forward, n_stages, "forward")
    b = _per_stage(backward, n_stages, "backward")
    if comp.kinds & {"I", "W"}:
        if weight is None:
            raise ValueError("schedule splits the backward into I and W: pass weight= "
                             "(the weight-gradient part of each stage's backward)")
        w = _per_stage(weight, n_stages, "weight")
        if (w > b).any():
            raise ValueError(f"weight time exceeds the full backward time on stages "
                             f"{np.flatnonzero(w > b).tolist()}")
    else:
        w = np.zeros(n_stages)
    links = _per_stage(p2p, max(n_stages - 1, 1), "p2p")
    return {"F": f, "B": b, "I": b - w, "W": w}, links


def _timed(actions: Sequence[Sequence[Action]], forward, backward, weight, p2p, hidden=None):
    """(start, end) of every action (``simulate``'s arguments, checked)."""
    comp = compile_schedule(actions)
    dur, links = _durations(comp, forward, backward, weight, p2p)
    if comp.deadlocked:
        raise ValueError(_deadlock_message(actions, comp.done))
    less = None
    if hidden:
        less = [float(hidden.get(a, 0.0)) for a in comp.flat]
        if min(less) < 0:
            raise ValueError(f"hidden seconds must be >= 0, got {min(less)}")
    t_start, t_end = _times(comp, dur, links, less=less)
    flat = comp.flat
    return {flat[n]: t_start[n] for n in comp.order}, {flat[n]: t_end[n] for n in comp.order}


def _peak_in_flight(start: dict[Action, float], end: dict[Action, float],
                    groups: list[list[int]]) -> tuple[int, ...]:
    """Per group of stages, the most (stage, micro-batch) activations held at once: from
    F's start to the end of the last backward (B, or W when split)."""
    group_of = {s: g for g, stages in enumerate(groups) for s in stages}
    events: list[list[tuple[float, int]]] = [[] for _ in groups]
    for a, t in start.items():
        if a.kind == "F":
            events[group_of[a.stage]].append((t, 1))
    for a, t in end.items():
        if a.kind in ("B", "W"):
            events[group_of[a.stage]].append((t, -1))
    peaks = []
    for ev in events:
        held = peak = 0
        for _, delta in sorted(ev):      # at equal times a release (-1) sorts before an F (+1)
            held += delta
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def format_grid(actions: list[list[Action]], error_step: int | None = None) -> str:
    """A step x rank table of the schedule, as torch.distributed.pipelining prints it.

    Steps come from a unit-time run of the schedule (every action takes one step, transfers
    are free), so a rank's empty cell is a step it waits. ``error_step`` marks one row.
    """
    steps = unit_steps(actions)
    n_steps = 1 + max((s for rank in steps for s in rank), default=-1)
    cells = [[""] * len(actions) for _ in range(n_steps)]
    for r, (rank_actions, rank_steps) in enumerate(zip(actions, steps)):
        for a, s in zip(rank_actions, rank_steps):
            cells[s][r] = str(a)
    width = max([len("Rank 00")] + [len(c) for row in cells for c in row])
    label = len(f"Step {n_steps - 1}")
    header = " " * (label + 2) + " ".join(f"Rank {r}".ljust(width) for r in range(len(actions)))
    lines = [header.rstrip()]
    for s, row in enumerate(cells):
        line = (f"Step {s:0{len(str(n_steps - 1))}d}: " + " ".join(c.ljust(width) for c in row)).rstrip()
        lines.append(line + (" <-- ERROR HERE" if s == error_step else ""))
    return "\n".join(lines)
