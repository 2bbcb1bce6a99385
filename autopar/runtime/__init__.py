"""The per-rank runtime: one module (``ParallelModule``) runs every plan, pipelined or not.

``build`` is how the API makes it: on this job's torch.distributed ranks (a DeviceMesh on
the rank's device) unless a communicator is given (``ThreadComm`` for simulated ranks).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture import Captured
from autopar.device import rank_device
from autopar.ops.comm import Comm, DistComm, mesh_group_options
from autopar.plan import Plan
from autopar.runtime.parallel_module import ParallelModule

__all__ = ["ParallelModule", "build", "dist_comm", "rank_device"]


def dist_comm(plan: Plan, timeout: float | None = None) -> DistComm:
    """The communicator of this torch.distributed rank on ``plan``'s mesh, built on the
    rank's device; its collectives wait at most ``timeout`` seconds, and its process groups
    are made with that timeout (None: the process group's timeout)."""
    mesh = init_device_mesh(rank_device().type, tuple(plan.mesh_shape),
                            mesh_dim_names=tuple(plan.mesh_axes),
                            backend_override=mesh_group_options(len(plan.mesh_shape), timeout))
    return DistComm(mesh, timeout=timeout)


def build(cap: Captured, plan: Plan, model: nn.Module, loss_fn: Callable | None = None,
          comm: Comm | None = None, batch: str = "global",
          timeout: float | None = None, weights=None) -> ParallelModule:
    """The module that runs ``plan`` on this rank. ``loss_fn``: a loss run outside the graph
    on the replicated output (when the capture has none); ``comm``: None for this job's
    torch.distributed ranks; ``batch``: ``"global"`` or ``"per_rank"``
    (``autopar.runtime.data``); ``timeout``: seconds a collective of ``dist_comm`` may wait;
    ``weights``: a weights source each rank reads its shards from (``autopar.runtime.weights``)."""
    return ParallelModule(cap, plan, comm if comm is not None else dist_comm(plan, timeout), model,
                          loss_fn, batch=batch, weights=weights)
