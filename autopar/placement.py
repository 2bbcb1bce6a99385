"""Placements of a tensor on one mesh axis, as data.

A tensor on an N-D mesh has one placement per mesh axis ("axis" is a mesh axis, "dim" is a
tensor dimension):

- ``Replicate()``  (``R``): every rank on the axis holds the whole tensor.
- ``Shard(dim)``   (``S(d)``): the tensor is split evenly along ``dim``; rank ``i`` on the
  axis holds block ``i``. When several axes shard the same dim, the earlier axis splits
  first (outer blocks), the later axis splits each of those blocks again.
- ``Partial()``    (``P``): every rank holds a term; the tensor is the sum of the terms.
- ``Shard(dim, groups=g)`` (``S(d/g)``): a strided shard. ``dim`` is read as ``g`` equal
  groups (a fused projection's q, k, v) and each group is split evenly; rank ``i`` holds
  block ``i`` of every group, side by side. Splitting the dim into its ``g`` groups then
  leaves each group plainly ``S(d)``: head boundaries stay whole (Megatron's per-head
  layout, DTensor's ``_StridedShard``).

Gradient convention used by the runtime (and by the cost of each conversion): the local
gradient of an ``R`` or ``P`` tensor is the whole gradient; of an ``S(d)`` tensor, its shard.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence, Union


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    groups: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim}/{self.groups})"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]
R = Replicate()
P = Partial()

_SHARD = re.compile(r"^S\((-?\d+)(?:/(\d+))?\)$")


def parse_placement(text: str) -> Placement:
    """``"R"`` / ``"P"`` / ``"S(1)"`` -> placement; the inverse of ``str``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)), int(m.group(2) or 1))
    raise ValueError(f"unknown placement {text!r}: expected 'R', 'P' or 'S(<dim>)'")


def placements_str(placements: Sequence[Placement]) -> str:
    """``(S(0), R)`` -> ``"S(0)R"``: compact, one entry per mesh axis."""
    return "".join(str(p) for p in placements)


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Inverse of :func:`placements_str` (a tuple of immutable placements: each text is
    parsed once, plans and their pricing read the same few again and again)."""
    got = _PARSED.get(text)
    if got is None:
        got = _parse_placements(text)
        if len(_PARSED) >= 10_000:
            _PARSED.clear()
        _PARSED[text] = got
    return got


_PARSED: dict[str, tuple[Placement, ...]] = {}


def _parse_placements(text: str) -> tuple[Placement, ...]:
    out, i = [], 0
    while i < len(text):
        if text[i] in "RP":
            out.append(parse_placement(text[i]))
            i += 1
        elif text[i] == "S":
            j = text.index(")", i)
            out.append(parse_placement(text[i : j + 1]))
            i = j + 1
        else:
            raise ValueError(f"cannot parse placements {text!r} at position {i}")
    return tuple(out)


def normalize(p: Placement, ndim: int) -> Placement:
    """Shard(-1) on a 3-D tensor -> Shard(2)."""
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim + ndim, p.groups)
    return p


def local_shape(shape: Sequence[int], placements: Sequence[Placement],
                mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The shape each rank holds, or None when a sharded dim does not divide evenly."""
    out = None
    dims = None                      # (dim, strided) of each shard, in axis order
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            if out is None:
                if not shape:
                    return None
                out, dims = list(shape), []
            d = p.dim % len(out)
            if out[d] % (n * p.groups):
                return None
            dims.append((d, p.groups > 1))
            out[d] //= n
    if out is None:                  # nothing sharded (the common case): no copy to divide
        return tuple(shape)
    if len(dims) > 1 and any(strided and sum(1 for e, _ in dims if e == d) > 1 for d, strided in dims):
        return None   # a strided shard shares its dim with no other shard
    return tuple(out)
