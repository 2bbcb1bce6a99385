"""The MIP solver (``ilp.mip_solver``) under a wall clock it cannot overrun: a large
sharding program is solved in a forked child that is killed at :func:`hard_limit_s`.
Written for CBC (below); SCIP, the solver now, checks its limit more often, and the fork
stays the guarantee for both. Where SCIP has not proved a program in a third of the limit,
CBC gets the rest (:func:`solve_in_turn`: SoPlex stalls on some frontier programs' root LP).

CBC checks its time limit (``Solver.SetTimeLimit``) between branch-and-bound nodes, and
OR-Tools cannot interrupt it (``Solver.InterruptSolve()`` is False for CBC, and CBC takes
no solver-specific parameters there). On some programs its root node (cuts, heuristics)
runs far past the limit. Measured (2026-11-30, one process, load 3-5): DeepSeek-V3's
pipeline-search stage mesh data 8 x expert 16 x tensor 8 at p = 2 (760,871 variables) was
still in ``Solve`` after 8 minutes under a 60 s limit, and so was data 8 x expert 4 x tensor
2 at p = 32 after 4 minutes, each holding the whole free search. Killed, such a program is
what the limit would have made it without an incumbent: a :class:`TimeLimitError` the
searches skip (and name in ``plan.solver.skipped``) rather than a planning that never ends.

Only programs of at least :data:`FORK_ABOVE` variables are forked (a fork of a process
holding a captured model costs tens of milliseconds, small beside writing such a program);
the others, and every program where ``os.fork`` is missing, are solved in this process as
before. The child solves the very program the parent wrote (the fork copies it), so the
answer is the in-process one: same choice, same status, same bound.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import time

from ortools.linear_solver import linear_solver_pb2, pywraplp

FORK_ABOVE = 20_000
"""Variables from which a program is solved in a forked child. The programs of the test
models' meshes are hundreds to a few thousand variables; a 2-D stage mesh of a frontier model
40-45 thousand (solved in 1-2 s, where its writing takes about as long)."""

KILLED = -1
"""The status :func:`solve_bounded` returns for a child killed at its hard limit."""


def hard_limit_s(time_limit_s: float) -> float:
    """Wall seconds after which a forked solve is killed: the time limit and half as much
    again, at least 10 s more (CBC's own stop comes at a node boundary, a little after the
    limit, and writing its answer back takes a moment)."""
    return time_limit_s + max(10.0, 0.5 * time_limit_s)


def solve_bounded(m: "pywraplp.Solver", x: dict, time_limit_s: float,
                  ) -> tuple[int, dict | None, float]:
    """``(status, choice, best bound)`` of the program written in ``m`` (``x``: decision ->
    its options' variables): ``choice`` maps each decision to the index of its chosen option
    (None without a solution); ``status`` is the solver's (:func:`solve_in_turn`), or
    :data:`KILLED` where the child passed :func:`hard_limit_s` (CBC's root overrunning the
    rest of the limit after SCIP's turn included: SCIP's incumbent goes with the child)."""
    if m.NumVariables() < FORK_ABOVE or not hasattr(os, "fork"):
        return solve_in_turn(m, x, time_limit_s)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: solve, write, leave at once
        try:
            os.close(read_fd)
            data = pickle.dumps(solve_in_turn(m, x, time_limit_s))
            with os.fdopen(write_fd, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + hard_limit_s(time_limit_s)
    chunks = []
    # poll, not select: select refuses a descriptor numbered 1,024 or more, which a
    # long-lived process holding many files (a sweep's gloo worker) reaches (issue 43:
    # "filedescriptor out of range in select()")
    ready = select.poll()
    ready.register(read_fd, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not ready.poll(left * 1000):
                os.kill(pid, signal.SIGKILL)
                return KILLED, None, float("nan")
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    if not chunks:                                 # the child died without an answer
        raise RuntimeError("the sharding ILP's solver process ended without an answer "
                           f"(pid {pid}); plan again, or report it with the model")
    return pickle.loads(b"".join(chunks))


SCIP_FIRST = 1 / 3
"""The share of a program's time limit SCIP has before CBC takes the program over
(:func:`solve_in_turn`)."""


def solve_in_turn(m: "pywraplp.Solver", x: dict, time_limit_s: float,
                  ) -> tuple[int, dict | None, float]:
    """:func:`solve_bounded`'s answer, in this process: SCIP (``m``) for :data:`SCIP_FIRST`
    of the limit; where it has not proved its program optimal or infeasible by then, CBC on
    the same program for the rest, and the better of the two answers.

    Why: SCIP pared down (``ilp.SCIP_SETTINGS``) solves most frontier programs in 0.5-8 s
    where CBC takes 1-17 s (its feasibility pump at the root), but on some of them SoPlex,
    SCIP's LP solver, has not solved the root LP after 40 s (no presolve; 46,761 simplex
    iterations in 15 s on one), while CBC's Clp solves the whole program in about a
    second. Measured 2026-12-02 (this 2-core machine; ``docs/measured.md``): DeepSeek-V3's
    free search wrote 125 programs of 40,000-104,000 variables; SCIP stopped 11 of them at
    the 30 s limit (9 with an incumbent up to 2.6x the optimum, 2 with none), CBC solved
    each of them in 0.8-3.5 s. Which solver answers depends on whether SCIP finished in its
    share of the wall clock, so on the load, as the limit itself does; both stop within the
    same relative gap, so the objective is the same up to it."""
    first = time_limit_s * SCIP_FIRST
    if not m.SolverVersion().startswith("SCIP"):
        return _answer(m, x, m.Solve())
    m.SetTimeLimit(max(1, int(first * 1000)))
    t0 = time.perf_counter()
    status = m.Solve()
    if status == pywraplp.Solver.OPTIMAL or (
            status == pywraplp.Solver.INFEASIBLE and time.perf_counter() - t0 < first):
        return _answer(m, x, status)
    scip = _answer(m, x, status)
    proto = linear_solver_pb2.MPModelProto()
    m.ExportModelToProto(proto)
    cbc = pywraplp.Solver.CreateSolver("CBC")
    if cbc is None:                 # pragma: no cover - every OR-Tools wheel has CBC
        return scip
    cbc.LoadModelFromProto(proto)
    cbc.SetTimeLimit(max(1, int((time_limit_s - (time.perf_counter() - t0)) * 1000)))
    columns = cbc.variables()
    answer = _answer(cbc, {n: [columns[v.index()] for v in xs] for n, xs in x.items()}, cbc.Solve())
    if scip[1] is not None and (answer[1] is None or
                                m.Objective().Value() < cbc.Objective().Value()):
        return scip
    return answer


def _answer(m, x: dict, status: int) -> tuple[int, dict | None, float]:
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return status, None, float("nan")
    choice = {n: max(range(len(xs)), key=lambda i: xs[i].solution_value()) for n, xs in x.items()}
    return status, choice, m.Objective().BestBound()
