"""Pipeline schedules as data.

A schedule is, per pipeline rank, the order in which that rank runs its compute actions.
An action prints the way torch.distributed.pipelining prints its ``_Action``:
``"2F0"`` is stage 2's forward of micro-batch 0. Kinds:

- ``F``  forward;
- ``B``  full backward (input and weight gradients together);
- ``I``  backward for the input gradient only (the zero-bubble paper's "B");
- ``W``  backward for the weight gradient only, deferred into the bubbles.

Kinds of schedule (``ScheduleKind``) and the torch class that runs each:

=====================  =====================================  =========================
kind                   order per rank                         torch class
=====================  =====================================  =========================
``gpipe``              all forwards, then all backwards       ``ScheduleGPipe``
``1f1b``               ``p - s`` forwards, then B/F pairs     ``Schedule1F1B``
``interleaved-1f1b``   Megatron-LM's depth-first order over   ``ScheduleInterleaved1F1B``
                       ``v`` virtual stages (model chunks)
                       per rank; stage ``k`` lives on rank
                       ``k mod p``
``zero-bubble``        1F1B with the backward split into I    ``ScheduleInterleavedZeroBubble``
                       and W; W of rank ``r`` trails by ``r``
                       micro-batches (ZB-H1 for ``v = 1``,
                       ZB1P for ``v > 1``)
``dualpipev``          DeepSeek's DualPipeV (DeepSeek-V3      ``ScheduleDualPipeV``
                       report, arXiv 2412.19437 sec. 3.2.1,
                       "cut in half"): V placement, exactly
                       two stages per rank; forward of one
                       micro-batch paired with the backward
                       of another in the steady state
=====================  =====================================  =========================

The interleaved and zero-bubble orders are the ones torch 2.13 computes in
``_calculate_single_rank_operations`` (tests compare them action by action), so what the
simulator times is what torch runs.

Placement (:func:`stage_ranks`): stage ``k`` of ``p * v`` lives on rank ``k mod p`` (the
loop placement), except under ``dualpipev``, whose ``2p`` stages sit in a V: stage ``k`` on
rank ``k`` for ``k < p`` and on rank ``2p - 1 - k`` otherwise (torch's
``generate_stage_to_rank_mapping(style="v")``), so rank 0 holds the first and the last
stage and the middle boundary (stage ``p - 1`` to ``p``) stays on rank ``p - 1``.

DualPipeV's steady state lists a pair "forward of one micro-batch on one local stage,
full backward of another on the other" (torch's ``OVERLAP_F_B`` action). torch 2.13's
``_PipelineScheduleRuntime`` runs the pair's two sub-actions one after the other (F, then
B) unless a caller registers its own function for ``OVERLAP_F_B``
(``register_custom_function``); autopar registers one where a stage's experts dispatch by
all-to-all (``runtime.overlap``: the two halves at once). The pair is listed here as its F
then its B (:func:`overlap_pairs` names them), and timed so, less what the pricing hides
of each half's expert all-to-all behind the other's compute where the runtime overlaps
(``solver.pipeline_price``). ``ScheduleZBVZeroBubble`` (the same V placement) is not
generated here.

>>> grid = schedule_actions("1f1b", n_stages=2, n_microbatches=3)
>>> [str(a) for a in grid[1]]
['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from autopar.errors import ArgumentError

ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleKind)

ActionKind = Literal["F", "B", "I", "W"]
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")

_TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}

V_SHAPED = frozenset({"dualpipev"})
"""Schedules whose two stages per rank sit in a V (:func:`stage_ranks`)."""


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: ``stage`` runs ``kind`` on micro-batch ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def from_str(text: str) -> "Action":
        """Inverse of ``str``: ``Action.from_str("2F0") == Action(2, "F", 0)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ArgumentError(f"cannot parse action {text!r}: expected <stage><F|B|I|W><microbatch>, e.g. '2F0'")
        return Action(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


def check_schedule(kind: str, n_stages: int, n_microbatches: int, virtual: int = 1) -> None:
    """Raise ValueError if ``kind`` cannot run ``n_stages`` pipeline ranks, ``virtual``
    stages per rank and ``n_microbatches`` micro-batches (the same conditions torch checks).

    ``n_stages`` counts pipeline ranks; the model is cut into ``n_stages * virtual`` stages.
    """
    if kind not in SCHEDULES:
        raise ArgumentError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or n_microbatches < 1 or virtual < 1:
        raise ArgumentError(f"n_stages ({n_stages}), n_microbatches ({n_microbatches}) and "
                            f"virtual ({virtual}) must all be >= 1")
    if kind in V_SHAPED:
        if virtual != 2:
            raise ArgumentError(f"schedule {kind!r} runs exactly two stages per rank (V placement), "
                                f"got virtual={virtual}; use virtual=2 (the model is cut into "
                                f"2 x {n_stages} stages)")
        if n_microbatches < 2 * n_stages:
            raise ArgumentError(f"schedule {kind!r} needs at least as many micro-batches as stages "
                                f"(2 per rank): got {n_microbatches} micro-batches for {2 * n_stages} "
                                f"stages on {n_stages} ranks (use m >= {2 * n_stages})")
        return
    if kind in ("gpipe", "1f1b") and virtual != 1:
        raise ArgumentError(f"schedule {kind!r} runs one stage per rank, got virtual={virtual}; "
                            "use 'interleaved-1f1b' for virtual stages")
    if kind in ("1f1b", "zero-bubble") and n_microbatches < n_stages:
        raise ArgumentError(f"schedule {kind!r} needs at least as many micro-batches as pipeline "
                            f"stages: got {n_microbatches} micro-batches for {n_stages} stages "
                            f"(use m >= {n_stages}, or 'gpipe')")
    if kind in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, n_microbatches // n_stages)
        if n_microbatches % rounds:
            raise ArgumentError(f"schedule {kind!r} needs the micro-batch count to be a multiple of "
                                f"its rounds max(1, m // p) = {rounds}: got m={n_microbatches} for "
                                f"p={n_stages} (use a multiple of {n_stages}, or m < {n_stages})")


def schedule_actions(kind: str, n_stages: int, n_microbatches: int,
                     virtual: int = 1) -> list[list[Action]]:
    """Compute actions per rank, in execution order, for ``n_stages`` pipeline ranks.

    Stage ``k`` (``0 <= k < n_stages * virtual``) lives on rank ``stage_ranks(...)[k]``.
    """
    check_schedule(kind, n_stages, n_microbatches, virtual)
    p, m, v = n_stages, n_microbatches, virtual
    if kind == "dualpipev":
        return [_dual_pipe_v(r, p, m) for r in range(p)]
    if kind == "gpipe":
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                for r in range(p)]
    if kind == "1f1b":
        return [_one_f_one_b(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, v, zero_bubble=(kind == "zero-bubble")) for r in range(p)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    """``min(m, p - rank)`` forwards, then backward/forward pairs, then the backwards left."""
    warmup = min(m, p - rank)
    ops = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m):
        ops.append(Action(rank, "B", i))
        if warmup + i < m:
            ops.append(Action(rank, "F", warmup + i))
    return ops


