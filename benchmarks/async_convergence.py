"""Convergence of the relaxed update schemes (``staleness=``, ``param_server=`` with
``staleness=``, ``learners=`` (Crossbow), Hogwild) against the exact data-parallel run: the
sibling of ``benchmarks/compression_convergence.py``, on the same problem: the small GPT
(``examples/gpt.py`` default config) trained as a character-level model over
``examples/data/lighthouse.txt`` on 2 gloo ranks, AdamW.

Every run reads the same batches (``examples/train_gpt.py``'s ``CharWindows`` and per-rank
``DistributedSampler`` slices, ``batch="per_rank"``) for the same number of steps, and every
run is made twice, from the initial weights of seed 0 and of seed 1; each is compared with the
exact run of its seed. Crossbow's m learners split each rank's batch (the plan is made for
the global batch / m: the same windows a step). Hogwild runs 2 processes of this host on
shared parameters (``autopar.hogwild``, each with its own AdamW), each process taking half
of each global batch, so the two together read the same windows in the same steps; it is
not a torchrun job, and only its final weights are evaluated.

Reported per run and seed: the final loss (the mean loss over every window of the text on
the weights of the last ``LAST`` evaluations, ``EVAL_EVERY`` steps apart, averaged; Hogwild:
of its final weights), its ratio to the exact run's of the same seed, and the bytes each rank
sent per step, averaged over the ranks and the run (parameter servers: pushes and pulls;
Crossbow: the SMA all-reduce of the weights; Hogwild: none, the parameters are shared
memory). The margin: final loss within ``MARGIN`` of the exact run's, for both seeds.
``param_server=1`` (synchronous) is exact and shows the run-to-run noise of the exact method
(it should match to the digits shown).

    nice python benchmarks/async_convergence.py             # 300 steps
    nice python benchmarks/async_convergence.py --steps 150
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from compression_convergence import free_port  # noqa: E402

MARGIN = 0.05
EVAL_EVERY, LAST = 10, 5
SEEDS = (0, 1)
RUNS = [("exact", {}), ("param_server=1", {"param_server": 1}),
        ("staleness=1", {"staleness": 1}), ("staleness=4", {"staleness": 4}),
        ("ps=2, stale=1", {"param_server": 2, "staleness": 1}),
        ("learners=2", {"learners": 2}), ("learners=4", {"learners": 4})]


def _text(batch: int, seed: int):
    from examples.gpt import gpt_factory
    from examples.train_gpt import TEXT, CharWindows
    ex = gpt_factory(batch=batch, seed=seed)
    ds = CharWindows(TEXT, ex.config.block_size, stride=4, vocab_size=ex.config.vocab_size)
    return ex, ds


def _evaluate_model(ex, state, xs, ys) -> float:
    import torch
    model = copy.deepcopy(ex.model)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return float(ex.loss_fn(model(xs), ys))


def worker(steps: int, batch: int, lr: float, out: str) -> None:
    import torch
    import torch.distributed as dist

    import autopar
    from examples.train_gpt import data_steps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for (label, pins), seed in itertools.product(RUNS, SEEDS):
        m = pins.get("learners", 1)
        ex, ds = _text(batch, seed)
        ids, target = (torch.stack(x) for x in zip(*(ds[i] for i in range(batch // m))))
        pm = autopar.parallelize(ex.model, (ids,), ex.loss_fn, target=target, batch="per_rank",
                                 data=2, **pins)
        opt = torch.optim.AdamW(pm.parameters(), lr=lr)
        inner = pm.pm if m > 1 else pm
        reducer = inner._grad_sync.reducer
        full = sum(p.numel() * p.element_size() for p in inner.module.parameters())
        sent, evals = 0, []
        xs, ys = (torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds)))))
        world = inner.data_world
        for step, (_, _, batches) in enumerate(itertools.islice(data_steps(ds, batch, world), steps)):
            x, y = batches[inner.data_rank]
            opt.zero_grad()
            pm.train_step(x, target=y)
            pm.step(opt)
            if m > 1:
                sent += pm.wire_bytes
            elif reducer is None:
                sent += full
            else:
                sent += reducer.wire_bytes + getattr(reducer, "pull_bytes", 0)
            if steps - step <= LAST * EVAL_EVERY and (steps - step - 1) % EVAL_EVERY == 0:
                state = pm.full_state_dict()
                if rank == 0:
                    evals.append(_evaluate_model(ex, state, xs, ys))
        total = torch.tensor([float(sent)])
        dist.all_reduce(total)
        if rank == 0:
            loss = sum(evals) / len(evals)
            rows.append({"run": label, "seed": seed, "loss": loss,
                         "wire": float(total) / dist.get_world_size() / steps, "full": full})
            print(f"[rank 0] {label} seed {seed}: loss {loss:.4f}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def hogwild_rows(steps: int, batch: int, lr: float) -> list[dict]:
    """Hogwild, 2 processes, each half of every global batch, AdamW per process."""
    from functools import partial

    import torch

    import autopar
    from examples.train_gpt import data_steps
    rows = []
    for seed in SEEDS:
        ex, ds = _text(batch, seed)
        got = [b[0] for _, _, b in itertools.islice(data_steps(ds, batch, 1), steps)]
        x = torch.cat([g[0] for g in got])
        y = torch.cat([g[1] for g in got])
        model = copy.deepcopy(ex.model)
        autopar.hogwild(model, (x,), ex.loss_fn, target=y, processes=2, steps=steps,
                        batch_size=batch // 2, optimizer=partial(torch.optim.AdamW, lr=lr))
        xs, ys = (torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds)))))
        with torch.no_grad():
            loss = float(ex.loss_fn(model(xs), ys))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append({"run": "hogwild=2", "seed": seed, "loss": loss, "wire": 0.0, "full": full})
        print(f"hogwild=2 seed {seed}: loss {loss:.4f}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="the global batch (windows a step)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.batch, args.lr, args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
               "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
               "--worker", out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.load(open(out))
    rows += hogwild_rows(args.steps, args.batch, args.lr)
    base = {r["seed"]: r["loss"] for r in rows if r["run"] == "exact"}
    full = rows[0]["full"]
    print(f"\nsmall GPT, {args.steps} steps of AdamW (lr {args.lr}), global batch {args.batch}, "
          f"2 gloo ranks (Hogwild: 2 processes); seeds {SEEDS}; margin: final loss within "
          f"{MARGIN:.0%} of the exact run of the same seed")
    print(f"{'run':<15} {'loss s0':>8} {'loss s1':>8} {'vs exact':>13} {'bytes/step':>11} "
          f"{'of exact':>8}  margin")
    for label in dict.fromkeys(r["run"] for r in rows):
        rs = sorted((r for r in rows if r["run"] == label), key=lambda r: r["seed"])
        ratios = [r["loss"] / base[r["seed"]] for r in rs]
        wire = sum(r["wire"] for r in rs) / len(rs)
        print(f"{label:<15} " + " ".join(f"{r['loss']:>8.4f}" for r in rs)
              + f" {' / '.join(f'{x:.3f}' for x in ratios):>13} {wire:>11.0f} {wire / full:>8.3f}  "
              + ("within" if all(x <= 1 + MARGIN for x in ratios) else "OUTSIDE"))


if __name__ == "__main__":
    main()
