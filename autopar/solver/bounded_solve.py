"""The MIP solver (``ilp.mip_solver``) under a wall clock it cannot overrun: a large
sharding program is solved in a forked child that is killed at :func:`hard_limit_s`.
Written for CBC (below); SCIP, the solver now, checks its limit more often, and the fork
stays the guarantee for both.

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

from ortools.linear_solver import pywraplp

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
    (None without a solution); ``status`` is CBC's, or :data:`KILLED` where the child passed
    :func:`hard_limit_s`."""
    if m.NumVariables() < FORK_ABOVE or not hasattr(os, "fork"):
        return _answer(m, x, m.Solve())
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: solve, write, leave at once
        try:
            os.close(read_fd)
            data = pickle.dumps(_answer(m, x, m.Solve()))
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


def _answer(m, x: dict, status: int) -> tuple[int, dict | None, float]:
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return status, None, float("nan")
    choice = {n: max(range(len(xs)), key=lambda i: xs[i].solution_value()) for n, xs in x.items()}
    return status, choice, m.Objective().BestBound()
