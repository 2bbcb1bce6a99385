"""The same plan every time (issue 40): a ``cpu:`` cluster's figures are measured once per
machine and kept on disk (``cost_models/machine.py``), so two planning processes give the
same plan digest, one of them with the machine loaded and its own measurement perturbed;
and the perturbation does change the plan where no figures were kept (so the equality is
the cache's doing, not a model whose plan ignores the constants)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cost_models import machine

ROOT = Path(__file__).resolve().parent.parent

# One planning process: optionally its CPU measurement slowed SLOW times (the seam:
# ``cpu._measure_cpu``, what a loaded machine's measurement looks like), then the plan of
# the small MLP on cpu:2; prints the plan's digest and the core figures it priced with.
PLAN = r"""
import json, sys
from dataclasses import replace
from autopar.cost_models import cpu
slow = float(sys.argv[1])
if slow != 1.0:
    measure = cpu._measure_cpu
    def perturbed():
        d = measure()
        return replace(d, peak_flops={k: v / slow for k, v in d.peak_flops.items()},
                       mem_bandwidth=d.mem_bandwidth / slow,
                       launch_overhead=d.launch_overhead * slow)
    cpu._measure_cpu = perturbed
from autopar.solver.driver import solve
from examples.models import EXAMPLES
ex = EXAMPLES["mlp"]()
plan = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
             world_size=2, pins={}).plan
core = cpu.cpu_core()
print(json.dumps({"digest": plan.digest(), "status": plan.solver.status,
                  "fp32": core.peak_flops["fp32"], "launch": core.launch_overhead}))
"""


def _plan(cache: Path, slow: float = 1.0, seed: str = "0") -> dict:
    env = {**os.environ, "AUTOPAR_CACHE": str(cache), "PYTHONHASHSEED": seed,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PLAN, str(slow)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _busy(seconds: float) -> subprocess.Popen:
    """A process that keeps one core busy for ``seconds`` (the loaded machine)."""
    return subprocess.Popen([sys.executable, "-c",
                             f"import time\nt = time.time() + {seconds}\nwhile time.time() < t: pass"])


def test_two_processes_plan_alike_idle_and_loaded(tmp_path):
    cache = tmp_path / "cache"
    first = _plan(cache)                                   # measures, keeps the figures
    kept = list((cache / "machine").glob("cpu-core-*.json"))
    assert len(kept) == 1, kept
    busy = _busy(120)
    try:
        second = _plan(cache, slow=3.0, seed="1")          # loaded, measuring 3x slower
    finally:
        busy.kill()
        busy.wait()
    assert second == first
    # the same perturbation with nothing kept: other figures, another plan digest
    alone = _plan(tmp_path / "fresh", slow=3.0)
    assert alone["fp32"] < first["fp32"] and alone["launch"] > first["launch"]
    assert alone["digest"] != first["digest"]


def test_kept_figures_are_rounded_and_the_first_writer_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    got = machine.measured_once("t", lambda: {"a": 123.456, "b": {"c": 0.0012345}, "n": 3})
    assert got == {"a": 120.0, "b": {"c": 0.0012}, "n": 3}
    # a later (or racing) measurement does not replace the kept figures
    assert machine.measured_once("t", lambda: {"a": 999.0}) == got
    machine._write_first(machine.cache_path("t"), {"a": 5.0}, "t")
    assert machine.measured_once("t", lambda: {"a": 999.0}) == got
    path = machine.cache_path("t")
    assert path.parent == tmp_path / "machine" and machine.machine_key() in path.name


def test_significant_digits():
    assert machine.significant(0.0) == 0.0
    assert machine.significant(1.25e-6) in (1.2e-6, 1.3e-6)
    assert machine.significant(7.25e10) == pytest.approx(7.2e10, rel=0.02)
    assert machine.significant(-345.0) == -350.0 or machine.significant(-345.0) == -340.0
    assert machine.significant(float("inf")) == float("inf")
