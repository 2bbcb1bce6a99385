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

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from torch.utils._pytree import tree_map

from autopar.cost_models import compute as compute_model
from autopar.cost_models.fp8 import check_fp8
from autopar.cost_models.offload import disk_seconds, exposed_share, offload_seconds
from autopar.pricing.activation_offload import copy_s, exposed_share as act_exposed_share
from autopar.cost_models.hardware import Cluster, axis_link
from autopar.placement import Replicate
from autopar.sharding.registry import TensorMeta, input_placements, localize, output_placements
from autopar.options import Options, as_options
from autopar.ops.experts import EXPERTS_OP
from autopar.pricing.comm_costs import (AVERAGING_COPIES, COPY_OUT, INF, Collective,  # noqa: F401
                                        CommCosts, _local, price_steps)
from autopar.pricing.context import context_attention_time, context_axis_of
from autopar.pricing.experts import dispatch_s, experts_time
from autopar.pricing.fp8 import fp8_time
from autopar.pricing.memory_costs import MemoryCosts
from autopar.pricing.problem import NodeVar

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


@dataclass(frozen=True)
class StepView:
    """What share of a training step the priced graph is: the whole step of one batch (the
    default), or one of m micro-batches / one pipeline stage's view of the whole graph."""
    memory_weights: dict | None = None
    """Factor per memory term (``{"params": 1/p, "activations": ...}``): the pipeline
    planner's per-stage view of the whole graph's memory (a stage holds 1/p of the layers
    and several micro-batches of their activations). None = every factor 1."""
    grad_sync_scale: float = 1.0
    """Factor on a parameter's gradient reduction (the backward all-reduce or
    reduce-scatter of a bucketed parameter edge): 1 / micro-batches when the graph is one
    micro-batch of a step whose gradients are reduced once (pipelines, accumulation)."""


WHOLE_STEP = StepView()


class Saves(NamedTuple):
    """What repeated layers do with the tensors they save for backward, each in the form of
    ``analysis.layers.recompute_nodes``: the nodes recomputed and those of theirs read outside
    their layer (kept), and the same for the nodes whose saved tensors go to host memory
    (``offload_activations=``). A plain (recomputed, kept) pair reads as one."""
    recomputed: frozenset = frozenset()
    kept: frozenset = frozenset()
    offloaded: frozenset = frozenset()
    offload_kept: frozenset = frozenset()


