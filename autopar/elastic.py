"""Elastic training: a job whose number of ranks changes between restarts.

Under ``torchrun --nnodes MIN:MAX`` (torch's elastic agent, c10d rendezvous) a lost node
ends the attempt and the agents that are left start the workers again in a smaller world;
a node that joins later makes them start again in a larger one. Each time, every worker
runs the training script from the top. What autopar adds so that the job goes on as if
nothing had happened:

1. :func:`elastic_pins` (``autopar.parallelize(..., elastic=True)``): the pins describe the
   job at the size it was written for; in the world it has now, the ``data`` axis takes the
   ranks the other mesh pins (``tensor``, ``context``, ``expert``, ``pipeline``, ``branch``:
   ``autopar.options.MESH_AXIS_PINS``) leave, and
   gradient accumulation grows so that each rank's micro-batch is no larger than under the
   pins, while the global batch (the example inputs' rows) stays what it was (a pipeline's
   ``micro_batch_size=`` shrinks with the data ranks instead, and it runs more of them). Under
   ``workers="accordion:W1:W2"`` (``autopar.runtime.updates.workers``) W1 and W2 are capped at this
   world's data degree (with a warning), and the schedule's state (regime, last norm,
   steps) travels in the checkpoint :func:`resume` loads.
2. :class:`GlobalBatchSampler`: the global batch of every step does not depend on the
   world (one permutation of the dataset per epoch, cut into global batches); a data rank
   reads its slice of it. The data position is the step counter alone.
3. :func:`resume`: the newest complete checkpoint (``autopar.checkpoint``, which loads
   across plans) into the new plan, and rank 0 prints how long the re-plan and the reload
   took.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from autopar.checkpoint import latest_checkpoint, load_checkpoint
from autopar.errors import ArgumentError
from autopar.options import MESH_AXIS_PINS, Options

__all__ = ["ElasticInfo", "GlobalBatchSampler", "elastic_pins", "global_batch_rows", "resume"]

MODEL_AXES = tuple(a for a in MESH_AXIS_PINS if a != "data")
"""The mesh pins an elastic job keeps as they are; ``data`` takes the rest of the world."""


@dataclass(frozen=True)
class ElasticInfo:
    """What ``parallelize(..., elastic=True)`` chose for this world (``pm.elastic``)."""
    world: int
    data: int
    accumulate: int                 # micro-batches a rank runs each step (a pipeline's too)
    global_batch: int
    plan_seconds: float = 0.0       # capture, solve and build: the re-plan
    split: int = 1                  # other axes that split the batch as data does (expert)

    @property
    def rows_per_rank(self) -> int:
        """Rows of one micro-batch on one batch rank (data x expert)."""
        return self.global_batch // (self.data * self.split * self.accumulate)


def global_batch_rows(example_inputs: Sequence, target=None) -> int:
    """Rows (dim 0) of the global batch the example inputs describe."""
    for x in (*example_inputs, target):
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    raise ArgumentError("elastic=True keeps the global batch, but no example input or target "
                        "is a tensor with a batch dimension: pass the global batch as "
                        "example_inputs")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_axes(pins: Options) -> int:
    """The degree of the model axes that split the batch as ``data`` does: ``expert``
    (``autopar.runtime.data.data_axes``: its ranks split the batch for every op but the
    experts)."""
    return pins.get("expert") or 1


def elastic_pins(pins: Options, world: int, global_batch: int) -> tuple[Options, ElasticInfo]:
    """``pins`` for a job of ``world`` ranks and a global batch of ``global_batch`` rows.

    ``data`` becomes ``world`` over the other mesh pins (an error when they do not divide
    ``world``). The batch is split over the data ranks and the expert axis (the *batch
    ranks*, ``data x expert``). The micro-batch rows each batch rank may hold are those the
    pins give: ``global_batch / (batch ranks x micro-batches)``, with the pinned ``data``
    (else this world's) and the pinned micro-batches (``accumulate=``, or the global batch
    over ``micro_batch_size=``). This world then runs the smallest number ``m`` of
    micro-batches that keeps each rank's within that and splits the global batch evenly
    over its batch ranks: ``accumulate=m`` without a pipeline, ``micro_batch_size=
    global_batch / m`` under one (whose micro-batch is split over the data ranks). A
    pipeline without ``micro_batch_size=`` keeps choosing its own micro-batches."""
    other = math.prod((pins.get(n) or 1) for n in MODEL_AXES)
    named = ", ".join(f"{n}={pins[n]}" for n in MODEL_AXES if (pins.get(n) or 1) > 1)
    if world % other:
        fits = ", ".join(str(k * other) for k in range(1, 5))
        raise ArgumentError(f"elastic: the pins {named} need a multiple of {other} ranks, but this "
                            f"job has {world}: launch with --nnodes MIN:MAX whose every size is a "
                            f"multiple of {other} ({fits}, ...), or drop those pins")
    data = world // other
    split = _batch_axes(pins)
    if global_batch % (data * split):
        sizes = [d * other for d in _divisors(global_batch // split)]
        ok = ", ".join(map(str, sizes[:10])) + (", ..." if len(sizes) > 10 else "")
        over = f"the {data} data ranks" + (f" x expert={split}" if split > 1 else "")
        raise ArgumentError(f"elastic: the global batch of {global_batch} rows does not split over "
                            f"{over} of this {world}-rank job: run on a number of "
                            f"ranks that splits it ({ok}; torchrun --nnodes MIN:MAX with "
                            f"every size from MIN to MAX one of those), or make the global "
                            f"batch a multiple of {data * split}")
    pipelined = (pins.get("pipeline") or 1) > 1
    mbs = pins.get("micro_batch_size")
    new = {**dict(pins), "data": data}
    new.pop("accumulate", None)
    m = 1
    if not pipelined or mbs is not None:
        full_data = pins.get("data") or data
        if mbs is not None and global_batch % mbs:
            raise ArgumentError(f"elastic: micro_batch_size={mbs} does not divide the global batch "
                                f"of {global_batch} rows: pin a divisor of {global_batch}")
        full_m = global_batch // mbs if mbs is not None else pins.get("accumulate") or 1
        if global_batch % (full_data * split * full_m):
            what = (f"micro_batch_size={mbs}" if mbs is not None else f"accumulate={full_m}")
            raise ArgumentError(f"elastic: data={full_data}{f' x expert={split}' if split > 1 else ''}"
                                f" x {what} does not split the global batch of {global_batch} "
                                f"rows evenly over the data ranks: pin values whose product "
                                f"divides {global_batch}")
        rows = global_batch // (full_data * split * full_m)   # a rank's micro-batch, at most
        n = data * split
        m = next(a for a in range(-(-global_batch // (n * rows)), global_batch // n + 1)
                 if global_batch % (n * a) == 0)
        new.pop("micro_batch_size", None)
        if pipelined:
            new["micro_batch_size"] = global_batch // m
        elif m > 1:
            new["accumulate"] = m
    counts = pins.worker_counts
    if counts is not None and counts[1] > data:     # workers=: at most this world's data ranks
        new["workers"] = f"accordion:{min(counts[0], data)}:{data}"
        warnings.warn(f"elastic: workers={pins.workers!r} asks for more data-parallel workers than "
                      f"the {data} data ranks of this {world}-rank job: training with "
                      f"workers={new['workers']!r} until the job grows again", stacklevel=2)
    return Options.from_pins(new), ElasticInfo(world, data, m, global_batch, split=split)


class GlobalBatchSampler(Sampler):
    """Batches of dataset indices for ``DataLoader(ds, batch_sampler=...)``: data rank
    ``rank``'s slice (of ``data_world``) of every global batch, from step ``start`` on.

    The global batch of step ``s`` does not depend on the world: epoch ``e`` is one
    permutation of ``range(n)`` (a generator seeded with ``seed + e``) cut into global
    batches of ``global_batch`` indices, the rest dropped; data rank ``r`` takes indices
    ``[r * k, (r + 1) * k)`` of it, ``k = global_batch // data_world`` (the slices of data
    ranks 0, 1, ... in order make the global batch, as ``batch="per_rank"`` expects). So a
    job that resumes at step ``s`` on another number of ranks reads what it would have
    read, and what one device reads. ``steps``: stop before this step (None: never)."""

    def __init__(self, n: int, global_batch: int, rank: int = 0, data_world: int = 1,
                 start: int = 0, seed: int = 0, steps: int | None = None):
        if global_batch < 1 or n < global_batch:
            raise ArgumentError(f"GlobalBatchSampler: a dataset of {n} samples holds no global "
                                f"batch of {global_batch}: pass a global batch in 1..{n}")
        if global_batch % data_world:
            raise ArgumentError(f"GlobalBatchSampler: the global batch of {global_batch} does not "
                                f"split over {data_world} data ranks")
        if not 0 <= rank < data_world:
            raise ArgumentError(f"GlobalBatchSampler: rank={rank} is not a data rank of {data_world}")
        self.n, self.global_batch, self.rank, self.world = n, global_batch, rank, data_world
        self.start, self.seed, self.steps = start, seed, steps
        self.per_epoch = n // global_batch

    def global_indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s whole global batch."""
        epoch, pos = divmod(step, self.per_epoch)
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        return perm[pos * self.global_batch:(pos + 1) * self.global_batch].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        k = self.global_batch // self.world
        step = self.start
        while self.steps is None or step < self.steps:
            yield self.global_indices(step)[self.rank * k:(self.rank + 1) * k]
            step += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("GlobalBatchSampler without steps= has no length")
        return max(0, self.steps - self.start)


