"""What the static SPMD check costs against planning (issue 43, item 1: it runs inside
``autopar.plan`` only if it costs at most 5% of planning).

For each model and pins: the seconds of ``autopar.plan`` (the solver driver on a fresh
capture, the capture cache off), of building one rank's programs (``runtime.static_verify.
Builder.build``: what ``verify --static`` does per rank before checking), of type-checking
that rank's programs (``runtime.spmd_check.check_program``, every program), and of the
whole ``verify --static`` (every rank: builds, checks, cross-rank order). Best of
``--repeat`` runs each.

    python benchmarks/static_check_cost.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import time

from autopar.capture.cache import caching
from autopar.options import Options
from autopar.runtime.spmd_check import check_program
from autopar.runtime.static_verify import Builder, static_verify
from autopar.solver.driver import solve
from cost_models.local_devices import local_cluster
from examples.models import EXAMPLES

CASES = [("gpt", 4, {"data": 2, "tensor": 2}), ("gpt", 4, {"data": 2, "tensor": 2, "zero": 3}),
         ("llama", 4, {"data": 2, "tensor": 2}), ("llama", 4, {})]


def best(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    print(f"{'model':6} {'pins':38} {'plan s':>7} {'build s':>8} {'check s':>8} {'check/plan':>10} "
          f"{'all ranks s':>11}")
    for name, world, pins in CASES:
        ex = EXAMPLES[name]()

        def plan():
            with caching(False):
                return solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                             cluster=local_cluster(world), world_size=world,
                             pins=Options.from_pins(pins))
        plan_s, got = best(plan, a.repeat)
        b = Builder(got.captured, got.plan, ex.model)
        coord = (0,) * len(got.plan.mesh_shape)
        build_s, (programs, ctx) = best(lambda: b.build(coord), a.repeat)
        check_s, _ = best(lambda: [check_program(gm, ctx[w]) for w, gm in programs.items()], a.repeat)
        all_s, results = best(lambda: static_verify(got.captured, got.plan, ex.model), 1)
        assert all(r.ok for r in results)
        print(f"{name:6} {str(pins):38} {plan_s:7.2f} {build_s:8.2f} {check_s:8.2f} "
              f"{check_s / plan_s:10.1%} {all_s:11.2f}")


if __name__ == "__main__":
    main()