@dataclass
class CostModel(CommCosts, MemoryCosts):
    """Prices of a sharding problem's options on ``mesh_shape`` of ``cluster`` under
    ``options`` (read through the properties below: precision, ZeRO stage, the update
    scheme, offload, compile, context attention, expert imbalance). Compute is here;
    communication is :class:`CommCosts`' (``pricing.comm_costs``), memory
    :class:`MemoryCosts`' (``pricing.memory_costs``)."""
    cluster: Cluster
    mesh_shape: tuple[int, ...]
    options: Options = field(default_factory=Options)
    """The plan's options (``autopar.options.Options``); never copied into fields."""
    data_axis: int | None = None
    profiler: Any = None
    """A :class:`autopar.cost_models.profile.Profiler` (fp32 only): its measured time where
    it has one, the roofline elsewhere."""
    recompute: frozenset = frozenset()
    """Captured nodes run again in backward (layers under ``recompute=``): one more forward."""
    recompute_kept: frozenset = frozenset()
    """Of those, the ones whose output is kept (a layer's output, the next one's input)."""
    act_offload: frozenset = frozenset()
    """Captured nodes of the layers whose saved activations go to host memory
    (``offload_activations=``; ``pricing.activation_offload``)."""
    act_offload_kept: frozenset = frozenset()
    """Of those, the ones read outside their layer: what they save stays on the device."""
    act_offload_exposed: float = 1.0
    """The share of the offloaded layers' copies not hidden behind their neighbours'
    compute (``activation_offload.exposed_share``, set by :meth:`act_offload_share` when a
    problem is priced)."""
    memory_weights: dict | None = None
    """:attr:`StepView.memory_weights`."""
    grad_sync_scale: float = 1.0
    """:attr:`StepView.grad_sync_scale`."""
    native: bool = False
    """The graph was captured in the dtypes the run computes in (``Captured.native_dtypes``:
    16-bit parameters): every tensor is priced at its own width, the fp32 ones the model
    makes itself (``x.float()`` in a norm, a loss's upcast) at 32 bits. Otherwise mixed
    precision moves every fp32 tensor of the (fp32) capture at 16 bits."""
    offload_exposed: float = 1.0
    """Under ``offload``: the share of the copies not hidden (``offload.exposed_share`` of the
    problem's parameters, set by :meth:`offload_share` when a problem is priced)."""
    fp8_nodes: dict = field(default_factory=dict)
    """Under :attr:`fp8`: the ops that may run in fp8 (``pricing.fp8.fp8_nodes`` of the
    problem, set when a problem is priced; chosen by price unless ``fp8_layers`` is pinned)."""
    fused_reads: dict = field(default_factory=dict)
    """Under :attr:`compiled`: op -> indices of the inputs it reads inside a fused kernel
    (``pricing.prices.fused_reads``, set when a problem is priced)."""

    # ---- what the options say (read once per model: hot loops read them) -------------
    @cached_property
    def dtype_key(self) -> str:
        """"fp32", or "bf16" / "fp16" for mixed precision (pin ``precision``); "bf16" under
        ``precision="fp8"`` (its ops but the fp8 linears, :attr:`fp8_nodes`)."""
        p = self.options.precision or "fp32"
        return "bf16" if p == "fp8" else p

    @cached_property
    def fp8(self) -> bool:
        """``precision="fp8"``: the problem's fp8 linears (:attr:`fp8_nodes`) priced by
        ``autopar.pricing.fp8``; refused on a device without fp8 tensor cores."""
        return self.options.precision == "fp8"

    @cached_property
    def zero(self) -> int:
        """The ZeRO stage pinned on the data axis."""
        return self.options.zero_stage

    @cached_property
    def compress(self) -> tuple | None:
        """The data axis's gradient all-reduce compressed (pin ``compress=``: (kind,
        parameter), ``Options.compression``); priced by ``comm.compressed_reduce_time``."""
        return self.options.compression

    @cached_property
    def local_sgd(self) -> int | None:
        """Pin ``local_sgd=H``: parameters averaged every H steps instead of gradients summed
        every step (priced after the warm-up: the all-reduce's 1/H)."""
        return self.options.local_sgd

    @cached_property
    def averaging(self) -> str | None:
        """Pin ``averaging=`` (BAGUA; ``autopar.runtime.updates.averaging``): parameters
        exchanged with the ring neighbours ("decentralized") or all-reduced in the background
        ("async") every :attr:`averaging_period` steps instead of gradients summed
        (``comm.averaging_time``); its buffers (:data:`AVERAGING_COPIES`) are priced as
        optimizer state."""
        return self.options.averaging

    @cached_property
    def averaging_period(self) -> int:
        return self.options.averaging_period or 1

    @cached_property
    def offload(self) -> bool:
        """``offload="optimizer"`` (ZeRO-Offload) or ``"disk"``: a parameter's optimizer state
        lives off the device and each step pays its shard's host step and the exposed share
        of its copies (``cost_models.offload``'s overlap rule), as that parameter's backward
        time, once per step."""
        return self.options.offload in ("optimizer", "disk")

    @cached_property
    def offload_disk(self) -> bool:
        """``offload="disk"`` (ZeRO-Infinity's disk tier): on top of :attr:`offload`, each
        parameter's optimizer shard is read from disk and written back every step; it pays
        the disk time beyond its host step (``cost_models.offload.disk_seconds``)."""
        return self.options.offload == "disk"

    @cached_property
    def grad_reduce(self) -> str:
        """The dtype parameter gradients are reduced in under mixed precision (pin
        ``grad_reduce``): fp32 unless "bf16", as the runtime reduces them
        (``autopar.runtime.precision``); see :meth:`_grad_scale`."""
        return self.options.grad_reduce or "fp32"

    @cached_property
    def context_form(self) -> str | None:
        """How context-parallel attention crosses its axis (pin ``context_attention``); None:
        each option priced at the faster form (``autopar.pricing.context``)."""
        return self.options.context_attention

    @cached_property
    def context_balanced(self) -> bool:
        """The graph runs the sequence in the causally balanced order (pin ``context=``)."""
        return (self.options.context or 1) > 1

    @cached_property
    def compiled(self) -> bool:
        """``compile=True``: memory-bound ops fuse as TorchInductor fuses them
        (``cost_models.compute``'s docstring), their fused inputs named by :attr:`fused_reads`."""
        return bool(self.options.compile)

    @cached_property
    def expert_imbalance(self) -> float:
        """The busiest expert-parallel rank's token-expert pairs over the mean
        (``Options.expert_imbalance``; ``autopar.pricing.experts``)."""
        return self.options.expert_imbalance or 1.0

    def offload_share(self, problem) -> float:
        """``cost_models.offload.exposed_share`` of ``problem``'s parameters in fp32 over every
        rank of the mesh (the least a rank's shard can be, so the most exposed share)."""
        whole = sum(len(v.members) * v.meta.numel * 4 for v in problem.vars.values() if v.kind == "param")
        ranks = 1
        for n in self.mesh_shape:
            ranks *= n
        return exposed_share(whole / ranks)

    @cached_property
    def mixed(self) -> bool:
        """Mixed precision as ``torch.autocast`` runs it: 16-bit compute and activations;
        fp32 master weights, gradients and optimizer moments (2Ψ params: the 16-bit copies
        of the weights, + 4Ψ grads + 12Ψ optimizer for Adam)."""
        return self.dtype_key in ("bf16", "fp16")

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
        if self.fp8:
            check_fp8(self.cluster.device)
        self._time_cache = _shared(("time", self.mesh_shape, self.cluster.device, self.dtype_key,
                                    self.fp8, self.options.fp8_scaling, self.options.fp8_layers,
                                    self.options.fp8_gathers, self.data_axis, self.native, self.compiled, tuple(self.links),
                                    self.context_form, self.context_balanced)) \
            if self.profiler is None else {}
        self._rec_count: dict = {}   # id(NodeVar) -> (it, members recomputed)
        self._kept: dict = {}        # id(NodeVar) -> (it, whether a member is kept, _keeps)
        self._off_count: dict = {}   # id(NodeVar) -> (it, members offloaded)
        self._prices = None      # the PriceTable of the last problem priced (autopar.pricing.prices)

    @classmethod
    def for_pins(cls, cluster: Cluster, mesh_shape: tuple[int, ...], pins: Options, *,
                 data_axis: int | None = None, recompute: tuple | Saves | None = None,
                 profiler: Any = None, view: StepView = WHOLE_STEP, native: bool = False) -> CostModel:
        """The cost model of a plan with ``pins`` on ``mesh_shape``; ``recompute``: the layers'
        :class:`Saves` (or its (recomputed nodes, kept nodes) pair); ``view``: the share of a
        step the graph is (:class:`StepView`); ``native``: the capture's own dtypes
        (``Captured.native_dtypes``). The solver and ``explain`` both build theirs here, so
        they price alike."""
        rec, kept, off, off_kept = recompute if isinstance(recompute, Saves) else Saves(*(recompute or ()))
        return cls(cluster, tuple(mesh_shape), as_options(pins), data_axis=data_axis,
                   act_offload=frozenset(off), act_offload_kept=frozenset(off_kept),
                   profiler=profiler, recompute=frozenset(rec), recompute_kept=frozenset(kept),
                   memory_weights=view.memory_weights, grad_sync_scale=view.grad_sync_scale,
                   native=native)

    # ---- compute -------------------------------------------------------------------------
    def node_time(self, v: NodeVar, combo) -> tuple[float, float]:
        """(forward, backward) seconds of one option of an op node, recomputation included."""
        return self.with_recompute(v, self.base_time(v, combo))

    def node_comm(self, v: NodeVar, combo) -> dict:
        """The collectives inside one option of an op node's own time (:meth:`base_time`),
        ``{(collective, axis): (forward, backward) seconds}``: an experts op's all-to-alls
        (``pricing.experts.dispatch_s``); {} for every other op."""
        if v.call is None or v.call.op is not EXPERTS_OP:
            return {}
        by_axis = dispatch_s(v.call, combo, self.mesh_shape, self.dtype_key, self.links,
                             self.expert_imbalance, self.native)
        return {("all_to_all", a): (2 * t, 2 * t) for a, t in by_axis.items()}

    def with_recompute(self, v: NodeVar, t: tuple[float, float],
                       memory: dict | None = None) -> tuple[float, float]:
        """``t`` = :meth:`base_time` with ``v``'s recomputed members' forward run again, and
        (given the option's :meth:`base_memory`, ``memory``) its offloaded members' copies
        to the host and back, the share not hidden (``pricing.activation_offload``), as
        backward time; so, under mixed precision, a parameter's 16-bit copy that only
        offloaded layers read (their saved tensor: ``split_recompute``)."""
        rec = self._recomputed(v)
        if rec:
            t = (t[0], t[1] + t[0] * rec / len(v.members))
        if memory is not None and self.act_offload:    # (a weight's copy: a param node's)
            moved = self._offloaded(v) * memory.get("activations", 0.0) + \
                (self._offloaded_params(v) * memory.get("params", 0.0) if self.mixed else 0.0)
            if moved:
                t = (t[0], t[1] + self.act_offload_exposed * copy_s(moved, self.cluster.device)
                     / len(v.members))
        return t

    def _offloaded(self, v: NodeVar) -> int:
        """How many of ``v``'s members save to host memory (``offload_activations=``): each
        member of an offloaded layer but those read outside the offloaded layers (what they
        save stays; ``solver.flat.offload_of``), as the last layer's output the final norm
        reads, where the other layers' outputs go with the next layer's saved tensors."""
        if not self.act_offload or v.kind != "op":
            return 0
        got = self._off_count.get(id(v))
        if got is None or got[0] is not v:
            n = sum(1 for m in v.members if m in self.act_offload and m not in self.act_offload_kept)
            got = self._off_count[id(v)] = (v, n)
        return got[1]

    def _offloaded_params(self, v: NodeVar) -> int:
        """How many of parameter ``v``'s members only offloaded layers read (their 16-bit
        copies go to the host with those layers' saved tensors; ``solver.flat.offload_of``)."""
        if not self.act_offload or v.kind != "param":
            return 0
        return sum(1 for m in v.members if m in self.act_offload)

    def act_offload_share(self, problem) -> float:
        """``activation_offload.exposed_share`` of the offloaded layers: their saved bytes,
        forward and backward seconds summed over their nodes, each at its fastest option
        (``pricing.activation_offload``'s docstring: the ratio hardly depends on placements)."""
        saved = fwd = bwd = 0.0
        for v in problem.vars.values():
            n = sum(1 for m in v.members if m in self.act_offload) if v.kind == "op" else 0
            if not n:
                continue
            times = [self.base_time(v, c) for c in v.options]
            k = min(range(len(times)), key=lambda i: sum(times[i]))
            fwd += n * times[k][0]
            bwd += n * times[k][1]
            # (a layer output read outside the offloaded layers stays)
            saved += self._offloaded(v) * self.saved_bytes(v, v.options[k])
        saved += sum(self._offloaded_params(v) * min(self.base_memory(v, c, 0)["params"] for c in v.options)
                     for v in problem.vars.values() if self.mixed and self._offloaded_params(v))
        return act_exposed_share(saved, fwd, bwd, self.cluster.device)

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
            if self.fp8 and v.name in self.fp8_nodes:      # its GEMMs fp8 (pricing.experts_fp8)
                return fp8_time(self, v, combo, (), ())
            return experts_time(v.call, combo, self.mesh_shape, self.cluster.device,
                                self.dtype_key, self.links, self.expert_imbalance, self.native)
        axis = context_axis_of(v.call, combo, self.mesh_shape)
        if axis is not None:
            return context_attention_time(v.call, combo, axis, self, self.context_form)
        ins = [_local(m, input_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.inputs)]
        outs = [_local(m, output_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.outputs)]
        if self.fp8 and v.name in self.fp8_nodes:
            return fp8_time(self, v, combo, ins, outs)
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


def grad_partial_flags(combo, k: int) -> tuple[bool, ...]:
    """Per axis: input ``k`` is read replicated by an op whose output is not replicated, so
    its gradient comes back partial."""
    return tuple(isinstance(s.inputs[k], Replicate)
                 and any(not isinstance(p, Replicate) for p in s.outputs) for s in combo)
