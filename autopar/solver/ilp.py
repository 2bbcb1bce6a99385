r"""Intra-operator sharding as one integer linear program (OR-Tools CP-SAT).

Variables
    x[v,i] ∈ {0,1}      node v runs option i (an N-D strategy; placeholders: a placement)
    e[u,p,v,q] ∈ {0,1}  edge u->v carries producer placement p into consumer placement q

Objective (seconds of one training step, forward + backward)
    min  Σ_v Σ_i n_v · t_compute[v,i] · x[v,i]          compute
       + Σ_(u,v) Σ_(p,q) n_uv · t_comm[p,q] · e[u,p,v,q]   resharding and gradient sync
       + Σ_i t_comm[out(i), R] · x[loss,i]              the loss ends replicated

Constraints
    one_option[v]:   Σ_i x[v,i] = 1
    edge[u->v,p,q]:  e ≥ y[u,p] + z[v,q] − 1,  y[u,p] = Σ_{i: out(i)=p} x[u,i],
                                               z[v,q] = Σ_{j: in(j)=q} x[v,j]
                     (t_comm ≥ 0 and we minimize, so e = y·z at the optimum)
    forbid[u->v,p,q]: y[u,p] + z[v,q] ≤ 1  where no conversion p -> q is offered
    memory:          Σ_v Σ_i n_v · bytes[v,i] · x[v,i] ≤ budget  (bytes per device)

n_v is the number of graph nodes that share v's choice (repeated layers), n_uv the number
of graph edges that share an edge. Classes p and q are placements, not options, so an
edge has at most (#placements)² terms however many options its ends have.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from autopar.placement import Replicate
from autopar.sharding.registry import input_placements, output_placements
from autopar.solver.costing import INF, CostModel, grad_partial_flags
from autopar.solver.problem import Problem

R = Replicate()


class InfeasibleError(ValueError):
    """No plan fits the memory budget."""


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
    memory: dict = field(default_factory=dict)     # term -> bytes per device

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


@dataclass
class _Tables:
    node_cost: dict          # v -> [seconds per option]
    node_mem: dict           # v -> [bytes per option]
    node_mem_terms: dict     # v -> [dict term -> bytes]
    edges: list              # (u, v, [class of u's options], [class of v's options], {(p,q): (t, by)})
    sink: tuple | None       # (v, [seconds per option], [by per option])


def tabulate(problem: Problem, cost: CostModel) -> _Tables:
    node_cost, node_mem, node_terms = {}, {}, {}
    for name, v in problem.vars.items():
        n = len(v.members)
        times, mems, terms = [], [], []
        for combo in v.options:
            f, b = cost.node_time(v, combo)
            times.append(n * (f + b))
            t = cost.node_memory(v, combo, problem.optimizer_states)
            terms.append({k: n * b for k, b in t.items()})
            mems.append(sum(terms[-1].values()))
        node_cost[name], node_mem[name], node_terms[name] = times, mems, terms
    edges = []
    for e in problem.edges:
        u, v = problem.vars[e.src], problem.vars[e.dst]
        pu = [output_placements(c, e.src_out) for c in u.options]
        qv = [(input_placements(c, e.dst_in), grad_partial_flags(c, e.dst_in)) for c in v.options]
        table = {}
        for p in set(pu):
            for q in set(qv):
                t, by = cost.edge_time(e.meta, p, q[0], q[1])
                table[(p, q)] = (t * e.count if t != INF else INF,
                                 {k: s * e.count for k, s in by.items()})
        if e.src == e.dst:   # a repeated layer feeding itself: the same option decides both ends
            for i in range(len(u.options)):
                t, _ = table[(pu[i], qv[i])]
                node_cost[e.src][i] = INF if t == INF else node_cost[e.src][i] + t
            continue
        edges.append((e.src, e.dst, pu, qv, table))
    sink = None
    if problem.sink:
        name, k = problem.sink
        v = problem.vars[name]
        n = len(problem.mesh_shape)
        ts, bys = [], []
        for c in v.options:
            t, by = cost.edge_time(v.outputs[k], output_placements(c, k), (R,) * n, (False,) * n)
            ts.append(t)
            bys.append(by)
        sink = (name, ts, bys)
    return _Tables(node_cost, node_mem, node_terms, edges, sink)


def solve(problem: Problem, cost: CostModel, memory_budget: float | None = None,
          time_limit_s: float = 60.0, minimize_memory: bool = False) -> Solution:
    """Choose one option per node; see the module docstring for the program."""
    t0 = time.perf_counter()
    tab = tabulate(problem, cost)
    finite = [c for cs in tab.node_cost.values() for c in cs if c != INF]
    finite += [t for *_, table in tab.edges for t, _ in table.values() if t != INF]
    scale = 1e9 / max(max(finite, default=1.0), 1e-12)

    m = cp_model.CpModel()
    x = {name: [m.NewBoolVar(f"x[{name},{i}]") for i in range(len(v.options))]
         for name, v in problem.vars.items()}
    obj = []
    for name, xs in x.items():
        m.AddExactlyOne(xs).WithName(f"one_option[{name}]")
        m.AddHint(xs[0], 1)
        for i, c in enumerate(tab.node_cost[name]):
            if c == INF:
                m.Add(xs[i] == 0)
            elif not minimize_memory:
                obj.append(int(round(c * scale)) * xs[i])
    for u, v, pu, qv, table in tab.edges:
        ys = defaultdict(list)
        zs = defaultdict(list)
        for i, p in enumerate(pu):
            ys[p].append(x[u][i])
        for j, q in enumerate(qv):
            zs[q].append(x[v][j])
        for (p, q), (t, _) in table.items():
            if t == INF:
                m.Add(sum(ys[p]) + sum(zs[q]) <= 1).WithName(f"forbid[{u}->{v}]")
            elif t > 0 and not minimize_memory:
                if len(ys) == 1:
                    obj.append(int(round(t * scale)) * sum(zs[q]))
                elif len(zs) == 1:
                    obj.append(int(round(t * scale)) * sum(ys[p]))
                else:
                    ev = m.NewBoolVar(f"e[{u}->{v}]")
                    m.Add(ev >= sum(ys[p]) + sum(zs[q]) - 1).WithName(f"edge[{u}->{v}]")
                    obj.append(int(round(t * scale)) * ev)
    if tab.sink:
        name, ts, _ = tab.sink
        for i, t in enumerate(ts):
            if t == INF:
                m.Add(x[name][i] == 0)
            elif t > 0 and not minimize_memory:
                obj.append(int(round(t * scale)) * x[name][i])
    mem_terms = [int(b) * x[name][i] for name, bs in tab.node_mem.items() for i, b in enumerate(bs) if b]
    if memory_budget is not None and not minimize_memory:
        m.Add(sum(mem_terms) <= int(memory_budget)).WithName("memory")
    m.Minimize(sum(mem_terms) if minimize_memory else sum(obj))

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 2
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(m)
    name = solver.StatusName(status)
    proto = m.Proto()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE and memory_budget is not None:
            raise _explain_infeasible(problem, cost, memory_budget, time_limit_s)
        raise RuntimeError(f"the sharding ILP ended with status {name} after "
                           f"{solver.WallTime():.1f}s; raise time_limit_s or pin more choices")
    choice = {n: next(i for i, xv in enumerate(xs) if solver.Value(xv)) for n, xs in x.items()}
    sol = Solution(choice, 0.0, 0.0, name, time.perf_counter() - t0,
                   len(proto.variables), len(proto.constraints))
    _fill_breakdown(sol, tab, choice)
    total = sol.compute_s + sum(sol.comm_s.values())
    sol.objective_s = total
    sol.bound_s = total if status == cp_model.OPTIMAL or minimize_memory else \
        min(total, solver.BestObjectiveBound() / scale)
    return sol


def _fill_breakdown(sol: Solution, tab: _Tables, choice: dict[str, int]) -> None:
    sol.compute_s = sum(tab.node_cost[n][i] for n, i in choice.items())
    comm: dict = defaultdict(float)
    for u, v, pu, qv, table in tab.edges:
        _, by = table[(pu[choice[u]], qv[choice[v]])]
        for k, s in by.items():
            comm[k] += s
    if tab.sink:
        name, _, bys = tab.sink
        for k, s in bys[choice[name]].items():
            comm[k] += s
    mem: dict = defaultdict(float)
    for n, i in choice.items():
        for k, b in tab.node_mem_terms[n][i].items():
            mem[k] += b
    sol.comm_s, sol.memory = dict(comm), dict(mem)


def _explain_infeasible(problem, cost, budget, time_limit_s) -> InfeasibleError:
    least = solve(problem, cost, None, time_limit_s, minimize_memory=True)
    need = sum(least.memory.values())
    terms = ", ".join(f"{k} {_gib(b)}" for k, b in sorted(least.memory.items(), key=lambda kv: -kv[1]))
    binding = max(least.memory.items(), key=lambda kv: kv[1])[0] if least.memory else "?"
    return InfeasibleError(
        f"no plan on mesh {problem.mesh_shape} fits the memory budget of {_gib(budget)} per "
        f"device: the smallest plan needs {_gib(need)} ({terms}); {binding} is the largest "
        f"term. Fix: raise memory_budget to at least {_gib(need)}, use more devices, or "
        "shard more (zero=3, tensor=...)")


def _gib(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if b >= 2**20:
        return f"{b / 2**20:.2f} MiB"
    return f"{b / 2**10:.1f} KiB"
