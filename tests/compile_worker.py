"""Run by tests/test_compile.py under torchrun: ``compile=True`` plans on real gloo ranks.

Each case parallelizes an example model with its pins and ``compile=True``, trains 3 SGD
steps and compares loss, every gradient and the weights with the same model trained eagerly
on one device (``tests/equivalence.py``). It returns what says the compiled path ran: the
compile report (every program's compile seconds), this rank's parameter bytes against the
model's, and, with ``"count": true``, what the functional all-gathers of one compiled step
send (ZeRO-3: a weight gathered again in backward, not saved, is sent twice; Inductor's
bucketing may merge gathers, so elements are counted, not calls).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import run_cases  # noqa: E402

GATHER = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")


def run_case(case: dict) -> dict:
    if case["model"].startswith("hf-"):        # a transformers model of the sweep's zoo
        from examples.zoo import build
        ex = build(case["model"][3:], batch=4)
    else:
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
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:
            pm.train_step(*ex.inputs, target=ex.target)
        gathered = [e.input_shapes[0] for e in prof.events() if e.name in GATHER]
        res["gathers"] = len(gathered)
        res["gathered_numel"] = sum(math.prod(s) for s in gathered)      # shards sent
        sharded = [a for a, p in pm.plan.params.items()
                   if "S(" in "".join(map(str, pm.plan.nodes[p].outputs))]
        local = dict(pm.module.named_parameters())
        res["sharded_numel"] = sum(local[a].numel() for a in sharded)
    return res


if __name__ == "__main__":
    run_cases(run_case)
