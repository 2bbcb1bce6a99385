"""The stage DP's cost tables worked out when read against all at once
(``stage_tables.LAZY_TABLES``; issue 40, planning time): every ``plan_stages`` call of one
frontier row's free planning, recorded once, then replayed in this process with the switch
on and off in turn, each plan compared, with the seconds and the most bytes numpy held at
once (``tracemalloc``, which numpy reports its arrays to).

    python benchmarks/stage_tables_lazy.py                       # Llama 3 405B's row
    python benchmarks/stage_tables_lazy.py --row llama3-70b --rounds 3
    python benchmarks/stage_tables_lazy.py --calls /tmp/calls.pkl # reuse a recording

A recording plans the row first (``benchmarks/frontier.py``'s free case, capture cache
included: about a minute for the 405B). Each call is replayed with the stage DP's memo
(``stage_dp._PLANNED``) cleared, so every one plans.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def record(row: str) -> list:
    """(LayerCosts, keywords) of every ``plan_stages`` call of ``row``'s free planning."""
    import frontier
    from autopar.solver import partial_recompute, pipeline_price, pipeline_search, stage_dp
    calls, planner = [], stage_dp.plan_stages

    def recorded(costs, **keywords):
        calls.append((costs, keywords))
        return planner(costs, **keywords)
    modules = (pipeline_search, pipeline_price, partial_recompute)
    for m in modules:
        m.plan_stages = recorded
    try:
        frontier.plan_case(frontier.ROWS[row], -1, 30.0)
    finally:
        for m in modules:
            m.plan_stages = planner
    return calls


def replay(calls: list) -> tuple[list, float, int]:
    """(each call's plan as a comparable tuple or its error's name, seconds, peak bytes)."""
    from autopar.solver import stage_dp
    out = []
    tracemalloc.start()
    t0 = time.perf_counter()
    for costs, keywords in calls:
        stage_dp._PLANNED.clear()
        try:
            p = stage_dp.plan_stages(costs, **keywords)
            out.append(None if p is None else (p.cuts, p.predicted_step_time, p.micro_batches,
                                               p.schedule, p.stage_times))
        except Exception as e:                    # a call that raised raises again alike
            out.append(type(e).__name__)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="llama3-405b")
    ap.add_argument("--calls", help="a recording to read, or to write where missing")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if args.calls and os.path.exists(args.calls):
        with open(args.calls, "rb") as f:
            calls = pickle.load(f)
    else:
        calls = record(args.row)
        if args.calls:
            with open(args.calls, "wb") as f:
                pickle.dump(calls, f)
    from autopar.solver import stage_tables
    print(f"{args.row}: {len(calls)} plan_stages calls")
    print(f"{'round':>5} {'tables':<8} {'seconds':>8} {'peak MB':>8}  same plans")
    first = None
    for r in range(args.rounds):
        for lazy in (True, False):
            stage_tables.LAZY_TABLES = lazy
            out, seconds, peak = replay(calls)
            first = out if first is None else first
            print(f"{r:>5} {'lazy' if lazy else 'whole':<8} {seconds:>8.1f} {peak / 1e6:>8.0f}  "
                  f"{out == first}", flush=True)
    stage_tables.LAZY_TABLES = True


if __name__ == "__main__":
    main()
