"""Run by tests/test_compile.py under torchrun: ``compile=True`` plans on real gloo ranks.

Each case parallelizes an example model with its pins and ``compile=True``, trains 3 SGD
steps and compares loss, every gradient and the weights with the same model trained eagerly
on one device (``tests/equivalence.py``). It returns what says the compiled path ran: the
compile report (every program's compile seconds), this rank's parameter bytes against the
model's, and, with ``"count": true``, the functional all-gathers one compiled step issues
(ZeRO-3: a weight gathered again in backward, not saved, is gathered twice).
"""
from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import run_cases  # noqa: E402

GATHER = "_c10d_functional::all_gather_into_tensor"


def run_case(case: dict) -> dict:
    ex = EXAMPLES[case["model"]](batch=8, seed=0)
    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, compile=True,
                             **case["pins"])
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    got = parallel_run(pm, ex.inputs, ex.target)
    worst = compare(ref, got, f"{case} compiled")
    res = {"worst": worst, "report": pm.compile_report(), "options": pm.plan.options.pinned(),
           "local_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
           "model_bytes": sum(p.numel() * p.element_size() for p in ex.model.parameters())}
    if case.get("count"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            pm.train_step(*ex.inputs, target=ex.target)
        names = collections.Counter(e.name for e in prof.events())
        res["gathers"] = names[GATHER]
        res["sharded_params"] = sum(1 for a, p in pm.plan.params.items()
                                    if "S(" in "".join(map(str, pm.plan.nodes[p].outputs)))
    return res


if __name__ == "__main__":
    run_cases(run_case)
