"""Data-parallel gradient synchronisation: once per step, bucketed, overlapped with backward.

``passes.insert_collectives`` leaves out the all-reduce of a replicated parameter's gradient
where every use of it makes the gradient partial on a mesh axis, and returns those axes
(``Rewritten.grad_sync``). :class:`GradSync` sums such gradients once per step (never per
micro-batch), in buckets of about ``BUCKET_BYTES``, each launched as soon as every gradient
in it is final, so the reduction runs while backward goes on:

- one stage (unpipelined): a parameter's gradient is final when autograd has accumulated
  it (:meth:`GradSync.launch_on_accumulate` installs the hooks); under gradient
  accumulation, in the last micro-batch's backward: the step begins (``begin()``) just
  before that micro-batch, so the hooks firing in the earlier ones launch nothing;
- pipelined: when the last backward of every local stage reading it is done (the pipeline
  runner calls :meth:`GradSync.ready`).

The ranks of a data-parallel group run the same program in the same order, so they launch
the same buckets in the same order. A step is ``begin()`` ... ``finish()``.

An update scheme (pins ``compress=``, ``local_sgd=``, ``staleness=``, ...): a bucket summed
over the data axis goes to the scheme's rule ``reducer`` (``autopar.runtime.updates``:
``UpdateRule.start``) instead of the exact all-reduce; the exact all-reduce's rule
(``ExactAllReduce``, the default) has no data axis of its own, and the sum is made here.
"""
from __future__ import annotations

import weakref

from torch import nn

from autopar.ops.comm import Comm
from autopar.runtime.updates.rule import ExactAllReduce, UpdateRule

BUCKET_BYTES = 25 * 2**20


class GradSync:
    """Sums the gradients of ``params`` (attribute path -> parameter) over the mesh axes
    ``axes_of[attr]`` of ``comm``, once per step."""

    def __init__(self, params: dict[str, nn.Parameter], axes_of: dict[str, tuple[int, ...]],
                 comm: Comm, bucket_bytes: int = BUCKET_BYTES, reduce_dtype=None,
                 reducer: UpdateRule | None = None):
        self.reduce_dtype = reduce_dtype    # None: sum in the gradients' dtype; else cast (bf16 pin)
        self.reducer = reducer if reducer is not None else ExactAllReduce()    # the update rule
        self.comm = comm
        # a sum over one rank is a no-op: such axes are dropped (the reducer's is kept), and a
        # parameter left with none gets no hook and no bookkeeping (world-1 plans)
        live = {a: tuple(x for x in axes if comm.size(x) > 1 or x == self.reducer.axis)
                for a, axes in axes_of.items()}
        self.params = {a: p for a, p in params.items() if live.get(a)}
        self.axes_of = {a: live[a] for a in self.params}
        self.bucket_bytes = bucket_bytes
        self._active = False
        self._reset()

    def _reset(self) -> None:
        self._pending: dict[tuple[int, ...], list[str]] = {}   # axes -> ready, not launched
        self._pending_bytes: dict[tuple[int, ...], int] = {}
        self._done: set[str] = set()                            # ready this step
        self._inflight: list = []                               # (work, grads, axes still to run)

    def launch_on_accumulate(self) -> None:
        """Launch a bucket once autograd has accumulated every gradient in it (for programs
        whose backward produces each gradient once per step).

        The hooks hold this GradSync weakly. A parameter's hooks are held by autograd's C++
        side, which the garbage collector cannot see through: a hook holding ``self`` (and
        through it ``comm``, the mesh and its process groups) made a cycle the collector
        never frees, so the process groups outlived ``destroy_process_group`` and their gloo
        threads ran on into interpreter shutdown, where a rank now and then aborted with
        "terminate called without an active exception" (exit -6)."""
        me = weakref.ref(self)

        def accumulated(attr: str) -> None:
            sync = me()
            if sync is not None:
                sync._accumulated(attr)

        for attr, p in self.params.items():
            p.register_post_accumulate_grad_hook(lambda _p, attr=attr: accumulated(attr))

    def _accumulated(self, attr: str) -> None:
        if not self._active or attr in self._done:
            return
        axes = self._add(attr)
        if self._pending_bytes[axes] >= self.bucket_bytes:
            self._launch(axes)

    # ---- a step ----------------------------------------------------------------------------
    def begin(self) -> None:
        self._reset()
        self._active = True

    def ready(self, attrs) -> None:
        """``attrs``' gradients are final for this step: launch their reductions now (a
        gradient backward never produced is a zero one)."""
        if not self._active:
            return
        for attr in attrs:
            if attr in self.params and attr not in self._done:
                p = self.params[attr]
                if p.grad is None:
                    p.grad = p.new_zeros(p.shape)
                self._add(attr)
        for axes in list(self._pending):
            self._launch(axes)

    def finish(self) -> None:
        """Launch what is left (gradients that exist but were never declared final), wait
        for every reduction and run the axes after the first."""
        self._active = False
        rest = [a for a, p in self.params.items() if a not in self._done and p.grad is not None]
        for attr in rest:
            self._add(attr)
        for axes in list(self._pending):
            self._launch(axes)
        for entry in self._inflight:
            self._complete(entry)
        self.reducer.end_step()
        self._reset()      # hold no finished work

    def _complete(self, entry) -> None:
        """Wait for one launched bucket, reduce it over its axes after the first, and copy
        the sums into the gradients that were not reduced in place."""
        work, grads, more, dest = entry
        work.wait()
        for a in more:
            self.comm.all_reduce_coalesced(grads, a).wait()
        for d, g in zip(dest, grads):
            if d is not g:
                d.copy_(g)

    def abort(self) -> None:
        self._active = False
        self._reset()

    # ---- buckets ---------------------------------------------------------------------------
    def _add(self, attr: str) -> tuple[int, ...]:
        axes = self.axes_of[attr]
        p = self.params[attr]
        self._done.add(attr)
        self._pending.setdefault(axes, []).append(attr)
        self._pending_bytes[axes] = self._pending_bytes.get(axes, 0) + p.numel() * p.element_size()
        return axes

    def _launch(self, axes: tuple[int, ...]) -> None:
        """Start summing the pending gradients on ``axes`` over the first axis, in buckets."""
        attrs = self._pending.pop(axes, [])
        self._pending_bytes.pop(axes, None)
        bucket, names, size = [], [], 0
        for attr in attrs:
            g = self.params[attr].grad
            bucket.append(g)
            names.append(attr)
            size += g.numel() * g.element_size()
            if size >= self.bucket_bytes:
                self._start(bucket, axes, tuple(names))
                bucket, names, size = [], [], 0
        if bucket:
            self._start(bucket, axes, tuple(names))

    def _start(self, grads: list, axes: tuple[int, ...], names: tuple[str, ...] = ()) -> None:
        if self.reducer.axis is not None and self.reducer.axis in axes:
            more = tuple(a for a in axes if a != self.reducer.axis)
            self._inflight.append((self.reducer.start(names, grads), grads, more, grads))
            return
        axes = tuple(a for a in axes if self.comm.size(a) > 1)    # a sum over one rank is a no-op
        if not axes:
            return
        dest = grads
        if self.reduce_dtype is not None:
            grads = [g.to(self.reduce_dtype) if g.is_floating_point() else g for g in grads]
        self._inflight.append((self.comm.all_reduce_coalesced(grads, axes[0]), grads, axes[1:], dest))
