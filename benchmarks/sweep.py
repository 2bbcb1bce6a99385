"""Differential sweep: every plan must train like one device, on any model.

A generator draws cases (architecture of ``examples/zoo.py`` x plan kind x pins x loss x
world size 1-4) from a seed; each case is planned by autopar, trained 3 steps of SGD with
momentum and 3 of AdamW under the plan and on one device, and compared: the loss, every
gradient by name, the weights relative to how far each moved (``benchmarks/sweep_cases.py``).

    python benchmarks/sweep.py --cases 100 --seed 0            # 100 drawn cases
    python benchmarks/sweep.py --cases 400 --seed 1 --jobs 2 --gloo-share 0.2
    python benchmarks/sweep.py --case llama:zero3:123456        # one case again (a repro line)
    python benchmarks/sweep.py --seed 0 --cases 100 --only 17   # the 17th (from 0) of a draw
    python benchmarks/sweep.py --list --cases 20 --seed 0       # what would run

Most cases run on ranks simulated as threads (the same capture, plan, rewrite and runtime
code as under torchrun; only the communicator differs) in ``--jobs`` worker processes; a
``--gloo-share`` of them, and every pipeline (torch.distributed.pipelining needs real
process groups), on real gloo processes: one torchrun spawn per world size runs all of that
world's cases (``tests/sweep_worker.py``). A case that runs longer than ``--timeout``
seconds is a failure (its worker is killed and replaced; a hung gloo launch is ended by its
per-case watchdog and started again with the cases left).

Outcomes: PASS (an fp32 case past its tolerances by less than 0.1 is planned and run again
with the model in float64 on thread ranks: equal to one device there to 1e-7, it passes as
fp32 rounding, listed apart; ``sweep_cases.float64_recheck``; an fp32 AdamW loss past its
tolerance alone is judged again beside one device's twin whose gradient elements that are
zero in exact arithmetic stay zero, listed apart: ``sweep_cases.compare_adamw``); REFUSED (autopar raised an ``AutoparInputError``: listed apart, grouped by
the message's first line, since a refusal of a plan that could work is a bug too); FAIL
(any other exception, or a number off). Every failure prints the line that reruns it. The
exit status is 1 when any case failed.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import sweep_cases as sc  # noqa: E402
from sweep_cases import Case  # noqa: E402
from proc_time import cpu_seconds, io_progress, waited_seconds  # noqa: E402

MARK = "@@SWEEP-RESULT "
PHASE = "@@SWEEP-PHASE "
DEFAULT_TIMEOUT = 180.0


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


# ---- thread-rank cases in worker processes ---------------------------------------------------

POLL_S = 5.0           # how often a running case's worker is looked at
STALL_S = 30.0         # a worker that neither ran nor waited for a core for
STALL_CPU_S = 0.2      # more than STALL_CPU_S seconds in this long is blocked: a hang
WALL_FACTOR = 6        # and a backstop on the wall clock less the wait for a core, in timeouts


def _io_moved(io: list | None, recent: int) -> bool:
    """Whether the process did or waited for I/O in the last ``recent`` samples of ``io``
    (``proc_time.io_progress``: (blocked in state D, I/O counter) each, None unknown)."""
    window = [x for x in (io or [])[-1 - recent:] if x is not None]
    return any(blocked for blocked, _ in window) or (
        len(window) > 1 and window[-1][1] > window[0][1])


def _overdue(wall: float, cpu: list, timeout: float, waited: list | None = None,
             io: list | None = None) -> str:
    """Why a thread-rank case that has run ``wall`` seconds is to be ended ("" to let it
    run); its worker's CPU seconds sampled every ``POLL_S`` seconds in ``cpu``, and in
    ``waited`` the seconds its threads were runnable but had no core (None: not known).
    Thread ranks that wait for each other for ever neither run nor wait for a core; a case
    slowed by a busy machine does one or the other: so past ``timeout`` of wall clock it
    ends only when it has stalled (less than ``STALL_CPU_S`` run or waited for in the last
    ``STALL_S``), or used ``timeout`` CPU seconds, or run ``WALL_FACTOR`` timeouts of wall
    clock not spent waiting for a core. A process that did I/O or was blocked on it (state
    D) in the last ``STALL_S``, sampled in ``io`` (:func:`_io_moved`), has not stalled
    either: under memory pressure a case is paged in and out and may run no CPU for a while
    (issue 43: mobilevit:2d:679679 at load ~100 while packages installed, judged hung).
    (A sweep of 100 cases at load 13 failed one case at 180 s of wall clock that passed
    in 26 s at load 5; one of 1,000 at load 20-118 failed five, a worker that had not finished importing torch judged stalled at 30 s with 1-2
    CPU seconds, and a case of 36 CPU seconds ended at 1,081 s.)"""
    if cpu[0] is None or cpu[-1] is None:
        return f"timed out after {timeout:.0f} s (a hang?)" if wall > timeout else ""
    waits = waited if waited and waited[0] is not None and waited[-1] is not None else None
    used = cpu[-1] - cpu[0]
    if used > timeout:
        return f"timed out after {used:.0f} CPU seconds ({wall:.0f} s)"
    queued = min(wall, waits[-1] - waits[0]) if waits else 0.0
    if wall - queued > WALL_FACTOR * timeout:
        return f"timed out after {wall:.0f} s ({used:.0f} CPU seconds)"
    recent = int(STALL_S / POLL_S)
    if wall > timeout and len(cpu) > recent:
        moved = cpu[-1] - cpu[-1 - recent]
        if waits and len(waits) == len(cpu):
            moved += waits[-1] - waits[-1 - recent]
        if moved < STALL_CPU_S and not _io_moved(io, recent):
            return (f"no progress for {STALL_S:.0f} s after {wall:.0f} s ({used:.0f} CPU seconds): "
                    "a hang")
    return ""


class _Worker:
    """A ``sweep.py --serve`` process: reads case JSON lines, answers result lines."""

    def __init__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=_env(), cwd=str(ROOT))
        self.answers: queue.Queue = queue.Queue()
        self.phase = "start"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(json.loads(line[len(MARK):]))
            elif line.startswith(PHASE):
                self.phase = line[len(PHASE):].strip()
        self.answers.put(None)          # the process ended

    def _stderr_tail(self) -> str:
        try:
            self.log.seek(0)
            return self.log.read()[-3000:]
        except (OSError, ValueError):
            return ""

    def run(self, case: Case, timeout: float) -> tuple[dict, bool]:
        """(result, whether this worker is still usable). The case is ended by
        :func:`_overdue`: by the CPU seconds it used and the wait for a core, not the wall
        clock, so that a busy machine slows a case without failing it."""
        t0 = time.perf_counter()
        self.phase = "start"
        cpu = [cpu_seconds(self.proc.pid)]          # samples, one per POLL_S
        waited = [waited_seconds(self.proc.pid)]
        io = [io_progress(self.proc.pid)]
        try:
            self.proc.stdin.write(json.dumps(case.to_json()) + "\n")
            self.proc.stdin.flush()
            while True:
                try:
                    r = self.answers.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    cpu.append(cpu_seconds(self.proc.pid))
                    waited.append(waited_seconds(self.proc.pid))
                    io.append(io_progress(self.proc.pid))
                    why = _overdue(time.perf_counter() - t0, cpu, timeout, waited, io)
                    if why:
                        self.kill()
                        return sc.Result(case.id, "fail", f"{why} in {self.phase}", self._stderr_tail(),
                                         seconds=time.perf_counter() - t0).to_json(), False
        except (BrokenPipeError, OSError):
            r = None
        if r is None:
            code = self.proc.wait()
            return sc.Result(case.id, "fail", f"the worker process died (exit code {code})",
                             self._stderr_tail(), seconds=time.perf_counter() - t0).to_json(), False
        return r, True

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.log.close()


def serve() -> None:
    """The worker's loop: one case a line on stdin, one result line on stdout. Each
    architecture is built and captured once per worker."""
    import warnings
    warnings.filterwarnings("ignore")
    out = sys.stdout
    sys.stdout = sys.stderr           # prints of the code under test go to the log

    def phase(name):
        out.write(PHASE + name + "\n")
        out.flush()
    sc.PHASE_HOOK = phase
    for line in sys.stdin:
        if not line.strip():
            continue
        case = Case.from_json(json.loads(line))
        r = sc.run_threads(case)
        out.write(MARK + json.dumps(r.to_json()) + "\n")
        out.flush()


# ---- gloo cases: one torchrun spawn per world size -------------------------------------------

def _gloo_launch(world: int, cases: list[Case], timeout: float) -> dict:
    """Every case of one world size in torchrun spawns of ``tests/sweep_worker.py``: the
    results by case id. A launch that dies (a hang ends at the worker's per-case
    watchdog) fails the case it was in, and the cases left run in a new launch. A pipeline
    that fails by a little in fp32 is run again on gloo in float64 (it cannot run on
    thread ranks: ``sweep_cases.float64_verdict``)."""
    results = _gloo_runs(world, cases, timeout)
    again = [c for c in cases if c.kind in sc.GLOO_ONLY and sc._precision(c) is None
             and results[c.id]["status"] == "fail"
             and sc.rounding_suspect(sc.Result.from_json(results[c.id]))]
    if again:
        r64 = _gloo_runs(world, again, timeout, float64=True)
        for c in again:
            r32 = sc.Result.from_json(results[c.id])
            results[c.id] = sc.float64_verdict(r32, sc.Result.from_json(r64[c.id]),
                                               r64[c.id].get("seconds", 0.0)).to_json()
    return results


def _gloo_runs(world: int, cases: list[Case], timeout: float, float64: bool = False) -> dict:
    """One pass of :func:`_gloo_launch` (``float64``: the cases' models in float64)."""
    from launch import torchrun_cases
    results: dict = {}
    left = list(cases)
    while left:
        with tempfile.TemporaryDirectory(prefix="autopar-sweep-") as tmp:
            spec = [{"id": c.id, **c.to_json(), **({"float64": True} if float64 else {})} for c in left]
            try:
                got, failed = torchrun_cases("sweep_worker.py", world, spec, Path(tmp) / "out.json",
                                             timeout=timeout * len(left) + 120,
                                             case_timeout=int(timeout))
            except subprocess.TimeoutExpired as e:
                got, failed = {}, f"torchrun timed out: {str(e)[-2000:]}"
            errors = _rank_errors(Path(tmp) / "out.json")
        for c in left:
            r = got.get(c.id)
            if r is None:
                continue
            if r.get("ok") and "status" in r:
                res = sc.Result(**{k: r[k] for k in ("id", "status", "message", "detail", "numbers",
                                                      "mesh", "seconds")})
                if res.status == "fail" and c.kind not in sc.GLOO_ONLY and \
                        sc._precision(c) is None and sc.rounding_suspect(res):
                    res = sc.float64_recheck(c, res)     # on thread ranks, here
                results[c.id] = res.to_json()
            else:
                err = r.get("error", "no result")
                results[c.id] = sc.Result(c.id, "fail", err.splitlines()[0][:300] if err else "",
                                          r.get("trace", ""), seconds=r.get("seconds", 0)).to_json()
        rest = [c for c in left if c.id not in results]
        if rest:       # the launch ended inside rest[0]
            why = ("timed out after {:.0f} s (the worker's watchdog: a hang?)".format(timeout)
                   if "Timeout (" in failed else "the gloo launch died in this case (crash)")
            raised = [(r, e) for r, e in errors if e["case"]["id"] == rest[0].id]
            detail = failed[:8000]      # the ranks' stacks lead (launch.torchrun_cases)
            if raised:      # a rank raised, and its peers waited for it
                # the first cause, not a peer's "connection closed" once that rank had gone
                raised.sort(key=lambda re_: _secondary(re_[1]["error"]))
                r, e = raised[0]
                why = f"rank {r} raised {e['error'].splitlines()[0][:240]} (then {why})"
                detail = e.get("trace", "") + "\n" + detail
            results[rest[0].id] = sc.Result(rest[0].id, "fail", why, detail).to_json()
            rest = rest[1:]
        left = rest
    return results


def _secondary(error: str) -> bool:
    """Whether a rank's error only says a peer went away (gloo's words for it)."""
    return any(w in error for w in ("Connection closed by peer", "Connection reset by peer",
                                    "Broken pipe"))


def _rank_errors(out: Path) -> list[tuple[int, dict]]:
    """(rank, its error) from the ``<out>.rank<r>.error`` files ``tests/worker_loop.py``
    writes when a case raises on a rank."""
    found = []
    for f in sorted(out.parent.glob(out.name + ".rank*.error")):
        found.append((int(f.name.rsplit(".rank", 1)[1].split(".")[0]), json.loads(f.read_text())))
    return found


# ---- the sweep -------------------------------------------------------------------------------

class Sweep:
    """Run ``cases``: thread-rank cases on ``jobs`` worker processes, gloo cases in one
    torchrun spawn per world size (started at once, beside them). ``result(id)`` waits for
    one case; ``wait()`` for all. ``on_result(case, result)`` is called as each arrives."""

    def __init__(self, cases: list[Case], jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
                 on_result=None):
        self.cases = {c.id: c for c in cases}
        self.jobs, self.timeout, self.on_result = max(1, jobs), timeout, on_result
        self.results: dict[str, dict] = {}
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._todo: queue.Queue = queue.Queue()
        for c in cases:
            if not c.gloo:
                self._todo.put(c)

    def start(self) -> "Sweep":
        gloo = defaultdict(list)
        for c in self.cases.values():
            if c.gloo:
                gloo[c.world].append(c)
        if gloo:
            t = threading.Thread(target=self._run_gloo, args=(dict(gloo),), daemon=True)
            t.start()
            self._threads.append(t)
        for _ in range(min(self.jobs, self._todo.qsize())):
            t = threading.Thread(target=self._run_threads, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _done(self, case: Case, r: dict) -> None:
        with self._cv:
            self.results[case.id] = r
            self._cv.notify_all()
        if self.on_result is not None:
            self.on_result(case, r)

    def _run_threads(self) -> None:
        worker = None
        try:
            while True:
                try:
                    case = self._todo.get_nowait()
                except queue.Empty:
                    return
                if worker is None:
                    worker = _Worker()
                    self._workers.append(worker)
                r, usable = worker.run(case, self.timeout)
                if not usable:
                    worker.close()
                    worker = None
                self._done(case, r)
        finally:
            if worker is not None:
                worker.close()

    def _run_gloo(self, by_world: dict) -> None:
        for world in sorted(by_world):
            try:
                results = _gloo_launch(world, by_world[world], self.timeout)
            except Exception as e:  # noqa: BLE001 - every case of the launch fails with it
                results = {c.id: sc.Result(c.id, "fail", f"gloo launch: {sc.first_line(e)}").to_json()
                           for c in by_world[world]}
            for c in by_world[world]:
                self._done(c, results[c.id])

    def result(self, case_id: str, timeout: float | None = None) -> dict:
        with self._cv:
            if not self._cv.wait_for(lambda: case_id in self.results, timeout=timeout):
                raise TimeoutError(f"{case_id}: no result after {timeout} s")
            return self.results[case_id]

    def wait(self) -> dict:
        for t in self._threads:
            t.join()
        return self.results

    def stop(self) -> None:
        for w in self._workers:
            w.kill()


# ---- reporting -------------------------------------------------------------------------------

def progress_line(i: int, n: int, case: Case, r: dict) -> str:
    status = r["status"].upper()
    where = "gloo" if case.gloo else "threads"
    line = f"[{i:4d}/{n}] {status:7s} {case.id:36s} {case.describe()} ({where}, {r['seconds']:.1f}s)"
    if r["status"] != "pass":
        line += f"\n            {r['message']}"
    if r["status"] == "fail":
        line += f"\n            repro: {case.repro}"
    return line


def table(cases: list[Case], results: dict) -> str:
    """Architectures x plan kinds: passes, F failures, R refusals."""
    kinds = [k for k in sc.PLAN_KINDS if any(c.kind == k for c in cases)]
    cells: dict = defaultdict(Counter)
    for c in cases:
        r = results.get(c.id)
        cells[(c.arch, c.kind)][r["status"] if r else "missing"] += 1
    short = {"free-budget": "budget", "accumulate": "accum", "recompute": "recomp",
             "pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interl",
             "pp-zero-bubble": "zb", "per-rank": "perrank", "offload": "offld"}
    width = 7
    head = f"{'arch':14s}" + "".join(f"{short.get(k, k)[:width - 1]:>{width}s}" for k in kinds) + \
        f"{'pass':>6s}{'fail':>5s}{'ref':>5s}"
    lines = [head, "-" * len(head)]
    total = Counter()
    for arch in sorted({c.arch for c in cases}):
        row, tot = f"{arch:14s}", Counter()
        for k in kinds:
            n = cells.get((arch, k), Counter())
            tot += n
            parts = ([str(n["pass"])] if n["pass"] else []) + \
                ([f"{n['fail']}F"] if n["fail"] else []) + ([f"{n['refused']}R"] if n["refused"] else []) + \
                ([f"{n['missing']}?"] if n["missing"] else [])
            row += f"{'+'.join(parts) or '.':>{width}s}"
        total += tot
        lines.append(row + f"{tot['pass']:6d}{tot['fail']:5d}{tot['refused']:5d}")
    lines.append("-" * len(head))
    col = f"{'all':14s}"
    for k in kinds:
        n = Counter()
        for arch in {c.arch for c in cases}:
            n += cells.get((arch, k), Counter())
        frac = f"{n['pass']}/{sum(n.values())}"
        col += f"{frac:>{width}s}"
    lines.append(col + f"{total['pass']:6d}{total['fail']:5d}{total['refused']:5d}")
    lines.append("cells: passes, F failures, R refusals; the last row: passes / cases of each kind")
    return "\n".join(lines)


def report(cases: list[Case], results: dict, seconds: float) -> tuple[str, int]:
    out = [table(cases, results), ""]
    refused = defaultdict(list)
    failed = []
    for c in cases:
        r = results.get(c.id, {"status": "missing", "message": "no result"})
        if r["status"] == "refused":
            refused[r["message"]].append(c)
        elif r["status"] != "pass":
            failed.append((c, r))
    if refused:
        out.append(f"REFUSED ({sum(len(v) for v in refused.values())}), by message:")
        for msg, cs in sorted(refused.items(), key=lambda kv: -len(kv[1])):
            out.append(f"  {len(cs):3d} x {msg}")
            for c in cs[:3]:
                out.append(f"        {c.id}  ({c.describe()})")
            if len(cs) > 3:
                out.append(f"        ... and {len(cs) - 3} more")
        out.append("")
    for prefix, title in (("fp32 rounding", "PASSED ON THE FLOAT64 RECHECK ({n}): past the fp32 "
                           "tolerances by a little, equal to one device in float64"),
                          ("judged against one device on", "PASSED AGAINST THE PLAN'S SPLIT OF THE "
                           "BATCH ({n}): mixed precision, equal to one device on the plan's "
                           "micro-batches (sweep_cases.split_references)"),
                          ("AdamW's loss within", "PASSED ON ADAMW'S EXACT-ZEROS TWIN ({n}): the AdamW "
                           "loss within one device's distance from its run with the gradients' "
                           "rounding noise zeroed (sweep_cases.compare_adamw)")):
        apart = [(c, results[c.id]) for c in cases if results.get(c.id, {}).get("status") == "pass"
                 and results[c.id].get("message", "").startswith(prefix)]
        if apart:
            out.append(title.format(n=len(apart)))
            for c, r in apart:
                out.append(f"  {c.id}  {c.describe()}")
                out.append(f"      {r['message']}")
            out.append("")
    if failed:
        out.append(f"FAILED ({len(failed)}):")
        for c, r in failed:
            out.append(f"  {c.id}  {c.describe()}{'  [gloo]' if c.gloo else ''}")
            out.append(f"      {r['message']}")
            if r.get("numbers"):
                out.append(f"      {r['detail']}")
            elif r.get("detail"):
                tail = [x for x in r["detail"].strip().splitlines() if x.strip()][-4:]
                out.extend(f"      | {x[:200]}" for x in tail)
            out.append(f"      repro: {c.repro}")
        out.append("")
    n = Counter(results.get(c.id, {"status": "missing"})["status"] for c in cases)
    gloo = sum(c.gloo for c in cases)
    out.append(f"{len(cases)} cases ({gloo} on gloo processes, {len(cases) - gloo} on thread ranks): "
               f"{n['pass']} passed, {n['fail'] + n['missing']} failed, {n['refused']} refused "
               f"in {seconds:.0f} s")
    return "\n".join(out), int(bool(n["fail"] or n["missing"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=50, help="how many cases to draw (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    ap.add_argument("--case", action="append", default=[],
                    help="run this case id (ARCH:KIND:SEED[:gloo]); repeatable")
    ap.add_argument("--only", type=int, action="append", default=[],
                    help="run only the K-th drawn case (from 0); repeatable")
    ap.add_argument("--arch", action="append", default=[], help="draw only these architectures")
    ap.add_argument("--kind", action="append", default=[], help="draw only these plan kinds")
    ap.add_argument("--gloo-share", type=float, default=0.1,
                    help="share of non-pipeline cases run on gloo processes (default 0.1)")
    ap.add_argument("--jobs", type=int, default=1, help="thread-rank worker processes (default 1)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help=f"seconds a case may take before it counts as a hang (default {DEFAULT_TIMEOUT:.0f})")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--json", metavar="PATH", help="also write every case and result to PATH")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if args.case:
        cases = [sc.parse_case_id(x) for x in args.case]
    else:
        cases = sc.draw_cases(args.cases, args.seed, args.gloo_share)
        if args.arch or args.kind:
            cases = [c for c in cases if (not args.arch or c.arch in args.arch)
                     and (not args.kind or c.kind in args.kind)]
        if args.only:
            cases = [cases[k] for k in args.only]
    if args.list:
        for i, c in enumerate(cases):
            print(f"{i:4d} {c.id:36s} {c.describe()}{'  [gloo]' if c.gloo else ''}")
        return 0
    t0 = time.perf_counter()
    done = [0]
    lock = threading.Lock()

    def on_result(case, r):
        with lock:
            done[0] += 1
            print(progress_line(done[0], len(cases), case, r), flush=True)

    print(f"sweep: {len(cases)} cases, {sum(c.gloo for c in cases)} on gloo, jobs {args.jobs}, "
          f"timeout {args.timeout:.0f} s a case", flush=True)
    sweep = Sweep(cases, jobs=args.jobs, timeout=args.timeout, on_result=on_result).start()
    try:
        results = sweep.wait()
    except KeyboardInterrupt:
        sweep.stop()
        raise
    text, code = report(cases, results, time.perf_counter() - t0)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"case": {"id": c.id, **c.to_json()}, "result": results.get(c.id)} for c in cases], indent=1))
    print()
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
