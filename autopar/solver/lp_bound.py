"""A lower bound of one sharding program's objective that counts communication: the
optimum of its LP relaxation (``ilp.write_program(..., integral=False)``: the same
variables, rows, memory budget and objective, each ``x`` in [0, 1] instead of {0, 1}).

Why it holds: every solution of the program (one option per decision, the edges' transport
plans, the shared conversions, the exposed gradient sync) is a point of the relaxation
with the same objective, so no solution is below the relaxation's optimum; in particular
not the ILP's optimum, nor an incumbent CBC stops with at its time limit. Where the
relaxation is infeasible (its memory rows cannot hold even fractionally), so is the
program. Unlike ``prices.compute_floor`` it counts what the memory budget forces: a
parameter that cannot stay replicated pays its ZeRO gathers or its tensor-parallel
collectives in the relaxation too, which is where Llama 3 70B's micro-batches lose (the
compute floor of its 8 x 8 mesh at 2 micro-batches is 2.9 s against 5.3 s solved).

Solved by GLOP (OR-Tools' primal-dual simplex), single-threaded and deterministic. Its
optimum is exact up to its feasibility tolerances (1e-7 by default); :data:`LP_MARGIN`
keeps a bound compared with a cutoff on the safe side of them.
"""
from __future__ import annotations

import math
import time

from ortools.linear_solver import pywraplp

from autopar.pricing.costing import CostModel
from autopar.pricing.problem import Problem
from autopar.solver.ilp import tabulate, write_program

LP_MARGIN = 1e-6
"""Relative margin taken off the relaxation's optimum before it is used as a bound: GLOP's
primal and dual feasibility tolerances are 1e-7 (OR-Tools' ``GlopParameters``), so an
optimum it reports is within about that of the exact one for programs whose coefficients
are seconds of order 1e-6..1e2; 1e-6 is ten times that."""


def lp_bound(problem: Problem, cost: CostModel, memory_budget: float | None,
             time_limit_s: float = 60.0) -> float:
    """Seconds no solution of the sharding program ``(problem, cost, memory_budget)`` (the
    one ``ilp.solve`` writes) has an objective below: its LP relaxation's optimum, less
    :data:`LP_MARGIN`. ``inf`` where the relaxation is infeasible (nothing fits the budget);
    ``-inf`` where it proves nothing (not solved within ``time_limit_s``, or unbounded)."""
    tab = tabulate(problem, cost)
    m = pywraplp.Solver.CreateSolver("GLOP")
    if m is None:          # pragma: no cover - every OR-Tools wheel has GLOP
        return -math.inf
    m.SetTimeLimit(int(time_limit_s * 1000))
    write_program(m, problem, cost, tab, memory_budget, integral=False)
    t0 = time.perf_counter()
    status = m.Solve()
    if status == pywraplp.Solver.INFEASIBLE and time.perf_counter() - t0 < time_limit_s:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return -math.inf
    value = m.Objective().Value()
    return value - LP_MARGIN * abs(value)
