"""Train the small GPT with autopar on every rank of this job.

    torchrun --nproc-per-node 4 examples/train_gpt.py                # the solver decides
    torchrun --nproc-per-node 4 examples/train_gpt.py --pin data=2 --pin tensor=2

Every rank builds the same model (same seed) and passes the same global batch; autopar
plans on rank 0, shares the plan, and each rank trains its shard. Rank 0 prints the plan
and the loss curve, next to the loss of the same model trained on one device.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples.gpt import gpt_factory  # noqa: E402


def parse_pins(items):
    pins = {}
    for item in items:
        key, _, value = item.partition("=")
        pins[key] = int(value) if value.isdigit() else value
    return pins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--pin", action="append", default=[], help="e.g. data=2, tensor=2, zero=3")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ex = gpt_factory(batch=args.batch, seed=0)
    single = copy.deepcopy(ex.model)          # the one-device model, for comparison

    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **parse_pins(args.pin))
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        print(f"\n{'step':>4}  {'autopar loss':>12}  {'one device':>12}")
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(single.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        # a fresh global batch each step, the same on every rank
        idx = torch.randint(0, ex.config.vocab_size, ex.inputs[0].shape, generator=gen)
        target = torch.roll(idx, -1, dims=1)
        opt.zero_grad()
        loss = pm.train_step(idx, target=target)
        opt.step()
        ref_opt.zero_grad()
        ref = ex.loss_fn(single(idx), target)
        ref.backward()
        ref_opt.step()
        if rank == 0:
            print(f"{step:>4}  {loss.item():>12.6f}  {ref.item():>12.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
