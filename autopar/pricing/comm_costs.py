"""The communication half of :class:`autopar.pricing.costing.CostModel`: what a
redistribution between two placements costs (forward and backward collectives, each priced
once by ``cost_models.comm``'s alpha-beta model over the mesh axis's link), a parameter's
gradient reduction under the data-parallel update scheme the options pin (exact, local SGD,
averaging, compression), and the overlap rule of ``cost_models/step.py``.

:class:`CommCosts` is a mixin: it reads the cost model's mesh, links, options-derived
settings (``zero``, ``compress``, ``averaging``, ...) and its ``_act`` / ``_grad_scale``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.cost_models import comm as comm_model
from autopar.cost_models.comm import terms_time
from autopar.placement import Partial, Placement, Replicate, Shard, local_shape
from autopar.sharding.redistribute import Step, Unsupported, plan_steps
from autopar.sharding.registry import TensorMeta

INF = float("inf")

AVERAGING_COPIES = {"async": 2, "decentralized": 3}
"""Parameter copies ``averaging=`` keeps (decentralized: 2 with 2 data ranks)."""

COPY_OUT = "copy_out"
"""The kind of a ZeRO-3 gather's copy-out (:meth:`CostModel._edge_steps`): device memory
traffic on the compute stream, listed with the gather it follows, not a collective."""


@dataclass(frozen=True)
class Collective:
    """One collective of a redistribution, priced once (seconds for one run)."""
    kind: str
    axis: int
    backward: bool
    seconds: float
    sync: bool          # once per step (``grad_sync_scale``): a parameter's gradient reduction,
    #                     or its ZeRO-1/2 gather after the optimizer step
    regather: bool      # a ZeRO-3 gather, run again in backward
    overlap: bool = False   # may run behind compute (``CostModel.overlap_rule``)


class CommCosts:
    """Redistribution and gradient-sync prices of a :class:`CostModel` (see the module)."""

    # ---- overlap (cost_models/step.py) --------------------------------------------------
    def overlap_rule(self) -> tuple[float, bool]:
        """(seconds never hidden, whether forward compute hides too) of the overlappable
        collectives (``Collective.overlap``). The data-parallel gradient reduction overlaps
        backward except its last bucket: ``DDP_BUCKET_BYTES`` (25 MiB, GradSync's ``BUCKET_BYTES``) summed
        over the data axis; once per step, so times ``grad_sync_scale`` in a micro-batch's
        view. ZeRO-3 gathers block by block ahead of use (FSDP-style): forward and backward
        hide them, except the first block's gather, taken as one bucket too."""
        t = self.last_bucket_s
        return (t if self.zero >= 3 else t * self.grad_sync_scale), self.zero >= 3

    @property
    def last_bucket_s(self) -> float:
        """Seconds of one ``DDP_BUCKET_BYTES`` bucket's reduction (ZeRO-3: gather) over the
        data axis; 0 without one."""
        a = self.data_axis
        if a is None or a >= len(self.mesh_shape) or self.mesh_shape[a] <= 1:
            return 0.0
        kind = "all_gather" if self.zero >= 3 else "reduce_scatter" if self.zero == 2 else "all_reduce"
        scale = self._act(1.0, torch.float32) if self.zero >= 3 else self._grad_scale(torch.float32)
        return comm_model.collective_time(kind, comm_model.DDP_BUCKET_BYTES * scale, self.mesh_shape[a],
                                          self.links[a], skew=False)

    # ---- communication -------------------------------------------------------------------
    def edge_time(self, meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                  grad_partial: tuple[bool, ...], bucketed: bool = False,
                  rerun: float = 0.0, shared: int = 1) -> tuple[float, dict]:
        """Seconds to move ``meta`` from ``src`` to ``dst`` (forward + backward), and the
        seconds by ``(collective, axis)``; INF when the conversion is not offered.

        ``bucketed``: ``meta`` is a parameter, whose gradient all-reduce the runtime sends in
        buckets with the others (once per step): it pays bandwidth, not a latency of its own.
        ``rerun``: the consumer's forward runs again in backward this often (recomputation,
        :meth:`rerun`), and the forward collectives with it.
        ``shared``: the consumer reads this many parameters. Their gathers (ZeRO, a weight
        stored sharded) run back to back just before it, and their gradients' reductions
        just after its backward, so each pays ``1 / shared`` of the link's wait for the
        peers (``Link.skew``); the bucketed gradient all-reduce pays none.
        """
        return price_steps(self.edge_steps(meta, src, dst, grad_partial, bucketed, shared),
                           rerun, self.grad_sync_scale)

    def edge_steps(self, meta: TensorMeta, src, dst, grad_partial, bucketed: bool = False,
                   shared: int = 1, fp8: bool = False) -> tuple[Collective, ...] | None:
        """The collectives of :meth:`edge_time`, each priced once (before ``rerun`` and
        ``grad_sync_scale``, which :func:`price_steps` applies); None when not offered.
        ``fp8``: the weight of an fp8 linear whose ZeRO-3 gather moves float8
        (``pricing.fp8.fp8_gather_edges``)."""
        if not meta.dtype.is_floating_point:
            grad_partial = (False,) * len(grad_partial)   # integer tensors carry no gradient
        cache = self._sync_cache if bucketed else self._edge_cache
        key = (meta.shape, meta.dtype, src, dst, grad_partial, shared if bucketed else 1, fp8)
        got = cache.get(key, cache)
        if got is cache:
            got = cache[key] = self._edge_steps(meta, src, dst, grad_partial, bucketed, shared, fp8)
        return got

    def _edge_steps(self, meta, src, dst, grad_partial, bucketed, shared, fp8=False):
        steps = _planned(src, dst, grad_partial)
        if steps is None:
            return None
        cur = list(src)
        out = []
        scale = self._act(1.0, meta.dtype)    # 16-bit tensors move half the bytes
        # ZeRO-3's fp8 gather (passes/fp8_gathers.py: one gather, read by the fp8 linear):
        # 1 byte an element, forward and again in backward, and the amax's max-reduction
        fp8 = fp8 and bucketed and self.zero >= 3 and sum(
            st.kind == "all_gather" and self.mesh_shape[st.axis] > 1 for st in steps) == 1
        # each step's local shape before is the last one's after: one local_shape a step
        shape = _local(meta, cur, self.mesh_shape).shape if steps else None
        for step in steps:
            before_shape = shape
            before = _nbytes(before_shape, meta.dtype)
            cur[step.axis] = _after(step, cur[step.axis])
            shape = local_shape(meta.shape, cur, self.mesh_shape)
            if shape is None:
                return None        # an intermediate placement would not divide evenly
            after = _nbytes(shape, meta.dtype)
            n = self.mesh_shape[step.axis]
            link = self.links[step.axis]
            # ZeRO-1/2: a parameter's gather over the data axis runs once per step, after the
            # optimizer step (bucketed); its gradient is all-reduced whole (stage 1) or
            # reduce-scattered (stage 2), bucketed and once per step as well
            per_step = (bucketed and self.zero in (1, 2) and step.axis == self.data_axis
                        and step.kind == "all_gather")
            for backward, kind in ((False, step.forward_collective()), (True, step.backward_collective())):
                if kind is None:
                    continue
                if per_step and backward and self.zero == 1:
                    kind = "all_reduce"
                # gathers and reduce-scatters move the whole, the rest what they start from
                size = (max(before, after) if kind in ("all_gather", "reduce_scatter")
                        or (per_step and kind == "all_reduce") else before)
                # a parameter's gradient reduction moves the reduce dtype's bytes
                grad = bucketed and backward and kind in ("all_reduce", "reduce_scatter")
                terms = self._terms(kind, step.axis)
                gathered8 = fp8 and not backward and kind == "all_gather"
                t = terms_time(terms, size * (self._grad_scale(meta.dtype) if grad
                                              else 1 / meta.dtype.itemsize if gathered8 else scale))
                if bucketed and (step.kind == "grad_all_reduce" or per_step):
                    t -= terms_time(terms, 1.0)   # latency shared by the bucket
                    if step.kind == "grad_all_reduce" and step.axis == self.data_axis:
                        t = self._lossy_grad_sync(t, TensorMeta(before_shape, meta.dtype), scale, n, link)
                else:
                    # the wait for the peers: once per collective between computations, shared
                    # by a consumer's parameters (see ``shared``)
                    t += link.skew / (max(1, shared) if bucketed else 1)
                # ZeRO-3 frees a gathered weight after use and gathers it again for backward
                # (on whichever axis it is split: the data axis, and a context axis too,
                # ``pricing.problem``; ``passes.insert_collectives`` marks every weight gather)
                regather = (not backward and bucketed and self.zero >= 3 and kind == "all_gather")
                # once per step: the deferred gradient reduction (GradSync) and ZeRO-1/2's;
                # ZeRO-3's reduce-scatter is in the backward graph, so it runs per micro-batch
                # what may hide behind compute (cost_models/step.py's overlap rule): the
                # gradient reductions GradSync launches as buckets fill during backward,
                # ZeRO-1/2's reduce-scatter, ZeRO-3's per-block gathers and reduce-scatters
                # (not decentralized averaging's exchange: the runtime runs it after the
                # optimizer step, ``runtime.updates.averaging.Decentralized``, where nothing hides it)
                overlap = ((bucketed and backward and step.kind == "grad_all_reduce"
                            and not (self.averaging == "decentralized" and step.axis == self.data_axis))
                           or (per_step and backward)
                           or (bucketed and self.zero >= 3))
                out.append(Collective(kind, step.axis, backward, t,
                                      (bucketed and backward and step.kind == "grad_all_reduce")
                                      or per_step, regather, overlap))
                if gathered8:
                    out.append(_amax_reduction(self, step.axis, shared))
                if regather:
                    # the gathered flat buffer is copied out into whole weights on the compute
                    # stream, after the gather and before the weights' readers (FSDP2's
                    # foreach_all_gather_copy_out, autopar's ParamBucket._unflatten): each
                    # gathered byte read once and written once; never hidden
                    dev = self.cluster.device
                    out.append(Collective(COPY_OUT, step.axis, False,
                                          2 * size * (1 / meta.dtype.itemsize if gathered8 else scale)
                                          / (dev.mem_bandwidth * dev.mem_efficiency),
                                          False, True, False))
        return tuple(out)

    def _terms(self, kind: str, axis: int) -> comm_model.Terms:
        """``comm_model.collective_terms`` of ``kind`` over mesh axis ``axis``, kept per
        cost model: each conversion's collectives are then priced by
        ``comm_model.terms_time``, the floating-point operations of ``collective_time``
        (``skew=False``) without looking up the kind, the group and the link again."""
        memo = self.__dict__.get("_terms_memo")
        if memo is None:
            memo = self.__dict__["_terms_memo"] = {}
        got = memo.get((kind, axis))
        if got is None:
            got = memo[(kind, axis)] = comm_model.collective_terms(kind, self.mesh_shape[axis],
                                                                   self.links[axis])
        return got

    def _lossy_grad_sync(self, t: float, local: TensorMeta, scale: float, n: int, link) -> float:
        """A parameter's gradient all-reduce over the data axis (``t`` seconds exact) under
        ``local_sgd``, ``averaging`` or ``compress``."""
        if self.averaging:
            return comm_model.averaging_time(self.averaging, math.prod(local.shape) * local.dtype.itemsize
                                             * scale, n, link, self.averaging_period)
        if self.local_sgd:
            return t / self.local_sgd
        if self.compress is None:
            return t
        kind, arg = self.compress
        return comm_model.compressed_reduce_time(kind, arg, local.shape, local.dtype.itemsize * scale,
                                                 n, link, self.cluster.device)

    def _lossy_copies(self) -> int:
        """Parameter-sized buffers a parameter keeps under ``averaging`` (decentralized: its
        flat copy and one received from each ring neighbour; async: the snapshot and its
        sum in flight) or Accordion (its interval's accumulated gradient)."""
        if self.averaging == "async":
            return AVERAGING_COPIES["async"]
        if self.averaging == "decentralized":
            n = self.mesh_shape[self.data_axis] if self.data_axis is not None else 1
            return 1 + (1 if n == 2 else 2) if n > 1 else 0
        return 1


def _amax_reduction(cost, axis: int, shared: int) -> Collective:
    """The max-reduction of an fp8-gathered weight's amax over ``axis`` before its gather
    (``ops.fp8.weight_scales``: an all-gather of one fp32 amax a rank, once a bucket: priced
    once a weight, its wait for the peers shared as a consumer's gathers share it), forward
    only (backward's gather again reuses the scale), not hidden (the cast waits for it)."""
    n = cost.mesh_shape[axis]
    t = terms_time(cost._terms("all_gather", axis), 4.0 * n) + cost.links[axis].skew / max(1, shared)
    return Collective("all_gather", axis, False, t, False, False, False)


def price_steps(steps: tuple[Collective, ...] | None, rerun: float = 0.0,
                sync_scale: float = 1.0) -> tuple[float, dict]:
    """(seconds, seconds by (collective, axis)) of ``steps``: the gradient reductions times
    ``sync_scale``; the forward collectives run ``1 + rerun`` times (recomputation), a
    ZeRO-3 gather once more, and those once per step (ZeRO-1/2's gathers) once. INF when
    ``steps`` is None (the conversion is not offered)."""
    if steps is None:
        return INF, {}
    total, by = 0.0, {}
    for c in steps:
        t = c.seconds
        if c.sync:
            t *= sync_scale
        if not c.backward and not c.sync:
            t *= 1.0 + rerun + (1.0 if c.regather else 0.0)
        total += t
        by[(c.kind, c.axis)] = by.get((c.kind, c.axis), 0.0) + t
    return total, by


_STEPS: dict = {}
"""``plan_steps`` by (src, dst, grad_partial), None where Unsupported: they read the
placements only, so every mesh and cost model shares them (a few thousand a plan)."""


def _planned(src, dst, grad_partial) -> tuple[Step, ...] | None:
    key = (src, dst, grad_partial)
    got = _STEPS.get(key, _STEPS)
    if got is _STEPS:
        if len(_STEPS) >= 100_000:
            _STEPS.clear()
        try:
            got = tuple(plan_steps(src, dst, grad_partial))
        except Unsupported:
            got = None
        _STEPS[key] = got
    return got


def _after(step: Step, p: Placement) -> Placement:
    if step.kind in ("all_gather", "all_reduce", "grad_all_reduce"):
        return Replicate()
    if step.kind in ("scatter", "reduce_scatter", "all_to_all"):
        return Shard(step.dim, step.groups)
    if step.kind == "shard_to_partial":
        return Partial()
    return p  # to_partial keeps the size


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    """``TensorMeta(shape, dtype).nbytes``."""
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _local(meta: TensorMeta, placements, mesh_shape) -> TensorMeta:
    shape = local_shape(meta.shape, placements, mesh_shape)
    if shape is None:
        raise ValueError(f"{meta} does not divide under {placements} on mesh {mesh_shape}")
    return TensorMeta(shape, meta.dtype)
