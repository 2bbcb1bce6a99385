"""Run by tests/test_titan.py under torchrun: torchtitan's Llama 3 (tests/titan_llama.py)
parallelized with ``compile=True`` on real gloo ranks, 3 AdamW steps compared with one
device (loss, every gradient, the weights: tests/equivalence.py)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
import titan_llama  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = titan_llama.build()
    pm = autopar.parallelize(model, inputs, loss_fn, target=target, optimizer="adamw",
                             compile=case.get("compile", True), **case["pins"])
    ref = reference_run(model, inputs, target, loss_fn, optimizer="adamw")
    got = parallel_run(pm, inputs, target, optimizer="adamw")
    worst = compare(ref, got, f"{case} torchtitan llama3")
    return {"worst": worst, "report": pm.compile_report(), "options": pm.plan.options.pinned()}


if __name__ == "__main__":
    run_cases(run_case)
