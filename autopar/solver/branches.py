"""Branch parallelism as a plan choice: the independent branches of each branch set
(``autopar.analysis.branches``) run on disjoint groups of ranks along a leading mesh axis
``"branch"`` (``Plan.branches``); inside a group, the rest of the plan (data / tensor
parallelism) is solved on the group's ``world / n`` devices.

The price of ``branch=n``, against running every branch everywhere:

- compute: the group plan's, with each branch set's branches costing the most loaded
  group's share (``max`` over groups of the sum of their branches) instead of all of them;
  branches go to groups longest first, each to the least loaded (LPT);
- communication: the group plan's, plus, per branch set, an all-reduce over the branch
  axis of the join's result (forward) and of the fork's gradient (backward);
- memory: the group plan's, less what the other groups' branches hold (parameters,
  gradients, optimizer state, activations), for the group that holds the most.

``plan_branched`` plans a ``branch=`` pin; ``search_branches`` is the free search's
candidate (every ``n`` dividing the world that leaves each group a branch), kept only
when it predicts a faster step.
"""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.analysis.branches import BranchSet, find_branches
from autopar.capture import Captured
from autopar.cost_models.comm import collective_time
from autopar.cost_models.hardware import axis_link
from autopar.cost_models.host import node_dispatches
from autopar.cost_models.step import step_time
from autopar.errors import PinError
from autopar.options import Options, as_options
from autopar.placement import local_shape
from autopar.plan import BranchGroups, NodePlacement, Plan
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import Solved, solve_captured
from autopar.solver.pipeline_search import _sub_cluster
from autopar.pricing.prices import price_table


def plan_branched(cap: Captured, cl, world: int, n: int, pins: Options, **kw) -> Plan:
    """The plan of ``cap`` with its branches over ``n`` groups of ``world / n`` ranks."""
    sets = find_branches(cap)
    if not sets:
        raise PinError(f"branch={n}: the model has no independent branches (a fork feeding "
                       "towers with their own parameters, joined by cat or add): drop branch=")
    if world % n:
        raise PinError(f"branch={n} does not divide the world of {world} devices: pin a divisor")
    few = min(len(s.branches) for s in sets)
    if n > few:
        raise PinError(f"branch={n}: a branch set has only {few} branches, one group each at "
                       f"most: pin branch= of at most {few}")
    d = world // n
    # the group plan: ZeRO is not offered beside branches (zero=0 unless pinned so)
    pins = as_options(pins)
    inner_pins = pins.replace(branch=None, zero=pins.zero_stage)
    inner, solved = solve_captured(cap, _sub_cluster(cl, d), d, pins=inner_pins, **kw)
    return branch_plan(cap, cl, world, n, inner, solved, sets)


def search_branches(cap: Captured, cl, world: int, pins: Options, **kw) -> Plan | None:
    """The fastest ``branch=n > 1`` plan for the free search, or None (no branches, or no
    ``n`` that fits)."""
    if pins.branch is not None or world < 2 or pins.zero or any(
            (v or 0) > 1 for v in (pins.pipeline, pins.accumulate, pins.micro_batch_size)):
        return None
    sets = find_branches(cap)
    if not sets:
        return None
    few = min(len(s.branches) for s in sets)
    best = None
    for n in range(2, min(few, world) + 1):
        if world % n:
            continue
        try:
            got = plan_branched(cap, cl, world, n, pins.replace(branch=n), **kw)
        except (InfeasibleError, PinError):
            continue
        if best is None or got.estimate.step_time_s < best.estimate.step_time_s:
            best = got
    return best


def assign(costs: list[float], n: int) -> list[list[int]]:
    """Branch indices per group: longest first, each to the least loaded group (LPT)."""
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        g = min(range(n), key=lambda g: (load[g], len(groups[g])))
        groups[g].append(k)
        load[g] += costs[k]
    return [sorted(g) for g in groups]


def branch_plan(cap: Captured, cl, world: int, n: int, inner: Plan, solved: Solved,
                sets: list[BranchSet]) -> Plan:
    """``inner`` (solved for one group) as the plan of ``n`` groups (module docstring)."""
    table = price_table(solved.problem, solved.cost)
    node_s, node_mem = {}, {}
    for name, v in solved.problem.vars.items():
        i = solved.choice[name]
        f, b = table.time(name, i)
        mem = table.memory(name, i)
        for m in v.members:
            node_s[m] = f + b
            node_mem[m] = {k: x / len(v.members) for k, x in mem.items()}
    mesh = (n, *inner.mesh_shape)
    link = axis_link(cl, mesh, 0)
    saved_s, join_s = 0.0, 0.0
    calls = {x.name: sum(node_dispatches(str(x.target))) for x in cap.gm.graph.nodes
             if x.op == "call_function"}
    skipped_calls = 0.0
    groups_of, spare = [], [dict() for _ in range(n)]    # memory the group does not hold
    for s in sets:
        costs = [sum(node_s.get(x, 0.0) for x in s.branches[k]) for k in range(len(s.branches))]
        groups = assign(costs, n)
        saved_s += sum(costs) - max(sum(costs[k] for k in g) for g in groups)
        # the host too dispatches only its group's branches (cost_models/host.py): the rank
        # that skips the fewest calls sets the host term
        skipped_calls += min(sum(calls.get(x, 0.0) for k in range(len(s.branches)) if k not in g
                                 for x in s.branches[k]) for g in groups)
        groups_of.append(BranchGroups(s.fork, s.join, [sum((s.owned(k) for k in g), ()) for g in groups]))
        for gi, g in enumerate(groups):
            for k in range(len(s.branches)):
                if k in g:
                    continue
                for x in s.owned(k):
                    for term, bytes_ in node_mem.get(x, {}).items():
                        spare[gi][term] = spare[gi].get(term, 0.0) + bytes_
        join_s += collective_time("all_reduce", _local_bytes(cap, inner, s.join, solved), n, link)
        if cap.node(s.fork).op != "placeholder":
            join_s += collective_time("all_reduce", _local_bytes(cap, inner, s.fork, solved), n, link)
    est = inner.estimate
    worst = max(range(n), key=lambda g: est.memory_total - sum(spare[g].values()))
    memory = {k: v - spare[worst].get(k, 0.0) for k, v in est.memory_bytes.items()}
    comm = {**est.comm, "all_reduce@branch": join_s}
    host_s = est.host_s * max(0.0, 1 - skipped_calls / max(sum(calls.values()), 1.0))
    estimate = replace(est, step_time_s=step_time(est.compute_s + est.comm_s - saved_s + join_s, host_s),
                       host_s=host_s,
                       compute_s=est.compute_s - saved_s, comm_s=est.comm_s + join_s,
                       memory_bytes=memory, comm=comm)
    nodes = {k: NodePlacement(tuple("R" + p for p in v.inputs), tuple("R" + p for p in v.outputs))
             for k, v in inner.nodes.items()}
    return replace(inner, world_size=world, mesh_shape=mesh, mesh_axes=("branch", *inner.mesh_axes),
                   cluster=cl.name, options=inner.options.replace(branch=n), nodes=nodes,
                   estimate=estimate, branches=tuple(groups_of))


def _local_bytes(cap: Captured, inner: Plan, name: str, solved: Solved) -> float:
    """Bytes per rank of node ``name``'s output under ``inner``'s placements (in the
    plan's compute precision)."""
    val = cap.node(name).meta["val"]
    shape = local_shape(tuple(val.shape), inner.nodes[name].output(0), tuple(inner.mesh_shape))
    return solved.cost._act(math.prod(shape) * val.element_size(), val.dtype)
