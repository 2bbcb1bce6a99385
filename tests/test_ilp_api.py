"""The sharding ILP written through OR-Tools' public API and through its private SWIG calls
(``solver.ilp.FAST_PATH``, used on the versions it was checked on) is the same program: the
same choice per node, the same objective, with and without a memory budget that binds."""
from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.solver import ilp
from autopar.solver.flat import solve_captured
from examples.models import EXAMPLES


@pytest.fixture(scope="module")
def solved():
    ex = EXAMPLES["gpt"](batch=4)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    _, sol = solve_captured(cap, parse_cluster("cpu:2"), 2, pins={"tensor": 2})
    return sol


@pytest.mark.parametrize("budget_share", [None, 0.8])
def test_public_and_fast_paths_write_the_same_program(solved, budget_share, monkeypatch):
    if ilp._pywraplp is None:
        pytest.skip("this OR-Tools has no private SWIG module: only the public path exists")
    budget = None
    if budget_share is not None:
        least = ilp.solve(solved.problem, solved.cost, None, 30.0, minimize_memory=True)
        free = ilp.solve(solved.problem, solved.cost, None, 30.0)
        budget = least.memory_total + budget_share * (free.memory_total - least.memory_total)
    got = {}
    for fast in (True, False):
        monkeypatch.setattr(ilp, "FAST_PATH", fast)
        got[fast] = ilp.solve(solved.problem, solved.cost, budget, 30.0)
    a, b = got[True], got[False]
    assert a.status == b.status == "OPTIMAL"
    assert a.n_variables == b.n_variables and a.n_constraints == b.n_constraints
    assert a.objective_s == pytest.approx(b.objective_s, rel=1e-9)
    assert a.choice == b.choice


def test_the_fast_path_runs_only_where_it_was_checked():
    import ortools
    assert ilp.FAST_PATH == (ilp._pywraplp is not None
                             and ortools.__version__.startswith(ilp.FAST_PATH_CHECKED))


@pytest.mark.parametrize("budget_share", [None, 0.8])
def test_pared_down_scip_reaches_cbcs_optimum(solved, budget_share, monkeypatch):
    """The program under ``SCIP_SETTINGS`` (no presolve, cuts or LP heuristics) and under CBC
    end at the same objective (within OR-Tools' relative gap, 1e-4), with and without a
    memory budget that binds; and the solver the ILP uses is SCIP with those settings."""
    m = ilp.mip_solver()
    assert m.SolverVersion().startswith("SCIP"), m.SolverVersion()
    budget = None
    if budget_share is not None:
        least = ilp.solve(solved.problem, solved.cost, None, 30.0, minimize_memory=True)
        free = ilp.solve(solved.problem, solved.cost, None, 30.0)
        budget = least.memory_total + budget_share * (free.memory_total - least.memory_total)
    scip = ilp.solve(solved.problem, solved.cost, budget, 30.0)
    monkeypatch.setattr(ilp, "mip_solver", lambda: ilp.pywraplp.Solver.CreateSolver("CBC"))
    cbc = ilp.solve(solved.problem, solved.cost, budget, 30.0)
    assert scip.status == cbc.status == "OPTIMAL"
    assert scip.objective_s == pytest.approx(cbc.objective_s, rel=1e-4)
    if budget is not None:
        assert scip.memory_total <= budget * (1 + 1e-9)
