"""The loop the torchrun workers share: run each case on every rank, gather every rank's
verdict, and let rank 0 write one result per case (the first failing rank's, if any), with
every rank's CPU seconds for it (``cpu_by_rank``) and before the first case
(``startup_cpu_by_rank``): the machine is shared, and wall time alone says little. A rank's
seconds count its reaped child processes too (``_cpu``): under ``compile=True`` Inductor
runs the C++ compiler as one, and that is most of a cold case (tests/test_titan.py).

A case that raises on one rank while the others wait in a collective would hang the launch:
every rank therefore prints the error at once (stderr) and writes it beside the results
(``<out>.rank<r>.error``, the last case that failed on rank r), and a watchdog
(``AUTOPAR_CASE_TIMEOUT`` seconds per case, default 240, pushed back by the time the rank's
threads waited for a core: :class:`Watchdog`) dumps every thread's stack and exits, so a
hang shows where each rank waits instead of ending in the test's timeout. The verdicts
are gathered on a group of their own (:func:`verdict_group`): a rank that raised and
reached the gather while its peers wait inside a collective of the case must not pair with
that collective (it did, on the default group: the peer read a verdict as the case's
object and failed with "too many values to unpack", and the real error was lost). The
dump goes to ``<out>.rank<r>.stack`` (the launch's own log keeps only its tail, where the
last rank's dump pushes out the first's), which ``launch.torchrun_cases`` shows on failure.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import resource
import sys
import threading
import time
import traceback
from typing import Callable

import torch.distributed as dist

from proc_time import waited_seconds


def _one_line(e: BaseException) -> str:
    """The error and its causes on one line (torch.distributed.pipelining's stage errors
    open with a blank line and keep the reason in ``__cause__``)."""
    parts = []
    while e is not None and len(parts) < 3:
        parts.append(f"{type(e).__name__}: {' '.join(str(e).split())}"[:300])
        e = e.__cause__
    return " <- ".join(parts)


def _cpu() -> float:
    """This process's user + system CPU seconds and its reaped children's (the compiler
    processes Inductor starts and waits for)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


class Watchdog:
    """``faulthandler``'s dump-and-exit after ``limit`` seconds of a case, its deadline moved
    back by the time this process's threads were runnable but had no core (a busy machine:
    ``proc_time.waited_seconds``, at most the wall clock of each ``POLL_S``, and by at most
    ``MAX_PUSH`` limits in all). A hang, where no thread is runnable, is not moved back. A
    thread re-arms the dump every ``POLL_S`` seconds; a rank stuck in C holding the GIL
    keeps the deadline it had."""
    POLL_S = 5.0
    MAX_PUSH = 5

    def __init__(self, file):
        self.file, self.lock, self.deadline = file, threading.Lock(), None
        threading.Thread(target=self._loop, daemon=True).start()

    def arm(self, limit: float) -> None:
        with self.lock:
            now = time.monotonic()
            self.limit, self.start, self.deadline = limit, now, now + limit
            self.seen = (now, waited_seconds())
            faulthandler.dump_traceback_later(limit, exit=True, file=self.file)

    def cancel(self) -> None:
        with self.lock:
            self.deadline = None
            faulthandler.cancel_dump_traceback_later()

    def _loop(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            with self.lock:
                if self.deadline is None:
                    continue
                now, waited = time.monotonic(), waited_seconds()
                (t, w), self.seen = self.seen, (now, waited)
                if waited is None or w is None:
                    continue
                push = min(now - t, waited - w)
                if push > 0 and self.deadline - self.start < (1 + self.MAX_PUSH) * self.limit:
                    self.deadline += push
                    faulthandler.dump_traceback_later(max(1.0, self.deadline - now), exit=True,
                                                      file=self.file)


_VERDICTS = None


def verdict_group():
    """The gloo group the loop (and ``sweep_cases.run_dist``) gathers verdicts on, made by
    every rank at once in :func:`run_cases`: none of a case's collectives can pair with it."""
    return _VERDICTS


def run_cases(run_case: Callable[[dict], dict]) -> None:
    """``argv[1]``: the cases as JSON; ``argv[2]``: where rank 0 writes the results."""
    global _VERDICTS
    cases = json.loads(sys.argv[1])
    out = sys.argv[2]
    dist.init_process_group("gloo")
    _VERDICTS = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    if rank == 0:
        with open(out, "w") as f:
            json.dump([], f)
    limit = float(os.environ.get("AUTOPAR_CASE_TIMEOUT", "240"))
    # each rank's CPU seconds before its first case (interpreter, imports, process group)
    startup = [None] * dist.get_world_size()
    dist.all_gather_object(startup, round(_cpu(), 3))
    results = []
    stack = open(f"{out}.rank{rank}.stack", "w")     # noqa: SIM115 - open until exit
    watchdog = Watchdog(stack)
    for case in cases:
        print(f"[rank {rank}] case {case}", file=sys.stderr, flush=True)
        stack.seek(0)
        stack.truncate()
        stack.write(f"rank {rank}: case {case['id'] if 'id' in case else case} still running after "
                    f"{limit:.0f} s (AUTOPAR_CASE_TIMEOUT) and the time it waited for a core; every "
                    "thread's stack:\n")
        stack.flush()
        watchdog.arm(limit)
        t0, c0 = time.perf_counter(), _cpu()
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
        res["cpu"] = round(_cpu() - c0, 3)     # this rank's CPU seconds, its children's too
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, res, group=_VERDICTS)
        watchdog.cancel()
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
