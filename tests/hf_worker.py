"""Run by tests/test_hf_models.py under torchrun: Hugging Face models on real gloo ranks.

Each case names an architecture of ``test_hf_models.MATRIX`` and the pins of one plan;
every rank builds the same tiny model (same seed), ``autopar.parallelize`` plans it (rank 0
solves, the others take its plan), then 3 SGD-momentum steps are compared with one device:
the loss of every step, every gradient by parameter name and the weights after the steps
(``tests/equivalence.py``). Rank 0 writes one JSON result per case (``worker_loop``).
"""
from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from test_hf_models import MATRIX  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def run_case(case: dict) -> dict:
    t0 = time.perf_counter()
    b = MATRIX[case["name"]].build()
    pm = autopar.parallelize(b.model, b.inputs, b.loss_fn, target=b.target, **case["pins"])
    t1 = time.perf_counter()
    ref = reference_run(b.model, b.inputs, b.target, b.loss_fn)
    got = parallel_run(pm, b.inputs, b.target)
    worst = compare(ref, got, f"{case['id']}")
    sharded = sum(p.numel() for p in pm.parameters()) < sum(p.numel() for p in b.model.parameters())
    return {"worst": worst, "mesh": list(pm.plan.mesh_shape), "sharded_params": sharded,
            "phases": {"plan": round(t1 - t0, 2), "train": round(time.perf_counter() - t1, 2)}}


if __name__ == "__main__":
    run_cases(run_case)
