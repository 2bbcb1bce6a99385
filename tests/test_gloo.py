"""The public API on real gloo ranks launched by torchrun (2 and 4 processes, a 2x2 mesh).

One launch per world size runs several cases, since each launch costs seconds."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from autopar.verify import Check
from equivalence import FAULT_PARAM, FAULT_STEP
from test_timing import GLOO_CASES as TIMING_CASES, check_gloo_results as check_timing

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, cases: list[dict], tmp_path) -> list[dict]:
    out = tmp_path / f"results_{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(HERE, "gloo_worker.py"), json.dumps(cases), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def check(results):
    for r in results:
        assert r["ok"], f"{r['case']}: {r['error']}\n{r.get('trace', '')}"


def test_two_ranks(tmp_path):
    cases = [
        {"model": "gpt", "pins": {"data": 2}},
        {"model": "gpt", "pins": {"tensor": 2}},
        {"model": "llama", "pins": {"data": 2, "zero": 3}},
        {"model": "resnet", "pins": {}, "shard": True},
        {"model": "mlp", "pins": {"tensor": 2}, "plan": "saved", "path": str(tmp_path / "plan2.json")},
        {"model": "mlp", "plan": "per-rank", "pins_by_rank": [{"data": 2}, {"tensor": 2}]},
        *TIMING_CASES,      # predicted against measured (tests/test_timing.py)
        # autopar verify's rank check with a planted fault (tests/equivalence.py): must fail
        {"verify": {"factory": "examples.models:gpt_factory", "factory_args": {}, "plan": None,
                    "pins": {"data": 2}, "setup": "tests.equivalence:zero_layernorm_grad_on_step_2"}},
    ]
    results = torchrun(2, cases, tmp_path)
    check(results)
    check_timing(results)
    assert [r["mesh"] for r in results[:3]] == [[2], [2], [2]]
    refused = results[5]["refused"]      # two plans passed to one job: a PlanError on each rank
    assert refused and "the ranks were given different plans" in refused and "ranks [0]" in refused, refused
    caught = results[-1]["check"]
    assert (caught["grad_worst"], caught["grad_step"]) == (FAULT_PARAM, FAULT_STEP), caught
    assert not Check(**caught).ok and caught["weight_worst"] == FAULT_PARAM, caught


def test_four_ranks_2x2_mesh(tmp_path):
    cases = [
        {"model": "gpt", "pins": {"data": 2, "tensor": 2}},
        {"model": "llama", "pins": {"data": 2, "tensor": 2}},
        {"model": "resnet", "pins": {"data": 4, "zero": 3}},
        {"model": "mlp", "pins": {}, "shard": True},
    ]
    results = torchrun(4, cases, tmp_path)
    check(results)
    assert results[0]["mesh"] == [2, 2] and results[1]["mesh"] == [2, 2]
