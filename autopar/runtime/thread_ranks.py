"""Run a plan on ranks simulated as threads of this process (tests, checks, the CLI's
quick verify). The per-rank module is the same as under torchrun; only the communicator
differs (``ThreadComm`` instead of torch.distributed)."""
from __future__ import annotations

import copy
from typing import Callable

from torch import nn

from autopar.capture import Captured
from autopar.ops.comm import ThreadWorld
from autopar.plan import Plan
from autopar.runtime.parallel_module import ParallelModule


def simulate(cap: Captured, plan: Plan, model: nn.Module, fn: Callable, loss_fn=None) -> list:
    """``fn(pm, comm)`` on every simulated rank of ``plan``'s mesh; results in rank order.
    Each rank gets its own copy of ``model`` to shard."""
    world = ThreadWorld(plan.mesh_shape)
    copies = [copy.deepcopy(model) for _ in range(world.world)]

    def body(comm):
        pm = ParallelModule(cap, plan, comm, copies[comm.rank], loss_fn)
        return fn(pm, comm)

    return world.run(body)
