"""Costs of a sharding problem's choices, from ``autopar.cost_models``.

- node cost: forward + backward time of the op on its local shapes under each option;
- edge cost: time of the redistribution steps between a producer's output placement and a
  consumer's input placement, forward and backward (gradient synchronisation of a replicated
  parameter is the backward of its ``grad_all_reduce`` step);
- memory: bytes each option keeps on a device — a parameter's shard with its gradient and
  optimizer states, the shards of what autograd saves for backward
  (``autopar.analysis.saved``: not every output, and tensors ops save inside).
Compute, communication and memory stay separate all the way to the plan's estimate.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autopar.analysis.saved import Kept
from autopar.cost_models import comm as comm_model
from autopar.cost_models import compute as compute_model
from autopar.cost_models import memory as memory_model
from autopar.cost_models.offload import disk_seconds, exposed_share, offload_seconds
from autopar.cost_models.hardware import Cluster, axis_link
from autopar.placement import Partial, Placement, Replicate, Shard, local_shape
from autopar.sharding.redistribute import Step, Unsupported, plan_steps
from autopar.sharding.registry import TensorMeta, input_placements, localize, output_placements
from autopar.options import Options, as_options
from autopar.ops.experts import EXPERTS_OP
from autopar.pricing.context import context_attention_time, context_axis_of
from autopar.pricing.experts import experts_saved_bytes, experts_time
from autopar.pricing.problem import VIEW_OPS, NodeVar

INF = float("inf")
OVERLAPPED = "overlapped"
"""The estimate's ``comm`` row (negative seconds) of communication hidden behind compute,
so the rows still add up to ``comm_s`` (``CostModel.overlap_rule``)."""

SHARED_PRICES = 32
"""Memos of redistribution and op prices kept at once (:func:`_shared`), the most recent
(8 dropped a mesh's while the pipeline search went back to it: 28% of GPT-175B's
redistributions were priced again)."""
_SHARED: OrderedDict = OrderedDict()


def _shared(key: tuple) -> dict:
    """The memo of every cost model whose prices of one kind read exactly ``key`` (mesh,
    links, precision, ...): a search prices a mesh's redistributions and op times once,
    whatever ZeRO stage, recomputation, memory view or graph (same calls) it weighs them
    for. Only the last :data:`SHARED_PRICES` are kept (a search goes mesh by mesh)."""
    memo = _SHARED.get(key)
    if memo is None:
        memo = _SHARED[key] = {}
        while len(_SHARED) > SHARED_PRICES:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return memo


@dataclass
class CostModel:
    cluster: Cluster
    mesh_shape: tuple[int, ...]
    dtype_key: str = "fp32"          # "fp32", or "bf16" / "fp16" for mixed precision
    zero: int = 0                    # ZeRO stage pinned on the data axis
    data_axis: int | None = None
    profiler: Any = None
    """A :class:`autopar.cost_models.profile.Profiler` (fp32 only): its measured time where
    it has one, the roofline elsewhere."""
    recompute: frozenset = frozenset()
    """Captured nodes run again in backward (layers under ``recompute=``): one more forward."""
    recompute_kept: frozenset = frozenset()
    """Of those, the ones whose output is kept (a layer's output, the next one's input)."""
    memory_weights: dict | None = None
    """Factor per memory term (``{"params": 1/p, "activations": ...}``): the pipeline
    planner's per-stage view of the whole graph's memory (a stage holds 1/p of the layers
    and several micro-batches of their activations). None = every factor 1."""
    grad_sync_scale: float = 1.0
    """Factor on a parameter's gradient reduction (the backward all-reduce or
    reduce-scatter of a bucketed parameter edge): 1 / micro-batches when the graph is one
    micro-batch of a step whose gradients are reduced once (pipelines)."""
    compress: tuple | None = None
    """The data axis's gradient all-reduce compressed (pin ``compress=``: (kind, parameter),
    ``Options.compression``); priced by ``comm.compressed_reduce_time``."""
    local_sgd: int | None = None
    """Pin ``local_sgd=H``: parameters averaged every H steps instead of gradients summed
    every step (priced after the warm-up: the all-reduce's 1/H)."""
    averaging: str | None = None
    """Pin ``averaging=`` (BAGUA; ``autopar.runtime.updates.averaging``): parameters exchanged with
    the ring neighbours ("decentralized") or all-reduced in the background ("async") every
    ``averaging_period`` steps instead of gradients summed (``comm.averaging_time``); its
    buffers (:data:`AVERAGING_COPIES`) are priced as optimizer state."""
    averaging_period: int = 1
    offload: bool = False
    """``offload="optimizer"`` (ZeRO-Offload): a parameter's optimizer state lives on the host
    (no device bytes) and each step pays its shard's host step and the exposed share of its
    copies (``cost_models.offload``'s overlap rule), as that parameter's backward time, once
    per step."""
    offload_disk: bool = False
    """``offload="disk"`` (ZeRO-Infinity's disk tier): on top of :attr:`offload`, each
    parameter's optimizer shard is read from disk and written back every step; it pays the
    disk time beyond its host step (``cost_models.offload.disk_seconds``)."""
    offload_exposed: float = 1.0
    """Under ``offload``: the share of the copies not hidden (``offload.exposed_share`` of the
    problem's parameters, set by :meth:`offload_share` when a problem is priced)."""
    grad_reduce: str = "fp32"
    """The dtype parameter gradients are reduced in under mixed precision (pin
    ``grad_reduce``): fp32 unless "bf16", as the runtime reduces them
    (``autopar.runtime.precision``); see :meth:`_grad_scale`."""
    native: bool = False
    """The graph was captured in the dtypes the run computes in (``Captured.native_dtypes``:
    16-bit parameters): every tensor is priced at its own width, the fp32 ones the model
    makes itself (``x.float()`` in a norm, a loss's upcast) at 32 bits. Otherwise mixed
    precision moves every fp32 tensor of the (fp32) capture at 16 bits."""

    context_form: str | None = None
    context_balanced: bool = False
    """The graph runs the sequence in the causally balanced order (pin ``context=``)."""
    """How context-parallel attention crosses its axis (pin ``context_attention``); None:
    each option priced at the faster form (``autopar.pricing.context``)."""
    compiled: bool = False
    """``compile=True``: memory-bound ops fuse as TorchInductor fuses them
    (``cost_models.compute``'s docstring), their fused inputs named by :attr:`fused_reads`."""
    fused_reads: dict = field(default_factory=dict)
    """Under :attr:`compiled`: op -> indices of the inputs it reads inside a fused kernel
    (``pricing.prices.fused_reads``, set when a problem is priced)."""
    expert_imbalance: float = 1.0
    """The busiest expert-parallel rank's token-expert pairs over the mean
    (``Options.expert_imbalance``; ``autopar.pricing.experts``)."""

    def offload_share(self, problem) -> float:
        """``cost_models.offload.exposed_share`` of ``problem``'s parameters in fp32 over every
        rank of the mesh (the least a rank's shard can be, so the most exposed share)."""
        whole = sum(len(v.members) * v.meta.numel * 4 for v in problem.vars.values() if v.kind == "param")
        ranks = 1
        for n in self.mesh_shape:
            ranks *= n
        return exposed_share(whole / ranks)

    @property
    def mixed(self) -> bool:
        """Mixed precision as ``torch.autocast`` runs it: 16-bit compute and activations;
        fp32 master weights, gradients and optimizer moments (2Ψ params: the 16-bit copies
        of the weights, + 4Ψ grads + 12Ψ optimizer for Adam)."""
        return self.dtype_key in ("bf16", "fp16")

    @property
    def memory_phases(self) -> tuple[tuple[str, ...], ...]:
        """Groups of memory terms never live at once (``cost_models.memory.step_phases``) when
        this prices a whole step of one micro-batch; none (every term at once) for a
        pipeline's per-stage view or one of several micro-batches (``memory_weights``,
        ``grad_sync_scale`` < 1): earlier micro-batches' gradients live beside later ones'
        activations."""
        if self.memory_weights or self.grad_sync_scale != 1.0:
            return ()
        return memory_model.step_phases(self.mixed)

    def _act(self, nbytes: float, dtype) -> float:
        """Bytes of an activation in this precision (fp32 tensors of an fp32 capture halve
        under mixed; a ``native`` capture's are what they are)."""
        if self.mixed and not self.native and dtype.is_floating_point and dtype.itemsize == 4:
            return nbytes / 2
        return nbytes

    def _grad_scale(self, dtype) -> float:
        """Bytes a parameter's gradient reduction moves per byte of a ``dtype`` tensor: under
        mixed precision the gradient is reduced in fp32 (4 bytes an element) unless
        ``grad_reduce="bf16"`` (2), whatever the parameter's captured dtype; otherwise in
        the parameter's own dtype."""
        if self.mixed and dtype.is_floating_point:
            return (2 if self.grad_reduce == "bf16" else 4) / dtype.itemsize
        return 1.0

    def __post_init__(self):
        self.links = [axis_link(self.cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        # what each kind of price reads, and so which models may share it: a redistribution
        # the mesh, its links and the precision; a parameter's (bucketed) one also the ZeRO
        # stage, the data axis and lossy reduction; an op's time the device and precision
        base = ("edges", self.mesh_shape, tuple(self.links), self.mixed, self.native,
                self.grad_reduce)
        self._edge_cache = _shared(base)
        self._sync_cache = _shared((*base, self.zero, self.data_axis, self.compress, self.local_sgd,
                                    self.averaging, self.averaging_period,
                                    self.cluster.device))
        self._time_cache = _shared(("time", self.mesh_shape, self.cluster.device, self.dtype_key,
                                    self.native, self.compiled, tuple(self.links),
                                    self.context_form, self.context_balanced)) \
            if self.profiler is None else {}
        self._rec_count: dict = {}   # id(NodeVar) -> (it, members recomputed)
        self._kept: dict = {}        # id(NodeVar) -> (it, whether a member is kept, _keeps)
        self._prices = None      # the PriceTable of the last problem priced (autopar.pricing.prices)

    @classmethod
    def for_pins(cls, cluster: Cluster, mesh_shape: tuple[int, ...], pins: Options, *,
                 data_axis: int | None = None, recompute: tuple | None = None, profiler: Any = None,
                 memory_weights: dict | None = None, grad_sync_scale: float = 1.0,
                 native: bool = False) -> CostModel:
        """The cost model of a plan with ``pins`` (precision, zero) on ``mesh_shape``;
        ``recompute`` = (recomputed nodes, kept nodes) (``analysis.layers.recompute_nodes``);
        ``native``: the capture's own dtypes (``Captured.native_dtypes``).
        The solver and ``explain`` both build theirs here, so they price alike."""
        rec, kept = recompute or (frozenset(), frozenset())
        pins = as_options(pins)
        return cls(cluster, tuple(mesh_shape), dtype_key=pins.precision or "fp32",
                   zero=pins.zero_stage, data_axis=data_axis, profiler=profiler,
                   recompute=frozenset(rec), recompute_kept=frozenset(kept),
                   memory_weights=memory_weights, grad_sync_scale=grad_sync_scale,
                   compress=pins.compression, local_sgd=pins.local_sgd,
                   averaging=pins.averaging, averaging_period=pins.averaging_period or 1,
                   offload=pins.offload in ("optimizer", "disk"), offload_disk=pins.offload == "disk",
                   native=native, compiled=bool(pins.compile),
                   grad_reduce=pins.grad_reduce or "fp32",
                   expert_imbalance=pins.expert_imbalance or 1.0,
                   context_form=pins.context_attention,
                   context_balanced=(pins.context or 1) > 1)

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

    # ---- compute -------------------------------------------------------------------------
    def node_time(self, v: NodeVar, combo) -> tuple[float, float]:
        """(forward, backward) seconds of one option of an op node, recomputation included."""
        return self.with_recompute(v, self.base_time(v, combo))

    def with_recompute(self, v: NodeVar, t: tuple[float, float]) -> tuple[float, float]:
        """``t`` = :meth:`base_time` with ``v``'s recomputed members' forward run again."""
        rec = self._recomputed(v)
        return t if not rec else (t[0], t[1] + t[0] * rec / len(v.members))

    def base_time(self, v: NodeVar, combo, optimizer_states: int = 2) -> tuple[float, float]:
        """(forward, backward) seconds of one option of an op node, without recomputation;
        a parameter's under ``offload``: its optimizer shard's copies and host step."""
        if v.call is None:
            if self.offload and v.kind == "param":
                b = _local(v.meta, output_placements(combo, 0), self.mesh_shape).nbytes
                t = offload_seconds(b, optimizer_states, self.cluster.device, self.offload_exposed)
                if self.offload_disk:
                    t += disk_seconds(b, optimizer_states, self.cluster.device)
                return 0.0, t * self.grad_sync_scale
            return 0.0, 0.0
        key = (id(v.call), combo)      # the call held in the memo: its id is not reused
        got = self._time_cache.get(key)
        if got is not None and got[0] is v.call:
            return got[1]
        t = self._op_time(v, combo)
        self._time_cache[key] = (v.call, t)
        return t

    def _op_time(self, v: NodeVar, combo) -> tuple[float, float]:
        if v.call.op is EXPERTS_OP:
            return experts_time(v.call, combo, self.mesh_shape, self.cluster.device,
                                self.dtype_key, self.links, self.expert_imbalance, self.native)
        axis = context_axis_of(v.call, combo, self.mesh_shape)
        if axis is not None:
            return context_attention_time(v.call, combo, self.mesh_shape, axis, self.cluster.device,
                                          self.dtype_key, self.links, self.context_form, self.native,
                                          self.context_balanced)
        ins = [_local(m, input_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.inputs)]
        outs = [_local(m, output_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.outputs)]
        if self.profiler is not None and not self.mixed:
            # the call each rank runs: local shape constants, local tensors in place
            op, args, kwargs = localize(v.call, combo, self.mesh_shape)
            local_of = {id(g): m for g, m in zip(v.call.inputs, ins)}
            sub = lambda a: local_of.get(id(a), a) if isinstance(a, TensorMeta) else a  # noqa: E731
            t = self.profiler.node_time(op, ins, outs, tree_map(sub, args), tree_map(sub, kwargs))
            return t if t is not None else self._roofline(v, ins, outs)
        return self._roofline(v, ins, outs)

    def _roofline(self, v, ins, outs) -> tuple[float, float]:
        # a native capture without a precision pin: each matmul at its own inputs' rate
        key = None if self.native and not self.mixed else self.dtype_key
        return compute_model.node_time(v.call.op, ins, outs, v.call.args, v.call.kwargs,
                                       self.cluster.device, key, native=self.native,
                                       fused_reads=self.fused_reads.get(v.name, frozenset()))

    def _recomputed(self, v: NodeVar) -> int:
        """How many of ``v``'s members (repeated-layer copies) are recomputed."""
        if not self.recompute:
            return 0
        got = self._rec_count.get(id(v))
        if got is None or got[0] is not v:
            got = self._rec_count[id(v)] = (v, sum(1 for m in v.members if m in self.recompute))
        return got[1]

    def _keeps(self, v: NodeVar) -> bool:
        """Whether a member of ``v`` is a layer output recomputation keeps (``recompute_kept``);
        worked out once per node (its members are a repeated layer's copies)."""
        if not self.recompute_kept:
            return False
        got = self._kept.get(id(v))
        if got is None or got[0] is not v:
            got = self._kept[id(v)] = (v, any(m in self.recompute_kept for m in v.members))
        return got[1]

    def rerun(self, v: NodeVar) -> float:
        """Fraction of ``v``'s members whose forward runs again in backward: the
        redistributions feeding them are inside the recomputed region and run again too."""
        return self._recomputed(v) / len(v.members) if self.recompute else 0.0

    # ---- memory --------------------------------------------------------------------------
    def node_memory(self, v: NodeVar, combo, optimizer_states: int) -> dict[str, float]:
        """Bytes per device of one option, by term (recomputation split, times ``memory_weights``)."""
        return self.weigh(self.split_recompute(v, self.base_memory(v, combo, optimizer_states)))

    def weigh(self, terms: dict[str, float]) -> dict[str, float]:
        """``terms`` times ``memory_weights`` (the pipeline planner's per-stage view)."""
        if not self.memory_weights:
            return terms
        return {k: b * self.memory_weights.get(k, 1.0) for k, b in terms.items()}

    def split_recompute(self, v: NodeVar, terms: dict[str, float]) -> dict[str, float]:
        """``terms`` (:meth:`base_memory`) with ``v``'s recomputed members keeping nothing:
        backward rebuilds one layer's activations at a time (the "recompute" term)."""
        rec = self._recomputed(v) if v.kind == "op" and "activations" in terms else 0
        if not rec or self._keeps(v):
            return terms
        b, n = terms["activations"], len(v.members)
        return {"activations": b * (n - rec) / n, "recompute": b / n}

    def base_memory(self, v: NodeVar, combo, optimizer_states: int) -> dict[str, float]:
        """Bytes per device of one option, by term, without recomputation or weights."""
        if v.kind == "param":
            placements = output_placements(combo, 0)
            b = _local(v.meta, placements, self.mesh_shape).nbytes
            held = grads = b
            if self.zero in (1, 2) and self.data_axis is not None:
                # ZeRO-1/2: the working weight, whole over the data axis, lives through the
                # step; stage 1 keeps its whole gradient too (all-reduced), stage 2 its block
                whole = list(placements)
                whole[self.data_axis] = Replicate()
                held = _local(v.meta, whole, self.mesh_shape).nbytes
                grads = held if self.zero == 1 else b
            if self.offload:     # master copy and moments on the host (ZeRO-Offload)
                return {"params": held / 2 if self.mixed else held, "grads": grads}
            if self.mixed:   # 16-bit weight copies; fp32 grads (of the masters), master copy + moments
                out = {"params": held / 2, "grads": grads, "optimizer": b * (1 + optimizer_states)}
            else:
                out = {"params": held, "grads": grads, "optimizer": b * optimizer_states}
            if self.averaging or (self.compress and self.compress[0] == "accordion"):
                out["optimizer"] += b * self._lossy_copies()
            if self.memory_phases and self.zero in (0, 1) and any(
                    n > 1 and (isinstance(p, Replicate) or (self.zero == 1 and a == self.data_axis))
                    for a, (p, n) in enumerate(zip(placements, self.mesh_shape))):
                # summed over the ranks it is read whole on once per step, in flat buckets
                # that live until the step's end (runtime.grad_sync): beside all gradients
                out["grad_buffers"] = grads
            return out
        if v.kind in ("input", "buffer"):
            b = _local(v.meta, output_placements(combo, 0), self.mesh_shape).nbytes
            return {"inputs" if v.kind == "input" else "buffers": b}
        return {"activations": self.saved_bytes(v, combo)}

    def saved_bytes(self, v: NodeVar, combo) -> float:
        """Bytes per device an op node keeps for backward (``v.kept``, from
        ``autopar.analysis.saved``: the outputs autograd saves, its own or a consumer's, and
        the tensors the op saves inside, each the local share of what it follows; the loss
        node adds the gradients its backward makes beside them, ``Kept.transient``). A layer
        output that recomputation keeps (``recompute_kept``) is kept whole."""
        kept, view = v.kept, v.call.op in VIEW_OPS
        if kept is None and view:
            return 0.0
        if kept is None or (not view and self.recompute_kept and self._keeps(v)):
            kept = Kept((1.0,) * len(v.call.outputs))
        local = lambda m, ps: _local(m, ps, self.mesh_shape).nbytes  # noqa: E731
        total = sum(self._act(share * local(m, output_placements(combo, k)), m.dtype)
                    for k, (share, m) in enumerate(zip(kept.outputs, v.call.outputs)) if share)
        for e in kept.extras + kept.transient:
            side, k = e.ref
            m = (v.call.inputs if side == "in" else v.call.outputs)[k]
            ps = input_placements(combo, k) if side == "in" else output_placements(combo, k)
            b = e.nbytes * local(m, ps) / max(m.nbytes, 1)
            total += b if e.fp32 else self._act(b, m.dtype)
        if v.call.op is EXPERTS_OP:
            total += self._act(experts_saved_bytes(v.call, combo, self.mesh_shape, self.expert_imbalance),
                               v.call.inputs[0].dtype)
        return total

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
                   shared: int = 1) -> tuple[Collective, ...] | None:
        """The collectives of :meth:`edge_time`, each priced once (before ``rerun`` and
        ``grad_sync_scale``, which :func:`price_steps` applies); None when not offered."""
        if not meta.dtype.is_floating_point:
            grad_partial = (False,) * len(grad_partial)   # integer tensors carry no gradient
        cache = self._sync_cache if bucketed else self._edge_cache
        key = (meta.shape, meta.dtype, src, dst, grad_partial, shared if bucketed else 1)
        got = cache.get(key, cache)
        if got is cache:
            got = cache[key] = self._edge_steps(meta, src, dst, grad_partial, bucketed, shared)
        return got

    def _edge_steps(self, meta, src, dst, grad_partial, bucketed, shared):
        steps = _planned(src, dst, grad_partial)
        if steps is None:
            return None
        cur = list(src)
        out = []
        scale = self._act(1.0, meta.dtype)    # 16-bit tensors move half the bytes
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
                t = comm_model.collective_time(kind, size * (self._grad_scale(meta.dtype) if grad else scale),
                                               n, link, skew=False)
                if bucketed and (step.kind == "grad_all_reduce" or per_step):
                    t -= comm_model.collective_time(kind, 1.0, n, link, skew=False)   # latency shared by the bucket
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
                if regather:
                    # the gathered flat buffer is copied out into whole weights on the compute
                    # stream, after the gather and before the weights' readers (FSDP2's
                    # foreach_all_gather_copy_out, autopar's ParamBucket._unflatten): each
                    # gathered byte read once and written once; never hidden
                    dev = self.cluster.device
                    out.append(Collective(COPY_OUT, step.axis, False,
                                          2 * size * scale / (dev.mem_bandwidth * dev.mem_efficiency),
                                          False, True, False))
        return tuple(out)


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


def hidden_steps_s(steps: tuple[Collective, ...] | None, rerun: float = 0.0,
                   sync_scale: float = 1.0) -> float:
    """Seconds of ``steps`` (as :func:`price_steps` counts them) that may overlap compute."""
    if not steps:
        return 0.0
    return price_steps(tuple(c for c in steps if c.overlap), rerun, sync_scale)[0]


def exposed_sync(pool_s: float, hide_s: float, last_s: float) -> float:
    """Seconds of ``pool_s`` of overlappable communication left on the step: all but what
    ``hide_s`` seconds of compute hide, never less than the last bucket (``last_s``) or
    ``pool_s`` itself (``cost_models.comm.grad_sync_time``'s rule, without the 1 - 1/k)."""
    return min(pool_s, max(last_s, pool_s - hide_s)) if pool_s > 0 else 0.0


def params_read(problem) -> dict[str, int]:
    """How many parameters each node of ``problem`` reads (``edge_time``'s ``shared``)."""
    out: dict[str, int] = {}
    for e in problem.edges:
        if problem.vars[e.src].kind == "param":
            out[e.dst] = out.get(e.dst, 0) + 1
    return out


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


def grad_partial_flags(combo, k: int) -> tuple[bool, ...]:
    """Per axis: input ``k`` is read replicated by an op whose output is not replicated, so
    its gradient comes back partial."""
    return tuple(isinstance(s.inputs[k], Replicate)
                 and any(not isinstance(p, Replicate) for p in s.outputs) for s in combo)
