"""One rank out of memory: a clear error on that rank, and on every rank waiting for it.

A rank whose step runs out of memory (``torch.OutOfMemoryError``, which is
``torch.cuda.OutOfMemoryError``, or the CPU allocator's ``RuntimeError: DefaultCPUAllocator:
can't allocate memory``) stops issuing collectives. :func:`reported_oom` turns the error
into :class:`RankOutOfMemoryError`, naming the rank, the module's step and the fixes, and
posts the same message to the ranks of its module (``Comm.post_fault``,
``autopar.ops.fault_notice``): each of them, waiting for this rank in a collective, raises
a ``CollectiveError`` that begins with it (under gloo within ``fault_notice.POLL_S``
seconds; under NCCL at the process group's timeout, ``parallelize(timeout=)``). Nothing is
written, so the last complete checkpoint is what a restart resumes from.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["RankOutOfMemoryError", "is_out_of_memory", "reported_oom"]

_CPU_OOM = "DefaultCPUAllocator: can't allocate memory"     # c10/core/impl/alloc_cpu.cpp

FIXES = ("lower the batch (or raise accumulate=), give autopar.parallelize a smaller "
         "memory_budget= so that the plan keeps less on each device, or shard more (zero=3, "
         "tensor=, pipeline=, recompute='full'); then resume from the last complete checkpoint")


class RankOutOfMemoryError(torch.OutOfMemoryError):
    """A rank ran out of memory in a step of a ParallelModule; the message names the rank,
    the step, the phase, and what to change. ``rank``, ``step`` and ``phase`` as
    attributes."""

    def __init__(self, message: str, *, rank: int, step: int, phase: str):
        super().__init__(message)
        self.rank, self.step, self.phase = rank, step, phase


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's report that the device (or the host) is full."""
    # the CPU allocator's c10::Error is a plain RuntimeError; subclasses (a CollectiveError
    # quoting a peer's notice) are not this rank's own
    return isinstance(e, torch.OutOfMemoryError) or (type(e) is RuntimeError and _CPU_OOM in str(e))


@contextlib.contextmanager
def reported_oom(comm, step: int, phase: str):
    """Run the block; an out-of-memory error in it becomes :class:`RankOutOfMemoryError`,
    first posted to the ranks of ``comm`` (those waiting for this one stop too)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, RankOutOfMemoryError) or not is_out_of_memory(e):
            raise
        first = " ".join(str(e).split())[:200]
        message = (f"rank {comm.rank} ran out of memory on {comm.device} in step {step} of its "
                   f"ParallelModule ({phase}): {type(e).__name__}: {first}. Every rank of the job "
                   f"stops with this error; to fix it, {FIXES}")
        post = getattr(comm, "post_fault", None)
        if post is not None:
            post(message)
        raise RankOutOfMemoryError(message, rank=comm.rank, step=step, phase=phase) from e
