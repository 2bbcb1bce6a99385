"""The per-rank runtime: one module (``ParallelModule``) runs every plan, pipelined or not.

``build`` is how the API makes it: on this job's torch.distributed ranks (a DeviceMesh on
the rank's device) unless a communicator is given (``ThreadComm`` for simulated ranks).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture import Captured
from autopar.ops.comm import Comm, DistComm
from autopar.plan import Plan
from autopar.runtime.parallel_module import ParallelModule

__all__ = ["ParallelModule", "build", "dist_comm", "rank_device"]


def rank_device() -> torch.device:
    """This rank's device: CUDA device ``LOCAL_RANK`` when CUDA is available (made the current
    device, so call this before the process group and mesh exist), else the CPU."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def dist_comm(plan: Plan) -> DistComm:
    """The communicator of this torch.distributed rank on ``plan``'s mesh, built on the
    rank's device."""
    mesh = init_device_mesh(rank_device().type, tuple(plan.mesh_shape),
                            mesh_dim_names=tuple(plan.mesh_axes))
    return DistComm(mesh)


def build(cap: Captured, plan: Plan, model: nn.Module, loss_fn: Callable | None = None,
          comm: Comm | None = None) -> ParallelModule:
    """The module that runs ``plan`` on this rank. ``loss_fn``: a loss run outside the graph
    on the replicated output (when the capture has none); ``comm``: None for this job's
    torch.distributed ranks."""
    return ParallelModule(cap, plan, comm if comm is not None else dist_comm(plan), model, loss_fn)
