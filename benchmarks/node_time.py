"""Cost of pricing one node with the roofline model (goal: under 50 us a call).

    python benchmarks/node_time.py

The solver prices every option of every decision, so ``cost_models.compute.node_time`` is
on the planner's hot path. The figure is the best of 5 runs of 5000 calls pricing a bf16
``aten.linear`` of [4, 512, 1024] x [4096, 1024] on an A100 (was a timed unit test; timing
belongs here, where the machine's load is printed beside it).
"""
from __future__ import annotations

import os
import time

import torch

from autopar.cost_models.compute import node_time
from autopar.cost_models.hardware import A100_80GB
from autopar.sharding.registry import TensorMeta

aten = torch.ops.aten
GOAL_S = 50e-6


def _meta(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), torch.bfloat16)


def main(calls: int = 5000, runs: int = 5) -> float:
    x, w, b = _meta(4, 512, 1024), _meta(4096, 1024), _meta(4096)
    args = (aten.linear.default, [x, w, b], [_meta(4, 512, 4096)], (x, w, b), {})
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            node_time(*args, device=A100_80GB, dtype_key="bf16")
        best = min(best, (time.perf_counter() - t0) / calls)
    load = os.getloadavg()[0]
    verdict = "meets" if best < GOAL_S else "misses"
    print(f"node_time: {best * 1e6:.1f} us per call (best of {runs} x {calls}; goal "
          f"{GOAL_S * 1e6:.0f} us: {verdict}); load average {load:.1f}")
    return best


if __name__ == "__main__":
    main()
