"""Launch many cases in one torchrun job (every case of a world size shares one spawn):
each worker script runs ``worker_loop.run_cases`` and rank 0 writes one result per case."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
NOISE = ("FutureWarning", "return func(")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cases(worker: str, nproc: int, cases: list[dict], out: Path, *,
                   timeout: float = 600, case_timeout: int = 120) -> tuple[dict, str]:
    """Run ``cases`` through ``tests/<worker>`` on ``nproc`` gloo ranks: (result by case id,
    the launch's stderr tail if it failed). A hang ends at the worker's per-case watchdog
    (``case_timeout`` seconds) with every rank's stack."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(HERE, worker), json.dumps(cases), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_CASE_TIMEOUT": str(case_timeout)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    results = json.loads(Path(out).read_text()) if Path(out).exists() else []
    log = "\n".join(x for x in proc.stderr.splitlines() if not any(w in x for w in NOISE))
    failed = ""
    if proc.returncode != 0:
        # a rank's watchdog dump (worker_loop) first: the log's tail may have lost it
        dumps = (p.read_text() for p in sorted(Path(out).parent.glob(f"{Path(out).name}.rank*.stack")))
        stacks = "".join(d[:6000] + "\n" for d in dumps if 'File "' in d)
        failed = f"torchrun failed ({proc.returncode}):\n{stacks}{log[-8000:]}"
    return {r["case"]["id"]: r for r in results}, failed


_REGISTERED: dict[tuple[str, int], list[dict]] = {}
_SPAWNED: dict[tuple[str, int], tuple[dict, str]] = {}


def register_cases(worker: str, nproc: int, cases: list[dict]) -> None:
    """Add ``cases`` to the one spawn of ``tests/<worker>`` on ``nproc`` ranks that several
    test modules share (each registers at import, i.e. at collection, before any runs)."""
    known = _REGISTERED.setdefault((worker, nproc), [])
    known += [c for c in cases if c not in known]


def shared_cases(worker: str, nproc: int, out_dir: Path, **kw) -> tuple[dict, str]:
    """:func:`torchrun_cases` of every case registered for ``worker`` on ``nproc`` ranks, run
    once per session (the first module to ask starts it; later ones read its results)."""
    key = (worker, nproc)
    if key not in _SPAWNED:
        _SPAWNED[key] = torchrun_cases(worker, nproc, _REGISTERED[key],
                                       Path(out_dir) / f"{Path(worker).stem}.json", **kw)
    return _SPAWNED[key]


def case_result(results: tuple[dict, str], case_id: str) -> dict:
    """One case's result from :func:`torchrun_cases` / :func:`shared_cases`, failing the test
    with the launch's output when the case did not run or raised."""
    got, failed = results
    r = got.get(case_id)
    assert r is not None, f"{case_id}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{case_id}: {r['error']}\n{r.get('trace', '')}"
    return r
