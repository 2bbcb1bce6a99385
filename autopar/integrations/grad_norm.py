"""The gradient norm of a parallel module's whole model, and clipping by it: what
``torch.nn.utils.clip_grad_norm_`` computes on one device, from each rank's shards.

Shared by the integrations whose trainers clip gradients themselves
(``autopar.integrations.transformers``, ``autopar.integrations.torchtitan``); it imports no
framework.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.placement import Shard

__all__ = ["global_grad_norm"]


def global_grad_norm(pm, max_norm: float) -> torch.Tensor:
    """The 2-norm of the whole gradient of ``pm``'s model, and (``max_norm`` finite) every
    local gradient scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device.

    A block held by ``c`` ranks (a parameter replicated on the mesh axes it is not sharded
    on: ``c = world / prod(mesh[a] for the axes a with Shard)``) is counted ``1 / c`` times
    per rank, so the sum over ranks (one all-reduce) counts each block once. The local
    gradient of a replicated or sharded parameter is its whole gradient or its block after
    backward's sum (``autopar.placement``'s convention)."""
    mesh = tuple(pm.plan.mesh_shape)
    world = math.prod(mesh)
    placements = pm._shards.placements
    total, grads = None, []
    for attr, p in pm._local_params().items():
        if p.grad is None:
            continue
        split = math.prod(n for n, pl in zip(mesh, placements[attr]) if isinstance(pl, Shard))
        sq = p.grad.detach().float().pow(2).sum() * (split / world)
        total = sq if total is None else total + sq
        grads.append(p.grad)
    device = pm.device if hasattr(pm, "device") else torch.device("cpu")
    total = torch.zeros((), device=device) if total is None else total
    if dist.is_initialized() and world > 1:
        dist.all_reduce(total)
    norm = total.sqrt()
    if math.isfinite(max_norm) and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))
    return norm
