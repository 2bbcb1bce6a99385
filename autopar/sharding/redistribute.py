"""How a tensor moves from one placement to another: a list of steps, one collective each.

Pure data, no torch.distributed: the solver costs these steps, the rewrite pass inserts
them as nodes. Every step acts on one mesh axis and says what it does in forward and what
its autograd backward does (under the gradient convention of ``autopar.placement``).

| step            | from -> to     | forward        | backward                          |
|-----------------|----------------|----------------|-----------------------------------|
| all_gather      | S(d) -> R      | all-gather     | slice, or reduce-scatter if the   |
|                 |                |                | consumer's gradient is partial    |
| all_reduce      | P -> R         | all-reduce     | none, or all-reduce (same rule)   |
| grad_all_reduce | R -> R         | none           | all-reduce                        |
| scatter         | R -> S(d)      | local slice    | all-gather                        |
| reduce_scatter  | P -> S(d)      | reduce-scatter | all-gather                        |
| all_to_all      | S(i) -> S(j)   | all-to-all     | all-to-all back                   |
| to_partial      | R -> P         | rank 0 keeps   | none                              |
| shard_to_partial| S(d) -> P      | zeros around   | local slice                       |
|                 |                | the own block  |                                   |

Axes that shard the same dim nest (the earlier axis splits first), so a step on axis ``a``
that touches dim ``d`` first brings every later axis that shards ``d`` back to ``R`` and
restores it afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.placement import Partial, Placement, Replicate, Shard

R = Replicate()


@dataclass(frozen=True)
class Step:
    kind: str                  # one of the table's names
    axis: int
    dim: int = -1              # tensor dim for gather / scatter; split dim for all_to_all
    dim2: int = -1             # concat dim for all_to_all
    grad_partial: bool = False  # gather / all_reduce: the backward reduces too
    groups: int = 1            # gather / scatter of a strided shard S(d/g)

    # (collective name, which size it moves) for forward and backward: used by the cost model.
    def forward_collective(self) -> str | None:
        return {"all_gather": "all_gather", "all_reduce": "all_reduce",
                "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all"}.get(self.kind)

    def backward_collective(self) -> str | None:
        if self.kind == "all_gather":
            return "reduce_scatter" if self.grad_partial else None
        if self.kind == "all_reduce":
            return "all_reduce" if self.grad_partial else None
        return {"grad_all_reduce": "all_reduce", "scatter": "all_gather",
                "reduce_scatter": "all_gather", "all_to_all": "all_to_all"}.get(self.kind)

    def __str__(self) -> str:
        g = f"/{self.groups}" if self.groups > 1 else ""
        extra = {"all_gather": f"dim={self.dim}{g}", "scatter": f"dim={self.dim}{g}",
                 "reduce_scatter": f"dim={self.dim}",
                 "all_to_all": f"{self.dim}->{self.dim2}"}.get(self.kind, "")
        return f"{self.kind}[axis {self.axis}{', ' + extra if extra else ''}]"


class Unsupported(ValueError):
    """This conversion is not offered (the solver treats it as infinitely expensive)."""


def plan_steps(src: Sequence[Placement], dst: Sequence[Placement],
               grad_partial: Sequence[bool] = ()) -> list[Step]:
    """Steps that turn placements ``src`` into ``dst`` (one entry per mesh axis).

    ``grad_partial[a]``: the consumer returns a partial gradient on axis ``a`` (it reads the
    tensor replicated but its own output is not replicated there), so the step that makes
    the tensor replicated on ``a`` must reduce the gradient in backward.
    """
    n = len(src)
    gp = tuple(grad_partial) or (False,) * n
    cur = list(src)
    dst = list(dst)
    steps: list[Step] = []

    # Phase A, last axis first: leave Shard / Partial placements that must change.
    for a in range(n - 1, -1, -1):
        s, d = cur[a], dst[a]
        if s == d or isinstance(s, Replicate):
            continue
        _clear_later(cur, steps, a, _dims_of(s) | _dims_of(d))
        step, cur[a] = _leave(s, d, a, gp[a])
        steps.append(step)

    # Phase B, first axis first: shard what is replicated now and must not be.
    for a in range(n):
        s, d = cur[a], dst[a]
        if s == d:
            if isinstance(s, Replicate) and isinstance(src[a], Replicate) and gp[a]:
                steps.append(Step("grad_all_reduce", a))
            continue
        _clear_later(cur, steps, a, _dims_of(d))
        steps.append(_enter(s, d, a))
        cur[a] = d
    # Axes cleared by _clear_later come back in phase B: an axis b > a is visited after a.
    return steps


def _dims_of(p: Placement) -> set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


def _clear_later(cur: list[Placement], steps: list[Step], a: int, dims: set[int]) -> None:
    """Gather every axis after ``a`` that shards one of ``dims`` (in ``cur``, in place)."""
    for b in range(len(cur) - 1, a, -1):
        if isinstance(cur[b], Shard) and cur[b].dim in dims:
            steps.append(Step("all_gather", b, cur[b].dim, groups=cur[b].groups))
            cur[b] = R


def _leave(s: Placement, d: Placement, a: int, grad_partial: bool) -> tuple[Step, Placement]:
    """Phase A on axis ``a``: the step off Shard / Partial ``s`` toward ``d``, and the
    placement it reaches (``d``, or Replicate where a strided shard goes through it)."""
    if isinstance(s, Shard):
        if isinstance(d, Replicate):
            return Step("all_gather", a, s.dim, grad_partial=grad_partial, groups=s.groups), d
        if isinstance(d, Shard) and s.groups == 1 and d.groups == 1:
            return Step("all_to_all", a, d.dim, s.dim), d
        if isinstance(d, Shard):          # strided on either side: through R
            return Step("all_gather", a, s.dim, groups=s.groups), R
        if s.groups == 1:                 # Partial: each rank's term is its block, zeros around
            return Step("shard_to_partial", a, s.dim), d
        raise Unsupported(f"{s} -> {d} on axis {a}")
    # Partial
    if isinstance(d, Replicate):
        return Step("all_reduce", a, grad_partial=grad_partial), d
    if d.groups == 1:
        return Step("reduce_scatter", a, d.dim), d
    return Step("all_reduce", a), R        # to a strided shard: through R


def _enter(s: Placement, d: Placement, a: int) -> Step:
    """Phase B on axis ``a``: the step from Replicate ``s`` to ``d``."""
    if isinstance(d, Shard):
        return Step("scatter", a, d.dim, groups=d.groups)
    if isinstance(d, Partial):
        return Step("to_partial", a)
    raise Unsupported(f"{s} -> {d} on axis {a}")
