"""Save a checkpoint when the job is told to stop (preemption: SIGTERM), then exit.

A scheduler that preempts a job (Slurm, Kubernetes, a spot VM) sends SIGTERM and kills the
job for good a grace period later. torchrun's agent forwards the SIGTERM to its workers and
waits ``30`` s for them (``LocalElasticAgent._shutdown``'s default timeout) before SIGKILL.

A checkpoint is collective, and ranks get the signal at different moments (one in step 5,
another in step 6), so the signal handler only records it; at the end of each step every
rank calls :meth:`Preemption.save_if_requested`, which sums the flag over the world (one
all-reduce of one number: PyTorch Lightning's ``reduce_boolean_decision`` for the same
purpose) so that every rank agrees at the same step, and if any rank was signalled they all
write ``save_step_checkpoint(root, step, ...)`` (atomic: a temporary directory renamed when
complete) and it returns True: the loop ends, the script exits, and a restart resumes from
that step (``latest_checkpoint``)::

    preempt = autopar.Preemption()            # installs the SIGTERM handler
    for step in range(start, steps):
        pm.train_step(x, target=y); pm.step(opt); opt.zero_grad()
        if preempt.save_if_requested(root, step + 1, pm, opt, extra={"step": step + 1}):
            sys.exit(0)                       # the checkpoint is complete

A step takes at most the grace period minus the save's time, or the save is cut short
(then ``latest_checkpoint`` still returns the previous one).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from autopar.checkpoint import save_step_checkpoint
from autopar.errors import ArgumentError

__all__ = ["Preemption"]


class Preemption:
    """Records ``signals`` (default SIGTERM) instead of dying at once; use as a context
    manager or call :meth:`close` to restore the previous handlers. ``every``: the ranks
    compare notes on every ``every``-th call only (the all-reduce cost ~4 ms a step on the
    busy 2-core test machine, ``benchmarks/faults.py``; a fraction of that on a real network).

    ``received``: the signal this rank got (None: none yet); ``saved``: the checkpoint
    :meth:`save_if_requested` wrote (None: none)."""

    def __init__(self, signals=(signal.SIGTERM,), every: int = 1):
        if threading.current_thread() is not threading.main_thread():
            raise ArgumentError("autopar.Preemption() installs a signal handler, which Python "
                                "allows only in the main thread: create it there")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ArgumentError(f"Preemption(every={every!r}): pass how many steps apart the ranks "
                                "compare notes (an int >= 1; the grace period must hold that many "
                                "steps and a save)")
        self.every, self._calls = every, 0
        self.received: int | None = None
        self.received_at: float | None = None
        self.saved: str | None = None
        self.save_seconds: float | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._record)

    def _record(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    def requested(self) -> bool:
        """Whether any rank has received a signal; the same answer on every rank.
        Collective over the default process group (one all-reduce of one number) on every
        ``every``-th call; False on the others, without communicating."""
        self._calls += 1
        if self._calls % self.every:
            return False
        flag = 1.0 if self.received is not None else 0.0
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag > 0
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        t = torch.tensor([flag], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def save_if_requested(self, root: str | os.PathLike, step: int, pm,
                          optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
                          keep: int | None = None) -> bool:
        """When any rank was signalled: ``save_step_checkpoint(root, step, pm, optimizer,
        extra, keep)`` on every rank and True (the caller exits); else False. Collective:
        every rank calls it after the same step."""
        if not self.requested():
            return False
        t0 = time.monotonic()
        self.saved = save_step_checkpoint(root, step, pm, optimizer, extra=extra, keep=keep)
        self.save_seconds = time.monotonic() - t0
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"autopar: stop requested (signal on some rank); checkpoint of step {step} "
                  f"written to {self.saved} in {self.save_seconds:.2f} s", file=sys.stderr, flush=True)
        return True

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
