"""Step time of ZeRO-Infinity's disk tier (``offload="disk"``) against ZeRO-Offload
(``offload="optimizer"``) on the same model, ranks and batch, in one run, steps alternating
(optimizer, disk, disk, optimizer, ...) so machine noise hits both; with each plan's
predicted step time.

    python benchmarks/disk_offload_time.py [--ranks 2] [--steps 10] [--width 2048] [--layers 6]
    PYTHONPATH=. python3 benchmarks/disk_offload_time.py --cuda --ranks 1 --width 4096   # one GPU

The model is a stack of ``--layers`` square Linear+ReLU layers of ``--width`` (6 x 2048:
25.2 M parameters, 100 MB in fp32; under ``data=2, zero=2`` each rank's optimizer shard,
master copy and AdamW's two moments, is 151 MB), batch 8. Each rank prints nothing; rank 0
prints one line per mode: median step (train_step + pm.step) in ms, its pm.step part, the
plan's predicted step, and the rank's bytes in host memory / on disk.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import autopar

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    x, y = torch.randn(8, args.width), torch.randn(8, args.width)
    kw = {"cluster": f"cpu:{args.ranks}"}
    if args.cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        model, x, y, kw = model.cuda(), x.cuda(), y.cuda(), {}
    runs = {}
    for mode in ("optimizer", "disk"):
        pm = autopar.parallelize(model, (x,), nn.functional.mse_loss, target=y, data=args.ranks,
                                 offload=mode, **kw)
        runs[mode] = [pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), [], []]
    order = ["optimizer", "disk", "disk", "optimizer"]
    for i in range(args.warmup + args.steps):
        for mode in order if i % 2 == 0 else order[::-1]:
            pm, opt, total, stepped = runs[mode]
            dist.barrier()
            if args.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            pm.train_step(x, target=y)
            t1 = time.perf_counter()
            pm.step(opt)
            if mode == "disk":
                pm._offload.drain()      # the step's writes are done: the next one starts clean
            if args.cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= args.warmup:
                total.append(t2 - t0)
                stepped.append(t2 - t1)
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{plan_device(runs)}: {args.ranks} ranks, {args.layers} x Linear({args.width}) = {n / 1e6:.1f} M "
              f"parameters, medians of {2 * args.steps} timed steps per mode")
        for mode, (pm, opt, total, stepped) in runs.items():
            plan = pm.plan
            disk = pm._offload.disk_bytes() if mode == "disk" else {}
            print(f"offload={mode!r}: step {statistics.median(total) * 1e3:.0f} ms "
                  f"(pm.step {statistics.median(stepped) * 1e3:.0f} ms), predicted "
                  f"{plan.estimate.step_time_s * 1e3:.0f} ms; host {sum(plan.host_memory_bytes.values()) / 1e6:.0f} MB, "
                  f"disk {sum(plan.disk_bytes.values()) / 1e6:.0f} MB"
                  + (f" (files {disk['files'] / 1e6:.0f} MB)" if disk else ""))


def plan_device(runs) -> str:
    import torch
    pm = runs["disk"][0]
    return f"{pm.plan.cluster}" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--cuda", action="store_true", help="the model on this rank's GPU")
    a = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={a.ranks}", os.path.abspath(__file__), *sys.argv[1:]]))
    main(a)
