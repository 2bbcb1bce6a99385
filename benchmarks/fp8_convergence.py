"""Convergence of ``precision="fp8"`` against bf16 (issue 44): the small GPT
(``examples/gpt.py`` default config) trained as a character-level model over
``examples/data/lighthouse.txt`` on 2 gloo ranks under ``data=2``, AdamW.

Every run starts from the same weights and reads the same batches (the data and the final
loss as ``benchmarks/compression_convergence.py``: the mean loss over every window of the
text, on the fp32 master weights of the last ``LAST`` evaluations ``EVAL_EVERY`` steps apart,
averaged). The runs: bf16 (the reference), bf16 from other initial weights (how far two
bf16 runs land apart), and fp8 with each scaling recipe (``fp8_scaling="tensorwise"``,
``"rowwise"``: torchao's float8 training recipes, ``autopar.ops.fp8`` over
``torch._scaled_mm``, which runs on this CPU). The margin, from the issue: the fp8 run's
final loss within ``MARGIN`` (2%) of bf16's.

    nice python benchmarks/fp8_convergence.py                 # 300 steps, a few minutes here
    nice python benchmarks/fp8_convergence.py --steps 100 --only rowwise
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from compression_convergence import EVAL_EVERY, LAST, free_port  # noqa: E402

MARGIN = 0.02
RUNS = [("bf16", 0, {"precision": "bf16"}),
        ("bf16, seed 1", 1, {"precision": "bf16"}),
        ("fp8 tensorwise", 0, {"precision": "fp8", "fp8_scaling": "tensorwise"}),
        ("fp8 rowwise", 0, {"precision": "fp8", "fp8_scaling": "rowwise"})]


def worker(steps: int, batch: int, lr: float, out: str, only: str | None) -> None:
    import copy

    import torch
    import torch.distributed as dist

    import autopar
    from examples.gpt import gpt_factory
    from examples.train_gpt import TEXT, CharWindows, data_steps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for label, seed, pins in RUNS:
        if only and label != "bf16" and not any(k.strip() in label for k in only.split(",")):
            continue
        torch.manual_seed(seed)
        ex = gpt_factory(batch=batch, seed=seed)
        ds = CharWindows(TEXT, ex.config.block_size, stride=4, vocab_size=ex.config.vocab_size)
        ids, target = (torch.stack(x) for x in zip(*(ds[i] for i in range(batch))))
        pm = autopar.parallelize(ex.model, (ids,), ex.loss_fn, target=target, batch="per_rank",
                                 data=dist.get_world_size(), **pins)
        opt = torch.optim.AdamW(pm.parameters(), lr=lr)
        xs, ys = (torch.stack(t) for t in zip(*(ds[i] for i in range(len(ds)))))
        evals, train = [], []
        for step, (_, _, batches) in enumerate(itertools.islice(data_steps(ds, batch, pm.data_world), steps)):
            x, y = batches[pm.data_rank]
            opt.zero_grad()
            train.append(float(pm.train_step(x, target=y)))
            pm.step(opt)
            if steps - step <= LAST * EVAL_EVERY and (steps - step - 1) % EVAL_EVERY == 0:
                state = pm.full_state_dict()      # every rank takes part; rank 0 evaluates
                if rank == 0:
                    model = copy.deepcopy(ex.model)
                    model.load_state_dict(state, strict=False)
                    with torch.no_grad():
                        evals.append(float(ex.loss_fn(model(xs), ys)))
        if rank == 0:
            rows.append({"run": label, "seed": seed, "loss": sum(evals) / len(evals),
                         "train_last50": sum(train[-50:]) / len(train[-50:]),
                         "options": {k: v for k, v in pm.plan.options.pinned().items()
                                     if k in ("precision", "fp8_scaling", "data")}})
            print(f"[rank 0] {label}: final loss {rows[-1]['loss']:.4f}", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="the global batch (windows a step)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--only", help="comma-separated parts of run labels to do besides bf16, "
                    "e.g. 'rowwise'")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.batch, args.lr, args.worker, args.only)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
               "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr),
               *(["--only", args.only] if args.only else []), "--worker", out]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.load(open(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    base = next(r["loss"] for r in rows if r["run"] == "bf16")
    print(f"\nsmall GPT, {args.steps} steps of AdamW (lr {args.lr}), global batch {args.batch}, "
          f"2 gloo ranks (data=2); margin: final loss within {MARGIN:.0%} of bf16's")
    print(f"{'run':<16} {'seed':>4} {'final loss':>10} {'vs bf16':>8} {'train (last 50)':>15}  margin")
    for r in rows:
        ratio = r["loss"] / base
        print(f"{r['run']:<16} {r['seed']:>4} {r['loss']:>10.4f} {ratio:>8.4f} {r['train_last50']:>15.4f}  "
              f"{'within' if abs(ratio - 1) <= MARGIN else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
