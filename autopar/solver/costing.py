"""Costs of a sharding problem's choices, from ``autopar.cost_models``.

- node cost: forward + backward time of the op on its local shapes under each option;
- edge cost: time of the redistribution steps between a producer's output placement and a
  consumer's input placement, forward and backward (gradient synchronisation of a replicated
  parameter is the backward of its ``grad_all_reduce`` step);
- memory: bytes each option keeps on a device — a parameter's shard with its gradient and
  optimizer states, an activation's shard (saved for backward).
Compute, communication and memory stay separate all the way to the plan's estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils._pytree import tree_map

from autopar.cost_models import comm as comm_model
from autopar.cost_models import compute as compute_model
from autopar.cost_models.hardware import Cluster, axis_link
from autopar.placement import Partial, Placement, Replicate, Shard, local_shape
from autopar.sharding.redistribute import Step, Unsupported, plan_steps
from autopar.sharding.registry import TensorMeta, input_placements, localize, output_placements
from autopar.solver.problem import VIEW_OPS, NodeVar

INF = float("inf")
# the backward collectives of a parameter edge that reduce its gradient (once per step)
GRAD_SYNC = ("all_reduce", "reduce_scatter")


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

    @property
    def mixed(self) -> bool:
        """Mixed precision: 16-bit compute, activations and gradients; fp32 master weights
        and optimizer moments (2Ψ params + 2Ψ grads + 12Ψ optimizer for Adam)."""
        return self.dtype_key in ("bf16", "fp16")

    def _act(self, nbytes: float, dtype) -> float:
        """Bytes of an activation in this precision (float tensors halve under mixed)."""
        return nbytes / 2 if self.mixed and dtype.is_floating_point and dtype.itemsize == 4 else nbytes

    def __post_init__(self):
        self.links = [axis_link(self.cluster, self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self._edge_cache: dict = {}

    # ---- compute -------------------------------------------------------------------------
    def node_time(self, v: NodeVar, combo) -> tuple[float, float]:
        """(forward, backward) seconds of one option of an op node."""
        if v.call is None:
            return 0.0, 0.0
        ins = [_local(m, input_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.inputs)]
        outs = [_local(m, output_placements(combo, k), self.mesh_shape) for k, m in enumerate(v.call.outputs)]
        if self.profiler is not None and not self.mixed:
            # the call each rank runs: local shape constants, local tensors in place
            op, args, kwargs = localize(v.call, combo, self.mesh_shape)
            local_of = {id(g): m for g, m in zip(v.call.inputs, ins)}
            sub = lambda a: local_of.get(id(a), a) if isinstance(a, TensorMeta) else a  # noqa: E731
            t = self.profiler.node_time(op, ins, outs, tree_map(sub, args), tree_map(sub, kwargs))
            t = t if t is not None else self._roofline(v, ins, outs)
        else:
            t = self._roofline(v, ins, outs)
        rec = self._recomputed(v)
        return t if not rec else (t[0], t[1] + t[0] * rec / len(v.members))

    def _roofline(self, v, ins, outs) -> tuple[float, float]:
        return compute_model.node_time(v.call.op, ins, outs, v.call.args, v.call.kwargs,
                                       self.cluster.device, self.dtype_key)

    def _recomputed(self, v: NodeVar) -> int:
        """How many of ``v``'s members (repeated-layer copies) are recomputed."""
        return sum(1 for m in v.members if m in self.recompute) if self.recompute else 0

    def rerun(self, v: NodeVar) -> float:
        """Fraction of ``v``'s members whose forward runs again in backward: the
        redistributions feeding them are inside the recomputed region and run again too."""
        return self._recomputed(v) / len(v.members) if self.recompute else 0.0

    # ---- memory --------------------------------------------------------------------------
    def node_memory(self, v: NodeVar, combo, optimizer_states: int) -> dict[str, float]:
        """Bytes per device of one option, by term (times ``memory_weights``)."""
        terms = self._node_memory(v, combo, optimizer_states)
        if not self.memory_weights:
            return terms
        return {k: b * self.memory_weights.get(k, 1.0) for k, b in terms.items()}

    def _node_memory(self, v: NodeVar, combo, optimizer_states: int) -> dict[str, float]:
        if v.kind == "param":
            placements = output_placements(combo, 0)
            b = _local(v.meta, placements, self.mesh_shape).nbytes
            held = b
            if self.zero in (1, 2) and self.data_axis is not None:
                # ZeRO-1/2: the weight gathered over the data axis lives through the step
                whole = list(placements)
                whole[self.data_axis] = Replicate()
                held = _local(v.meta, whole, self.mesh_shape).nbytes
            if self.mixed:   # 16-bit weights and grads; fp32 master copy + moments
                return {"params": held / 2, "grads": b / 2, "optimizer": b * (1 + optimizer_states)}
            return {"params": held, "grads": b, "optimizer": b * optimizer_states}
        if v.kind in ("input", "buffer"):
            b = _local(v.meta, output_placements(combo, 0), self.mesh_shape).nbytes
            return {"inputs" if v.kind == "input" else "buffers": b}
        if v.call.op in VIEW_OPS:
            return {}
        b = sum(self._act(_local(m, output_placements(combo, k), self.mesh_shape).nbytes, m.dtype)
                for k, m in enumerate(v.call.outputs))
        rec = self._recomputed(v)
        if not rec or any(m in self.recompute_kept for m in v.members):
            return {"activations": b}
        # recomputed members keep nothing; backward rebuilds one layer's activations at a time
        n = len(v.members)
        return {"activations": b * (n - rec) / n, "recompute": b / n}

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
        if not meta.dtype.is_floating_point:
            grad_partial = (False,) * len(grad_partial)   # integer tensors carry no gradient
        key = (meta.shape, meta.dtype, src, dst, grad_partial, bucketed, rerun, shared)
        hit = self._edge_cache.get(key)
        if hit is None:
            hit = self._edge_cache[key] = self._edge_time(meta, src, dst, grad_partial, bucketed,
                                                          rerun, shared)
        return hit

    def _edge_time(self, meta, src, dst, grad_partial, bucketed=False, rerun=0.0, shared=1):
        try:
            steps = plan_steps(src, dst, grad_partial)
        except Unsupported:
            return INF, {}
        cur = list(src)
        total, by = 0.0, {}
        scale = self._act(1.0, meta.dtype)    # 16-bit tensors move half the bytes
        for step in steps:
            before = _local(meta, cur, self.mesh_shape).nbytes
            cur[step.axis] = _after(step, cur[step.axis])
            if local_shape(meta.shape, cur, self.mesh_shape) is None:
                return INF, {}     # an intermediate placement would not divide evenly
            after = _local(meta, cur, self.mesh_shape).nbytes
            n = self.mesh_shape[step.axis]
            link = self.links[step.axis]
            for backward, kind in ((False, step.forward_collective()), (True, step.backward_collective())):
                if kind is None:
                    continue
                size = {"all_gather": max(before, after), "reduce_scatter": max(before, after),
                        "all_reduce": before, "all_to_all": before}[kind]
                t = comm_model.collective_time(kind, size * scale, n, link, skew=False)
                if bucketed and step.kind == "grad_all_reduce":
                    t -= comm_model.collective_time(kind, 1.0, n, link, skew=False)   # latency shared by the bucket
                else:
                    # the wait for the peers: once per collective between computations, shared
                    # by a consumer's parameters (see ``shared``)
                    t += link.skew / (max(1, shared) if bucketed else 1)
                if bucketed and backward and kind in GRAD_SYNC:
                    t *= self.grad_sync_scale
                if not backward:
                    regather = (bucketed and self.zero >= 3 and kind == "all_gather"
                                and step.axis == self.data_axis)
                    # ZeRO-3 frees a gathered weight after use and gathers it again for
                    # backward; recomputation runs the forward collectives again
                    t *= 1.0 + rerun + (1.0 if regather else 0.0)
                total += t
                by[(kind, step.axis)] = by.get((kind, step.axis), 0.0) + t
        return total, by


def params_read(problem) -> dict[str, int]:
    """How many parameters each node of ``problem`` reads (``edge_time``'s ``shared``)."""
    out: dict[str, int] = {}
    for e in problem.edges:
        if problem.vars[e.src].kind == "param":
            out[e.dst] = out.get(e.dst, 0) + 1
    return out


def _after(step: Step, p: Placement) -> Placement:
    if step.kind in ("all_gather", "all_reduce", "grad_all_reduce"):
        return Replicate()
    if step.kind in ("scatter", "reduce_scatter", "all_to_all"):
        return Shard(step.dim, step.groups)
    if step.kind == "shard_to_partial":
        return Partial()
    return p  # to_partial keeps the size


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
