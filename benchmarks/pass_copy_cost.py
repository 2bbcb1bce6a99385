"""What the rewrite passes' copies cost (``passes/copy_program``, ``runtime/program_passes``):
for each example on one simulated rank, the nodes of its train program, one
``copy_program`` of it, and the seconds of building the rank's programs
(``program_passes.rewrite``) with every in-place pass on a copy and as the fold runs them
(editing the program an earlier pass of the fold made: no copy).

    python benchmarks/pass_copy_cost.py gpt llama resnet

Measured 2026-11-29 (2 cores shared, load ~10), plain plan / zero=3 + bf16, every in-place
pass on a copy against the fold: gpt (84 nodes, one copy 17 ms) 136 vs 79 ms / 216 vs
73 ms; llama (157 nodes, 23-26 ms) 235 vs 163 ms / 364 vs 157 ms. So the fold edits what
it made (``program_passes.rewrite``) and copies only what it did not.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import replace
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

    whiches = ("train", "forward") if cap.has_loss else ("forward",)
    copying = tuple(replace(ps, edit=None) for ps in pp.PASSES)   # every in-place pass copies

    def build(passes):
        for which in whiches:
            pp.rewrite(pp.RankProgram(which, cap, plan, False, (0,), torch.device("cpu"), root,
                                      shards.attr_of), passes)
    with_copies = _seconds(lambda: build(copying), 3)
    in_place = _seconds(lambda: build(pp.PASSES), 3)
    print(f"{name:<10} {str(pins):<45} nodes {len(gm.graph.nodes):>5}  copy {copy_s * 1e3:7.1f} ms  "
          f"programs {with_copies * 1e3:7.1f} ms with copies, {in_place * 1e3:7.1f} ms in place", flush=True)


def main() -> None:
    for name in sys.argv[1:] or list(EXAMPLES):
        for pins in PINS:
            row(name, pins)


if __name__ == "__main__":
    main()
