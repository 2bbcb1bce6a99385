"""The one-stage (unpipelined) plan of a captured graph: the sharding ILP over the meshes
the pins allow, with and without recomputation; also what the pipeline planner solves
inside each stage (``memory_weights``, ``grad_sync_scale``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.analysis.layers import recompute_nodes, select_layers
from autopar.capture import Captured, fingerprint
from autopar.errors import PinError
from autopar.placement import placements_str
from autopar.plan import Estimate, NodePlacement, Plan, SolverReport
from autopar.sharding.registry import input_placements, output_placements
from autopar.solver.costing import CostModel
from autopar.solver.ilp import InfeasibleError, solve as solve_ilp
from autopar.solver.meshes import mesh_candidates
from autopar.solver.pins import check_optimizer
from autopar.solver.problem import build_problem

RECOMPUTE_WHEN = 0.9
"""Recompute every repeated layer too when the best plan without it uses this share of memory."""
ZERO_STAGES = (3, 1, 2)
"""Without a ``zero=`` pin, the ZeRO stages weighed on the data axis when memory binds (nothing
fits without them, or the best plan uses more than ``RECOMPUTE_WHEN`` of the budget). Stage 3
first: it needs the least memory, so when it does not fit neither do the others."""


@dataclass(frozen=True)
class Solved:
    """What the solver decided, for callers that price the plan further (the pipeline
    planner): the problem, the cost model it was priced with and the option per node."""
    problem: Any
    cost: Any
    choice: dict


@dataclass
class _Best:
    sol: Any
    problem: Any
    shape: tuple
    axes: tuple
    recompute: tuple
    cost: Any
    pins: dict


def node_placements(problem, choice: dict[str, int]) -> dict[str, NodePlacement]:
    """Every graph node's placements, given one option per decision of ``problem``."""
    nodes = {}
    for name, v in problem.vars.items():
        combo = v.options[choice[name]]
        n_in = len(v.call.inputs) if v.call else 0
        entry = NodePlacement(
            tuple(placements_str(input_placements(combo, k)) for k in range(n_in)),
            tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs))))
        for member in v.members:
            nodes[member] = entry
    return nodes


def plan_captured(cap: Captured, cl, world: int, *, memory_budget=None, mesh_shape=None,
                  optimizer="adamw", time_limit_s=60.0, capture_s=0.0, verbose=False,
                  pins=None, profiler=None) -> Plan:
    """The best plan for the captured graph on ``world`` devices of ``cl`` (no pipeline)."""
    return solve_captured(cap, cl, world, memory_budget=memory_budget, mesh_shape=mesh_shape,
                          optimizer=optimizer, time_limit_s=time_limit_s, capture_s=capture_s,
                          verbose=verbose, pins=pins, profiler=profiler)[0]


def solve_captured(cap: Captured, cl, world: int, *, memory_budget=None, mesh_shape=None,
                   optimizer="adamw", time_limit_s=60.0, capture_s=0.0, verbose=False,
                   pins=None, profiler=None, memory_weights=None,
                   grad_sync_scale=1.0, explain=True) -> tuple[Plan, Solved]:
    """``plan_captured``, and the solver's :class:`Solved`. ``memory_weights`` and
    ``grad_sync_scale`` go to the :class:`CostModel` (the pipeline's per-stage view);
    ``explain=False`` skips working out how far from fitting an infeasible mesh is."""
    pins = pins or {}
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    kw = dict(budget=budget, mesh_shape=mesh_shape, optimizer=optimizer, time_limit_s=time_limit_s,
              verbose=verbose, profiler=profiler, memory_weights=memory_weights,
              grad_sync_scale=grad_sync_scale, explain=explain)
    best, errors = _search(cap, cl, world, pins, **kw)
    if pins.get("zero") is None and (mesh_shape is None or len(mesh_shape) == 1) and (
            best is None or sum(best.sol.memory.values()) > RECOMPUTE_WHEN * budget):
        # memory binds: weigh sharding parameters, gradients and optimizer state over the
        # data axis (ZeRO 1, 2, 3); the least predicted step wins
        for stage in ZERO_STAGES:
            if verbose:
                print(f"trying zero={stage} on the data axis")
            try:
                got, _ = _search(cap, cl, world, {**pins, "zero": stage}, **{**kw, "explain": False})
            except PinError:         # e.g. a batch the data axis cannot split
                break
            if got is None and stage == ZERO_STAGES[0]:
                break
            if got is not None and (best is None or got.sol.objective_s < best.sol.objective_s):
                best = got
    if best is None:
        raise errors[0] if len(errors) == 1 else InfeasibleError("\n".join(str(e) for e in errors))
    plan = _to_plan(cap, best, cl, world, best.pins, memory_budget, capture_s)
    return plan, Solved(best.problem, best.cost, dict(best.sol.choice))