def _interleaved(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    """Megatron-LM's interleaved order (torch's flexible variant, m need not be a multiple of p).

    Micro-batches go in rounds of ``per_round``; the k-th forward on this rank runs local
    chunk ``(k // per_round) % v``, the k-th backward chunk ``v - 1 - (k // per_round) % v``.
    Warm-up forwards: ``(v - 1) * per_round + f * (p - 1 - rank)`` with f = 2 (1F1B) or
    1 (zero bubble). Zero bubble splits B into I and W and starts issuing W after ``rank``
    steady-state steps, each W for the oldest I without one.
    """
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    back = "I" if zero_bubble else "B"
    f_next = [0] * v       # next micro-batch per local chunk, forward
    b_next = [0] * v       # next micro-batch per local chunk, backward
    pending_w: list[Action] = []
    ops: list[Action] = []

    def forward(k: int) -> None:
        chunk = (k // per_round) % v
        ops.append(Action(chunk * p + rank, "F", f_next[chunk]))
        f_next[chunk] += 1

    def backward(k: int) -> None:
        chunk = v - 1 - (k // per_round) % v
        action = Action(chunk * p + rank, back, b_next[chunk])
        b_next[chunk] += 1
        ops.append(action)
        if zero_bubble:
            pending_w.append(Action(action.stage, "W", action.microbatch))
            if k >= rank:
                ops.append(pending_w.pop(0))

    for k in range(warmup):
        forward(k)
    for k in range(total):
        if warmup + k < total:
            forward(warmup + k)
        backward(k)
    ops.extend(pending_w)
    return ops


def stage_ranks(kind: str, n_stages: int, virtual: int = 1) -> list[int]:
    """The pipeline rank of each of the ``n_stages * virtual`` stages: ``k mod p`` (loop),
    or the V of :data:`V_SHAPED` schedules (``k`` for ``k < p``, ``2p - 1 - k`` after).

    >>> stage_ranks("dualpipev", 3, 2), stage_ranks("interleaved-1f1b", 3, 2)
    ([0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2])
    """
    p = n_stages
    if kind in V_SHAPED:
        return [k if k < p else 2 * p - 1 - k for k in range(p * virtual)]
    return [k % p for k in range(p * virtual)]


def rank_stages(kind: str, n_stages: int, virtual: int = 1) -> list[list[int]]:
    """Per rank, its stages in increasing order (inverse of :func:`stage_ranks`)."""
    out: list[list[int]] = [[] for _ in range(n_stages)]
    for k, r in enumerate(stage_ranks(kind, n_stages, virtual)):
        out[r].append(k)
    return out


def overlap_pairs(kind: str, n_stages: int, n_microbatches: int) -> list[list[tuple[Action, Action]]]:
    """Per rank, the (forward, backward) pairs torch runs as one ``OVERLAP_F_B`` action
    (DualPipeV's steps 4 and 5, :func:`_dual_pipe_v`), each listed by
    :func:`schedule_actions` as its F then its B; none for other schedules.

    >>> [[(str(f), str(b)) for f, b in r] for r in overlap_pairs("dualpipev", 2, 4)][0]
    [('0F3', '3B1'), ('3F2', '0B0'), ('3F3', '0B1')]
    """
    if kind != "dualpipev":
        return [[] for _ in range(n_stages)]
    check_schedule(kind, n_stages, n_microbatches, 2)
    out: list[list[tuple[Action, Action]]] = []
    for r in range(n_stages):
        pairs: list[tuple[Action, Action]] = []
        _dual_pipe_v(r, n_stages, n_microbatches, pairs)
        out.append(pairs)
    return out


def _dual_pipe_v(rank: int, p: int, m: int, pairs: list | None = None) -> list[Action]:
    """DualPipeV's order on ``rank`` of ``p`` for ``m >= 2p`` micro-batches, as torch 2.13's
    ``ScheduleDualPipeV._calculate_single_rank_operations`` builds it (DeepSeek's
    ``dualpipev.py``), its ``OVERLAP_F_B`` pairs listed as their F then their B (what torch
    runs, see the module docstring). The rank holds stages ``s0 = rank`` (going down the V)
    and ``s1 = 2p - 1 - rank`` (coming back up); in eight steps:

    1. ``2 (p - 1 - rank)`` forwards of s0;  2. ``rank + 1`` pairs F(s0) F(s1);
    3. ``p - 1 - rank`` times I(s1), the oldest pending W, F(s1);
    4. ``m - 2p + rank + 1`` times [F(s0) B(s1)] [F(s1) B(s0)] (the last rank's first
       F(s0) B(s1) not a pair: torch runs it unpaired "to further reduce bubble size");
    5. ``p - 1 - rank`` times B(s1), [F(s1) B(s0)];
    6. ``rank + 1`` pairs B(s1) B(s0), from the middle pair on split into I (zero bubble;
       the switch falls after B(s1) on odd ranks, before it on even ones);
    7. ``p - 1 - rank`` times the oldest pending W, then s0's backward (I once split);
    8. ``rank + 1`` pending Ws.

    A full backward B of (s, i) counts as both its I and its W; the W queue holds only the
    Is' weight halves, oldest first. ``pairs``: given, the bracketed pairs of 4 and 5 (torch's
    ``OVERLAP_F_B`` actions) are appended to it as (F, B).
    """
    s0, s1 = rank, 2 * p - 1 - rank
    ops: list[Action] = []
    nxt: dict[tuple[int, str], int] = {}        # (stage, F | I) -> next micro-batch
    weights: list[Action] = []                  # W pending behind an I, oldest first

    def add(stage: int, kind: str) -> None:
        key = (stage, "F" if kind == "F" else "I")
        i = nxt.get(key, 0)
        nxt[key] = i + 1
        ops.append(Action(stage, kind, i))      # type: ignore[arg-type]
        if kind == "I":
            weights.append(Action(stage, "W", i))

    def pending_weight() -> None:
        if weights:
            ops.append(weights.pop(0))

    for _ in range(2 * (p - 1 - rank)):                 # 1
        add(s0, "F")
    for _ in range(rank + 1):                           # 2
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - 1 - rank):                       # 3
        add(s1, "I")
        pending_weight()
        add(s1, "F")
    def pair(f: int, b: int) -> None:
        add(f, "F")
        add(b, "B")
        if pairs is not None:
            pairs.append((ops[-2], ops[-1]))

    for k in range(m - 2 * p + rank + 1):               # 4
        if k == 0 and rank == p - 1:        # torch: not overlapped, "to reduce bubble size"
            add(s0, "F")
            add(s1, "B")
        else:
            pair(s0, s1)
        pair(s1, s0)
    for _ in range(p - 1 - rank):                       # 5
        add(s1, "B")
        pair(s1, s0)
    split = False
    half = (rank + 1) // 2
    for k in range(rank + 1):                           # 6
        if k == half and rank % 2 == 1:
            split = True
        add(s1, "I" if split else "B")
        if k == half and rank % 2 == 0:
            split = True
        add(s0, "I" if split else "B")
    for _ in range(p - 1 - rank):                       # 7
        pending_weight()
        add(s0, "I" if split else "B")
    for _ in range(rank + 1):                           # 8
        pending_weight()
    return ops


def torch_schedule_class(kind: str) -> type:
    """The torch.distributed.pipelining class that runs schedule ``kind``."""
    if kind not in _TORCH_CLASS:
        raise ArgumentError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    # lazy: importing torch.distributed.pipelining takes seconds (it loads torch.distributed)
    # and planning, which only names the class, never needs it
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, _TORCH_CLASS[kind])


LOWERED = frozenset({"interleaved-1f1b", "zero-bubble", "dualpipev"})
"""Schedules torch runs from a lowered program (``_PipelineScheduleRuntime``: compute and
communication actions in one list per rank), whose receives :func:`lowered_program` lists."""


class _PlaceholderStage:
    """What a torch schedule class reads of its stages to build its program (their index,
    count and rank), without a module, a device or a process group."""

    def __init__(self, index: int, n_stages: int, rank: int, ranks: int):
        self.stage_index, self.num_stages = index, n_stages
        self.group_rank, self.group_size = rank, ranks
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.has_backward, self.submod = True, None


def lowered_program(kind: str, n_stages: int, n_microbatches: int,
                    virtual: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank, the compute actions and receives torch's runtime runs in order, as
    (op, stage, micro-batch) with op one of ``F B I W RECV_F RECV_B`` (an ``OVERLAP_F_B``
    pair as its F then its backward; sends and FSDP's unshard/reshard left out), for the
    :data:`LOWERED` schedules: the program torch's own class lowers
    (``_PipelineScheduleRuntime._prepare_schedule_with_comms``: a receive goes into the
    receiver's list when its sender's action is placed, as early as the deadlock-free
    order allows), built over placeholder stages, so where each receive is posted is
    torch's placement, not a copy of it."""
    if kind not in LOWERED:
        raise ArgumentError(f"schedule {kind!r} runs no lowered program (one of "
                            f"{', '.join(sorted(LOWERED))} does)")
    check_schedule(kind, n_stages, n_microbatches, virtual)
    p, v = n_stages, virtual
    ranks = stage_ranks(kind, p, v)
    cls = torch_schedule_class(kind)
    from torch.distributed.pipelining import schedules as torch_schedules
    ops = {getattr(torch_schedules, name): op for name, op in (
        ("FORWARD", "F"), ("FULL_BACKWARD", "B"), ("BACKWARD_INPUT", "I"),
        ("BACKWARD_WEIGHT", "W"), ("RECV_F", "RECV_F"), ("RECV_B", "RECV_B"))}
    # every rank's program is built by every rank's schedule object: rank 0's will do
    stages = [_PlaceholderStage(k, p * v, 0, p) for k in range(p * v) if ranks[k] == 0]
    program = cls(stages, n_microbatches=n_microbatches, loss_fn=None).pipeline_order_with_comms
    out: list[list[tuple[str, int, int]]] = []
    for r in range(p):
        listed = []
        for a in program[r]:
            for b in (a.sub_actions or (a,)) if a is not None else ():
                if b.computation_type in ops:
                    listed.append((ops[b.computation_type], b.stage_index, b.microbatch_index))
        out.append(listed)
    return out
