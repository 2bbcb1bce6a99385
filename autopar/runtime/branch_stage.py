"""Which rank keeps what under branch parallelism (``Plan.branches``): the unpipelined
runner (``parallel_module.OneStage``) runs programs that keep only this rank's branches
(``passes.branch_parallel.keep_branches``); :class:`BranchRanks` is its "stage rank" view:
this rank's coordinate on the mesh axis ``"branch"``; a branch parameter is kept by the
ranks of its group only, every other tensor by all; a whole tensor (state dicts, gradients)
comes from the first group holding it, broadcast over the branch axis."""
from __future__ import annotations

import torch

from autopar.ops.comm import Comm
from autopar.passes.branch_parallel import BRANCH_AXIS, branch_owned
from autopar.plan import Plan


class BranchRanks:
    def __init__(self, plan: Plan, comm: Comm, attr_of: dict[str, str]):
        self.axis = plan.mesh_axes.index(BRANCH_AXIS)
        self.comm = comm
        self.groups = plan.mesh_shape[self.axis]
        self.rank = comm.coord[self.axis]
        self.owned = branch_owned(plan, attr_of)     # attr -> its group

    def owners(self, attrs) -> dict[str, list[int]]:
        everyone = list(range(self.groups))
        return {attr: [self.owned[attr]] if attr in self.owned else everyone for attr in attrs}

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` of the group at ``src`` on every rank of the branch axis (a sum with zeros)."""
        if self.rank != src:
            t = torch.zeros_like(t)
        return self.comm.all_reduce(t, self.axis)
