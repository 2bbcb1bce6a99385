"""One driver: ``autopar.plan``, the CLI's ``autopar plan`` and the planning inside
``autopar.parallelize`` all call ``autopar.solver.driver.solve``, so the same model, inputs,
cluster and pins give the same plan (placements, mesh, pipeline, estimate) whichever asks.

The big cases run as processes started when the module's fixtures are first used (torchrun
with 2 gloo ranks; the CLI planning a GPT-1.3b on the meta device), so they overlap with
the in-process planning. Run as a script under torchrun, this file is that worker.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import autopar
from autopar.capture import fingerprint
from autopar.cli import cli
from autopar.cost_models.hardware import parse_cluster
from autopar.plan import Plan
from autopar.solver.driver import capture_for_plan, solve
from autopar.solver.errors import InfeasibleError, PipelineInfeasibleError
from examples.models import gpt_factory

ROOT = Path(__file__).resolve().parents[1]
GPT = "examples.models:gpt_factory"
PIN_SETS = {"unpipelined": {"tensor": 2}, "pipelined": {"pipeline": 2}}
# a preset, not cpu:2: a CPU cluster's rates are measured by each process, so two processes
# (the test, the torchrun ranks) would price the same plan slightly differently
TWO = "2xA100"
BIG = {"config": "gpt-1.3b", "batch": 2048}      # activations do not fit 80 GB unpipelined
# how long planning took, and whether the capture cache gave the graph: not the plan
TIMING = {"solve_time_s", "capture_time_s", "capture_s", "phases", "capture_cache"}


def comparable(plan) -> dict:
    """The plan as JSON data without the seconds planning took (floats to 9 digits)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMING}
        if isinstance(x, list):
            return [strip(v) for v in x]
        if isinstance(x, float):
            return float(f"{x:.9g}")
        return x
    return strip(plan.to_dict())


