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
=====================  =====================================  =========================

The interleaved and zero-bubble orders are the ones torch 2.13 computes in
``_calculate_single_rank_operations`` (tests compare them action by action), so what the
simulator times is what torch runs. ``ScheduleZBVZeroBubble`` (V-shaped placement, exactly
two stages per rank) is not generated here.

>>> grid = schedule_actions("1f1b", n_stages=2, n_microbatches=3)
>>> [str(a) for a in grid[1]]
['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from autopar.errors import ArgumentError

ScheduleKind = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleKind)

ActionKind = Literal["F", "B", "I", "W"]
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")

_TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


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

    Stage ``k`` (``0 <= k < n_stages * virtual``) lives on rank ``k % n_stages``.
    """
    check_schedule(kind, n_stages, n_microbatches, virtual)
    p, m, v = n_stages, n_microbatches, virtual
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


def torch_schedule_class(kind: str) -> type:
    """The torch.distributed.pipelining class that runs schedule ``kind``."""
    if kind not in _TORCH_CLASS:
        raise ArgumentError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    # lazy: importing torch.distributed.pipelining takes seconds (it loads torch.distributed)
    # and planning, which only names the class, never needs it
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, _TORCH_CLASS[kind])
