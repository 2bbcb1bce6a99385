"""What the rewrite passes' copies cost (``passes/copy_program``, ``runtime/program_passes``):
for each example on one simulated rank, the nodes of its train program, one
``copy_program`` of it, and the seconds of building the rank's programs
(``program_passes.rank_programs``) with the copies and with them skipped (every in-place
pass editing the program the fold holds, as before the passes were declared).

    python benchmarks/pass_copy_cost.py gpt llama resnet

Measured 2026-11-29 (2 cores shared, load 13: seconds ~3-5x a quiet machine's), plain plan /
zero=3 + bf16: gpt (84 nodes) copy 54-70 ms, programs 470 vs 426 ms / 788 vs 353 ms; llama
(157 nodes) 96-126 ms, 1,422 vs 875 ms / 1,848 vs 711 ms; resnet (70 nodes) 58-82 ms,
412 vs 210 ms / 806 vs 254 ms. About 60 % of a copy is the GraphModule's code generated
again (``recompile``), which the pass then regenerates after its edit.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar.runtime.program_passes as pp  # noqa: E402
from autopar import api  # noqa: E402
from autopar.ops.comm import ThreadWorld  # noqa: E402
from autopar.passes.copy_program import copy_program  # noqa: E402
from autopar.runtime.shards import shard_model  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402

PINS = ({}, {"zero": 3, "precision": "bf16", "data": 1})


def _seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(name: str, pins: dict) -> None:
    ex = EXAMPLES[name]()
    pm = api.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                         comm=ThreadWorld((1,)).comm(0), cluster="cpu:1", **pins)
    gm = pm.runner.programs["train" if "train" in pm.runner.programs else "forward"]
    copy_s = _seconds(lambda: copy_program(gm), 5)
    cap, plan = pm._cap, pm.plan
    root, shards = shard_model(cap, plan, (0,), ex.model, torch.device("cpu"))

    def build():
        pp.rank_programs(cap, plan, False, (0,), torch.device("cpu"), root, shards.attr_of)
    with_copies = _seconds(build, 3)
    real = pp.copy_program
    pp.copy_program = lambda g: g         # the in-place passes edit the fold's own program
    try:
        in_place = _seconds(build, 3)
    finally:
        pp.copy_program = real
    print(f"{name:<10} {str(pins):<45} nodes {len(gm.graph.nodes):>5}  copy {copy_s * 1e3:7.1f} ms  "
          f"programs {with_copies * 1e3:7.1f} ms with copies, {in_place * 1e3:7.1f} ms in place", flush=True)


def main() -> None:
    for name in sys.argv[1:] or list(EXAMPLES):
        for pins in PINS:
            row(name, pins)


if __name__ == "__main__":
    main()
