"""Plan quality: autopar's free plan against textbook configurations, same cost model.

    python benchmarks/plan_quality.py            # every case
    python benchmarks/plan_quality.py --quick    # the cases that plan in seconds today

For GPT models from 1.3B to 175B on 8 to 1024 A100s (DGX A100 nodes; the models are built
on the meta device, so nothing is allocated), we plan once with no pins (the solver picks
the mesh, every placement and, on more than one node, whether and how to pipeline) and
once per textbook configuration, each pinned:

- ``dp``:        pure data parallelism, ``data=N``
- ``zero3``:     ZeRO-3, ``data=N, zero=3``
- ``tp8 x dp``:  Megatron tensor parallelism inside a node, ``tensor=8, data=N/8``
- ``tpT x dp``:  the grid of tensor degrees 2, 4 (and 16, 32 where N allows) times data
- ``tp8 x dp z3``: tensor 8 in a node, ZeRO-3 over the data axis (beyond one node)
- ``tp8 x ppP x dpD``: Megatron-LM's 3-D layout, tensor 8 inside a node, P pipeline stages
  of whole nodes (P = 2, 4, 8 where they divide the nodes), data D over the rest; 1F1B with
  one sample per data-parallel rank per micro-batch (``micro_batch_size=D``)

A configuration the global batch does not divide is shown with the pin error.
A configuration that does not fit in 80 GB per GPU is shown as ``OOM`` (the solver proves
that no placement under those pins fits). The check: the free plan is never predicted
slower than any configuration that fits. Each row prints the predicted step time
(``plan.estimate.step_time_s``), its memory per GPU, and the planning time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.capture import capture  # noqa: E402
from autopar.cost_models.hardware import parse_cluster  # noqa: E402
from autopar.solver.driver import plan_search  # noqa: E402
from autopar.solver.flat import plan_captured  # noqa: E402
from autopar.solver.ilp import InfeasibleError  # noqa: E402
from autopar.solver.pipeline_search import plan_pipelined  # noqa: E402
from examples.models import gpt_factory  # noqa: E402

# GPT config overrides per model
MODELS = {
    "gpt-1.3b": dict(config="gpt-1.3b"),
    "gpt-6.7b": dict(config="gpt-1.3b", n_layer=32, n_head=32, n_embd=4096),
    "gpt-13b": dict(config="gpt-1.3b", n_layer=40, n_head=40, n_embd=5120),
    "gpt-175b": dict(config="gpt-175b"),
}
# model, nodes of DGX A100, global batch, pins every row of the case shares: 175B is
# planned in mixed precision, for the free plan and the textbook ones alike (each row
# recomputes activations where it needs to, to fit in 80 GB).
CASES = [
    ("gpt-1.3b", 1, 16, {}),
    ("gpt-1.3b", 4, 64, {}),
    ("gpt-6.7b", 8, 64, {}),
    ("gpt-13b", 16, 128, {}),
    ("gpt-175b", 128, 1536, {"precision": "bf16"}),
]
QUICK = CASES[:1] + CASES[2:3]


def configs(world: int, nodes: int) -> list[tuple[str, dict]]:
    out = [("dp", {"data": world}), ("zero3", {"data": world, "zero": 3})]
    for t in (2, 4, 8, 16, 32):
        if t <= world and world % t == 0:
            out.append((f"tp{t} x dp{world // t}", {"tensor": t, "data": world // t}))
    if world > 8:   # Megatron inside the node, ZeRO-3 across (FSDP + TP)
        out.append((f"tp8 x dp{world // 8} z3", {"tensor": 8, "data": world // 8, "zero": 3}))
    for p in (2, 4, 8):   # Megatron-LM 3-D: tensor in a node, pipeline over nodes, data
        if nodes % p == 0:
            d = world // 8 // p
            out.append((f"tp8 x pp{p} x dp{d}", {"tensor": 8, "pipeline": p, "data": d,
                                                 "micro_batch_size": d, "schedule": "1f1b"}))
    return out


def plan_row(plan_fn, time_limit_s):
    t0 = time.perf_counter()
    try:
        p = plan_fn(time_limit_s)
    except InfeasibleError:
        return None, time.perf_counter() - t0, "OOM"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return p, time.perf_counter() - t0, ""


def row_planner(ex, cap, cl, world, pins):
    """How one row plans: pinned pipelines capture at their micro-batch, the free row
    searches pipelines too (on more than one node), the rest plan the captured batch."""
    if (pins.get("pipeline") or 1) > 1:
        return lambda t: plan_pipelined(ex.model, ex.inputs, ex.loss_fn, ex.target, cl, world,
                                        pins, time_limit_s=t)[0]
    if not pins.get("data") and not pins.get("tensor"):
        return lambda t: plan_search(cap, ex.model, ex.inputs, ex.loss_fn, ex.target, cl, world,
                                     pins=pins, time_limit_s=t)
    return lambda t: plan_captured(cap, cl, world, pins=pins, time_limit_s=t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the cases that plan in seconds")
    ap.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit per mesh (s)")
    args = ap.parse_args()
    cases = QUICK if args.quick else CASES
    print(f"{'model':<10}{'GPUs':>6}{'batch':>6}  {'config':<18}{'mesh':<16}{'step s':>9}"
          f"{'mem GB':>8}{'plan s':>8}  note")
    ok = True
    for name, nodes, batch, common in cases:
        world = nodes * 8
        cl = parse_cluster(f"{nodes}xdgx-a100")
        t0 = time.perf_counter()
        with torch.device("meta"):
            ex = gpt_factory(batch=batch, **MODELS[name])
        cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
        t_cap = time.perf_counter() - t0
        if common:
            print(f"{name}: every row pinned {common}")
        rows = [("free", {})] + configs(world, nodes)
        results = []
        for label, pins in rows:
            p, secs, note = plan_row(row_planner(ex, cap, cl, world, {**common, **pins}),
                                     args.time_limit)
            results.append((label, p))
            step = f"{p.estimate.step_time_s:9.3f}" if p else f"{'-':>9}"
            mem = f"{p.estimate.memory_total / 1e9:8.1f}" if p else f"{'-':>8}"
            mesh = str(tuple(p.mesh_shape)) if p else ""
            if p is not None and p.pipeline_stages > 1:
                note = (f"{p.schedule} m={p.n_microbatches}"
                        + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "") + " " + note)
            if p is not None and p.recompute:
                note = "recompute " + note
            print(f"{name:<10}{world:>6}{batch:>6}  {label:<18}{mesh:<16}{step}{mem}{secs:>8.1f}  "
                  f"{note}{' (capture %.1fs)' % t_cap if label == 'free' else ''}", flush=True)
        free = results[0][1]
        fits = [(lab, p) for lab, p in results[1:] if p is not None]
        if free is None:
            print(f"  !! no free plan for {name} on {world} GPUs")
            ok = False
            continue
        worse = [(lab, p.estimate.step_time_s) for lab, p in fits
                 if p.estimate.step_time_s < free.estimate.step_time_s * (1 - 1e-9)]
        if worse:
            ok = False
            print(f"  !! free plan ({free.estimate.step_time_s:.3f} s) is slower than "
                  + ", ".join(f"{lab} ({s:.3f} s)" for lab, s in worse))
        elif fits:
            best = min(fits, key=lambda lp: lp[1].estimate.step_time_s)
            print(f"  free plan {free.estimate.step_time_s:.3f} s <= best textbook "
                  f"{best[0]} {best[1].estimate.step_time_s:.3f} s "
                  f"({best[1].estimate.step_time_s / free.estimate.step_time_s:.2f}x)")
    print("\nfree plan never predicted slower than a textbook configuration:", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
