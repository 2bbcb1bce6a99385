"""What an exact reduction of the sharding ILP could remove (issue 40): plan an example on a
pinned mesh and, for each ILP solved, count its edges between decisions by kind and what
three exact reductions would leave.

    python benchmarks/ilp_shape.py                        # the tiny llama, data 2 x tensor 2
    python benchmarks/ilp_shape.py deepseek_v3            # examples/zoo.py's tiny DeepSeek-V3
    python benchmarks/ilp_shape.py llama --pins '{"tensor": 4}'

Edge kinds (``autopar.solver.ilp._Tables.edges``, after followers and edges inside one
decision are folded in): ``linear`` (one side has one class: already written linear, no
transport variables), ``grouped`` (in a shared-conversion group: priced once per group),
``zero`` (every price and overlappable second 0, no INF: it imposes nothing), ``separable``
(no INF and t[p,q] = a[p] + b[q] to 1e-9 of the table's largest price: foldable into the
two nodes' costs), ``dense`` (the rest).
``merged``: the transport variables and rows left if producer classes with identical rows
of (price, overlappable seconds), then consumer classes with identical columns, were one
class (exact, and the LP relaxation is unchanged). ``dominated``: options j no better than
another option i in every coefficient (compute, overlap, memory per phase, sink, each
edge's row or column; for a consumer in a shared group, the same class only), which an
exact reduction could drop.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from autopar.pricing.costing import INF  # noqa: E402
from autopar.solver import flat, ilp  # noqa: E402


def edge_kinds(t) -> dict:
    """Counts of ``t``'s edges by kind and the transport sizes before/after merging classes."""
    kinds = dict(linear=0, grouped=0, zero=0, separable=0, dense=0)
    e_vars = [0, 0]
    rows = [0, 0]
    for (u, v, pu, qv, table, hid), g in zip(t.edges, t.group):
        ps, qs = sorted(set(pu)), sorted(set(qv))
        if len(ps) == 1 or len(qs) == 1:
            kinds["linear"] += 1
            continue
        n_e = sum(1 for tv in table.values() if tv[0] != INF)
        e_vars[0] += n_e
        rows[0] += len(ps) + len(qs)
        if g is not None:
            kinds["grouped"] += 1
            e_vars[1] += n_e
            rows[1] += len(ps) + len(qs)
            continue
        price = {pq: tv[0] for pq, tv in table.items()}
        if INF in price.values():
            kinds["dense"] += 1
        elif all(x == 0 for x in price.values()) and all(h == 0 for h in hid.values()):
            kinds["zero"] += 1
        elif all(abs(price[(p, q)] + price[(ps[0], qs[0])] - price[(p, qs[0])] - price[(ps[0], q)])
                 <= 1e-9 * max(map(abs, price.values())) for p in ps for q in qs):
            kinds["separable"] += 1
        else:
            kinds["dense"] += 1
        row_of = {p: tuple((price[(p, q)], hid[(p, q)]) for q in qs) for p in ps}
        ps2 = list({row_of[p]: p for p in reversed(ps)}.values())
        col_of = {q: tuple((price[(p, q)], hid[(p, q)]) for p in ps2) for q in qs}
        qs2 = list({col_of[q]: q for q in reversed(qs)}.values())
        if len(ps2) > 1 and len(qs2) > 1:
            e_vars[1] += sum(1 for p in ps2 for q in qs2 if price[(p, q)] != INF)
            rows[1] += len(ps2) + len(qs2)
    return dict(kinds, transport_vars=e_vars, transport_rows=rows)


def _le(a: float, b: float) -> bool:
    return b == INF or (a != INF and a <= b)