def _search(cap: Captured, cl, world: int, pins: dict, *, budget, mesh_shape, optimizer,
            time_limit_s, verbose, profiler, memory_weights, grad_sync_scale, explain):
    """(the best :class:`_Best` under ``pins`` over the meshes they allow, or None; the
    reasons of the meshes that did not fit)."""
    n_states = check_optimizer(optimizer)
    # Recomputation is pinned, or chosen here: plans without it first; with every repeated
    # layer recomputed too when memory binds (nothing fits, or the best uses > 90%).
    choices = [pins.get("recompute")] if pins.get("recompute") is not None else [None]
    if choices == [None] and _has_repeated_layers(cap):
        choices.append("full")
    # the problem depends on the mesh only: built once, costed per recomputation choice
    problems = [(build_problem(cap, shape, zero=pins.get("zero") or 0, optimizer_states=n_states,
                               **roles), shape, axes, roles)
                for shape, axes, roles in mesh_candidates(world, pins, mesh_shape)]
    best, errors = None, []
    for rec in choices:
        if rec == "full" and best is not None and \
                sum(best.sol.memory.values()) <= RECOMPUTE_WHEN * budget:
            break
        recompute = select_layers(cap.gm, rec)
        rec_nodes, rec_kept = recompute_nodes(cap.gm, recompute)
        errors = []                    # report the last pass's reasons
        for problem, shape, axes, roles in problems:
            cost = CostModel.for_pins(cl, shape, pins, data_axis=roles.get("data_axis"),
                                      recompute=(rec_nodes, rec_kept), profiler=profiler,
                                      memory_weights=memory_weights, grad_sync_scale=grad_sync_scale)
            try:
                sol = solve_ilp(problem, cost, budget if budget != float("inf") else None,
                                time_limit_s, explain=explain and rec == choices[-1])
            except InfeasibleError as e:
                errors.append(e)
                continue
            if verbose:
                print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}: "
                      f"{sol.objective_s * 1e3:.3f} ms ({sol.status}, {sol.solve_time_s:.2f}s)")
            if best is None or sol.objective_s < best.sol.objective_s:
                best = _Best(sol, problem, shape, axes, recompute, cost, pins)
    return best, errors


def _to_plan(cap: Captured, best: _Best, cl, world: int, pins: dict, memory_budget,
             capture_s: float) -> Plan:
    """The Plan of the solver's best solution."""
    sol, problem, axes = best.sol, best.problem, best.axes
    nodes = node_placements(problem, sol.choice)
    comm = {f"{kind}@{axes[a]}": s for (kind, a), s in sorted(sol.comm_s.items())}
    comm_total = sum(sol.comm_s.values())
    est = Estimate(step_time_s=sol.compute_s + comm_total, compute_s=sol.compute_s,
                   comm_s=comm_total, memory_bytes=dict(sol.memory), comm=comm)
    n_graph = sum(1 for n in cap.gm.graph.nodes if n.op in ("placeholder", "call_function"))
    report = SolverReport(sol.status, sol.objective_s, sol.bound_s, sol.gap, sol.solve_time_s,
                          capture_s, sol.n_variables, sol.n_constraints, n_graph, len(problem.vars))
    params = {names[i]: ph for ph, names in cap.params.items() for i in range(len(names))}
    return Plan(world_size=world, mesh_shape=best.shape, mesh_axes=axes, cluster=cl.name,
                pins={k: v for k, v in pins.items() if v is not None}, nodes=nodes,
                params=params, fingerprint=fingerprint(cap), estimate=est, solver=report,
                memory_budget=memory_budget,
                param_shapes={n: list(cap.node(ph).meta["val"].shape) for n, ph in params.items()},
                node_ops={n.name: str(n.target) for n in cap.gm.graph.nodes
                          if n.op == "call_function" and n.name in nodes},
                inputs=tuple(cap.inputs), recompute=best.recompute)


def _has_repeated_layers(cap: Captured) -> bool:
    try:
        return bool(select_layers(cap.gm, "full"))
    except ValueError:
        return False
