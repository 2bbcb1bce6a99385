"""Every compiled plan of ``tests/compile_worker.py`` (``CASES``) on 2 gloo ranks, one
torchrun launch: each trains 3 SGD steps under ``compile=True`` and is compared with the
same model trained eagerly on one device (loss, every gradient, the weights), then checked
as ``tests/test_compile.py`` checks its few (``check_compiled``). Prints one row per case:
pass or the failure, its compile seconds and the launch's CPU seconds on each rank.

    python benchmarks/compiled_plans.py                 # every case (about 15 minutes cold)
    python benchmarks/compiled_plans.py --cases tensor,hf-llama

``make test`` runs three of these (``tests/test_compile.py``'s ``CORE``): on a fresh machine
Inductor compiles every kernel once (a C++ compiler run each, seconds on 2 cores), so the
whole list is a benchmark's time, not a unit test's. Exit status 1 if any case fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from compile_worker import CASES, check_compiled  # noqa: E402
from launch import torchrun_cases  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case ids (default: all)")
    args = ap.parse_args(argv)
    want = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(want) - {c["id"] for c in CASES})
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {[c['id'] for c in CASES]}")
    cases = [c for c in CASES if not want or c["id"] in want]
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        got, failed = torchrun_cases("compile_worker.py", 2, cases, Path(tmp) / "r.json",
                                     timeout=60 * 60, case_timeout=900)
    bad = 0
    print(f"{'case':<16} {'result':<8} {'compile s':>10} {'CPU s by rank':>16}  detail")
    for c in cases:
        r = got.get(c["id"])
        if r is None:
            bad += 1
            print(f"{c['id']:<16} {'no run':<8} {'':>10} {'':>16}  the launch ended before it")
            continue
        try:
            if not r["ok"]:
                raise AssertionError(r["error"])
            check_compiled(r)
            verdict, detail = "pass", f"pins {c['pins']}"
        except AssertionError as e:
            bad += 1
            verdict, detail = "FAIL", " ".join(str(e).split())[:200]
        compile_s = sum((r.get("report") or {}).get("compile_s", {}).values())
        print(f"{c['id']:<16} {verdict:<8} {compile_s:>10.1f} {str(r.get('cpu_by_rank')):>16}  {detail}")
    if failed:
        print(failed[-3000:], file=sys.stderr)
    print(f"{len(cases) - bad} of {len(cases)} cases pass")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
