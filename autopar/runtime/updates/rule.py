"""The contract every data-parallel update scheme keeps: :class:`UpdateRule`.

A plan's rank makes its step's update in five places, and a scheme (``compress=``,
``local_sgd=``, ``averaging=``, ``staleness=``, ``param_server=``, ``learners=``,
``workers=``; none: the exact all-reduce) decides each through one declared method, whose
default is what the exact all-reduce does:

- ``train(stage, inputs, target, sync)``: run the step's forward and backward
  (``parallel_module.OneStage``); ``workers=`` skips them on idle data ranks;
- ``start(names, grads)`` / ``reduce(index, flat, shapes)`` / ``end_step()``: sum a bucket
  of gradients over the data axis ``axis`` (``runtime.grad_sync.GradSync`` hands a bucket
  to ``start`` when the rule has a data axis; the exact all-reduce has none, GradSync sums
  it itself);
- ``optimizer_step(step, params)``: ``ParallelModule.step``'s optimizer step, under the
  learning rate times ``lr_scale``; stale schemes skip it, a parameter server steps what it
  serves and pulls the rest, local SGD and model averaging average the parameters after it;
- ``global_grads(grads)``: the gradients ``pm.full_grads()`` reports (a parameter
  server's hold the global batch's);
- ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint keeps of the scheme
  (``runtime.dcp_state``; None: nothing).

The table from scheme to rule is ``autopar.runtime.updates.table.RULES``.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist

from autopar.errors import ArgumentError


class UpdateRule:
    """How a step's data-parallel update is made; the defaults are the exact all-reduce's
    (gradients summed over the data axis by ``GradSync``, one optimizer step)."""

    axis: int | None = None
    """The data axis whose buckets :meth:`start` sums; None: GradSync sums them exactly."""

    def train(self, stage, inputs: tuple, target, sync) -> torch.Tensor:
        """The step's forward and backward on ``stage`` (a ``parallel_module.OneStage``) and
        its gradient sync ``sync``; the global batch's loss."""
        return stage.run(inputs, target, sync)

    def start(self, names: tuple[str, ...], grads: list[torch.Tensor]):
        """Start summing the bucket ``grads`` (of the parameters ``names``) over
        :attr:`axis`; a handle whose ``wait()`` leaves the sum in ``grads``."""
        raise NotImplementedError(f"{type(self).__name__} has data axis {self.axis} but does not "
                                  "say how to sum a bucket over it: define start() or reduce()")

    def end_step(self) -> None:
        """After every bucket of the step has been waited for."""

    @property
    def lr_scale(self) -> float | None:
        """The learning rate's factor for this step's optimizer step (None: unchanged)."""
        return None

    def optimizer_step(self, step: Callable[[], bool], params: Iterable[torch.Tensor]) -> bool:
        """``ParallelModule.step``'s optimizer step: ``step()`` (the optimizer's, with fp16
        loss scaling) on ``params`` (``pm.parameters()``); whether the optimizer stepped."""
        return step()

    def global_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``grads`` (this rank's ``.grad`` by attribute) as the global batch's gradients
        (collective where the rule needs one)."""
        return grads

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the rule (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`'s ``state`` (a rule with no state takes none)."""


class ExactAllReduce(UpdateRule):
    """No scheme pinned: every default (the exact bucketed all-reduce, DDP's)."""


def data_group(comm: Comm, axis: int):
    """The torch.distributed process group of mesh axis ``axis`` of ``comm``."""
    base = comm
    while hasattr(base, "outer"):      # a stage's mesh inside a pipeline (Comm.inner)
        base, axis = base.outer, axis + 1
    groups = getattr(base, "groups", None)
    if groups is None:
        raise ArgumentError("the update schemes (compress=, local_sgd=, ...) need torch.distributed ranks: build the module "
                            "with autopar.parallelize under torchrun, not on simulated (thread) ranks")
    return groups[axis]



class _Result:
    """A reduction in flight: ``wait()`` writes the summed flat bucket into the gradients."""

    def __init__(self, grads: list[torch.Tensor], value):
        self.grads, self.value = grads, value    # a Future, a function giving the sum, or it

    def wait(self) -> None:
        flat = resolve(self.value)
        off = 0
        for g in self.grads:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()


def resolve(value) -> torch.Tensor:
    """The flat sum a :meth:`Reducer.reduce` returned: a Future of it, a function giving it,
    or it."""
    if callable(value):
        value = value()
    elif not isinstance(value, torch.Tensor):
        value = value.wait()          # a torch Future
    return value[0] if isinstance(value, list) else value


class Reducer(UpdateRule):
    """A rule that sums a bucket of gradients over the data axis ``axis`` (process group
    ``group``) itself: :meth:`start` flattens the bucket and hands it to :meth:`reduce`."""

    def __init__(self, group, axis: int):
        self.group, self.axis = group, axis
        self.size = dist.get_world_size(group)
        self._index: dict[tuple[str, ...], int] = {}
        self.wire_bytes = 0         # bytes this rank sent in the last step
        self._step_bytes = 0

    def bucket_index(self, names: tuple[str, ...]) -> int:
        return self._index.setdefault(tuple(names), len(self._index))

    def start(self, names: tuple[str, ...], grads: list[torch.Tensor]) -> _Result:
        flat = torch.cat([g.reshape(-1) for g in grads])
        return _Result(grads, self.reduce(self.bucket_index(names), flat, [g.shape for g in grads]))

    def reduce(self, index: int, flat: torch.Tensor, shapes):
        """The sum over the data ranks of ``flat``: a Future of it, a function returning it
        once the collectives it started are done, or it; may overwrite ``flat``."""
        raise NotImplementedError

    def end_step(self) -> None:
        self.wire_bytes, self._step_bytes = self._step_bytes, 0

    def _all_gather(self, t: torch.Tensor):
        """Start gathering ``t`` of every rank: (their stack, the work)."""
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        self._step_bytes += t.numel() * t.element_size()
        # all_gather_into_tensor, as ops/comm.py: public on every torch autopar supports
        # (torch 2.11 has no all_gather_single)
        work = dist.all_gather_into_tensor(out, t.contiguous(), group=self.group, async_op=True)
        return out.view(self.size, *t.shape), work
