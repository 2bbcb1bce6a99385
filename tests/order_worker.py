"""Run by tests/test_collective_order.py under torchrun: programs whose ranks would issue
their collectives in different orders are refused before they run (``CollectiveOrderError``
naming the first differing collective on each rank), not left to hang; the same programs
in one order on every rank run.

- ``compiled``: a program compiled with Inductor (``runtime.compiled.CompiledProgram``)
  all-reduces a tensor of 3 elements and all-gathers one of 5, in an order that depends on
  the rank when ``differ`` is set (a Python branch on the rank, traced into each rank's
  graph; two all-reduces would not do: Inductor buckets them into one, the same on both);
- ``eager``: the same as two rewritten fx graphs calling ``autopar.ops.collectives``, one
  per rank order (``runtime.collective_order.check_eager_programs``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.ops import collectives  # noqa: E402
from autopar.ops.comm import DistComm, use_comm  # noqa: E402
from autopar.runtime.collective_order import (  # noqa: E402
    EAGER_FIX, CollectiveOrderError, check_eager_programs, order_check,
)
from autopar.runtime.compiled import CompiledProgram  # noqa: E402
from worker_loop import run_cases  # noqa: E402

_COMM: list = []


def _comm() -> DistComm:
    if not _COMM:
        from torch.distributed.device_mesh import init_device_mesh
        _COMM.append(DistComm(init_device_mesh("cpu", (dist.get_world_size(),),
                                               mesh_dim_names=("data",))))
    return _COMM[0]


def _sum_and_gather(a, b, reverse: bool):
    """all-reduce ``a``, all-gather ``b`` (``reverse``: the gather first)."""
    if reverse:
        b = collectives.all_gather(b, 0, 0)
        a = collectives.all_reduce(a, 0)
    else:
        a = collectives.all_reduce(a, 0)
        b = collectives.all_gather(b, 0, 0)
    return a, b


class _SumAndGather(torch.nn.Module):
    def __init__(self, reverse: bool):
        super().__init__()
        self.reverse = reverse

    def forward(self, a, b):
        return _sum_and_gather(a, b, self.reverse)


def _program(reverse: bool) -> fx.GraphModule:
    """The same as a rewritten graph: ``a`` (3 elements) all-reduced, ``b`` (5) all-gathered."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(3), torch.empty(5)
    if reverse:
        gb = g.call_function(collectives.all_gather, (b,), {"axis": 0, "dim": 0})
        sa = g.call_function(collectives.all_reduce, (a,), {"axis": 0})
    else:
        sa = g.call_function(collectives.all_reduce, (a,), {"axis": 0})
        gb = g.call_function(collectives.all_gather, (b,), {"axis": 0, "dim": 0})
    g.output((sa, gb))
    return fx.GraphModule(torch.nn.Module(), g)


def run_case(case: dict) -> dict:
    if case["mode"] == "absent":        # rank 1 never reaches the check: rank 0 waits 2 s
        check = order_check(_comm(), pipelined=False)
        check.timeout_s = 2.0
        refused = None
        if dist.get_rank() == 0:
            try:
                check.check("the train program", [], EAGER_FIX)
            except CollectiveOrderError as e:
                refused = str(e)
        return {"refused": refused}
    comm = _comm()
    rank = dist.get_rank()
    reverse = case["differ"] and rank == 1
    check = order_check(comm, pipelined=False)
    a, b = torch.full((3,), rank + 1.0), torch.full((5,), 10.0 * (rank + 1))
    try:
        with use_comm(comm):
            if case["mode"] == "compiled":
                torch._dynamo.reset()
                sa, sb = CompiledProgram(_SumAndGather(reverse), "train", check)(
                    a.requires_grad_(), b.requires_grad_())    # a forward and a backward
                (sa.sum() + sb.sum()).backward()
            else:
                check_eager_programs(check, comm, {"train": _program(reverse)})
                sa, sb = _program(reverse)(a, b)
    except CollectiveOrderError as e:
        refused = str(e)
    else:
        refused = None
    on = [None] * dist.get_world_size()          # which ranks refused it
    dist.all_gather_object(on, refused is not None)
    if refused is not None:
        return {"refused": refused, "refused_on": on, "checked": check.checked}
    return {"refused": None, "refused_on": on, "checked": check.checked,
            "sums": [sa.tolist(), sb.tolist()]}


if __name__ == "__main__":
    run_cases(run_case)
