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
    once per session (the first module to ask starts it; later ones read its results).

    Under pytest-xdist every worker process collects every module, so each registered the
    same cases; the modules that read them may run on different workers (``--dist
    loadfile``), and each worker spawned the whole list again (the fresh clone of session
    27 ran the zero_worker spawn twice: 67 s in test_experts, 51 s in
    test_shared_conversions). The workers of one run share it through :func:`_across_workers`:
    the first to ask runs it, the others wait on its lock and read its results."""
    key = (worker, nproc)
    if key not in _SPAWNED:
        def spawn() -> tuple[dict, str]:
            return torchrun_cases(worker, nproc, _REGISTERED[key],
                                  Path(out_dir) / f"{Path(worker).stem}.json", **kw)
        _SPAWNED[key] = _across_workers(f"{Path(worker).stem}-{nproc}", spawn)
    return _SPAWNED[key]


SHARED_DIR_ENV = "AUTOPAR_TEST_SHARED_DIR"
"""A folder the pytest-xdist workers of one run share (set by ``tests/conftest.py`` in the
controller, which removes it when the session ends); unset without xdist."""


def _across_workers(name: str, spawn) -> tuple[dict, str]:
    """``spawn()`` once for every xdist worker of this run: under an exclusive lock on
    ``<shared dir>/<name>.lock``, the results of the worker that ran it first
    (``<name>.json``), else ``spawn()``'s, written there for the others."""
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared or not os.path.isdir(shared):
        return spawn()
    import fcntl
    done = Path(shared) / f"{name}.json"
    with open(Path(shared) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        if done.exists():
            results, failed = json.loads(done.read_text())
            return results, failed
        results, failed = spawn()
        done.write_text(json.dumps([results, failed]))
        return results, failed


def case_result(results: tuple[dict, str], case_id: str) -> dict:
    """One case's result from :func:`torchrun_cases` / :func:`shared_cases`, failing the test
    with the launch's output when the case did not run or raised."""
    got, failed = results
    r = got.get(case_id)
    assert r is not None, f"{case_id}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{case_id}: {r['error']}\n{r.get('trace', '')}"
    return r
