"""One rank of ``autopar verify`` (run by torchrun; see ``autopar.verify.launch``).

Builds the model from the factory, trains it on one device and under the plan (the given
plan file, or one solved for this world with the pins), compares, and writes
``rank<R>.json`` into the spec's output folder. Every rank checks its own copy of the
parallel module's whole gradients (at every step) and weights against its own
single-device run. :func:`check_rank` is that check on a process group already set up.
"""
from __future__ import annotations

import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

import autopar
from autopar.cli_args import build_example, load_factory
from autopar.verify import compare, parallel_run, reference_run


def check_rank(spec: dict) -> dict:
    """This rank's check of ``spec`` (the keys of ``autopar.verify.launch``'s spec): the
    :class:`~autopar.verify.Check` as a dict under ``check``, with the mesh, this rank's
    coordinate and the first step's loss. A ``setup`` (``MODULE:FUNCTION``) is called with the
    ParallelModule before it trains. With ``timing`` (a number of steps), rank 0's
    dict also holds the ``TimingReport`` of ``pm.timing_report`` under ``timing``."""
    ex = build_example(spec["factory"], spec["factory_args"], meta=False)
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    plan = spec.get("plan")
    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                             plan=plan, **({} if plan else spec.get("pins") or {}))
    if spec.get("setup"):
        load_factory(spec["setup"])(pm)
    got = parallel_run(pm, ex.inputs, ex.target)
    out = {"check": asdict(compare(ref, got)), "mesh_shape": list(pm.plan.mesh_shape),
           "mesh_axes": list(pm.plan.mesh_axes), "coord": list(pm.comm.coord),
           "loss": got.losses[0]}
    if spec.get("timing"):          # predicted against measured, gathered on rank 0
        report = pm.timing_report(*ex.inputs, target=ex.target, steps=int(spec["timing"]))
        if report is not None:
            out["timing"] = report.to_dict()
    return out


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict = {"rank": rank}
    try:
        out.update(check_rank(spec))
        code = 0
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which prints it
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        code = 1
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(out))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank that failed may leave the group broken
        pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