def resume(root: str | os.PathLike | None, pm, optimizer: torch.optim.Optimizer | None = None,
           *, verbose: bool = True) -> dict | None:
    """Load the newest complete checkpoint under ``root`` (``save_step_checkpoint``'s) into
    ``pm``, whatever plan and world it was saved under, and into ``optimizer``; returns its
    ``extra`` (None when there is none yet). Rank 0 prints the world, the accumulation and
    how long the re-plan (``pm.elastic.plan_seconds``) and this reload took; the reload's
    seconds are ``extra["reload_seconds"]``. Collective."""
    ckpt = latest_checkpoint(root) if root is not None else None
    t0 = time.perf_counter()
    extra = load_checkpoint(ckpt, pm, optimizer) if ckpt is not None else None
    reload_s = time.perf_counter() - t0
    if extra is not None:
        extra = {**extra, "reload_seconds": reload_s} if isinstance(extra, dict) else extra
    info = getattr(pm, "elastic", None)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        where = (f"{info.world} ranks (data {info.data}, accumulate {info.accumulate}, global "
                 f"batch {info.global_batch}): re-planned in {info.plan_seconds:.2f} s" if info else
                 "planned")
        what = (f"reloaded {os.path.basename(ckpt)} in {reload_s:.2f} s" if ckpt is not None
                else "no checkpoint yet: starting at step 0")
        print(f"autopar elastic: {where}; {what}", flush=True)
    return extra
