"""The loop people already have, on a ParallelModule: ``loss_fn(pm(x), y).backward()``,
``opt.step()``, and ``with pm.no_sync():`` for accumulation, as with DDP.

``pm(x)`` runs the plan's forward program and returns the model's outputs whole on every
rank; its collectives are autograd functions (``autopar.ops.collectives``), so backward from
a loss computed on those outputs runs the planned backward: each rank's parameters receive
the gradient of the global loss through their own part of the batch and model. What the
program leaves to the step is the sum of data-parallel gradients over the ranks
(``Rewritten.grad_sync``), which ``train_step`` runs with its own backward. Here:

- a forward with grad enabled *arms* the step's gradient sync (``GradSync.begin``), unless it
  runs under :meth:`BackwardLoop.no_sync`; the sync's hooks then launch each bucket as
  backward makes its gradients final, overlapped with the rest of backward (DDP's buckets);
- the outputs pass through an entry node (:class:`_Entry`), the first node of the model that
  backward reaches. Its backward checks that the plan runs this loop (else an
  ``ArgumentError`` that says what to call instead), that the armed sync was not already
  spent by an earlier backward (a second backward through the same step would add unsynced
  gradients to synced ones), and queues the end of the step on autograd's engine: wait for
  every bucket, give ZeRO-1/2's optimizer shards their blocks, copy offloaded gradients
  down (:meth:`BackwardLoop._end`).

``pm(x, target=y)`` (the loss in the plan's graph) returns the global batch's loss,
differentiable: each rank's term of it summed over the ranks by an all-reduce whose backward
hands every rank its own term's gradient. Under ``batch="per_rank"`` (each data rank passes
its slice) ``pm(x)`` returns this rank's rows of the outputs, as DDP does, and backward
averages the gradients over the data ranks (``RankData.local_rows``): a loss that is a mean
over equal slices then trains as on one device; ``pm(x, target=y)`` is the global batch's
loss there too.

Accumulating with ``no_sync``: the gradients of the backward passes under it stay local and
add up in ``.grad``; the first backward outside it sums the accumulated gradients once, as
DDP does. The loss a user writes on the whole outputs is the global batch's loss, so the
summed gradient equals one device's; with ``k`` accumulated micro-batches the user divides
each loss by ``k``, as on one device.

Not run this way (the error says why and what to call): pipelined plans (the schedule
interleaves micro-batches' forward and backward: ``train_step``), plans that accumulate
micro-batches themselves (``accumulate=``), ``branch=``, fp16 (loss scaling lives in
``train_step`` / ``pm.step``), and the data-parallel update schemes
other than the exact sum (``compress=``, ``local_sgd=`` and the rest change what a step
does with the gradients and are stepped through ``train_step``).
"""
from __future__ import annotations

import contextlib

import torch

from autopar.errors import ArgumentError
from autopar.options import Options

def refusal(options: Options, pipelined: bool, accumulate: int, branches: bool,
            compute_dtype) -> str | None:
    """Why a plan cannot train through ``loss.backward()`` on ``pm(x)``, or None."""
    if pipelined:
        return ("the plan is pipelined: its schedule runs forward and backward of the "
                "micro-batches interleaved, stage by stage, so it cannot wait for a backward "
                "you start. Train with loss = pm.train_step(*inputs, target=y), then opt.step()")
    if accumulate > 1:
        return (f"the plan accumulates {accumulate} micro-batches itself (accumulate="
                f"{accumulate}): call loss = pm.train_step(*inputs, target=y), or plan "
                "without accumulation and accumulate in your loop under pm.no_sync()")
    if branches:
        return ("the plan runs branches on separate ranks (branch=): train with "
                "pm.train_step(*inputs, target=y)")
    if compute_dtype == torch.float16:
        return ("precision='fp16' scales the loss dynamically inside pm.train_step and "
                "pm.step(opt): train with those, or use precision='bf16'")
    scheme = options.update     # autopar.update_schemes
    if scheme.pin is not None:
        return (f"{scheme.written()} changes how a step applies the "
                "gradients: train with loss = pm.train_step(*inputs, target=y), then "
                "pm.step(opt)")
    return None


class _Entry(torch.autograd.Function):
    """Identity on the model's outputs; its backward starts the step's end (see module)."""

    @staticmethod
    def forward(ctx, loop, why_not, synced, n_anchor, *outs):
        ctx.loop, ctx.why_not, ctx.synced, ctx.n_anchor = loop, why_not, synced, n_anchor
        return tuple(o.view_as(o) for o in outs[n_anchor:])

    @staticmethod
    def backward(ctx, *grads):
        ctx.loop._backward_began(ctx.why_not, ctx.synced)
        return (None, None, None, None, *(None,) * ctx.n_anchor, *grads)


class BackwardLoop:
    """The ordinary loop's state for one ParallelModule. ``sync``: its GradSync (or
    ZeroGradSync); ``zero``: ZeRO-1/2's OptimizerShards or None; ``offload``: the module's
    offload (its ``grads_down`` after the sync), read when a backward ends."""

    def __init__(self, sync, zero, offload_of, why_not: str | None):
        self.sync, self.zero, self._offload_of = sync, zero, offload_of
        self.why_not = why_not
        self._no_sync = False
        self._armed = False        # a forward armed the sync and no backward has spent it
        self._queued = False       # this backward's end is queued on the engine

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside keep their gradients local (accumulating
        in ``.grad``); the first backward of a forward outside sums everything accumulated."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def arm(self) -> None:
        """Called before a forward with grad enabled: the step's sync starts listening (not
        under ``no_sync``, nor when the plan refuses this loop)."""
        if self.why_not is not None or self._no_sync:
            return
        self.sync.begin()
        self._armed = True

    def disarm(self) -> None:
        """``train_step`` runs a step of its own: a forward's armed sync is dropped."""
        self._armed = False

    def attach(self, outs: list) -> list:
        """The outputs, through the entry node (tensors that require grad only); a backward
        through them raises the plan's refusal, if any."""
        why_not = self.why_not
        idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        anchor = ()
        if not idx and why_not is not None:
            # a refused plan's forward may not record a graph (a pipeline's stages): its
            # floating outputs still lead a backward here, to the error that says why
            idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            anchor = (torch.zeros((), requires_grad=True),)
        if not idx:
            return outs
        through = _Entry.apply(self, why_not, not self._no_sync and why_not is None, len(anchor),
                               *anchor, *(outs[i] for i in idx))
        outs = list(outs)
        for i, t in zip(idx, through):
            outs[i] = t
        return outs

    def _backward_began(self, why_not: str | None, synced: bool) -> None:
        if why_not is not None:
            raise ArgumentError(f"loss.backward() through pm(x) cannot train this plan: {why_not}")
        if self._queued:
            return
        if synced and not self._armed:
            raise ArgumentError(
                "this backward runs through a forward of pm whose step already ended: its "
                "gradient sync was spent by an earlier backward (two backward passes after "
                "one forward, or forward, forward, backward, backward). Run one backward per "
                "forward, or the earlier ones under `with pm.no_sync():`")
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        """Backward ended: finish the step's sync (when one was armed) and hand ZeRO-1/2's
        shards and the offloaded masters their gradients."""
        self._queued = False
        if not self._armed:
            return             # backward of forwards under no_sync: gradients stay local
        self._armed = False
        self.sync.finish()
        if self.zero is not None:
            self.zero.drop_working_grads()   # the shards hold their blocks now
        offload = self._offload_of()
        if offload is not None:
            offload.grads_down()
