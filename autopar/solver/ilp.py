r"""Intra-operator sharding as one mixed-integer linear program (OR-Tools).

Variables
    x[v,i] ∈ {0,1}      node v runs option i (an N-D strategy; placeholders: a placement)
    e[u,p,v,q] ∈ [0,1]  edge u->v carries producer placement p into consumer placement q
    s[g,p,q] ∈ [0,1]    the shared conversion p -> q of value group g runs (below)

Objective (seconds of one training step, forward + backward)
    min  Σ_v Σ_i n_v · t_compute[v,i] · x[v,i]          compute
       + Σ_(u,v) Σ_(p,q) n_uv · t_comm[p,q] · e[u,p,v,q]   resharding and gradient sync
       + Σ_i t_comm[out(i), R] · x[loss,i]              the loss ends replicated
       - (overlappable seconds of those edges) + E       gradient sync, exposed part only
    E ≥ last,  E ≥ Σ overlappable - Σ_v Σ_i hide[v,i] · x[v,i]
    (``CostModel.overlap_rule``: the data-parallel gradient reduction overlaps backward
    compute, ``hide``, except the last 25 MiB bucket; ZeRO-3's gathers and reduce-scatters
    overlap forward and backward except the first block's)

Constraints
    one_option[v]:   Σ_i x[v,i] = 1
    edge_out[u->v,p]: Σ_q e[u,p,v,q] = y[u,p],   y[u,p] = Σ_{i: out(i)=p} x[u,i]
    edge_in[u->v,q]:  Σ_p e[u,p,v,q] = z[v,q],   z[v,q] = Σ_{j: in(j)=q} x[v,j]
                     (so e = y·z; no e exists for a pair p -> q with no conversion)
    memory:          for each phase g of the step (``cost_models.memory.step_phases``: the
                     loss's backward, a layer's backward, the end of backward's gradients)
                     Σ_v Σ_i n_v · (always[v,i] + bytes_g[v,i]) · x[v,i] ≤ budget
                     (bytes per device, written in GiB: ``MEMORY_ROW_UNIT``; ``always``:
                     parameters, optimizer state, inputs; a pipeline stage's or
                     accumulation's one phase holds every term)

Shared conversions: readers of one value that need it in the same class q convert it once
(``passes.insert_collectives``; the groups are ``PriceTable.shared``). A conversion p -> q
that two or more edges of a group can carry gets its own s[g,p,q] ≥ (each such edge's
indicator of carrying p -> q: its e, or y / z where one side has a single class), and its
price goes on s instead of on each edge; the rest of a group's pairs stay on their edge.
The estimate (``_fill_breakdown``) counts each group's chosen pairs once the same way.

n_v is the number of graph nodes that share v's choice (repeated layers), n_uv the number
of graph edges that share an edge. Classes p and q are placements, not options, so an
edge has at most (#placements)² terms however many options its ends have. Every
coefficient is read from the problem's :class:`autopar.pricing.prices.PriceTable`, the
prices ``explain``, the stage DP and the estimate read too.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import ortools
from ortools.linear_solver import pywraplp

try:        # OR-Tools' SWIG calls under pywraplp's Python wrappers: see FAST_PATH
    from ortools.linear_solver import _pywraplp
except ImportError:         # pragma: no cover - an OR-Tools without them: the public API
    _pywraplp = None

from autopar.cost_models.memory import peak_bytes
from autopar.errors import AutoparInputError
from autopar.mesh_roles import MeshRoles
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import INF, CostModel, exposed_sync, grad_partial_flags
from autopar.pricing.prices import PriceTable, price_table
from autopar.pricing.problem import Problem
from autopar.solver.bounded_solve import KILLED, solve_bounded


FAST_PATH_CHECKED = ("9.12.", "9.15.")
"""OR-Tools versions whose private SWIG functions (``_pywraplp.Solver_Constraint``,
``Constraint_SetCoefficient``, ``Solver_NumVar``, what ``Solver.Constraint`` /
``SetCoefficient`` / ``NumVar`` call under their Python wrappers) this module was checked
on; they make a large mesh's millions of coefficients ~2x faster to write. On any other
version the ILP is written through the public API (``tests/test_ilp_api.py`` holds the two
to the same plan)."""
FAST_PATH = _pywraplp is not None and ortools.__version__.startswith(FAST_PATH_CHECKED)


class InfeasibleError(AutoparInputError):
    """No plan fits the memory budget. Where the search worked out how far, the error says
    so in its fields (None or empty where it did not):

    - one mesh's ILP (``flat._search``): ``mesh_shape``, ``axes``, ``roles``, ``recompute``,
      and, once explained (``explain_infeasible``: the least-memory plan, one more ILP),
      ``need_bytes`` and its ``terms`` by memory term; ``unexplained`` holds what that
      explanation needs until it is asked for;
    - the whole search (``flat.infeasible``): ``meshes`` (every mesh's figures),
      ``closest`` (per mesh family) and ``suggestions`` (the smallest changes that fit)."""

    mesh_shape: tuple | None = None
    axes: tuple | None = None
    roles: MeshRoles | None = None
    recompute = None
    need_bytes: float | None = None
    terms: dict | None = None
    unexplained: tuple | None = None

    def __init__(self, message: str = "", **fields):
        """``fields``: any of the fields above by name (``mesh_shape``, ``axes``, ``roles``,
        ``recompute``, ``need_bytes``, ``terms``, ``unexplained``, ``meshes``, ``closest``,
        ``suggestions``); another name is a TypeError."""
        super().__init__(message)
        unknown = sorted(set(fields) - set(INFEASIBLE_FIELDS))
        if unknown:
            raise TypeError(f"InfeasibleError() got unknown field(s) {unknown}; its fields are "
                            f"{list(INFEASIBLE_FIELDS)}")
        for name in INFEASIBLE_FIELDS:
            setattr(self, name, fields.get(name))
        self.meshes, self.closest = self.meshes or [], self.closest or []
        self.suggestions = self.suggestions or []

    explain_later = None
    """Where the search deferred the explanation (``flat.solve_captured(explain="later")``):
    a function returning the explained error; None otherwise."""

    @property
    def explained(self) -> bool:
        """Whether the least-memory plan's figures (``need_bytes``, ``terms``) are known."""
        return self.need_bytes is not None


INFEASIBLE_FIELDS = ("mesh_shape", "axes", "roles", "recompute", "need_bytes", "terms",
                     "unexplained", "meshes", "closest", "suggestions")
"""What an :class:`InfeasibleError` may say about why nothing fits (None or empty: not known)."""


class TimeLimitError(InfeasibleError):
    """The sharding ILP reached its time limit without any solution (``solve``). A kind of
    :class:`InfeasibleError` ("no plan here"), so a search over meshes, stages and pipeline
    degrees skips that program as it skips one that does not fit, and fails only when no
    program gave a plan; its message names the limit and how to raise it. Not explained
    by a least-memory ILP (memory is not what stopped it)."""

    def __init__(self, message: str = "", *, time_limit_s: float | None = None, **kw):
        super().__init__(message, **kw)
        self.time_limit_s = time_limit_s


def time_limit_fix(time_limit_s: float) -> str:
    """How to give the solver more time (the end of a :class:`TimeLimitError`'s message)."""
    more = max(2 * time_limit_s, 60.0)
    return (f"raise the limit: autopar.plan(..., time_limit_s={more:g}) or "
            f"`autopar plan --time-limit {more:g}`, or pin more choices (tensor=, data=, ...)")


@dataclass
class Solution:
    choice: dict[str, int]                     # representative -> option index
    objective_s: float
    bound_s: float
    status: str
    solve_time_s: float
    n_variables: int
    n_constraints: int
    compute_s: float = 0.0
    comm_s: dict = field(default_factory=dict)     # (collective, axis) -> seconds
    overlapped_s: float = 0.0                      # of comm_s, hidden behind compute
    memory: dict = field(default_factory=dict)     # term -> bytes per device
    memory_phases: tuple = ()                      # groups of terms never live at once
    time_limit: str = ""         # "" when proven optimal; else what the time limit stopped

    @property
    def memory_total(self) -> float:
        """Peak bytes per device (``cost_models.memory.peak_bytes`` of ``memory``)."""
        return peak_bytes(self.memory, self.memory_phases)

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@dataclass
class _Tables:
    node_cost: dict          # root -> [seconds per option]
    node_mem: dict           # root -> [bytes per option]
    node_mem_terms: dict     # root -> [dict term -> bytes]
    edges: list              # (u, v, [class of u's options], [class of v's options], {(p,q): (t, by)})
    #                          and {(p,q): overlappable seconds}
    sink: tuple | None       # (root, [seconds per option], [by per option])
    follow: dict             # follower -> (root, [its option for each of root's options])
    self_comm: dict          # root -> [{(collective, axis): seconds} per option] (absorbed edges)
    hidden: dict = field(default_factory=dict)   # root -> [overlappable seconds per option]
    hide: dict = field(default_factory=dict)     # root -> [compute seconds that hide them]
    last_s: float = 0.0                          # overlappable seconds never hidden
    group: list = field(default_factory=list)    # per edge: its shared-conversion group or None


def tabulate(problem: Problem, cost: CostModel) -> _Tables:
    """The program's coefficients, read from ``cost``'s :class:`PriceTable` for ``problem``:
    followers folded into their roots, edges settled by one variable folded into it."""
    pt = price_table(problem, cost)
    node_cost = {n: [pt.compute_s(n, i) for i in range(len(v.options))] for n, v in problem.vars.items()}
    node_terms = {n: [pt.memory(n, i) for i in range(len(v.options))] for n, v in problem.vars.items()}
    node_mem = {n: [sum(t.values()) for t in terms] for n, terms in node_terms.items()}
    self_comm: dict[str, list[dict]] = {}
    for n, v in problem.vars.items():   # collectives inside a node's own time (experts' all-to-alls)
        own = [pt.self_comm(n, i) for i in range(len(v.options))]
        if any(own):
            self_comm[n] = own
    scale = cost.grad_sync_scale
    last_s, with_forward = cost.overlap_rule()
    hide = {n: [_hiding(pt, n, i, with_forward, scale) for i in range(len(v.options))]
            for n, v in problem.vars.items()}
    hidden = {n: [0.0] * len(v.options) for n, v in problem.vars.items()}
    into = {e.dst: k for k, e in enumerate(problem.edges) if e.dst in pt.follow}
    for name, (root, pick) in pt.follow.items():     # graph order, as the table merged them
        k = into[name]
        e = problem.edges[k]
        comm = self_comm.setdefault(root, [{} for _ in pick])
        u, v = problem.vars[e.src], problem.vars[name]
        sig = pt.signature(k)
        for i, j in enumerate(pick):
            p = output_placements(u.options[pt.option_of(e.src, i)], e.src_out)
            c = v.options[j]
            _, (t, by), h = pt.pair(sig, pt.number(p), pt.number((input_placements(c, 0),
                                                                  grad_partial_flags(c, 0))))
            node_cost[root][i] += t + node_cost[name][j]
            hidden[root][i] += h + hidden[name][j]
            hide[root][i] += hide[name][j]
            node_mem[root][i] += node_mem[name][j]
            for key, b in node_terms[name][j].items():
                node_terms[root][i][key] = node_terms[root][i].get(key, 0.0) + b
            for key, sec in by.items():
                comm[i][key] = comm[i].get(key, 0.0) + sec
    edges, group = _edge_tables(pt, node_cost, self_comm, hidden)
    sink = None
    if problem.sink:
        name = problem.sink[0]
        root = pt.root(name)
        priced = [pt.sink(name, pt.option_of(name, i)).priced(scale)
                  for i in range(len(problem.vars[root].options))]
        sink = (root, [t for t, _ in priced], [by for _, by in priced])
    for name in pt.follow:
        del node_cost[name], node_mem[name], node_terms[name], hidden[name], hide[name]
    return _Tables(node_cost, node_mem, node_terms, edges, sink, dict(pt.follow), self_comm,
                   hidden, hide, last_s, group)


def _hiding(pt: PriceTable, name: str, i: int, with_forward: bool, scale: float) -> float:
    """Compute seconds of ``name``'s option ``i`` that overlappable collectives hide behind:
    its backward (recomputation included), once per step, so ``scale`` of it in a
    micro-batch's view; forward and backward in full under ZeRO-3 (``CostModel.overlap_rule``)."""
    f, b = pt.time(name, i)
    n = len(pt.problem.vars[name].members)
    return n * (f + b) if with_forward else n * b * scale


def _edge_tables(pt: PriceTable, node_cost: dict, self_comm: dict, hidden: dict) -> tuple[list, list]:
    """The edges between two variables, each with its price per (class, class) pair and
    their overlappable seconds, and each one's shared-conversion group (None: its own);
    an edge whose ends one variable decides is added to that variable's cost instead.
    A class (a producer's output placements, or a consumer's input placements with their
    partial-gradient flags) is named by a number, the same in every edge of the program
    (``PriceTable.number``): the tables are keyed and looked up by pairs of numbers, not of
    placement tuples (whose hashing was most of pricing a large mesh's edges). Edges of one
    ``PriceTable.signature`` with the same classes in the same order have equal tables:
    built once and shared (read only)."""
    problem = pt.problem
    shared = pt.shared()
    outs: dict = {}          # (node, output) -> its classes, read by every edge from it
    tables: dict = {}        # (signature, classes, classes) -> (table, hid)
    edges, group = [], []
    for k, e in enumerate(problem.edges):
        if e.dst in pt.follow:
            continue
        src, dst = pt.root(e.src), pt.root(e.dst)
        u, v = problem.vars[e.src], problem.vars[e.dst]
        key = (e.src, e.src_out)
        if key not in outs:
            outs[key] = _numbered([output_placements(u.options[pt.option_of(e.src, i)], e.src_out)
                                   for i in range(len(problem.vars[src].options))], pt)
        (pu, us), (qv, vs) = outs[key], _numbered(
            [(input_placements(v.options[pt.option_of(e.dst, j)], e.dst_in),
              grad_partial_flags(v.options[pt.option_of(e.dst, j)], e.dst_in))
             for j in range(len(problem.vars[dst].options))], pt)
        sig = pt.signature(k)
        got = tables.get((sig, us, vs))
        if got is None:
            prices = {(p, q): pt.pair(sig, p, q) for p in us for q in vs}
            got = tables[(sig, us, vs)] = ({pq: pr[1] for pq, pr in prices.items()},
                                           {pq: pr[2] for pq, pr in prices.items()})
        table, hid = got
        if src == dst:   # both ends decided by one variable (repeated layer, or a follower)
            comm = self_comm.setdefault(src, [{} for _ in pu])
            for i in range(len(pu)):
                t, by = table[(pu[i], qv[i])]
                node_cost[src][i] = INF if t == INF else node_cost[src][i] + t
                hidden[src][i] += hid[(pu[i], qv[i])]
                for key, sec in by.items():
                    comm[i][key] = comm[i].get(key, 0.0) + sec
            continue
        edges.append((src, dst, pu, qv, table, hid))
        group.append(shared.get(k))
    return edges, group


def _numbered(classes: list, pt: PriceTable) -> tuple[list[int], tuple[int, ...]]:
    """(each option's class number, the distinct classes' numbers in the order of
    ``set(classes)``, the order the program's pairs were always built in), numbered by
    ``pt.number``."""
    of = {c: pt.number(c) for c in set(classes)}
    return [of[c] for c in classes], tuple(of.values())


SCIP_SETTINGS = "\n".join((
    "numerics/feastol = 1e-9",
    "presolving/maxrounds = 0", "separating/maxrounds = 0", "separating/maxroundsroot = 0",
    "heuristics/feaspump/freq = -1", "heuristics/rens/freq = -1", "heuristics/rins/freq = -1"))
"""SCIP's settings for the sharding program: no presolve, no cutting planes, no feasibility
pump, RENS or RINS (each an LP-based heuristic; SCIP's cheaper rounding and diving
heuristics stay on); a row met to 1e-9 of its bound (``numerics/feastol``, 1e-6 by default,
absolute below 1: on the memory rows, written in GiB, about a KiB a device; GPT-NeoX's tiny
test model was planned "optimal" at 284,168 bytes under a budget of 284,160). The
program's LP relaxation is near integral, so what a general MIP spends at the root bought
nothing here. Measured on 2026-12-01 (session 39, this 2-core
machine), seconds per program written by the free search, same objectives: Llama 3 70B on
8x8xH100 (batch 16 x 8,192; 37,000-40,000 variables) 6.6-16.6 with CBC, 6.1 with SCIP's
defaults, 0.55-7.7 with these; summed over a whole planning (``AUTOPAR_PLAN_WORKERS=0``),
CBC against these: that Llama 75 -> 22 s (wall 97 -> 47 s), Mixtral 8x7B's frontier row
63 -> 31 s (99 -> 75 s), Llama 3 405B's 8.8 -> 4.8 s. CBC spent them in its feasibility
pump at the root (its log), and OR-Tools passes CBC no parameters to turn it off."""


def mip_solver():
    """An empty OR-Tools MIP solver for the sharding program: SCIP under
    :data:`SCIP_SETTINGS`, or CBC where this OR-Tools has no SCIP."""
    m = pywraplp.Solver.CreateSolver("SCIP")
    if m is not None:
        if not m.SetSolverSpecificParametersAsString(SCIP_SETTINGS):
            raise RuntimeError(f"this OR-Tools' SCIP refused the settings {SCIP_SETTINGS!r}")
        return m
    m = pywraplp.Solver.CreateSolver("CBC")
    if m is None:
        raise RuntimeError("OR-Tools has neither SCIP nor CBC: reinstall ortools")
    return m


def solve(problem: Problem, cost: CostModel, memory_budget: float | None = None,
          time_limit_s: float = 60.0, minimize_memory: bool = False,
          explain: bool = True) -> Solution:
    """Choose one option per node; see the module docstring for the program.

    x is binary; e may be continuous in [0, 1]: with x integral the transport constraints
    leave e a feasible transport plan between two one-hot vectors, which is their product.
    Solved as a MIP by OR-Tools' SCIP under :data:`SCIP_SETTINGS` (CBC where SCIP is
    missing, and for the rest of the limit where SCIP has not proved the program optimal in
    its first third: ``bounded_solve.solve_in_turn``): the transport form's LP relaxation is
    tight (a handful of fractional options on a frontier model's 40,000-variable program),
    so branch-and-bound needs few nodes; SCIP's presolve, cutting planes and three LP-based
    heuristics are turned off, which is most of the time a solve took (the constant's
    docstring has the figures).

    Same program, same answer: SCIP runs single-threaded and deterministically, and the
    program is written in one order in every process (variables in the problem's graph
    order, each edge's pairs in the order of its classes' numbers, ``PriceTable.number``,
    none in the order of a hash of strings), so equal coefficients give the same choice,
    ties included: among plans within the relative gap OR-Tools stops at (1e-4) the plan is
    the one SCIP's deterministic branch-and-bound reaches first on that program. The
    coefficients are equal when the cluster's constants are (datasheets; ``cpu:``
    clusters' figures measured once per machine and kept, ``cost_models/machine.py``).

    The time limit (``time_limit_s``, wall-clock seconds of the solver's search) is the one
    exception: a program stopped by it returns its incumbent, status ``"FEASIBLE"``, with
    ``Solution.time_limit`` saying so and the gap to the bound; which incumbent depends on
    how far the search got, so on the machine's load. A program stopped with no solution
    at all raises :class:`TimeLimitError`, naming the limit and how to raise it; so does an
    "INFEASIBLE" that took the whole limit (a search cut short may report it without a proof).
    """
    t0 = time.perf_counter()
    tab = tabulate(problem, cost)
    m = mip_solver()
    m.SetTimeLimit(int(time_limit_s * 1000))
    x = write_program(m, problem, cost, tab, memory_budget, minimize_memory)
    phases = cost.memory_phases
    t_solve = time.perf_counter()
    status, choice, best_bound = solve_bounded(m, x, time_limit_s)
    if status == KILLED:            # past the hard limit (``bounded_solve``): nothing in hand
        status = pywraplp.Solver.NOT_SOLVED
    if status == pywraplp.Solver.INFEASIBLE and time.perf_counter() - t_solve >= time_limit_s:
        # CBC stopped by its limit mid-search could report INFEASIBLE (seen: a program with
        # no memory budget, 0.05 s): a search cut short proves nothing, so no solution in time
        status = pywraplp.Solver.NOT_SOLVED
    names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
             pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED"}
    name = names.get(status, f"STATUS_{status}")
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if status == pywraplp.Solver.INFEASIBLE and memory_budget is not None:
            if not explain:    # the caller has another way to try: skip the second solve
                raise InfeasibleError(f"no plan on mesh {problem.mesh_shape} fits the memory budget")
            raise explain_infeasible(problem, cost, memory_budget, time_limit_s)
        if status == pywraplp.Solver.NOT_SOLVED:    # stopped by the limit, nothing in hand
            raise TimeLimitError(
                f"the sharding ILP on mesh {tuple(problem.mesh_shape)} found no solution within "
                f"its time limit of {time_limit_s:g} s ({len(x)} decisions, {m.NumVariables()} "
                f"variables, {time.perf_counter() - t0:.1f} s with building it); "
                + time_limit_fix(time_limit_s),
                mesh_shape=tuple(problem.mesh_shape), time_limit_s=time_limit_s)
        raise RuntimeError(f"the sharding ILP on mesh {tuple(problem.mesh_shape)} ended with "
                           f"status {name} after {time.perf_counter() - t0:.1f}s")
    for n, (root, pick) in tab.follow.items():
        choice[n] = pick[choice[root]]
    sol = Solution(choice, 0.0, 0.0, name, time.perf_counter() - t0,
                   m.NumVariables(), m.NumConstraints(), memory_phases=phases)
    _fill_breakdown(sol, tab, choice)
    total = sol.compute_s + sum(sol.comm_s.values()) - sol.overlapped_s
    sol.objective_s = total
    bound = best_bound if not minimize_memory else total
    sol.bound_s = min(total, bound) if status != pywraplp.Solver.OPTIMAL else total
    if status == pywraplp.Solver.FEASIBLE:   # stopped at the limit: its incumbent
        sol.time_limit = (f"the sharding ILP on mesh {tuple(problem.mesh_shape)} stopped at its "
                          f"time limit of {time_limit_s:g} s with a solution {sol.gap:.1%} from "
                          "its bound")
    return sol


def write_program(m, problem: Problem, cost: CostModel, tab: "_Tables", memory_budget: float | None,
                  minimize_memory: bool = False, integral: bool = True) -> dict:
    """Write :func:`solve`'s program (module docstring) into the OR-Tools solver ``m``: its
    variables, rows and objective; returns ``x`` (decision -> one variable per option).
    ``integral=False``: every x continuous in [0, 1], the program's LP relaxation (whose
    optimum no solution of the program is below: ``solver.lp_bound``)."""
    x = {name: [m.BoolVar("") if integral else m.NumVar(0.0, 1.0, "")
              for _ in range(len(problem.vars[name].options))]
         for name in tab.node_cost}
    # built through the solver's own calls (a row's coefficients, the objective's): OR-Tools'
    # expression API costs more than the solve on a large mesh
    obj: dict = defaultdict(float)              # variable -> seconds
    # overlap: Σ overlappable - Σ hiding compute, by variable (module docstring's E)
    overlap = not minimize_memory and _overlaps(tab)
    sync: dict = defaultdict(float)
    for name, xs in x.items():
        _row(m, 1.0, 1.0, [(v, 1.0) for v in xs])
        for i, c in enumerate(tab.node_cost[name]):
            if c == INF:
                xs[i].SetUb(0)
            elif c > 0 and not minimize_memory:
                h = tab.hidden[name][i] if overlap else 0.0
                obj[xs[i]] += c - h
                if overlap:
                    sync[xs[i]] += h - tab.hide[name][i]
    _add_edges(m, x, tab, obj, minimize_memory, sync if overlap else None)
    if overlap:
        exposed = m.NumVar(tab.last_s, pywraplp.Solver.infinity(), "exposed_sync")
        obj[exposed] += 1.0
        _row(m, 0.0, pywraplp.Solver.infinity(),
             [(exposed, 1.0)] + [(v, -c) for v, c in sync.items() if c])
    if tab.sink:
        name, ts, _ = tab.sink
        for i, t in enumerate(ts):
            if t == INF:
                x[name][i].SetUb(0)
            elif t > 0 and not minimize_memory:
                obj[x[name][i]] += t
    phases = cost.memory_phases
    peaks = _memory_rows(x, tab, phases)
    if memory_budget is not None and not minimize_memory:
        for row in peaks:
            if not isinstance(row, (int, float)):  # a number: no memory at all
                m.Add(row <= float(memory_budget) / MEMORY_ROW_UNIT)
    if minimize_memory:
        mem = m.NumVar(0.0, pywraplp.Solver.infinity(), "peak")
        for row in peaks:
            m.Add(mem >= row)
    if minimize_memory:
        m.Minimize(mem)
    else:
        objective = m.Objective()
        for v, c in obj.items():
            objective.SetCoefficient(v, c)
        objective.SetMinimization()
    return x


MEMORY_ROW_UNIT = float(2**30)
"""Bytes per unit of the program's memory rows (GiB): each row and the budget are written
divided by it. In bytes (coefficients up to 1e10 beside objective coefficients of 1e-5 to
300 s) SCIP under ``SCIP_SETTINGS`` returned OPTIMAL on a program whose optimum it had not
reached: Llama 3 70B's frontier row (``benchmarks/frontier.py``), the unpipelined 8 x 8
mesh recomputing 78 of 80 layers (47,081 variables), SCIP 11.247 s "optimal", CBC 10.088
s (its solution checked against every row: violations of 2e-16); SCIP with presolve alone
turned off 10.142 s, "optimal" too. Written in GiB, SCIP and CBC agree on that program and on the four
other slow ones of that planning (measured 2026-12-02, session 45, ``docs/measured.md``).
In the planning itself SCIP had been stopped at its third of the limit and CBC's answer
kept (``bounded_solve.solve_in_turn``): on a faster machine SCIP's would have been."""


def _memory_rows(x: dict, tab: _Tables, phases: tuple) -> list:
    """The peak of each phase, linear in ``x``, in :data:`MEMORY_ROW_UNIT` (GiB): the terms
    in no phase plus that phase's (module docstring); one row of every term when there are
    no phases."""
    grouped = {k for g in phases for k in g}
    rows = []
    for group in phases or ((),):
        keep = set(group)
        rows.append(sum(b / MEMORY_ROW_UNIT * x[name][i] for name, options in tab.node_mem_terms.items()
                        for i, terms in enumerate(options)
                        for b in [sum(v for k, v in terms.items() if k in keep or k not in grouped)]
                        if b))
    return rows


def _row(m, lo: float, hi: float, terms) -> None:
    """The constraint ``lo <= sum(coefficient * variable) <= hi`` (each variable once);
    through pywraplp's own calls under its Python wrappers where checked (FAST_PATH)."""
    if not FAST_PATH:
        row = m.Constraint(lo, hi)
        for v, c in terms:
            row.SetCoefficient(v, c)
        return
    row = _pywraplp.Solver_Constraint(m, lo, hi)
    set_coefficient = _pywraplp.Constraint_SetCoefficient
    for v, c in terms:
        set_coefficient(row, v, c)


def _overlaps(tab: _Tables) -> bool:
    """Whether any choice has communication that may overlap compute."""
    return (any(h > 0 for hs in tab.hidden.values() for h in hs)
            or any(h > 0 for *_, hid in tab.edges for h in hid.values()))


def _add_edges(m, x: dict, tab: _Tables, obj: dict, minimize_memory: bool,
               sync: dict | None = None) -> None:
    """The edges' terms: linear in one side's choice when the other has a single class,
    else a transport plan ``e`` between the two sides' classes (module docstring). With
    ``sync``, an edge's overlappable seconds go there instead of into ``obj``. A priced
    pair that several edges of one shared-conversion group can carry is paid once, on its
    own variable ``s`` (module docstring)."""
    carriers = defaultdict(list)     # (group, pair) -> each edge's indicator: its variables
    # m.NumVar without its Python wrapper (FAST_PATH)
    num_var = _pywraplp.Solver_NumVar if FAST_PATH else pywraplp.Solver.NumVar

    def pay(variables, t: float, h: float) -> None:
        for var in variables:
            obj[var] += t - h
            if h:
                sync[var] += h

    for (u, v, pu, qv, table, hid), g in zip(tab.edges, tab.group):
        ys = defaultdict(list)
        zs = defaultdict(list)
        for i, p in enumerate(pu):
            ys[p].append(x[u][i])
        for j, q in enumerate(qv):
            zs[q].append(x[v][j])
        if len(ys) == 1 or len(zs) == 1:
            # one side has a single class: the cost is linear in the other side's choice
            for (p, q), (t, _) in table.items():
                lin = zs[q] if len(ys) == 1 else ys[p]
                if t == INF:                   # that class is not offered: its options neither
                    for var in lin:
                        var.SetUb(0)
                elif t > 0 and not minimize_memory:
                    if g is not None:
                        carriers[(g, (p, q))].append((lin, t, hid[(p, q)]))
                    else:
                        pay(lin, t, hid[(p, q)] if sync is not None else 0.0)
            continue
        e = {pq: num_var(m, 0.0, 1.0, "") for pq, (t, _) in table.items() if t != INF}
        out, into = defaultdict(list), defaultdict(list)
        for (p, q), ev in e.items():
            out[p].append((ev, 1.0))
            into[q].append((ev, 1.0))
        for p, xs in ys.items():
            _row(m, 0.0, 0.0, out[p] + [(var, -1.0) for var in xs])
        for q, xs in zs.items():
            _row(m, 0.0, 0.0, into[q] + [(var, -1.0) for var in xs])
        if not minimize_memory:
            for pq, ev in e.items():
                if table[pq][0] > 0:
                    if g is not None:
                        carriers[(g, pq)].append(([ev], table[pq][0], hid[pq]))
                    else:
                        pay([ev], table[pq][0], hid[pq] if sync is not None else 0.0)
    for ways in carriers.values():
        t, h = ways[0][1], (ways[0][2] if sync is not None else 0.0)
        # indicators over the same variables (readers whose class is fixed: the producer's y)
        # are one
        indicators = list({tuple(sorted(map(id, vs))): vs for vs, _, _ in ways}.values())
        if len(indicators) == 1:      # one way to carry it: priced on that indicator
            pay(indicators[0], t, h)
            continue
        shared = m.NumVar(0.0, 1.0, "")
        for variables in indicators:  # shared >= each edge's indicator of carrying the pair
            _row(m, 0.0, pywraplp.Solver.infinity(), [(shared, 1.0)] + [(var, -1.0) for var in variables])
        pay([shared], t, h)


def _fill_breakdown(sol: Solution, tab: _Tables, choice: dict[str, int]) -> None:
    comm: dict = defaultdict(float)
    for n, per_option in tab.self_comm.items():
        for k, sec in per_option[choice[n]].items():
            comm[k] += sec
    sol.compute_s = sum(tab.node_cost[n][choice[n]] for n in tab.node_cost) - sum(comm.values())
    pool = sum(tab.hidden[n][choice[n]] for n in tab.hidden)
    hide = sum(tab.hide[n][choice[n]] for n in tab.hide)
    paid = set()          # (group, pair): a shared conversion is counted once
    for (u, v, pu, qv, table, hid), g in zip(tab.edges, tab.group):
        pq = (pu[choice[u]], qv[choice[v]])
        if g is not None and table[pq][0] > 0:
            if (g, pq) in paid:
                continue
            paid.add((g, pq))
        _, by = table[pq]
        pool += hid[pq]
        for k, s in by.items():
            comm[k] += s
    sol.overlapped_s = pool - exposed_sync(pool, hide, tab.last_s)
    if tab.sink:
        name, _, bys = tab.sink
        for k, s in bys[choice[name]].items():
            comm[k] += s
    mem: dict = defaultdict(float)
    for n in tab.node_mem_terms:
        for k, b in tab.node_mem_terms[n][choice[n]].items():
            mem[k] += b
    sol.comm_s, sol.memory = dict(comm), dict(mem)


def explain_infeasible(problem, cost, budget, time_limit_s) -> InfeasibleError:
    """The error for ``problem`` not fitting ``budget``, with what its least-memory plan
    (one more ILP) needs and which term binds."""
    least = solve(problem, cost, None, time_limit_s, minimize_memory=True)
    need = least.memory_total
    terms = ", ".join(f"{k} {_gib(b)}" for k, b in sorted(least.memory.items(), key=lambda kv: -kv[1]))
    binding = max(least.memory.items(), key=lambda kv: kv[1])[0] if least.memory else "?"
    # the figures, for a summary over meshes (autopar.solver.flat)
    return InfeasibleError(
        f"no plan on mesh {problem.mesh_shape} fits the memory budget of {_gib(budget)} per "
        f"device: the smallest plan needs {_gib(need)} ({terms}); {binding} is the largest "
        f"term. Fix: raise memory_budget to at least {_gib(need)}, use more devices, or "
        "shard more (zero=3, tensor=...)",
        mesh_shape=tuple(problem.mesh_shape), need_bytes=need, terms=dict(least.memory))


def _gib(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if b >= 2**20:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 2**10:.1f} KiB"
