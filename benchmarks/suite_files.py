"""Where the test suite's time goes, file by file: a pytest plugin that records, for each test
file, the wall seconds and the CPU seconds of the process running it and of its children it
reaped (torchrun launches and their ranks; not Inductor's compile workers, which outlive it),
one JSON list per xdist worker, and a summary of them.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \\
        --no-loadscope-reorder -m "not slow" -p suite_files          # make test's flags, plus the plugin
    python benchmarks/suite_files.py                                   # the summary, largest first

Files go to ``$AUTOPAR_SUITE_TIMES`` (default: the system's temporary folder,
``suite_files_<worker>.json``). Measured 2026-11-30 on the 2-core machine (one helper
planning beside it; tests 1,435 s): 1,945 CPU s in all, the two workers' wall 1,391 / 1,382 s;
test_sweep 295 CPU s, test_experts 145, test_titan 107, test_hf_models 78 (docs/measured.md).
"""
from __future__ import annotations

import glob
import json
import os
import resource
import tempfile
import time

OUT = os.environ.get("AUTOPAR_SUITE_TIMES", tempfile.gettempdir())
_now = {"file": None, "wall": 0.0, "cpu": 0.0}
_rows: list[dict] = []


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _close() -> None:
    if _now["file"] is not None:
        _rows.append({"file": _now["file"], "wall": time.time() - _now["wall"], "cpu": _cpu() - _now["cpu"]})


def pytest_runtest_logstart(nodeid, location):
    name = nodeid.split("::")[0]
    if name != _now["file"]:
        _close()
        _now.update(file=name, wall=time.time(), cpu=_cpu())


def pytest_sessionfinish(session, exitstatus):
    _close()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(OUT, f"suite_files_{worker}.json"), "w") as f:
        json.dump(_rows, f, indent=0)


def main() -> None:
    rows = []
    for path in sorted(glob.glob(os.path.join(OUT, "suite_files_*.json"))):
        worker = os.path.basename(path)[len("suite_files_"):-len(".json")]
        rows += [{**r, "worker": worker} for r in json.load(open(path))]
    for w in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == w]
        print(f"{w}: {len(mine)} files, wall {sum(r['wall'] for r in mine):.0f} s, "
              f"CPU {sum(r['cpu'] for r in mine):.0f} s")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:30]:
        print(f"  {r['file']:50s} CPU {r['cpu']:7.1f} s  wall {r['wall']:7.1f} s  ({r['worker']})")


if __name__ == "__main__":
    main()
