"""Fault injection (issue 43, item 3): each kind of fault on 2 gloo ranks, and what autopar
does about it. Prints a table: fault, what autopar does, time to a clear error (or to the
checkpoint), what is kept.

Run, from the repository root::

    PYTHONPATH=. python benchmarks/faults.py             # all (about 4 minutes on 2 busy cores)
    PYTHONPATH=. python benchmarks/faults.py --quick     # without the torchrun restart chain

The faults are those of ``tests/faults_worker.py`` (the same runs ``tests/test_faults.py``
checks): a tiny MLP under ZeRO-3 over data 2, AdamW, fp32. "Time to a clear error" is
measured from the fault (the signal, the kill, the write that fails, the load) to the
moment the rank that reports it has its exception (or, for SIGTERM, its complete
checkpoint); a restart's time (torchrun starting the workers again, re-planning,
reloading) comes on top and is given separately. ``--json`` writes the events and figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from faults_worker import (CHAIN_KILLS, OOM_TIMEOUT, SAVE_TIMEOUT, STALL_TIMEOUT, events,  # noqa: E402
                           run_chain, run_inproc)


def _first(evs, case, **match):
    found = [e for e in evs if e.get("case") == case and all(e.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _resumed_bitwise(evs) -> bool:
    """Whether the run resumed after the out-of-memory error has the fault-free run's losses."""
    plain = _first(evs, "plain")["losses"]
    resumed = _first(evs, "oom_resume", rank=0)["losses"]
    return all(plain[k] == v for k, v in resumed.items())


def inproc_rows(evs) -> list[tuple[str, str, str, str]]:
    rows = []
    sig = _first(evs, "sigterm", rank=1)
    rows.append(("SIGTERM on one rank (in a step)",
                 "`autopar.Preemption`: every rank agrees at the step's end (one all-reduce), "
                 "all save `step-N` atomically; the script exits; a resume is bitwise",
                 _s(sig["done_at"] - sig["signalled_at"]) + " to a complete checkpoint",
                 f"the checkpoint of step {sig['saved_step']} (the step in progress)"))
    nan = _first(evs, "nan", rank=0)
    rows.append(("NaN in one rank's gradients",
                 "`pm.step(opt, skip_nonfinite=True)`: the step is skipped on every rank (a "
                 f"flag per rank, all-reduced), a warning names rank(s) {nan['skips'][0]}, training goes on",
                 "the same step",
                 "weights equal the run without that batch, bitwise"
                 if nan["diff_to_run_without_step"] == 0.0 else f"off by {nan['diff_to_run_without_step']:.1e}"))
    full = _first(evs, "enospc", rank=0)
    rows.append(("disk full while saving (ENOSPC on rank 1's writer)",
                 "`CheckpointError` on every rank naming the step, rank 1 and errno 28; the "
                 "temporary directory removed",
                 _s(full["seconds"]),
                 f"the previous checkpoint ({full['latest']})"))
    for kind, what in (("corrupt", "a corrupted shard (one byte flipped)"),
                       ("missing", "a missing shard file"), ("truncated", "a truncated shard file")):
        r = _first(evs, kind, rank=0)
        rows.append((f"{what} at load",
                     "`CheckpointError` on every rank before anything is read, naming the file "
                     + ("(CRC-32 saved with the checkpoint)" if kind == "corrupt" else "(sizes in .metadata)"),
                     _s(r["seconds"]), "the module's weights untouched; older checkpoints"))
    st = _first(evs, "stall", rank=0)
    rows.append(("a rank stalls in a collective",
                 f"`CollectiveError` naming {st['op']} on mesh axis '{st['axis']}', group ranks "
                 f"{st['ranks']}, the ranks to look at, the timeout",
                 _s(st["seconds"]) + f" (timeout={STALL_TIMEOUT:g} s)", "the last checkpoint"))
    oom, peer = _first(evs, "oom", rank=1), _first(evs, "oom", rank=0)
    injected = _first(evs, "oom_injected", rank=1)["injected_at"]
    rows.append(("one rank out of memory (rank 1's forward, a real allocation failure)",
                 f"`{oom['raised']}` on rank 1 naming the rank, step {oom['oom_step']} and the fixes "
                 "(batch, `memory_budget=`, more sharding), posted to the job's store; rank 0, "
                 f"waiting in a collective, raises `{peer['raised']}` beginning with that message",
                 _s(peer["raised_at"] - injected) + f" on rank 0 (its timeout was {OOM_TIMEOUT:g} s)",
                 f"the last complete checkpoint ({oom['latest']}); resumed "
                 + ("bitwise" if _resumed_bitwise(evs) else "with other losses")))
    ss = _first(evs, "save_stall", rank=0)
    rows.append(("a rank's checkpoint write stalls",
                 f"`save_step_checkpoint(..., timeout=)`: `{ss['raised']}` naming the directory and "
                 f"rank(s) {ss['ranks']} that did not finish writing (DCP on a gloo group with that "
                 "timeout); the partial `.step-N.tmp` is never picked",
                 _s(ss["seconds"]) + f" (timeout={SAVE_TIMEOUT:g} s)",
                 f"the previous checkpoint ({ss['latest']}), loaded after"))
    dw = _first(evs, "died_writing", rank=0)
    rows.append(("a rank dies while writing its shard",
                 "the survivor's save raises `CheckpointError` (another rank stopped taking part); "
                 "the partial `.step-N.tmp` is never picked, and loading it is refused naming the "
                 "newest complete one",
                 _s(dw["seconds"]), f"the previous checkpoint ({dw['latest']})"))
    return rows


