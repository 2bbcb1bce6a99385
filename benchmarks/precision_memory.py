"""Mixed precision: the cost model's per-rank memory for bf16 plans against the measured peak
on this CPU (the same plans in fp32 alongside).

Predicted: the plan's ``estimate.memory_total`` (parameters, gradients, optimizer state and
activations as ``cost_models`` counts them for ``precision="bf16"``). Measured exactly as
``benchmarks/cost_model_accuracy.py`` measures (its worker is reused): the bytes of the
local parameters and AdamW state plus the peak of live tensor bytes during one
``train_step`` (``PeakMemory``), the largest rank. Target (issue 10): within 15% for bf16.

    python benchmarks/precision_memory.py            # 2 ranks, ~2-4 min on 2 busy cores
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cost_model_accuracy import launch, plan_cases  # noqa: E402

PINS = [("dp2", {"data": 2}), ("zero3 dp2", {"data": 2, "zero": 3}), ("tp2", {"tensor": 2}),
        ("pp2", {"pipeline": 2})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt256", choices=["gpt256", "gpt128", "mlp"])
    args = ap.parse_args()
    cases = [(f"{args.model} {label} {prec}", args.model, 2, {**pins, "precision": prec})
             for label, pins in PINS for prec in ("bf16", "fp32")]
    with tempfile.TemporaryDirectory() as tmp:
        planned = plan_cases(cases, False, tmp)
        t0 = time.perf_counter()
        results = launch(2, planned, 1, 1, tmp)
        print(f"ran {len(planned)} cases on 2 ranks in {time.perf_counter() - t0:.0f}s")
    print(f"\n{'case':<26} {'predicted':>11} {'measured':>11} {'error':>8}")
    errs = {"bf16": [], "fp32": []}
    for c, r in zip(planned, results):
        err = c["pred_mem"] / r["meas_mem"] - 1
        errs["bf16" if "bf16" in c["label"] else "fp32"].append(abs(err))
        print(f"{c['label']:<26} {c['pred_mem'] / 2**20:9.1f}Mi {r['meas_mem'] / 2**20:9.1f}Mi {err:+8.1%}")
    for prec, e in errs.items():
        print(f"{prec}: mean abs error {sum(e) / len(e):.1%}, worst {max(e):.1%}")


if __name__ == "__main__":
    main()
