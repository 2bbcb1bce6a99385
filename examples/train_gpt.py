"""Train the small GPT with autopar on every rank of this job, from a DataLoader per rank.

    torchrun --nproc-per-node 4 examples/train_gpt.py                # the solver decides
    torchrun --nproc-per-node 4 examples/train_gpt.py --pin data=2 --pin tensor=2
    torchrun --nproc-per-node 2 examples/train_gpt.py --batch-mode global

    # survive a dead rank: checkpoint every 5 steps, restart up to 3 times, resume each time
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \
        examples/train_gpt.py --pin data=2 --checkpoint-dir ckpt --checkpoint-every 5 --resume

The data: a character-level language model over a small text file
(``examples/data/lighthouse.txt``, a few KB written for this example), cut into windows of
the model's block size. Every rank builds the same model (same seed); autopar plans on rank
0 and shares the plan. With ``--batch-mode per_rank`` (the default) each rank reads its own
slice through a ``DistributedSampler(num_replicas=pm.data_world, rank=pm.data_rank)`` (ranks
with the same data rank read the same slice); with ``global`` every rank reads the whole
global batch. Rank 0 prints the plan and the loss curve, next to the loss of the same model
trained on one device on the concatenation of the data ranks' slices.

Checkpoints (``--checkpoint-dir``): every ``--checkpoint-every`` steps and at the end, each
rank writes its shards of the weights and AdamW's moments to ``DIR/step-<N>``
(``autopar.checkpoint.save_step_checkpoint``: into a temporary directory renamed when
complete, so a rank killed mid-save never leaves a checkpoint half written), with the data
position (epoch, batches read in it) and the RNG state in ``extra``; the two newest are
kept. ``--resume`` starts from the newest complete one (``latest_checkpoint``), or from
scratch when there is none, so the same command serves the first launch and every restart
``torchrun --max-restarts`` makes (SIGTERM, a scheduler's preemption, writes one of the
step in progress and exits: ``autopar.Preemption``); the data order goes on where the checkpoint left it, and
the one-device model on rank 0 replays the steps before it, so the two columns still
compare the same training. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each restart a
fresh store for its process group (with torchrun's shared store a restarted rank may read
the dead attempt's gloo address and fail to connect).

Elastic (``--elastic``): the job may lose ranks and gain them back, and goes on each time:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2:4 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id gpt --max-restarts 3 \
        examples/train_gpt.py --elastic --checkpoint-dir ckpt --batch 12 --pin data=4

on every node (a global batch of 12 splits over 2, 3 and 4 ranks; a world it does not split
over is an error naming the sizes that work). Each time the agents meet again in another
world, every rank plans for it (``autopar.parallelize(..., elastic=True)``: the data axis
takes the ranks, accumulation keeps the global batch ``--batch``), reloads the newest
checkpoint into that plan (``autopar.elastic.resume``, which prints how long both took) and
reads the data from the step it had reached (``autopar.elastic.GlobalBatchSampler``: the
global batch of a step does not depend on the world).

``--pin workers=accordion:1:4`` (with or without ``--elastic``): Accordion's batch-size
form (``autopar.runtime.updates.workers``): 1 data rank trains in critical regimes, 4 otherwise;
the others skip the step (their slice of the batch is not used), so the one-device column,
which trains on the whole batch, no longer matches. Its regime is saved in the checkpoints
and resumed with them.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.checkpoint import latest_checkpoint, save_step_checkpoint  # noqa: E402
from autopar.device import backend_for, rank_device  # noqa: E402
from autopar.elastic import GlobalBatchSampler, resume  # noqa: E402
from examples.gpt import gpt_factory  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lighthouse.txt")


class CharWindows(Dataset):
    """(ids, next ids) windows of ``block`` characters, ``stride`` apart."""

    def __init__(self, path: str, block: int, stride: int, vocab_size: int):
        text = open(path, encoding="utf-8").read()
        chars = sorted(set(text))
        if len(chars) > vocab_size:
            raise ValueError(f"{path} has {len(chars)} characters; the model's vocabulary {vocab_size}")
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block, self.stride = block, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block - 1) // self.stride + 1

    def __getitem__(self, i):
        s = i * self.stride
        chunk = self.data[s: s + self.block + 1]
        return chunk[:-1], chunk[1:]


def parse_pins(items):
    pins = {}
    for item in items:
        key, _, value = item.partition("=")
        pins[key] = int(value) if value.isdigit() else value
    return pins


def loader(ds, batch: int, world: int, rank: int, epoch: int) -> DataLoader:
    """Data rank ``rank``'s DataLoader: ``batch // world`` windows a step."""
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=batch // world, sampler=sampler, drop_last=True)