def chain_rows(evs, out) -> list[tuple[str, str, str, str]]:
    rows = []
    for attempt, where in CHAIN_KILLS.items():
        kill = _first(evs, "kill", attempt=attempt, rank=1)
        surv = _first(evs, "survivor", attempt=attempt, rank=0)
        nxt = _first(evs, "start", attempt=attempt + 1, rank=0)
        if kill is None:
            continue
        to_error = _s(surv["time"] - kill["time"]) if surv else "stopped by torchrun first"
        restart = f"; restarted and resumed in {nxt['time'] - kill['time']:.1f} s" if nxt else ""
        what = (f"survivor: `{surv['raised']}` ({surv['error'].split(' (')[0][:80]}...); torchrun "
                "restarts every rank" if surv else "torchrun stops the others and restarts")
        label = {"forward": "forward", "backward": "backward", "optimizer": "the optimizer step",
                 "checkpoint": "a checkpoint write"}[where]
        rows.append((f"a rank SIGKILLed in {label}",
                     what, to_error + restart,
                     f"the last complete checkpoint (step {nxt['resumed_from']})" if nxt else "n/a"))
    pre = _first(evs, "preempted", rank=0)
    if pre and out.get("sigterm_sent"):
        rows.append(("SIGTERM to the torchrun agent (preemption)",
                     "the agent forwards it (30 s grace); `Preemption` saves at the step's end "
                     "on every rank; a new launch resumes bitwise",
                     _s(pre["time"] - out["sigterm_sent"]) + " to a complete checkpoint",
                     f"the checkpoint of step {pre['step']}"))
    return rows


def table(rows) -> str:
    lines = ["| fault | what autopar does | time to a clear error | what is kept |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the torchrun restart chain")
    ap.add_argument("--json", type=Path, help="write the events and figures here")
    args = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "inproc").mkdir()
        rc, log, secs = run_inproc(str(Path(tmp) / "inproc"))
        if rc != 0:
            sys.exit(f"the inproc launch failed ({rc}):\n{log}")
        evs = events(str(Path(tmp) / "inproc"))
        rows = inproc_rows(evs)
        report["inproc"] = {"seconds": secs, "events": evs}
        Path(tmp, "overhead").mkdir()
        rc, log, _ = run_inproc(str(Path(tmp) / "overhead"), mode="overhead")
        over = _first(events(str(Path(tmp) / "overhead")), "overhead") if rc == 0 else None
        report["overhead"] = over
        if not args.quick:
            Path(tmp, "chain").mkdir()
            out = run_chain(str(Path(tmp) / "chain"))
            cevs = events(str(Path(tmp) / "chain"))
            rows += chain_rows(cevs, out)
            report["chain"] = {**{k: v for k, v in out.items() if not k.endswith("_log")}, "events": cevs}
    print(table(rows))
    if over:
        print(f"\nper step (median of 40, tiny MLP, 2 gloo ranks): plain {over['plain'] * 1e3:.2f} ms, "
              f"with the preemption check {over['preemption_check'] * 1e3:.2f} ms, with "
              f"skip_nonfinite {over['skip_nonfinite'] * 1e3:.2f} ms; a save of "
              f"{over['shard_bytes']} shard bytes {over['save'] * 1e3:.1f} ms, its checksums "
              f"{over['checksums'] * 1e3:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
