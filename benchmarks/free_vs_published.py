"""A published run's model planned free (bf16 pinned, nothing else) against its published
degrees pinned, by the same cost model (``benchmarks/published_runs.py`` builds both):
the plan, predicted step, bubble, memory and planning wall / CPU seconds of each.

    python benchmarks/free_vs_published.py --row 17 --batch 1920 free
    python benchmarks/free_vs_published.py --row 17 --batch 1920 published \\
        --pin micro_batch_size=128 --pin schedule=gpipe

``published``: the row's degrees (tensor, pipeline, data, expert, context), bf16 and the
row's gradient dtype pinned; ``--pin k=v`` adds or replaces pins (at a batch other than the
row's, its micro-batch and schedule may not run: DeepSeek-V3's 128-sequence micro-batches
over 16 stages need 2,048 sequences for 1F1B). Issue 40 planned DeepSeek-V3 (row 17) free
at 1,920 sequences.

Measured 2026-11-29 (2-core machine shared, load 6-15; ``PYTHONHASHSEED=0``), row 17 at
1,920 x 4,096 on 256 DGX H800 nodes:

- free, before expert axes in the free search (b08e95d): pipeline 4 x data 128 x tensor 4,
  ZeRO-3, every layer recomputed, m=1 GPipe, bubble 0.750, 35.06 s, 78.2 GiB; planned in
  987 s wall (142.8 s CPU in the main process; capture 116 s, pipeline search 590 s,
  unpipelined 280 s). One micro-batch: the micro-batch counts the 128-way batch split
  allows are 1, 3, 5 and 15, and on the ZeRO-3 stage mesh each micro-batch gathers the
  parameters again; the loss analysis does not refuse micro-batches
  (``tests/test_expert_search.py``).
- published degrees (pipeline 16 x data 2 x expert 64, micro-batches of 128: m=15, GPipe,
  since 1F1B needs m >= 16): 7.803 s, bubble 0.527, 76.0 GiB; 657 s wall, 37.5 s CPU.
- free, with expert axes: not finished within the session (after 55 minutes at load 10-15,
  the pipeline search had planned p=2's meshes and was in p=4's).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import published_runs as pr  # noqa: E402

from autopar.solver.driver import solve  # noqa: E402


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("free", "published"))
    ap.add_argument("--row", type=int, default=17)
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the row's)")
    ap.add_argument("--pin", action="append", default=[], help="k=v, a further pin")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit (s)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    run = pr.RUNS[args.row]
    if args.batch:
        run = replace(run, batch=args.batch)
    ex = pr.build(run, run.batch)
    cluster = pr.run_cluster(run)
    if args.mode == "free":
        pins = {"precision": "bf16"}
    else:
        pins = {"precision": "bf16", "grad_reduce": run.grad_reduce, "pipeline": run.pipeline,
                "data": run.data, "tensor": run.tensor}
        pins.update({k: v for k, v in (("expert", run.expert), ("context", run.context)) if v > 1})
    pins.update({k: _value(v) for k, v in (p.split("=", 1) for p in args.pin)})
    print(f"{run.name}, batch {run.batch} x {run.seq}, {cluster}, pins {pins}", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster, pins=pins,
                    time_limit_s=args.time_limit, verbose=args.verbose)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    e = plan.estimate
    pipe = (f", pipeline {plan.pipeline_stages} x m={plan.n_microbatches} {plan.schedule}, bubble "
            f"{e.bubble_fraction:.3f}" if plan.pipeline_stages > 1 else "")
    print(f"{args.mode}: mesh {plan.mesh_shape} {plan.mesh_axes}, options {plan.pins}{pipe}; "
          f"step {e.step_time_s:.4g} s, {e.memory_total / 2**30:.1f} GiB/device; planned in "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU here", flush=True)
    print("phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in plan.solver.phases.items()))


if __name__ == "__main__":
    main()
