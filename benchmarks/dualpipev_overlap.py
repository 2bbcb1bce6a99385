"""DualPipeV's forward/backward pairs at once (``runtime.overlap``) against one after the other,
measured side by side on gloo ranks, with both plans' estimates.

    PYTHONPATH=. torchrun --nproc-per-node 4 benchmarks/dualpipev_overlap.py [--steps 20] [--batch 8]
    PYTHONPATH=. torchrun --nproc-per-node 4 benchmarks/dualpipev_overlap.py --fault

transformers' Mixtral of ``examples.zoo`` (2 layers, 4 experts top 2, hidden 32, sequence 16,
vocabulary 128; batch 8) under ``pipeline=2, expert=2, schedule="dualpipev",
micro_batch_size=2`` (4 micro-batches; each rank's schedule lists 3 ``OVERLAP_F_B`` pairs),
one module with ``dualpipev_overlap`` on (the default) and one with it off, the same weights.
After 3 warm-up steps each, the two take turns, one step each, ``--steps`` times (so load
from other work falls on both alike); every step ends with a barrier. Rank 0 prints the
median wall seconds of a step of each, their ratio, the CPU seconds of a step on rank 0
(this process), the pairs run at once, and each plan's estimate (``cpu:4``).

``--fault``: instead, no hang when one half of a pair fails. After a first step, rank 0's
forward of stage 0, micro-batch 3 raises on the pair's thread (``planted failure``); every
rank must end its next ``train_step`` in an error within ``--fault-limit`` seconds (the
failing rank naming the pair, the others a collective or send/recv error or a peer's
notice). Each rank prints its error and seconds and exits 0 when it ended so, else 1 (a
rank still waiting at the limit is what a hang would be: the job's 2x limit kills it)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from examples import zoo  # noqa: E402

PINS = {"pipeline": 2, "expert": 2, "schedule": "dualpipev", "micro_batch_size": 2}


def fault(args) -> int:
    """``--fault`` (module docstring)."""
    import os
    import threading
    b = zoo.build("mixtral", batch=args.batch)
    pm = autopar.parallelize(b.model, b.inputs, b.loss_fn, target=b.target,
                             timeout=args.fault_limit, **PINS)
    pm.train_step(*b.inputs, target=b.target)
    rank = dist.get_rank()
    if rank == 0:
        stage = {st.stage_index: st for _, st in pm.runner.stages["train"]}[0]
        real = stage.forward_one_chunk

        def broken(mb, *a, **k):
            if mb == 3 and threading.current_thread().name == "autopar-overlap":
                raise RuntimeError("planted failure")
            return real(mb, *a, **k)
        stage.forward_one_chunk = broken
    t = time.perf_counter()
    try:
        pm.train_step(*b.inputs, target=b.target)
        print(f"rank {rank}: no error", flush=True)
        code = 1
    except Exception as e:  # noqa: BLE001 - reported
        took = time.perf_counter() - t
        notes = " ".join(getattr(e, "__notes__", []))
        print(f"rank {rank}: {type(e).__name__} after {took:.1f} s: {str(e)[:160]!r} {notes[:200]}",
              flush=True)
        code = 0 if took < args.fault_limit else 1
    os._exit(code)      # the process group is broken: no orderly teardown


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fault", action="store_true")
    ap.add_argument("--fault-limit", type=float, default=60.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.fault:
        return fault(args)
    b = zoo.build("mixtral", batch=args.batch)
    pms = {on: autopar.parallelize(b.model, b.inputs, b.loss_fn, target=b.target,
                                   dualpipev_overlap=on, **PINS) for on in (True, False)}
    assert pms[True].runner.overlap is not None and pms[False].runner.overlap is None
    wall = {on: [] for on in pms}
    cpu = {on: [] for on in pms}
    losses = {}

    def step(on: bool, keep: bool) -> None:
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        losses[on] = float(pms[on].train_step(*b.inputs, target=b.target))
        dist.barrier()
        if keep:
            wall[on].append(time.perf_counter() - t)
            cpu[on].append(time.process_time() - c)
    for _ in range(3):
        for on in pms:
            step(on, False)
    for _ in range(args.steps):
        for on in pms:
            step(on, True)
    counts = [None] * dist.get_world_size()
    ov = pms[True].runner.overlap
    dist.all_gather_object(counts, (ov.pairs, ov.concurrent))
    if dist.get_rank() == 0:
        med = {on: statistics.median(w) for on, w in wall.items()}
        for on in (True, False):
            e = pms[on].plan.estimate
            print(f"dualpipev_overlap={on}: step {med[on] * 1e3:.1f} ms median of {args.steps} "
                  f"(min {min(wall[on]) * 1e3:.1f}, max {max(wall[on]) * 1e3:.1f}); rank 0 CPU "
                  f"{statistics.median(cpu[on]) * 1e3:.1f} ms a step; loss {losses[on]:.6f}; "
                  f"estimate {e.step_time_s * 1e3:.1f} ms (all_to_all@expert "
                  f"{e.comm.get('all_to_all@expert', 0.0) * 1e3:.1f} ms, overlapped "
                  f"{-e.comm.get('overlapped', 0.0) * 1e3:.1f} ms)", flush=True)
        est = pms[True].plan.estimate.step_time_s / pms[False].plan.estimate.step_time_s
        print(f"on / off: measured {med[True] / med[False]:.3f}, estimated {est:.3f}; pairs run "
              f"(at once) per rank: {counts}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
