"""Cut whole tensors into the shard one rank holds, and put shards back together.

``shard_tensor`` is local (no communication): every rank starts from the same full tensor
(the model's initial weights, or a full state dict) and keeps its block. ``unshard`` runs
the collectives that bring a shard back to the whole tensor (for checkpoints and checks).
"""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.placement import Placement, Replicate, Shard
from autopar.ops.collectives import apply_step
from autopar.sharding.redistribute import plan_steps


def shard_tensor(full: torch.Tensor, placements: Sequence[Placement], coord: Sequence[int],
                 mesh_shape: Sequence[int]) -> torch.Tensor:
    """This rank's block of ``full`` (axes that shard the same dim nest, earlier axis outer)."""
    out = full
    for p, c, n in zip(placements, coord, mesh_shape):
        if isinstance(p, Shard) and p.groups > 1:
            out = out.unflatten(p.dim, (p.groups, -1)).chunk(n, dim=p.dim + 1)[c].flatten(p.dim, p.dim + 1)
        elif isinstance(p, Shard):
            out = out.chunk(n, dim=p.dim)[c]
        elif not isinstance(p, Replicate):
            raise ValueError(f"a stored tensor cannot be {p}: only R and S(d)")
    return out.detach().clone().contiguous()


def unshard(local: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
    """The whole tensor on every rank (collectives on the current communicator)."""
    out = local
    with torch.no_grad():
        for step in plan_steps(tuple(placements), (Replicate(),) * len(placements)):
            out = apply_step(out, step)
    return out
