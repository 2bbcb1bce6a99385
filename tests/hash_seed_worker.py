"""``tests/sweep_worker.py`` with each rank under its own ``PYTHONHASHSEED`` (rank r under the
r-th of ``AUTOPAR_TEST_HASH_SEEDS``, default ``0,99``; the rank re-executes itself to take
it, keeping its pid for torchrun), so Python code that iterates a set of strings runs in
another order on each (``tests/test_capture_align.py``). Each case's result also holds every rank's fingerprint
of its own capture of the model, before any alignment (``raw_fingerprints``)."""
from __future__ import annotations

import os
import sys

SEEDS = os.environ.get("AUTOPAR_TEST_HASH_SEEDS", "0,99").split(",")
_seed = SEEDS[int(os.environ["RANK"]) % len(SEEDS)]
if os.environ.get("PYTHONHASHSEED") != _seed:
    os.environ["PYTHONHASHSEED"] = _seed
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch.distributed as dist  # noqa: E402

from sweep_worker import run_case, sc  # noqa: E402
from worker_loop import run_cases, verdict_group  # noqa: E402


def run_case_with_fingerprints(case: dict) -> dict:
    from autopar.capture import capture, fingerprint
    c = sc.Case.from_json({k: v for k, v in case.items() if k != "id"})
    b = sc.model_inputs(c)
    mine = fingerprint(capture(b.model, b.inputs, b.loss_fn, b.target))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=verdict_group())
    return {**run_case(case), "raw_fingerprints": every}


if __name__ == "__main__":
    run_cases(run_case_with_fingerprints)
