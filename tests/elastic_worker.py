"""Run by tests/test_elastic.py on every node of an elastic ``torchrun --nnodes 3:4`` job.

``python elastic_worker.py ROOT``: a tiny MLP under ``autopar.parallelize(..., elastic=True,
data=4, accumulate=2, zero=3)`` with a global batch of ``BATCH`` rows, each rank reading its
slice from ``autopar.elastic.GlobalBatchSampler`` (the data position is the step counter),
AdamW, a checkpoint every ``EVERY`` steps (``save_step_checkpoint``), resuming each attempt
with ``autopar.elastic.resume``. What an attempt does depends on the world it got and on
``ROOT/killed`` (written by the node that dies):

- nobody killed yet, 4 ranks: train; before step ``KILL_AT`` the node started with
  ``ELASTIC_VICTIM=1`` SIGKILLs its agent (the whole node is lost) and then itself;
- nobody killed yet, fewer ranks (the 4th agent was slow to join): wait, alive, until the
  agents restart the workers in the larger world;
- after the kill, 3 ranks: train up to step ``PAUSE_AT``, then wait for the test's new 4th
  agent, whose arrival makes the agents restart the workers (the steps after the last
  checkpoint are lost and done again);
- after the kill, 4 ranks: train to ``STEPS``; rank 0 saves the final weights to
  ``ROOT/final.pt``.

Every event is one JSON line in ``ROOT/events.jsonl`` (``restart_worker.log``).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.checkpoint import save_step_checkpoint  # noqa: E402
from autopar.elastic import GlobalBatchSampler, resume  # noqa: E402
from examples.models import mlp_factory  # noqa: E402
from restart_worker import log  # noqa: E402

STEPS, EVERY, KILL_AT, PAUSE_AT = 12, 2, 5, 9   # kill after checkpoint 4; pause after step 9
BATCH, SAMPLES, LR = 24, 120, 1e-2               # 5 steps an epoch: two epoch boundaries
PINS = dict(data=4, accumulate=2, zero=3)        # written for 4 ranks: 3 rows a rank a micro-batch
FULL = 4
WAIT_S = 120                                     # the longest a worker waits for a restart


def example():
    return mlp_factory(batch=BATCH, seed=0)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, 32, generator=g), torch.randn(SAMPLES, 16, generator=g))


def wait_for_restart(root: str, why: str, **event) -> None:
    """Stay alive until the elastic agent stops this worker for a new rendezvous."""
    log(root, event="wait", why=why, **event)
    time.sleep(WAIT_S)
    log(root, event="wait_timeout", why=why, **event)
    sys.exit(3)


def main() -> None:
    root = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    killed = os.path.exists(os.path.join(root, "killed"))
    ev = dict(attempt=attempt, rank=rank, world=world)
    if not killed and world < FULL:
        wait_for_restart(root, "full world", **ev)
    ex = example()
    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, batch="per_rank",
                             elastic=True, timeout=30, **PINS)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    extra = resume(os.path.join(root, "ckpt"), pm, opt) or {"step": 0, "reload_seconds": 0.0}
    step = extra["step"]
    log(root, event="start", **ev, resumed_from=step, data=pm.data_world,
        accumulate=pm.plan.accumulate, mesh=list(pm.plan.mesh_shape),
        plan_seconds=round(pm.elastic.plan_seconds, 3), reload_seconds=round(extra["reload_seconds"], 3))
    ds = dataset()
    sampler = GlobalBatchSampler(len(ds), BATCH, pm.data_rank, pm.data_world, start=step, seed=0,
                                 steps=STEPS)
    for x, y in DataLoader(ds, batch_sampler=sampler):
        if not killed and step + 1 == KILL_AT and os.environ.get("ELASTIC_VICTIM") == "1":
            open(os.path.join(root, "killed"), "w").close()
            log(root, event="kill", **ev, before_step=step + 1)
            os.kill(os.getppid(), signal.SIGKILL)       # the node's agent: the node is lost
            os.kill(os.getpid(), signal.SIGKILL)
        pm.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        step += 1
        if step % EVERY == 0:
            save_step_checkpoint(os.path.join(root, "ckpt"), step, pm, opt, keep=2,
                                 extra={"step": step, "world": world})
        if killed and world < FULL and step == PAUSE_AT:
            wait_for_restart(root, "grow", **ev, step=step)
    full = pm.full_state_dict()
    if rank == 0:
        torch.save(full, os.path.join(root, "final.pt"))
        log(root, event="done", **ev, steps=step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
