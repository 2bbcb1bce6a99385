"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, Sec. 5) in the runtime.

A plan pinned ``zero=1`` or ``zero=2`` stores each parameter sharded ``S(d)`` over the data
axis: that is the optimizer's shard. The per-rank programs run on the *working* parameters,
the same tensors replicated over the data axis (:func:`working_plan`), so the forward needs
no gather and each gradient comes back partial over the data axis:

- stage 1: the gradients are all-reduced once per step, bucketed and overlapped with
  backward (``autopar.runtime.grad_sync.GradSync``); each rank's optimizer shard takes the
  block of the summed gradient that is its own (a view: the whole gradient stays, as the
  stage's memory says);
- stage 2: the gradients are reduce-scattered instead (:class:`ZeroGradSync`, same buckets,
  same overlap): each rank keeps only its block of each gradient; the whole gradient is
  freed as soon as its bucket is sent.

``pm.parameters()`` (what the user's optimizer is built on) are the shards: views of the
working parameters' blocks, so updating a shard updates this rank's block of the working
tensor in place; :meth:`OptimizerShards.gather` then all-gathers every block over the
data axis (bucketed). ``pm.step(optimizer)`` gathers right after the step; a step taken
with ``optimizer.step()`` (or a checkpoint or state dict loaded into the shards) is seen by
the shards' version counters, or by a step post-hook of the optimizers that hold them (a
fused step, ``AdamW(fused=True)``, torchtitan's default, bumps no version counter), and
gathered before the next forward. Stage 3 does not come
here: its parameters stay sharded and the rewritten graph gathers them per use
(``passes.insert_collectives``), by blocks (``passes.prefetch``: one all-gather of a block's
weights, one reduce-scatter of their gradients, ``autopar.ops.param_buckets``).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from autopar.errors import ArgumentError

from autopar.ops.comm import Comm
from autopar.ops.param_buckets import IN_FLIGHT
from autopar.placement import Replicate, Shard, parse_placements, placements_str
from autopar.plan import NodePlacement, Plan
from autopar.runtime.grad_sync import BUCKET_BYTES, GradSync
from autopar.runtime.shards import Shards


def optimizer_sharded(plan: Plan) -> bool:
    """Whether ``plan`` runs ZeRO stage 1 or 2 (working parameters, optimizer shards)."""
    return plan.options.zero_stage in (1, 2) and "data" in plan.mesh_axes


def working_plan(plan: Plan) -> Plan:
    """``plan`` with every parameter replicated on the data axis: what the programs run."""
    a = plan.mesh_axes.index("data")
    nodes = dict(plan.nodes)
    for ph in set(plan.params.values()):
        np_ = nodes[ph]
        ps = list(np_.output(0))
        if isinstance(ps[a], Shard):
            ps[a] = Replicate()
            nodes[ph] = NodePlacement(np_.inputs, (placements_str(ps),) + tuple(np_.outputs[1:]))
    return dataclasses.replace(plan, nodes=nodes)


def stored_shards(run: Shards, plan: Plan) -> Shards:
    """``run`` (the working parameters' description) with the placements ``plan`` stores
    them in (the optimizer shards)."""
    placements = dict(run.placements)
    for ph, attr in run.attr_of.items():
        if attr in run.params:
            placements[attr] = tuple(parse_placements(plan.nodes[ph].outputs[0]))
    return dataclasses.replace(run, placements=placements)


class OptimizerShards:
    """This rank's optimizer shard of every working parameter stored sharded on ``axis``
    (``placements``: the stored placements of the stage's mesh); a parameter replicated
    there is its own shard."""

    def __init__(self, stage: int, working: dict[str, nn.Parameter], placements: dict[str, tuple],
                 axis: int, comm: Comm, bucket_bytes: int = BUCKET_BYTES):
        self.stage, self.axis, self.comm, self.bucket_bytes = stage, axis, comm, bucket_bytes
        self.n, self.coord = comm.mesh_shape[axis], comm.coord[axis]
        self.dims: dict[str, int] = {}          # attr -> the dim its data-axis shard splits
        self.params: dict[str, nn.Parameter] = {}
        for attr, w in working.items():
            p = placements[attr][axis]
            if isinstance(p, Shard):
                if p.groups > 1:
                    raise ValueError(f"parameter {attr!r} is stored as a strided shard {p} on the "
                                     "data axis; ZeRO-1/2 shards parameters by plain blocks S(d)")
                d = p.dim % w.dim()
                self.dims[attr] = d
                self.params[attr] = nn.Parameter(w.detach().chunk(self.n, d)[self.coord],
                                                 requires_grad=w.requires_grad)
            else:
                self.params[attr] = w
        self.working = {a: working[a] for a in self.dims}
        self._versions = self._now()
        self._stepped = False       # an optimizer holding the shards stepped since the gather
        self._step_hook()

    def block(self, attr: str, t: torch.Tensor, j: int | None = None) -> torch.Tensor:
        """Rank ``j``'s (default: this rank's) block of the working-shaped ``t``."""
        return t.chunk(self.n, self.dims[attr])[self.coord if j is None else j]

    # ---- parameters ----------------------------------------------------------------------
    def _now(self) -> list[int]:
        return [self.params[a]._version for a in self.dims]

    def _step_hook(self) -> None:
        """Mark the shards stepped after any ``optimizer.step()`` of an optimizer that holds
        one of them: torch's fused AdamW (``_fused_adamw_``) updates parameters in place
        without bumping their version counters (torch 2.13, CPU: measured), so the counters
        alone miss its steps and the working parameters stay stale."""
        ids, ref = {id(p) for p in self.params.values()}, weakref.ref(self)
        strided = {id(p): a for a, p in self.params.items() if not p.is_contiguous()}
        stage = self.stage

        def refuse_fused(optimizer, args, kwargs) -> None:
            """torch's fused AdamW/Adam kernels (2.13, CPU: measured) update a
            non-contiguous parameter wrongly; a shard split along a dim > 0 is such a view."""
            if not strided or not any(g.get("fused") for g in optimizer.param_groups):
                return
            hit = next((strided[id(p)] for g in optimizer.param_groups if g.get("fused")
                        for p in g["params"] if id(p) in strided), None)
            if hit is not None:
                raise ArgumentError(
                    f"a fused optimizer ({type(optimizer).__name__}(fused=True)) steps ZeRO-{stage}'s "
                    f"shard of {hit!r}, a non-contiguous view of the working parameter, which "
                    "torch's fused kernel updates wrongly: build it with foreach=True (torchtitan: "
                    "optimizer.implementation='foreach'), or pin zero=3")

        def stepped(optimizer, args, kwargs) -> None:
            me = ref()
            if me is not None and any(id(p) in ids for g in optimizer.param_groups
                                      for p in g["params"]):
                me._stepped = True
        handles = (register_optimizer_step_pre_hook(refuse_fused),
                   register_optimizer_step_post_hook(stepped))
        for handle in handles:
            weakref.finalize(self, handle.remove)

    def dirty(self) -> bool:
        """A shard changed since the last gather (an optimizer step, a load)."""
        return self._stepped or self._now() != self._versions

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather every shard over the data axis into the working parameters (in
        buckets of about ``bucket_bytes``, one flat all-gather each). Collective. Just
        before a bucket is read, the communicator's ``settings.bucket_listener`` (ZeRO-Offload's
        host masters) may write its shards: ``listener.up(shards)``."""
        listener = self.comm.settings.bucket_listener
        for bucket in self._buckets(list(self.dims)):
            if listener is not None:
                listener.up([self.params[a] for a in bucket])
            flat = torch.cat([self.params[a].detach().reshape(-1) for a in bucket])
            parts = self.comm.all_gather(flat, self.axis, 0).view(self.n, -1)
            for j in range(self.n):
                off = 0
                for a in bucket:
                    s = self.params[a]
                    self.block(a, self.working[a], j).copy_(parts[j, off: off + s.numel()].view(s.shape))
                    off += s.numel()
        self._versions, self._stepped = self._now(), False

    def _buckets(self, attrs: list[str]) -> list[list[str]]:
        out, cur, size, dtype = [], [], 0, None
        for a in attrs:
            s = self.params[a]
            if cur and (size >= self.bucket_bytes or s.dtype != dtype):
                out.append(cur)
                cur, size = [], 0
            cur.append(a)
            size, dtype = size + s.numel() * s.element_size(), s.dtype
        return out + ([cur] if cur else [])

    # ---- gradients -----------------------------------------------------------------------
    def drop_working_grads(self) -> None:
        """A step starts with no gradient on the working parameters (the shards' gradients
        of earlier steps are kept by the module)."""
        for w in self.working.values():
            w.grad = None

    def grads_to_shards(self) -> None:
        """Give each shard whose gradient has not arrived by a reduce-scatter its block of
        the working gradient (summed by then): a view under stage 1, a copy under stage 2
        (which frees the whole gradient)."""
        for a, w in self.working.items():
            s = self.params[a]
            if s.grad is None and w.grad is not None:
                g = self.block(a, w.grad)
                if self.stage >= 2:
                    s.grad, w.grad = g.contiguous().clone(), None
                else:
                    s.grad = g

    def start_reduce_scatter(self, attrs: list[str], dtype=None):
        """Start summing ``attrs``' working gradients over the data axis, each rank receiving
        its blocks; the working gradients are freed (the flat copy is what is sent)."""
        grads = [self.working[a].grad for a in attrs]
        flat = torch.cat([self.block(a, g, j).reshape(-1) for j in range(self.n)
                          for a, g in zip(attrs, grads)])
        if dtype is not None:
            flat = flat.to(dtype)
        for a in attrs:
            self.working[a].grad = None
        return self.comm.reduce_scatter_start(flat, self.axis), grads[0].dtype

    def finish_reduce_scatter(self, started, attrs: list[str], more_axes=()) -> None:
        """Wait for :meth:`start_reduce_scatter`; sum over ``more_axes`` too; set the shards'
        gradients (views of the received buffer)."""
        work, dtype = started
        out = work.wait()
        for ax in more_axes:
            out = self.comm.all_reduce(out, ax)
        out = out.to(dtype)
        off = 0
        for a in attrs:
            s = self.params[a]
            s.grad = out[off: off + s.numel()].view(s.shape)
            off += s.numel()


class ZeroGradSync(GradSync):
    """:class:`GradSync` for ZeRO-1/2: stage 2 reduce-scatters the gradients of parameters
    stored sharded on the data axis (in the same buckets, launched at the same moments);
    both stages leave each optimizer shard its block of the summed gradient."""

    def __init__(self, params, axes_of, comm: Comm, shards: OptimizerShards, **kw):
        super().__init__(params, axes_of, comm, **kw)
        self.zero = shards
        self._scattered: list = []
        self._names: dict[int, tuple[str, ...]] = {}   # id(an all-reduce in flight) -> its attrs

    def begin(self) -> None:
        self._scattered, self._names = [], {}
        super().begin()

    def abort(self) -> None:
        super().abort()
        self._scattered = []

    def _start(self, grads: list, axes: tuple[int, ...], names: tuple[str, ...] = ()) -> None:
        n = len(self._inflight)
        super()._start(grads, axes, names)
        if len(self._inflight) > n:
            self._names[id(self._inflight[-1])] = names

    def _finish_early(self) -> None:
        """With a ``settings.bucket_listener`` on the communicator (ZeRO-Offload), finish the buckets
        launched before the last :data:`IN_FLIGHT` as the next is launched (as ZeRO-3's
        ``param_buckets._Scatters`` does), give their optimizer shards their gradients and
        hand the shards to ``listener.reduced``, while backward goes on."""
        listener = self.comm.settings.bucket_listener
        if listener is None:
            return
        while len(self._scattered) > IN_FLIGHT:
            started, bucket, more = self._scattered.pop(0)
            self.zero.finish_reduce_scatter(started, bucket, more)
            listener.reduced([self.zero.params[a] for a in bucket])
        while len(self._inflight) > IN_FLIGHT:
            entry = self._inflight.pop(0)
            self._complete(entry)
            mine = [a for a in self._names.pop(id(entry), ()) if a in self.zero.dims]
            for a in mine:        # the working gradient is summed: the shard's block of it
                s, w = self.zero.params[a], self.zero.working[a]
                if s.grad is None and w.grad is not None:
                    s.grad = self.zero.block(a, w.grad)
                    w.grad = None     # the shard's view keeps it until its copy is made
            listener.reduced([self.zero.params[a] for a in mine])

    def _launch(self, axes: tuple[int, ...]) -> None:
        self._launch_buckets(axes)
        self._finish_early()

    def _launch_buckets(self, axes: tuple[int, ...]) -> None:
        if self.zero.stage >= 2 and self.zero.axis in axes:
            attrs = self._pending.get(axes, [])
            mine = [a for a in attrs if a in self.zero.dims]
            if mine:
                self._pending[axes] = [a for a in attrs if a not in self.zero.dims]
                more = tuple(a for a in axes if a != self.zero.axis)
                for bucket in self.zero._buckets(mine):
                    self._scattered.append((self.zero.start_reduce_scatter(bucket, self.reduce_dtype),
                                            bucket, more))
        super()._launch(axes)

    def finish(self) -> None:
        super().finish()
        for started, bucket, more in self._scattered:
            self.zero.finish_reduce_scatter(started, bucket, more)
        self._scattered, self._names = [], {}
        self.zero.grads_to_shards()
