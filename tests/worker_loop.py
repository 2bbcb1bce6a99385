"""The loop the torchrun workers share: run each case on every rank, gather every rank's
verdict, and let rank 0 write one result per case (the first failing rank's, if any), with
every rank's CPU seconds for it (``cpu_by_rank``) and before the first case
(``startup_cpu_by_rank``): the machine is shared, and wall time alone says little.

A case that raises on one rank while the others wait in a collective would hang the launch:
every rank therefore prints the error at once (stderr) and writes it beside the results
(``<out>.rank<r>.error``, the last case that failed on rank r), and a watchdog
(``AUTOPAR_CASE_TIMEOUT`` seconds per case, default 240) dumps every thread's stack and
exits, so a hang shows where each rank waits instead of ending in the test's timeout. The
dump goes to ``<out>.rank<r>.stack`` (the launch's own log keeps only its tail, where the
last rank's dump pushes out the first's), which ``launch.torchrun_cases`` shows on failure.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from typing import Callable

import torch.distributed as dist


def _one_line(e: BaseException) -> str:
    """The error and its causes on one line (torch.distributed.pipelining's stage errors
    open with a blank line and keep the reason in ``__cause__``)."""
    parts = []
    while e is not None and len(parts) < 3:
        parts.append(f"{type(e).__name__}: {' '.join(str(e).split())}"[:300])
        e = e.__cause__
    return " <- ".join(parts)


def run_cases(run_case: Callable[[dict], dict]) -> None:
    """``argv[1]``: the cases as JSON; ``argv[2]``: where rank 0 writes the results."""
    cases = json.loads(sys.argv[1])
    out = sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([], f)
    limit = float(os.environ.get("AUTOPAR_CASE_TIMEOUT", "240"))
    # each rank's CPU seconds before its first case (interpreter, imports, process group)
    startup = [None] * dist.get_world_size()
    dist.all_gather_object(startup, round(time.process_time(), 3))
    results = []
    stack = open(f"{out}.rank{rank}.stack", "w")     # noqa: SIM115 - open until exit
    for case in cases:
        print(f"[rank {rank}] case {case}", file=sys.stderr, flush=True)
        stack.seek(0)
        stack.truncate()
        stack.write(f"rank {rank}: case {case['id'] if 'id' in case else case} still running after "
                    f"{limit:.0f} s (AUTOPAR_CASE_TIMEOUT); every thread's stack:\n")
        stack.flush()
        faulthandler.dump_traceback_later(limit, exit=True, file=stack)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            res = {"case": case, "ok": True, **run_case(case)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"case": case, "ok": False, "error": _one_line(e),
                   "trace": traceback.format_exc()[-3000:]}
            print(f"[rank {rank}] FAILED {case}\n{res['trace']}", file=sys.stderr, flush=True)
            # the peers may now wait for this rank until the watchdog: say why first
            with open(f"{out}.rank{rank}.error", "w") as f:
                json.dump(res, f)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        res["cpu"] = round(time.process_time() - c0, 3)     # this rank's CPU seconds
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, res)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            bad = [v for v in verdicts if not v["ok"]]
            results.append({**(bad[0] if bad else res),
                            "cpu_by_rank": [v["cpu"] for v in verdicts],
                            "startup_cpu_by_rank": startup})
            print(f"[rank 0] {'ok' if not bad else 'FAIL'} in {res['seconds']:.2f}s "
                  f"(CPU s by rank {[v['cpu'] for v in verdicts]}): {case}", file=sys.stderr, flush=True)
            with open(out, "w") as f:      # after every case: a launch that dies keeps the rest
                json.dump(results, f)
    stack.close()
    os.remove(stack.name)
    gc.collect()       # drop every module (and its work handles) before the groups go
    dist.barrier()
    dist.destroy_process_group()


def on_rank0(make: Callable):
    """``make()`` on rank 0, its result on every rank: for a plan every rank must run alike
    (``autopar.plan`` on each rank can return different plans where the solver breaks a tie
    by this machine's measured op times, which a loaded machine measures differently per
    process; ``parallelize(plan=...)`` refuses plans that differ)."""
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]