def data_steps(ds, batch: int, world: int, epoch: int = 0, position: int = 0):
    """Every data rank's batches, step after step, from batch ``position`` of ``epoch`` on:
    ``(epoch, position after this step, batches)``. The order depends only on the epoch, so
    a restart that starts here reads what an uninterrupted run would."""
    while True:
        loaders = [loader(ds, batch, world, d, epoch) for d in range(world)]
        for batches in itertools.islice(zip(*loaders), position, None):
            position += 1
            yield epoch, position, batches
        epoch, position = epoch + 1, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="the global batch (windows a step)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-mode", choices=("per_rank", "global"), default="per_rank")
    ap.add_argument("--pin", action="append", default=[], help="e.g. data=2, tensor=2, zero=3")
    ap.add_argument("--checkpoint-dir", help="write DIR/step-<N> checkpoints (the two newest kept)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--resume", action="store_true",
                    help="start from the newest complete checkpoint in --checkpoint-dir, if any")
    ap.add_argument("--elastic", action="store_true",
                    help="re-plan for the world each restart has, keep the global batch, resume "
                         "from --checkpoint-dir (torchrun --nnodes MIN:MAX)")
    args = ap.parse_args()
    if args.elastic and not args.checkpoint_dir:
        ap.error("--elastic resumes each restart from a checkpoint: pass --checkpoint-dir DIR")
    if args.resume and not args.checkpoint_dir:
        ap.error("--resume reads the checkpoints of --checkpoint-dir: pass --checkpoint-dir DIR")
    if args.checkpoint_every < 1:
        ap.error(f"--checkpoint-every {args.checkpoint_every}: pass a number of steps >= 1")

    # the rank's device first (CUDA device LOCAL_RANK on a GPU machine), then its backend
    dist.init_process_group(backend_for(rank_device()))
    rank = dist.get_rank()
    ex = gpt_factory(batch=args.batch, seed=0)
    ds = CharWindows(TEXT, ex.config.block_size, stride=4, vocab_size=ex.config.vocab_size)
    single = copy.deepcopy(ex.model)          # the one-device model, for comparison

    # example inputs: a global batch (the plan is made for its shape)
    ids, target = (torch.stack(x) for x in zip(*(ds[i] for i in range(args.batch))))
    pm = autopar.parallelize(ex.model, (ids,), ex.loss_fn, target=target,
                             batch=args.batch_mode, elastic=args.elastic, **parse_pins(args.pin))
    w, r = pm.data_world, pm.data_rank
    if rank == 0:
        print(pm.plan.summary(), flush=True)
        print(f"\nbatch={args.batch_mode}: data world {w}, {args.batch // w} windows per data rank "
              f"a step, {len(ds)} windows of {ex.config.block_size} characters")
        print(f"\n{'step':>4}  {'autopar loss':>12}  {'one device':>12}")
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(single.parameters(), lr=args.lr)

    def reference_step(batches) -> torch.Tensor:
        """One step of the one-device model on the concatenation of the data ranks' batches."""
        ref_opt.zero_grad()
        xs, ys = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ref = ex.loss_fn(single(xs), ys)
        ref.backward()
        ref_opt.step()
        return ref

    if args.elastic:
        train_elastic(args, pm, opt, ds, reference_step)
        return

    step, epoch, position = 0, 0, 0
    ckpt = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if ckpt is not None:
        extra = autopar.load_checkpoint(ckpt, pm, opt)      # weights, moments, this dict
        step, epoch, position = extra["step"], extra["epoch"], extra["position"]
        torch.set_rng_state(extra["rng"])
        if rank == 0:
            print(f"resumed from {ckpt}: step {step}, epoch {epoch}, batch {position} of it", flush=True)
            for _, _, batches in itertools.islice(data_steps(ds, args.batch, w), step):
                reference_step(batches)          # the one-device model catches up
    stream = data_steps(ds, args.batch, w, epoch, position)
    # SIGTERM (a scheduler's preemption): a checkpoint of the step in progress, then exit
    preempt = autopar.Preemption() if args.checkpoint_dir else None
    while step < args.steps:
        epoch, position, batches = next(stream)
        x, y = batches[r]
        opt.zero_grad()
        loss = pm.train_step(x, target=y)
        pm.step(opt)          # opt.step(), plus what a pin asks of it (e.g. workers=' rate)
        if rank == 0:
            ref = reference_step(batches)
            print(f"{step:>4}  {loss.item():>12.6f}  {ref.item():>12.6f}", flush=True)
        step += 1
        stop = preempt is not None and preempt.requested()    # some rank got SIGTERM: all agree
        if args.checkpoint_dir and (stop or step % args.checkpoint_every == 0 or step == args.steps):
            save_step_checkpoint(args.checkpoint_dir, step, pm, opt, keep=2,
                                 extra={"step": step, "epoch": epoch, "position": position,
                                        "rng": torch.get_rng_state()})
        if stop:
            if rank == 0:
                print(f"preempted: the checkpoint of step {step} is written; exiting", flush=True)
            break
    dist.barrier()
    dist.destroy_process_group()


def train_elastic(args, pm, opt, ds, reference_step) -> None:
    """--elastic: resume from the newest checkpoint into this world's plan, read this data
    rank's slice of every global batch from the step reached, checkpoint as usual."""
    rank = dist.get_rank()
    step = (resume(args.checkpoint_dir, pm, opt) or {"step": 0})["step"]
    sampler = GlobalBatchSampler(len(ds), args.batch, pm.data_rank, pm.data_world, start=step,
                                 seed=0, steps=args.steps)
    if rank == 0:
        for s in range(step):               # the one-device model catches up
            reference_step([ds_batch(ds, sampler.global_indices(s))])
    for x, y in DataLoader(ds, batch_sampler=sampler):
        opt.zero_grad()
        loss = pm.train_step(x, target=y)
        pm.step(opt)          # opt.step(), plus what a pin asks of it (e.g. workers=' rate)
        if rank == 0:
            ref = reference_step([ds_batch(ds, sampler.global_indices(step))])
            print(f"{step:>4}  {loss.item():>12.6f}  {ref.item():>12.6f}", flush=True)
        step += 1
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_step_checkpoint(args.checkpoint_dir, step, pm, opt, keep=2, extra={"step": step})
    dist.barrier()
    dist.destroy_process_group()


def ds_batch(ds, indices):
    """The windows ``indices`` of ``ds``, stacked: (ids, next ids)."""
    return tuple(torch.stack(t) for t in zip(*(ds[i] for i in indices)))


if __name__ == "__main__":
    main()
