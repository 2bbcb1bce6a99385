"""Run by tests/test_gloo.py under torchrun: real gloo ranks, the public API.

Each case builds an example model, calls ``autopar.parallelize`` (which plans on rank 0 and
shares the plan) or loads a saved plan, trains 3 steps, and compares loss, every gradient
and the weights with the same model trained on one device in this process. Rank 0 writes
one JSON line per case: the worst errors, or the error message.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402


def run_case(case: dict) -> dict:
    ex = EXAMPLES[case["model"]]()
    plan = case.get("plan")
    if plan == "saved":
        path = case["path"]
        if dist.get_rank() == 0:
            autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                         cluster=f"cpu:{dist.get_world_size()}", **case["pins"]).save(path)
        dist.barrier()
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=path)
    else:
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **case["pins"])
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    got = parallel_run(pm, ex.inputs, ex.target)
    worst = compare(ref, got, f"{case} rank {dist.get_rank()}")
    return {"mesh": list(pm.plan.mesh_shape), "worst": worst}


def main() -> None:
    cases = json.loads(sys.argv[1])
    out = sys.argv[2]
    dist.init_process_group("gloo")
    results = []
    for case in cases:
        print(f"[rank {dist.get_rank()}] case {case}", file=sys.stderr, flush=True)
        try:
            res = {"case": case, "ok": True, **run_case(case)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-2000:]}
        # every rank's verdict: a failure on any rank fails the case
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, res)
        if dist.get_rank() == 0:
            bad = [v for v in verdicts if not v["ok"]]
            results.append(bad[0] if bad else res)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    gc.collect()       # drop every module (and its work handles) before the groups go
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
