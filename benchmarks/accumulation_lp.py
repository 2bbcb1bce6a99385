"""How tight the accumulation stage's bounds are on a frontier row: for each program the
stage may solve at ``k`` micro-batches (mesh x recomputation, ZeRO stage), its compute
floor (``prices.compute_floor``), its LP relaxation (``solver.lp_bound``) and, with
``--ilp``, its ILP's objective, each per micro-batch and with seconds spent.

    python benchmarks/accumulation_lp.py --row llama3-70b --k 2 --meshes 64,8x8 --ilp

A program whose bound times ``k`` is at least the best step found (``--best``, the
pipeline's 7.384 s for Llama 3 70B) is one the stage leaves unsolved
(``accumulate.search_accumulation``)."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import frontier as fr                               # noqa: E402
import published_runs as pr                         # noqa: E402
from autopar.options import check_optimizer         # noqa: E402
from autopar.pricing.costing import StepView        # noqa: E402
from autopar.pricing.prices import compute_floor, memory_floor  # noqa: E402
from autopar.solver import flat                     # noqa: E402
from autopar.solver.accumulate import capture_accumulated  # noqa: E402
from autopar.solver.driver import _spec             # noqa: E402
from autopar.solver.ilp import InfeasibleError, solve  # noqa: E402
from autopar.solver.lp_bound import lp_bound        # noqa: E402
from autopar.solver.meshes import mesh_candidates   # noqa: E402
from autopar.solver.spec import Settings            # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="llama3-70b", help=f"a frontier row: {', '.join(fr.ROWS)}")
    ap.add_argument("--k", type=int, default=2, help="micro-batches a step")
    ap.add_argument("--meshes", default="", help="e.g. 64,8x8 (default: every mesh)")
    ap.add_argument("--zero", default="0", help="ZeRO stages, e.g. 0,3")
    ap.add_argument("--rec", default="none,full", help="recomputation choices: none, full")
    ap.add_argument("--best", type=float, default=7.384, help="the best step found (s)")
    ap.add_argument("--ilp", action="store_true", help="solve each program's ILP too")
    args = ap.parse_args()
    run = fr.ROWS[args.row].run
    ex = pr.build(run, run.batch)
    spec = _spec(ex.model, ex.inputs, ex.loss_fn, ex.target, pr.run_cluster(run), None,
                 {"precision": "bf16", "grad_reduce": run.grad_reduce},
                 Settings(time_limit_s=max(30.0, run.time_limit_s)))
    t0 = time.perf_counter()
    cap = capture_accumulated(spec.model, spec.example_inputs, spec.loss_fn, spec.target, args.k)
    print(f"capture at {args.k} micro-batches: {time.perf_counter() - t0:.1f} s")
    shapes = {tuple(int(d) for d in m.split("x")) for m in args.meshes.split(",") if m}
    n_states = check_optimizer(spec.optimizer)
    view = StepView(grad_sync_scale=1.0 / args.k)
    cutoff = args.best / args.k
    for zero in (int(z) for z in args.zero.split(",")):
        pins = spec.options.replace(zero=zero) if zero else spec.options
        for shape, _, roles in mesh_candidates(spec.world, pins, None, spec.cluster.devices_per_node):
            if shapes and tuple(shape) not in shapes:
                continue
            for rec in (None if r == "none" else r for r in args.rec.split(",")):
                job = flat.MeshJob(shape, roles, rec, pins, n_states, spec.budget, spec.time_limit_s)
                problem = flat._problem(cap, shape, roles, pins.zero_stage, n_states)
                cost = flat._cost_model(cap, spec.cluster, job, view=view)
                w, c = time.perf_counter(), time.process_time()
                line = f"zero={zero} mesh {shape} recompute {rec}: "
                if memory_floor(problem, cost) > spec.budget:
                    print(line + "memory floor over the budget")
                    continue
                floor = compute_floor(problem, cost)
                bound = lp_bound(problem, cost, spec.budget, spec.time_limit_s)
                line += (f"floor {floor:.4f} s, LP {bound:.4f} s ({time.perf_counter() - w:.1f} s "
                         f"wall, {time.process_time() - c:.1f} CPU s with pricing)")
                if args.ilp:
                    w = time.perf_counter()
                    try:
                        sol = solve(problem, cost, spec.budget, spec.time_limit_s, explain=False)
                        line += f", ILP {sol.objective_s:.4f} s ({sol.status}, {time.perf_counter() - w:.1f} s)"
                    except InfeasibleError as e:
                        line += f", ILP: {str(e).splitlines()[0][:80]}"
                unsolved = max(floor, bound) >= cutoff
                print(line + (f"; >= {cutoff:.4f} s: not solved" if unsolved else "")
                      + f"; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
