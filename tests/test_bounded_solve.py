"""The MIP solver under a hard wall clock (``autopar.solver.bounded_solve``):

- a program solved in a forked child gives the plan the in-process solve gives (digest);
- a child past its hard limit is killed and the program is a ``TimeLimitError`` that names
  the limit, not a planning that never ends;
- the free pipeline search skips a stage mesh whose ILP timed out, goes on to the other
  meshes of its expert degree (a time limit is not "out of memory"), and says so in
  ``plan.solver.skipped``;
- a program SCIP has not proved optimal in its share of the limit is handed to CBC, whose
  plan is as fast as SCIP's own;
- the memory rows are written in GiB (``ilp.MEMORY_ROW_UNIT``: in bytes SCIP called a
  program's suboptimal answer optimal). Plans on the meta device."""
from __future__ import annotations

import os

import pytest

from ortools.linear_solver import pywraplp

from autopar.solver import bounded_solve, ilp, pipeline_free
from autopar.solver.driver import solve
from autopar.solver.errors import TimeLimitError
from test_stage_floor import _tight


def _plan(monkeypatch, **kw):
    ex, cap = _tight()
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "0")
    return solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x8xA100",
                 captured=cap, time_limit_s=30.0, **kw)[0]


def _count_forks(monkeypatch) -> list:
    forks = []
    real = os.fork

    def counted():
        pid = real()
        if pid:
            forks.append(pid)
        return pid
    monkeypatch.setattr(bounded_solve.os, "fork", counted)
    return forks


def test_a_forked_solve_plans_what_the_in_process_one_plans(monkeypatch):
    pins = {"data": 2, "tensor": 4}
    here = _plan(monkeypatch, pins=pins)
    forks = _count_forks(monkeypatch)
    monkeypatch.setattr(bounded_solve, "FORK_ABOVE", 0)
    forked = _plan(monkeypatch, pins=pins)
    assert forks, "the programs must be solved in a child"
    assert forked.digest() == here.digest()
    assert forked.solver.status == here.solver.status == "OPTIMAL"


def test_a_child_past_its_hard_limit_is_killed_and_named(monkeypatch):
    forks = _count_forks(monkeypatch)
    monkeypatch.setattr(bounded_solve, "FORK_ABOVE", 0)
    monkeypatch.setattr(bounded_solve, "hard_limit_s", lambda limit: 0.0)
    with pytest.raises(TimeLimitError, match="time limit of 30 s"):
        _plan(monkeypatch, pins={"data": 2, "tensor": 4})
    assert forks
    for pid in forks:      # reaped: no child left behind
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_program_scip_leaves_unproved_is_handed_to_cbc(monkeypatch):
    pins = {"data": 2, "tensor": 4}
    scip = _plan(monkeypatch, pins=pins)
    made, create = [], pywraplp.Solver.CreateSolver

    def counted(name):
        made.append(name)
        return create(name)
    monkeypatch.setattr(pywraplp.Solver, "CreateSolver", staticmethod(counted))
    # SCIP stopped before its first node (an incumbent from its heuristics, nothing proved):
    # what the clock does to it on a program whose root LP SoPlex has not solved in time
    monkeypatch.setattr(ilp, "SCIP_SETTINGS", ilp.SCIP_SETTINGS + "\nlimits/nodes = 0")
    handed = _plan(monkeypatch, pins=pins)
    assert made.count("CBC") and made.count("CBC") == made.count("SCIP"), made
    assert handed.solver.status == "OPTIMAL"
    assert handed.estimate.step_time_s == pytest.approx(scip.estimate.step_time_s, rel=1e-4)


def test_a_stage_mesh_past_the_time_limit_is_skipped_and_said(monkeypatch):
    """The first (most tensor-parallel) stage mesh of each degree times out: the search goes
    on to that degree's other meshes, plans a pipeline, and names the meshes skipped."""
    real = pipeline_free._DegreeSearch._solve
    first = {}

    def first_times_out(self, p, data, tensor, expert=1):
        if first.setdefault(p, (data, tensor, expert)) == (data, tensor, expert):
            raise TimeLimitError("the sharding ILP found no solution within its time limit "
                                 "of 30 s", mesh_shape=(data, tensor), time_limit_s=30.0)
        return real(self, p, data, tensor, expert)
    monkeypatch.setattr(pipeline_free._DegreeSearch, "_solve", first_times_out)
    plan = _plan(monkeypatch, pins={"accumulate": 1}, memory_budget=6 * 2**20)
    assert plan.pipeline_stages > 1, "the case must plan a pipeline"
    assert len(first) >= 2, first
    assert "pipeline stage mesh(es) skipped: no solution within the ILP's time limit" \
        in plan.solver.skipped, plan.solver.skipped
    for p, (data, tensor, expert) in first.items():
        assert str((p, data, tensor, expert)) in plan.solver.skipped


def test_a_forked_solve_in_a_process_holding_many_files(monkeypatch):
    """Issue 43: in a sweep's gloo worker, holding over 1,024 descriptors, the forked solve's
    pipe was numbered past what ``select`` takes ("filedescriptor out of range in select()",
    three cases). It waits with ``poll`` now."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files, fewer than the 1,200 the case needs")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200 if hard == resource.RLIM_INFINITY
                                                    else min(1200, hard), hard))
    held = [os.dup(0) for _ in range(1100)]
    try:
        assert max(held) >= 1024
        forks = _count_forks(monkeypatch)
        monkeypatch.setattr(bounded_solve, "FORK_ABOVE", 0)
        plan = _plan(monkeypatch, pins={"data": 2, "tensor": 4})
        assert forks and plan.solver.status == "OPTIMAL"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_memory_rows_are_written_in_gib(monkeypatch):
    """Every program's coefficients stay within a few orders of magnitude of one another:
    the memory rows and the budget in GiB (``ilp.MEMORY_ROW_UNIT``), not bytes, whose
    coefficients up to 1e10 beside objective coefficients of 1e-5 s led SCIP to call a
    suboptimal answer optimal (Llama 3 70B's frontier row: 11.25 s against CBC's 10.09 s,
    the same program in GiB 10.09 s from both)."""
    from ortools.linear_solver import linear_solver_pb2
    rows = []
    real = ilp.solve_bounded

    def exported(m, x, time_limit_s):
        proto = linear_solver_pb2.MPModelProto()
        m.ExportModelToProto(proto)
        rows.extend(proto.constraint)
        return real(m, x, time_limit_s)
    monkeypatch.setattr(ilp, "solve_bounded", exported)
    budget = 6 * 2**20
    plan = _plan(monkeypatch, pins={"data": 2, "tensor": 4, "pipeline": 1, "accumulate": 2},
                 memory_budget=budget)
    assert plan.estimate.memory_total <= budget
    memory = [r for r in rows if r.upper_bound == pytest.approx(budget / 2**30)]
    assert memory, sorted({r.upper_bound for r in rows})[-5:]
    biggest = max(abs(c) for r in rows for c in r.coefficient)
    assert biggest < 1e4, biggest