def dominated(t, phases: tuple) -> tuple[int, int]:
    """(options dominated by another option of their decision, options) of ``t``."""
    grouped_terms = {k for g in phases for k in g}
    adjacent = {n: [] for n in t.node_cost}
    for k, (u, v, *_rest) in enumerate(t.edges):
        adjacent[u].append((k, 0))
        adjacent[v].append((k, 1))

    def memory(n, i):
        terms = t.node_mem_terms[n][i]
        return [sum(b for key, b in terms.items() if key in g or key not in grouped_terms)
                for g in (phases or ((),))]

    def no_worse(n, j, i):     # option j is nowhere worse than option i
        c, h, hide = t.node_cost[n], t.hidden[n], t.hide[n]
        if not (_le(c[j] - h[j], c[i] - h[i]) and _le(h[j] - hide[j], h[i] - hide[i])):
            return False
        if any(a > b for a, b in zip(memory(n, j), memory(n, i))):
            return False
        if t.sink and t.sink[0] == n and not _le(t.sink[1][j], t.sink[1][i]):
            return False
        for k, side in adjacent[n]:
            u, v, pu, qv, table, hid = t.edges[k]
            cls = pu if side == 0 else qv
            if cls[i] == cls[j]:
                continue
            if side == 1 and t.group[k] is not None:
                return False
            for other in set(qv if side == 0 else pu):
                a, b = ((cls[j], other), (cls[i], other)) if side == 0 else ((other, cls[j]), (other, cls[i]))
                ta, tb = table[a][0], table[b][0]
                if not _le(ta, tb) or (tb != INF and (ta - hid[a] > tb - hid[b] or hid[a] > hid[b])):
                    return False
        return True

    total = count = 0
    for n, costs in t.node_cost.items():
        for i in range(len(costs)):
            total += 1
            count += any(no_worse(n, j, i) for j in range(len(costs)) if j != i)
    return count, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("example", nargs="?", default="llama",
                    help="'llama' (examples.models) or a name of examples/zoo.py")
    ap.add_argument("--pins", default='{"data": 2, "tensor": 2}', help="pins, as JSON")
    ap.add_argument("--cluster", default="1x4xH100")
    args = ap.parse_args()
    pins = json.loads(args.pins)
    world = 1
    for d in pins.values():
        world *= d if isinstance(d, int) else 1
    real_tabulate, real_solve = ilp.tabulate, flat.solve_ilp
    seen = {}

    def tabulate(problem, cost):
        seen["tables"] = t = real_tabulate(problem, cost)
        seen["phases"] = cost.memory_phases
        return t

    def solve(problem, cost, *a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        sol = real_solve(problem, cost, *a, **k)
        t = seen["tables"]
        n_dom, n_opt = dominated(t, seen["phases"])
        single = sum(1 for c in t.node_cost.values() if len(c) == 1)
        print(f"ILP mesh {tuple(problem.mesh_shape)}: {len(t.node_cost)} decisions ({single} with one "
              f"option), {len(t.edges)} edges {edge_kinds(t)}; dominated options {n_dom} of {n_opt}; "
              f"{sol.n_variables} variables, {sol.n_constraints} rows; {sol.status}, objective "
              f"{sol.objective_s:.9g} s; {time.perf_counter() - t0:.1f} s wall, "
              f"{time.process_time() - c0:.1f} s CPU (pricing and CBC)", flush=True)
        return sol

    ilp.tabulate, flat.solve_ilp = tabulate, solve
    from autopar.solver.driver import solve as plan
    if args.example == "llama":
        from examples.models import EXAMPLES
        ex = EXAMPLES["llama"]()
        model, inputs, loss_fn, target = ex.model, ex.inputs, ex.loss_fn, ex.target
    else:
        from examples import zoo
        b = zoo.build(args.example)
        model, inputs, loss_fn, target = b.model, b.inputs, b.loss_fn, b.target
    p = plan(model, inputs, loss_fn, target=target, cluster=args.cluster, world_size=world,
             pins=pins, cache=False).plan
    print(f"plan: mesh {p.mesh_shape}, {p.estimate.step_time_s:.9g} s, digest {p.digest()}")


if __name__ == "__main__":
    main()
