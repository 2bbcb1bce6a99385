"""Run by ``benchmarks/sweep.py`` (and ``tests/test_sweep.py``) under torchrun: the
differential sweep's cases on real gloo processes, every case of one world size in one
spawn. Each case is ``benchmarks/sweep_cases.Case`` as JSON (plus its ``id``); every rank
runs ``sweep_cases.run_dist`` (``autopar.parallelize`` as a user calls it, 3 SGD-momentum
and 3 AdamW steps, compared with one device) and rank 0 writes one result per case
(``tests/worker_loop.py``, whose per-case watchdog ends a hung launch with every rank's
stack)."""
from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
warnings.filterwarnings("ignore")

import sweep_cases as sc  # noqa: E402
from worker_loop import run_cases, verdict_group  # noqa: E402


def run_case(case: dict) -> dict:
    c = sc.Case.from_json({k: v for k, v in case.items() if k not in ("id", "float64")})
    return sc.run_dist(c, float64=case.get("float64", False), group=verdict_group())


if __name__ == "__main__":
    run_cases(run_case)
