"""The per-rank runtime: one module (``ParallelModule``) runs every plan, pipelined or not.

``build`` is how the API makes it: on this job's torch.distributed ranks (a DeviceMesh on
the rank's device) unless a communicator is given (``ThreadComm`` for simulated ranks).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture import Captured
from autopar.device import rank_device
from autopar.ops.comm import Comm, DistComm, mesh_group_options
from autopar.plan import Plan
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.updates.crossbow import Crossbow
from autopar.runtime.updates.rule import data_group

if TYPE_CHECKING:        # autopar.elastic reads checkpoints, which import the runtime
    from autopar.elastic import ElasticInfo

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
          comm: Comm | None = None, batch: str = "global", timeout: float | None = None,
          weights=None, *, check: Callable[[nn.Module], Callable] | None = None,
          elastic: ElasticInfo | None = None):
    """The finished module that runs ``plan`` on this rank: a :class:`ParallelModule`, or,
    under ``learners=`` (Crossbow), the learners over it (``runtime.updates.crossbow``).

    ``loss_fn``: a loss run outside the graph on the replicated output (when the capture has
    none); ``comm``: None for this job's torch.distributed ranks; ``batch``: ``"global"`` or
    ``"per_rank"`` (``autopar.runtime.data``); ``timeout``: seconds a collective of
    ``dist_comm`` may wait; ``weights``: a weights source each rank reads its shards from
    (``autopar.runtime.weights``); ``check``: the check of the first ``train_step`` made from
    the module (``parallelize``'s ``check=``: ``autopar.first_step.FirstStepCheck``, called
    with the step's inputs, target and loss); ``elastic``: what an
    elastic re-plan chose (``pm.elastic``; its ``plan_seconds`` counted to the end of this
    build)."""
    started = time.perf_counter()
    pm = ParallelModule(cap, plan, comm if comm is not None else dist_comm(plan, timeout), model,
                        loss_fn, batch=batch, weights=weights)
    if plan.options.learners:       # Crossbow: the learners over the plan's module
        data = plan.mesh_axes.index("data") if "data" in plan.mesh_axes else None
        group = data_group(pm.comm, data) if data is not None and plan.mesh_shape[data] > 1 else None
        pm = Crossbow(pm, plan.options.learners, group)
    if check is not None:
        pm.first_step_check = check(pm)
    if elastic is not None:
        pm.elastic = replace(elastic, plan_seconds=elastic.plan_seconds + time.perf_counter() - started)
    return pm
