"""Stale-synchronous data parallelism: the pin ``staleness=s`` (s >= 1).

Each bucket of gradients is all-reduced over the data axis as backward produces it, as the
exact reduction is, but the sum is not waited for in its own step: step t applies the sum
launched at step t - s (of the same bucket: the ranks launch the same buckets in the same
order every step), so a step's reduction runs behind the whole of the next s steps. The
first s steps have no gradient to apply: ``ParallelModule.step`` does not step the optimizer
then (it returns False, as a skipped fp16 step), and their ``.grad`` are zeros. From step s
on, ``.grad`` after ``train_step`` is the gradient (summed over the data ranks: the global
batch's) of the weights of step t - s. Call ``pm.step(opt)``, not ``opt.step()``.

This is the bounded-staleness rule of stale-synchronous parallel (Ho et al. 2013) with the
bound met exactly (every gradient is s steps old), which makes it reproducible: with s = 1
the weights after step t equal one device applying the gradient of step t - 1 at step t
(``tests/test_async_updates.py``). Written here because no maintained library offers a
delayed gradient all-reduce for torch: torch's DDP communication hooks must return the
bucket's reduction for the step that launched it (``torch.distributed.algorithms``), and
torch's asynchronous SGD examples use ``torch.distributed.rpc`` parameter servers.

The reductions in flight hold s copies of the gradients (the cost model counts them,
``autopar.pricing.costing``). Used by ``autopar.runtime.updates.param_server`` too, where the
servers apply each pushed gradient s steps late.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from autopar.errors import ArgumentError
from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.updates.rule import Reducer, _Result, data_group


def on_data_axis(name: str, axis: int | None) -> None:
    """An ArgumentError when the scheme pinned as ``name=`` finds no data axis."""
    if axis is None:
        raise ArgumentError(f"{name}= works on the data-parallel axis and this plan has none: "
                            "pin data= (the number of data-parallel ranks) too")


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> "Stale":
    """``staleness=``' rule on the data axis ``axis`` (``param_server=`` takes it as a
    parameter: ``autopar.runtime.updates.param_server.make_rule``)."""
    on_data_axis("staleness", axis)
    return Stale(data_group(comm, axis), axis, options.staleness)


class Delayed(Reducer):
    """A reducer whose sum of step t is written into the gradients at step t + ``staleness``
    (0: in its own step). Subclasses launch a bucket's reduction (:meth:`launch`)."""

    def __init__(self, group, axis: int, staleness: int = 0):
        super().__init__(group, axis)
        self.staleness = staleness
        self._queues: dict[tuple[str, ...], deque] = {}
        self.steps = 0          # steps whose reductions have finished (end_step)

    def launch(self, names: tuple[str, ...], grads: list[torch.Tensor],
               flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start reducing ``flat`` (a copy of ``grads``, this rank's owns); return a function
        that waits and returns the reduced flat bucket."""
        raise NotImplementedError

    def start(self, names: tuple[str, ...], grads: list[torch.Tensor]) -> _Result:
        names = tuple(names)
        self.bucket_index(names)
        flat = torch.cat([g.reshape(-1) for g in grads])      # a copy: grads change next step
        done = self.launch(names, grads, flat)
        if self.staleness == 0:
            return _Result(grads, done)
        if names not in self._queues and self.steps > 0:
            raise ArgumentError(
                f"staleness={self.staleness}: step {self.steps} reduces a bucket of gradients "
                f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) the first step did not; "
                "the delayed sums are matched by bucket, so every step must produce the same "
                "gradients: give every parameter a gradient each step (or drop staleness=)")
        queue = self._queues.setdefault(names, deque())
        queue.append(done)
        if len(queue) > self.staleness:
            return _Result(grads, queue.popleft())
        return _Result(grads, lambda: torch.zeros_like(flat))   # nothing s steps old yet

    def end_step(self) -> None:
        super().end_step()
        self.steps += 1

    @property
    def has_gradient(self) -> bool:
        """Whether the last finished step's gradients are a gradient (the first
        ``staleness`` steps' are zeros)."""
        return self.steps > self.staleness

    def optimizer_step(self, step: Callable[[], bool], params) -> bool:
        """``ParallelModule.step``'s optimizer step (``step()``) when there is a gradient."""
        return step() if self.has_gradient else False


class Stale(Delayed):
    """``staleness=s`` on the data axis: each bucket all-reduced, the sum applied s steps later."""

    def launch(self, names, grads, flat):
        self._step_bytes += flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def total():
            work.wait()
            return flat
        return total
