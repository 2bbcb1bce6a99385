"""Convergence of the lossy data-parallel pins (``compress=``, ``local_sgd=``, ``averaging=``)
against the exact all-reduce: the small GPT (``examples/gpt.py`` default config) trained as a
character-level model over ``examples/data/lighthouse.txt`` on 2 gloo ranks.

Every run starts from the same weights and reads the same batches (``examples/train_gpt.py``'s
``CharWindows`` and per-rank ``DistributedSampler`` slices, ``batch="per_rank"``), AdamW.
Reported per run: the final loss (the mean loss over every window of the text, evaluated
on the weights of the last ``LAST`` evaluations, ``EVAL_EVERY`` steps apart, and averaged:
one evaluation moves with the last few batches), its ratio to the uncompressed run's, and
the bytes of gradient (or, under local SGD, parameter) traffic each rank sent per step,
averaged over the run (at 2 ranks a ring all-reduce of S bytes and an all-gather of S bytes
per rank both send S per rank), and the worker-steps (data ranks that ran forward and
backward, summed over the steps) over the exact run's (below 1 only under ``workers=``,
Accordion's batch-size form, whose idle ranks skip the step). The margin: final loss within ``MARGIN`` of the uncompressed run's; the
uncompressed run from other initial weights ("none, seed 1") shows how far two exact runs
land apart.

``--seeds N`` runs each of them from N initial weights (``gpt_factory(seed=...)``) and compares each with the exact run of the same seed;
``--nproc N`` trains on N ranks (default 2; a ring of 2 is one pair); ``--only a,b`` keeps the runs whose label starts with one of those (the exact run always
runs). Under ``averaging=`` and local SGD the model evaluated is the ranks' average.

    nice python benchmarks/compression_convergence.py            # 300 steps, ~6-10 min on 2 busy cores
    nice python benchmarks/compression_convergence.py --steps 400
    nice python benchmarks/compression_convergence.py --seeds 2 --only nuq,accordion,averaging
    nice python benchmarks/compression_convergence.py --seeds 2 --only workers
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MARGIN = 0.05
EVAL_EVERY, LAST = 10, 5       # the final loss: the mean of the last 5 evaluations, 10 steps apart
RUNS = [("none", {}), ("none, seed 1", {"seed": 1}), ("bf16", {"compress": "bf16"}), ("int8", {"compress": "int8"}),
        ("topk:0.1", {"compress": "topk:0.1"}), ("topk:0.01", {"compress": "topk:0.01"}),
        ("powersgd:4", {"compress": "powersgd:4"}), ("powersgd:1", {"compress": "powersgd:1"}),
        ("local_sgd=4", {"local_sgd": 4, "local_sgd_warmup": 20}),
        ("local_sgd=16", {"local_sgd": 16, "local_sgd_warmup": 20}),
        ("nuq:4", {"compress": "nuq:4"}), ("nuq:8", {"compress": "nuq:8"}),
        ("accordion:powersgd:1:4", {"compress": "accordion:powersgd:1:4"}),
        ("accordion:topk:0.01:0.1", {"compress": "accordion:topk:0.01:0.1"}),
        ("averaging=decentralized", {"averaging": "decentralized"}),
        ("averaging=async", {"averaging": "async"}),
        ("averaging=async, period 4", {"averaging": "async", "averaging_period": 4}),
        ("workers=accordion:1:2", {"workers": "accordion:1:2"}),
        ("workers=accordion:1:2, lr constant", {"workers": "accordion:1:2", "workers_lr": "constant"})]


def chosen(only: str | None, seeds: int) -> list[tuple[str, int, dict]]:
    """(label, seed, pins) of each run: the exact run first for every seed."""
    keep = [w.strip() for w in only.split(",")] if only else None
    runs = [(label, pins) for label, pins in RUNS
            if label == "none" or (keep is None and "seed" not in label)
            or (keep is not None and any(label.startswith(k) for k in keep))]
    if seeds == 1 and keep is None:
        runs = [(label, pins) for label, pins in RUNS]      # as before: "none, seed 1" too
        return [(label, 0, pins) for label, pins in runs]
    return [(label, seed, {**pins, "seed": seed}) for seed in range(seeds) for label, pins in runs]


def worker(steps: int, batch: int, lr: float, out: str, only: str | None = None, seeds: int = 1) -> None:
    import itertools

    import torch
    import torch.distributed as dist

    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    import autopar
    from autopar.runtime.updates.averaging import ModelAveraging
    from autopar.runtime.updates.compression import LocalSGD
    from examples.gpt import gpt_factory
    from examples.train_gpt import TEXT, CharWindows, data_steps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for label, seed, pins in chosen(only, seeds):
        pins = dict(pins)
        torch.manual_seed(seed)
        ex = gpt_factory(batch=batch, seed=pins.pop("seed", 0))
        ds = CharWindows(TEXT, ex.config.block_size, stride=4, vocab_size=ex.config.vocab_size)
        ids, target = (torch.stack(x) for x in zip(*(ds[i] for i in range(batch))))
        pm = autopar.parallelize(ex.model, (ids,), ex.loss_fn, target=target, batch="per_rank",
                                 data=dist.get_world_size(), **pins)
        opt = torch.optim.AdamW(pm.parameters(), lr=lr)
        reducer = pm._grad_sync.reducer
        sync = pm._grad_sync     # the gradients summed over the data axis (0) each step
        full = sum(p.numel() * p.element_size() for a, p in sync.params.items() if 0 in sync.axes_of[a])
        wire, evals = 0, []
        xs, ys = (torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds)))))

        def evaluate() -> None:
            """The mean loss over every window of the text (rank 0, a copy of the weights;
            under local SGD, of the ranks' average)."""
            params = list(pm.parameters())
            own = [p.data for p in params]
            if isinstance(reducer, ModelAveraging):
                reducer.wait()          # no collective of its in flight beside this one
            if isinstance(reducer, (LocalSGD, ModelAveraging)):
                average_parameters(iter(params), reducer.group)
            state = pm.full_state_dict()
            for p, d in zip(params, own):      # training goes on from each rank's own
                p.data = d
            if rank == 0:
                model = copy.deepcopy(ex.model)
                model.load_state_dict(state, strict=False)
                with torch.no_grad():
                    evals.append(float(ex.loss_fn(model(xs), ys)))
        for step, (_, _, batches) in enumerate(itertools.islice(data_steps(ds, batch, pm.data_world), steps)):
            x, y = batches[pm.data_rank]
            opt.zero_grad()
            pm.train_step(x, target=y)
            pm.step(opt)
            wire += full if reducer is None else reducer.wire_bytes
            if steps - step <= LAST * EVAL_EVERY and (steps - step - 1) % EVAL_EVERY == 0:
                evaluate()
        if rank == 0:
            loss = sum(evals) / len(evals)
            counts = getattr(reducer, "counts", None)      # workers=: ranks that trained, by step
            rows.append({"run": label, "seed": seed, "loss": loss, "wire": wire / steps, "full": full,
                         "compute": sum(counts) / (steps * dist.get_world_size()) if counts else 1.0,
                         "critical": (sum(reducer.history) / len(reducer.history)
                                      if getattr(reducer, "history", None) else None)})
            print(f"[rank 0] {label}: loss {loss:.4f}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="the global batch (windows a step)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, default=1, help="initial weights per run (each compared "
                    "with the exact run of its seed)")
    ap.add_argument("--only", help="comma-separated label prefixes of the runs to do (the exact "
                    "run always runs), e.g. 'nuq,accordion,averaging'")
    ap.add_argument("--nproc", type=int, default=2, help="gloo ranks (the data-parallel degree)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.batch, args.lr, args.worker, args.only, args.seeds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
               "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
               "--seeds", str(args.seeds), *(["--only", args.only] if args.only else []),
               "--worker", out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.load(open(out))
    base = {r.get("seed", 0): r["loss"] for r in rows if r["run"] == "none"}
    print(f"\nsmall GPT, {args.steps} steps of AdamW (lr {args.lr}), global batch {args.batch}, "
          f"{args.nproc} gloo ranks; margin: final loss within {MARGIN:.0%} of the uncompressed run of the same seed")
    w = max(26, *(len(r["run"]) for r in rows))
    print(f"{'run':<{w}} {'seed':>4} {'final loss':>10} {'vs none':>8} {'bytes/step':>11} {'of none':>8} "
          f"{'compute':>8}  margin")
    for r in rows:
        ratio = r["loss"] / base[r.get("seed", 0)]
        crit = f"  (critical {r['critical']:.0%} of steps)" if r.get("critical") is not None else ""
        print(f"{r['run']:<{w}} {r.get('seed', 0):>4} {r['loss']:>10.4f} {ratio:>8.3f} {r['wire']:>11.0f} "
              f"{r['wire'] / r['full']:>8.3f} {r.get('compute', 1.0):>8.3f}  "
              f"{'within' if ratio <= 1 + MARGIN else 'OUTSIDE'}{crit}")


if __name__ == "__main__":
    main()
