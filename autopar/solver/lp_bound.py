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

Solved by GLOP's dual simplex (OR-Tools), single-threaded and deterministic. Its optimum
is exact up to its feasibility tolerances (1e-7 by default); :data:`LP_MARGIN` keeps a
bound compared with a cutoff on the safe side of them. The dual simplex, not GLOP's
default primal: measured 2026-12-01 on Llama 3 70B's 8 x 8, 16 x 4 and 32 x 2 meshes
(8x8xH100, batch 16 x 8,192; 28,662-39,808 variables), 0.29 / 0.17 / 0.33 s against
2.22 / 1.75 / 0.31 s, the same optima.

:func:`best_first` orders a search's large programs by this bound, so that the mesh most
likely to win is solved first and the others whose bound is not below it are not solved.
"""
from __future__ import annotations

import math
import time

from ortools.linear_solver import pywraplp

from typing import Callable, Iterator, Sequence, TypeVar

from autopar.pricing.costing import CostModel
from autopar.pricing.problem import Problem
from autopar.solver.ilp import tabulate, write_program

T = TypeVar("T")

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
    if not m.SetSolverSpecificParametersAsString("use_dual_simplex: true"):
        raise RuntimeError("this OR-Tools' GLOP refused use_dual_simplex")
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


LP_FIRST_ABOVE = 50_000
"""The :func:`program_size` from which a search bounds a program by its LP relaxation
before solving any (:func:`best_first`). Measured 2026-12-01 (this 2-core machine), Llama 3
70B on 8x8xH100 at batch 16 x 8,192: the unpipelined meshes 8 x 8, 16 x 4 and 32 x 2 (sizes
93,925 / 86,902 / 64,517; 39,808 / 38,130 / 28,662 variables) took SCIP 9.7, 1.3 and 6.7 s
(branching to prove a gap under 0.5%), their relaxations 0.2-0.3 s; the pipeline search's
stage programs (sizes 34,000-49,000, 12,000-17,700 variables) and a test GPT's 2 x 2 mesh
(30,303) are solved in 0.1-0.5 s, about what writing their relaxation costs."""


def program_size(problem: Problem) -> int:
    """An upper bound of the variables the sharding program of ``problem`` has: one per
    option of each decision and one per pair of options at the ends of each edge (the
    program has fewer, about 40%: an edge's pairs are of classes of options, and edges
    one variable settles are folded into it)."""
    options = {name: len(v.options) for name, v in problem.vars.items()}
    return sum(options.values()) + sum(options.get(e.src, 1) * options.get(e.dst, 1)
                                       for e in problem.edges)


def best_first(items: Sequence[T], bound: Callable[[T], float], large: Callable[[T], bool],
               settled: Callable[[T], bool] = lambda item: False,
               ) -> Iterator[tuple[T, float | None]]:
    """``items`` (a search's programs, in its order) in the order to solve them, each with
    its LP bound (None where not worked out), lazily: the small ones first, in their order
    (each solved about as fast as its relaxation, and a plan found early prunes the others);
    then the ``large`` ones that a cheaper bound already settles (``settled``, asked once the
    small ones are done: the compute floor against the best found), in their order, without
    a bound; then the other large ones by ``bound`` (ascending, ties in their order; one not
    worked out in time, ``-inf``, last), where there are two or more of them (one alone is
    yielded without: a stage mesh's single program, whose relaxation would order nothing). Best-first branch and bound over the programs: the
    one whose relaxation is least is the likeliest to win, and once it is solved every
    program whose bound is not below its objective cannot beat it and is left unsolved by
    the caller. The order is a function of the programs and of what was solved before, so
    the search is as deterministic as before; among programs of equal objective the first
    in this order wins."""
    for item in items:
        if not large(item):
            yield item, None
    rest = []
    for item in items:
        if large(item):
            if settled(item):
                yield item, None
            else:
                rest.append(item)
    if len(rest) < 2:       # nothing to order: its bound would cost what it saves nothing
        yield from ((item, None) for item in rest)
        return
    bounded = [(item, bound(item)) for item in rest]
    # a bound not worked out in time (-inf) says nothing: after those that say something
    yield from sorted(bounded, key=lambda pair: pair[1] if pair[1] > -math.inf else math.inf)
