"""Run by tests/test_restart.py under ``torchrun --max-restarts 1`` on 2 gloo ranks.

``python restart_worker.py ROOT``: a tiny MLP under ZeRO-3 (data 2, parameters sharded),
each rank reading its own slice (``batch="per_rank"``) from a ``DistributedSampler``, trains
``STEPS`` AdamW steps, checkpointing every ``EVERY`` steps to ``ROOT/ckpt`` with
``save_step_checkpoint`` (the data position in ``extra``: epoch and batches read in it).

1. Restart after a failure. On the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1
   kills itself with SIGKILL before step ``KILL_AT``; the elastic agent stops rank 0 and
   starts both again. The new attempt resumes from ``latest_checkpoint`` (model, moments,
   data position) and finishes; rank 0 saves the final weights to ``ROOT/final.pt``.
2. No hang. Then, on the second attempt, rank 1 stops taking part in a step (it waits,
   alive, until rank 0 is done) while rank 0 takes it, twice: under the same plan built
   again with ``timeout=HANG_TIMEOUT`` (a collective: the all-gather of the per-rank
   slices) and under a 2-stage pipeline (a send / recv inside
   ``torch.distributed.pipelining``). Both must raise ``CollectiveError`` in time.

Every event (start, resume, kill, the final figures, the hang's error) is one JSON line in
``ROOT/events.jsonl``; the test reads them and compares the final weights with one device.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.checkpoint import latest_checkpoint, save_step_checkpoint  # noqa: E402
from autopar.ops.comm import CollectiveError  # noqa: E402
from examples.models import mlp_factory  # noqa: E402

STEPS, EVERY, KILL_AT = 8, 2, 5      # the kill comes after checkpoint 4, before step 5
BATCH, SAMPLES, LR = 8, 48, 1e-2     # 6 steps an epoch: the run crosses an epoch boundary
DATA_WORLD = 2
HANG_TIMEOUT = 2.0
HANGS = ("data", "pipeline")


def example():
    return mlp_factory(batch=BATCH, seed=0)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, 32, generator=g), torch.randn(SAMPLES, 16, generator=g))


def loader(ds, data_rank: int, epoch: int) -> DataLoader:
    """Data rank ``data_rank``'s batches in ``epoch`` (shuffled, the same order on a restart)."""
    sampler = DistributedSampler(ds, num_replicas=DATA_WORLD, rank=data_rank, shuffle=True,
                                 seed=0, drop_last=True)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH // DATA_WORLD, sampler=sampler, drop_last=True)


def global_batches(ds, steps: int):
    """The global batch of every step (the data ranks' slices, concatenated): what one
    device trains on."""
    out, epoch = [], 0
    while len(out) < steps:
        for parts in zip(*(loader(ds, d, epoch) for d in range(DATA_WORLD))):
            out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
        epoch += 1
    return out[:steps]


def log(root: str, **event) -> None:
    with open(os.path.join(root, "events.jsonl"), "a") as f:
        f.write(json.dumps({**event, "time": round(time.time(), 2)}) + "\n")


def events(root: str) -> list[dict]:
    path = os.path.join(root, "events.jsonl")
    return [json.loads(x) for x in open(path).read().splitlines()] if os.path.exists(path) else []


def train(root: str, attempt: int, rank: int) -> autopar.Plan:
    ex = example()
    full_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, batch="per_rank",
                             data=DATA_WORLD, zero=3)
    local_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ds = dataset()
    step, epoch, position = 0, 0, 0
    ckpt = latest_checkpoint(os.path.join(root, "ckpt"))
    if ckpt is not None:
        extra = autopar.load_checkpoint(ckpt, pm, opt)
        step, epoch, position = extra["step"], extra["epoch"], extra["position"]
        torch.set_rng_state(extra["rng"])
    log(root, event="start", attempt=attempt, rank=rank, resumed_from=step,
        checkpoint=os.path.basename(ckpt) if ckpt else None)
    while step < STEPS:
        for x, y in itertools.islice(loader(ds, pm.data_rank, epoch), position, None):
            if attempt == 0 and rank == 1 and step + 1 == KILL_AT:
                log(root, event="kill", attempt=attempt, rank=rank, before_step=step + 1)
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                pm.train_step(x, target=y)
            except CollectiveError as e:       # rank 0 while its peer is dead: reported, re-raised
                log(root, event="peer_died", attempt=attempt, rank=rank, error=str(e))
                raise
            opt.step()
            opt.zero_grad()
            step, position = step + 1, position + 1
            if step % EVERY == 0:
                save_step_checkpoint(os.path.join(root, "ckpt"), step, pm, opt, keep=2,
                                     extra={"step": step, "epoch": epoch, "position": position,
                                            "rng": torch.get_rng_state()})
            if step == STEPS:
                break
        else:
            epoch, position = epoch + 1, 0
    full = pm.full_state_dict()
    if rank == 0:
        torch.save(full, os.path.join(root, "final.pt"))
        log(root, event="done", attempt=attempt, steps=step, local_bytes=local_bytes,
            full_bytes=full_bytes, checkpoints=sorted(os.listdir(os.path.join(root, "ckpt"))))
    return pm.plan


def hang(root: str, kind: str, plan, rank: int) -> None:
    """Rank 1 stops taking part in a step; rank 0's must end with CollectiveError in time.
    ``kind``: ``data`` (``plan``, per-rank slices) or ``pipeline`` (2 stages, 4 micro-batches)."""
    ex = example()
    if kind == "data":
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=plan,
                                 batch="per_rank", timeout=HANG_TIMEOUT)
        x, y = next(iter(loader(dataset(), pm.data_rank, 0)))
    else:
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, pipeline=2,
                                 micro_batch_size=2, timeout=HANG_TIMEOUT)
        x, y = ex.inputs[0], ex.target
    dist.barrier()
    if rank == 1:       # never calls the step's collectives; alive until rank 0 is done
        end = time.monotonic() + HANG_TIMEOUT + 30
        while time.monotonic() < end and not any(e["event"] == "hang" and e["kind"] == kind
                                                 for e in events(root)):
            time.sleep(0.1)
        return
    t0 = time.monotonic()
    try:
        pm.train_step(x, target=y)
        log(root, event="hang", kind=kind, raised=None, seconds=time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        log(root, event="hang", kind=kind, raised=type(e).__name__, error=str(e),
            seconds=time.monotonic() - t0, op=getattr(e, "op", None), axis=getattr(e, "axis", None),
            ranks=getattr(e, "ranks", None), timed_out=getattr(e, "timed_out", None),
            mesh=list(pm.plan.mesh_axes), microbatches=pm.plan.n_microbatches)


def main() -> None:
    root = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = train(root, attempt, rank)
    for kind in HANGS:
        hang(root, kind, plan, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without tearing the groups down: they hold the steps' timed-out or never-joined ops
    os._exit(0)


if __name__ == "__main__":
    main()