def assert_same_plan(a, b) -> None:
    """The fields that say what runs first (for a readable failure), then everything else."""
    for field in ("mesh_shape", "mesh_axes", "pipeline_stages", "virtual_stages",
                  "n_microbatches", "schedule", "stage_cuts", "recompute", "pins"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.nodes == b.nodes
    assert a.estimate.step_time_s == pytest.approx(b.estimate.step_time_s, rel=1e-9)
    assert comparable(a) == comparable(b)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", COLUMNS="200")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("driver")


@pytest.fixture(scope="module")
def background(workdir):
    """Processes started at once: torchrun (2 ranks) planning inside autopar.parallelize
    for each pin set; the CLI planning the big GPT on 2xdgx-a100."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                str(Path(__file__).resolve()), str(workdir)]
    big = [sys.executable, "-m", "autopar", "plan", GPT, "--meta", "--cluster", "2xdgx-a100",
           *[a for k, v in BIG.items() for a in ("--factory-args", f"{k}={v}")],
           "--pin", "accumulate=1",
           "-o", str(workdir / "big_cli.json")]
    jobs = {name: subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, cmd in (("parallelize", torchrun), ("big_cli", big))}
    yield jobs
    for p in jobs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _finish(job, timeout=900) -> str:
    out, err = job.communicate(timeout=timeout)
    assert job.returncode == 0, f"exit {job.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return out


def _cli_plan(path, *args):
    res = CliRunner().invoke(cli, ["plan", GPT, *map(str, args), "-o", str(path)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return Plan.load(path)


def _api_plan(cluster, meta=False, factory_args=None, **pins):
    with torch.device("meta") if meta else torch.device("cpu"):
        ex = gpt_factory(**(factory_args or {}))
    return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster, **pins)


@pytest.mark.parametrize("which", list(PIN_SETS))
def test_plan_cli_and_parallelize_agree(which, background, workdir):
    """For the same model, cluster and pins, autopar.plan, `autopar plan` and
    autopar.parallelize (rank 0 solves, rank 1 takes its plan) give the same plan."""
    pins = PIN_SETS[which]
    api = _api_plan(TWO, **pins)
    by_cli = _cli_plan(workdir / f"{which}_cli.json", "--cluster", TWO,
                    *[a for k, v in pins.items() for a in ("--pin", f"{k}={v}")])
    _finish(background["parallelize"], timeout=600)
    ranks = Plan.load(workdir / f"{which}_parallelize.json")
    assert api.pipeline_stages == (2 if which == "pipelined" else 1)
    assert_same_plan(api, by_cli)
    assert_same_plan(api, ranks)


def test_cli_honours_a_pipeline_pin(workdir):
    """--pin pipeline=2 --pin data=2 on 4 CPUs is a pipeline of two stages, each a data axis
    of 2 (it used to write a data x tensor plan with no pipeline, its pins saying otherwise)."""
    p = _cli_plan(workdir / "pp.json", "--cluster", "cpu:4", "--pin", "pipeline=2",
                  "--pin", "data=2")
    assert p.pipeline_stages == 2 and p.pins == {"pipeline": 2, "data": 2}
    assert p.mesh_shape == (2, 2) and p.mesh_axes == ("pipeline", "data")
    assert len(p.stage_cuts) == 1
    assert_same_plan(p, _api_plan("cpu:4", pipeline=2, data=2))


def test_big_gpt_comes_out_pipelined_from_the_cli_as_from_the_api(background, workdir):
    """GPT-1.3b with a global batch of 2048 on two DGX-A100 nodes: no unpipelined plan fits
    80 GB (its activations need about 138 GiB per device at the least); the free search
    pipelines it, from the CLI exactly as from the API. (``accumulate=1``: the whole batch a
    step. Allowed micro-batches without a pipeline, the free search accumulates 16, predicted
    faster than the pipeline; tests/test_accumulate.py tests that choice on a small model.)"""
    api = _api_plan("2xdgx-a100", meta=True, factory_args=BIG, accumulate=1)
    assert api.pipeline_stages == 2 and api.mesh_axes[0] == "pipeline"
    assert api.pins == {"accumulate": 1}
    assert api.estimate.memory_total <= parse_cluster("2xdgx-a100").device.memory_bytes
    out = _finish(background["big_cli"])
    assert "pipeline" in out
    assert_same_plan(api, Plan.load(workdir / "big_cli.json"))


def test_solve_returns_the_graph_the_plan_runs_on():
    """A pipelined plan runs on the graph captured at its micro-batch; an unpipelined one on
    the full batch; ``capture_for_plan`` gives the same graph from the plan alone."""
    ex = gpt_factory()
    for pins in PIN_SETS.values():
        plan, cap = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                          pins=pins)
        batch = cap.node(cap.inputs[0]).meta["val"].shape[0]
        assert batch == ex.inputs[0].shape[0] // plan.n_microbatches if plan.pipeline_stages > 1 \
            else batch == ex.inputs[0].shape[0]
        assert fingerprint(cap) == plan.fingerprint
        again = capture_for_plan(ex.model, ex.inputs, ex.loss_fn, ex.target, plan)
        assert fingerprint(again) == plan.fingerprint


def test_errors_are_typed():
    """A pipeline that cannot fit raises PipelineInfeasibleError (an InfeasibleError), not a
    ValueError recognised by its text."""
    ex = gpt_factory()
    with pytest.raises(PipelineInfeasibleError) as e:
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                     memory_budget=4096, pipeline=2, micro_batch_size=4, schedule="1f1b")
    assert isinstance(e.value, InfeasibleError) and "pipeline=2" in str(e.value)


# ---- the torchrun worker -------------------------------------------------------------------
def _worker(outdir: str) -> None:
    """Every rank: autopar.parallelize for each pin set; rank 0 writes the plan it runs."""
    dist.init_process_group("gloo")
    try:
        for which, pins in PIN_SETS.items():
            ex = gpt_factory()
            pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                     cluster=TWO, **pins)
            pm.train_step(*ex.inputs, target=ex.target)        # the plan runs
            if dist.get_rank() == 0:
                pm.plan.save(os.path.join(outdir, f"{which}_parallelize.json"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
