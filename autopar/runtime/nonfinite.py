"""Skip an optimizer step whose gradients hold NaN or Inf on any rank (``pm.step(opt,
skip_nonfinite=True)``), on every rank alike.

One bad batch (a NaN in one rank's slice, an overflow) makes that rank's gradients
non-finite; under tensor parallelism or ZeRO only that rank's shards may show it. Each rank
therefore puts a 1 at its own global rank in a vector of ``world`` zeros when any of its
gradients is not finite, and the vector is summed over every axis of the mesh (one
all-reduce of ``world`` floats per axis: ``precision.found_anywhere``, what fp16's loss
scaler does). Every rank then reads the same vector: the step is skipped everywhere, or
taken everywhere, and the ranks with bad gradients are named. The optimizer's state is
untouched by a skipped step (AdamW's step count too), so training goes on as if that batch
had not been there. Under ``precision="fp16"`` the loss scaler already skips such steps.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from autopar.runtime.precision import found_anywhere


def nonfinite_ranks(params, comm) -> list[int]:
    """The global ranks whose gradients of ``params`` hold NaN or Inf; the same list on
    every rank. Collective over ``comm``'s whole mesh."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        flags = torch.zeros(world, dtype=torch.float32, device=comm.device)
        if grads:      # one reduction on the device, no host sync per gradient
            bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
            flags[rank] = bad.to(flags.device, torch.float32)
        flags = found_anywhere(flags, comm)
    return [r for r, f in enumerate(flags.tolist()) if f > 0]


def finite_or_skip(pm, params) -> bool:
    """True when every rank's gradients are finite; else records the skip on ``pm``
    (``pm.nonfinite_skips``: one list of the bad ranks per skipped step), warns on rank 0
    and returns False. Collective."""
    bad = nonfinite_ranks(params, pm.comm)
    if not bad:
        return True
    skips = getattr(pm, "nonfinite_skips", None)
    if skips is None:
        skips = pm.nonfinite_skips = []
    skips.append(bad)
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(f"autopar: optimizer step skipped on every rank: NaN or Inf in the gradients "
                      f"of rank{'s' if len(bad) > 1 else ''} {bad} ({len(skips)} skipped so far; "
                      "pm.nonfinite_skips lists them)", RuntimeWarning, stacklevel=3)
    return False
