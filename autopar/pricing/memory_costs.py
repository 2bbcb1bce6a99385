"""The memory half of :class:`autopar.pricing.costing.CostModel`: bytes per device of
one option of a node, by term (a parameter's shard with its gradient and optimizer state,
under the ZeRO stage, precision and offload the options pin; the activations autograd
saves, ``autopar.analysis.saved``; recomputation's and activation offload's split
(``autopar.pricing.activation_offload``); the pipeline planner's
``memory_weights``), and the phases whose terms are never live at once
(``cost_models.memory.step_phases``).

:class:`MemoryCosts` is a mixin: it reads the cost model's mesh, options-derived settings
and its ``_act``, ``_recomputed``, ``_keeps`` and ``_offloaded``.
"""
from __future__ import annotations

from autopar.analysis.saved import Kept
from autopar.cost_models import memory as memory_model
from autopar.ops.experts import EXPERTS_OP
from autopar.placement import Replicate
from autopar.pricing.activation_offload import in_flight_layers
from autopar.pricing.comm_costs import _local
from autopar.pricing.experts import experts_saved_bytes
from autopar.pricing.problem import VIEW_OPS, NodeVar
from autopar.sharding.registry import input_placements, output_placements


class MemoryCosts:
    """Bytes per device of a :class:`CostModel`'s options (see the module)."""

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
        backward rebuilds one layer's activations at a time (the "recompute" term); and its
        offloaded members (``offload_activations=``) keeping nothing on the device but the
        layers in flight, ``activation_offload.in_flight_layers`` (the "offload" term).

        Per member, of ``n`` members (a repeated layer's copies) of which ``r`` are
        recomputed and ``o`` offloaded, with ``b`` bytes saved each: activations
        ``b (n - r - o) / n``, recompute ``b / n`` if ``r``, offload ``k b / n`` if ``o``
        (k layers in flight); summed over the ``n`` members: ``b (n - r - o)``, one layer,
        k layers.

        A parameter only offloaded layers read (``solver.flat.offload_of``) under mixed
        precision: its 16-bit copy is a tensor those layers save (not the parameter, which
        the hooks leave alone), so it goes to the host with them and comes back with its
        layer; its ``params`` term splits the same way (``o`` of its ``n`` members)."""
        if v.kind == "param":
            off = self._offloaded_params(v) if self.mixed and "params" in terms else 0
            if not off:
                return terms
            b, n = terms["params"], len(v.members)
            return dict(terms, params=b * (n - off) / n,
                        offload=b * min(off, in_flight_layers(self.cluster.device)) / n)
        if v.kind != "op" or "activations" not in terms:
            return terms
        rec = 0 if self._keeps(v) else self._recomputed(v)
        off = self._offloaded(v)
        if not rec and not off:
            return terms
        b, n = terms["activations"], len(v.members)
        out = dict(terms, activations=b * (n - rec - off) / n)
        if rec:
            out["recompute"] = b / n
        if off:
            out["offload"] = b * min(off, in_flight_layers(self.cluster.device)) / n
        return out

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
            if self.memory_phases:    # the step's temporaries, beside the gradients
                step = memory_model.optimizer_step_bytes(b, optimizer_states, self.cluster.device.name)
                if step:
                    out["optimizer_step"] = step
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
        saved, grads = self.saved_bytes(v, combo), self.loss_grad_bytes(v, combo)
        if not grads:
            return {"activations": saved}
        if self.memory_phases:      # its own phase (cost_models.memory.step_phases)
            return {"activations": saved, "loss_grads": grads}
        return {"activations": saved + grads}    # every term adds: one with the activations

    def loss_grad_bytes(self, v: NodeVar, combo) -> float:
        """Bytes per device of the gradients the loss node's backward makes beside every saved
        tensor (``Kept.transient``, ``analysis.saved.LOSS_GRADIENTS``); 0 for other nodes.
        Where the step's memory has phases it is the ``loss_grads`` term, live at the loss's
        backward only, before any offloaded or recomputed layer is back on the device
        (``cost_models.memory``); where every term adds (a pipeline stage's view, one of
        several micro-batches) it joins ``activations`` and their weights, as before."""
        kept = v.kept
        if kept is None or not kept.transient or (self.recompute_kept and self._keeps(v)):
            return 0.0          # (a node recomputation keeps whole saves its outputs only)
        return self._extras_bytes(v, combo, kept.transient)

    def _extras_bytes(self, v: NodeVar, combo, extras) -> float:
        total = 0.0
        for e in extras:
            side, k = e.ref
            m = (v.call.inputs if side == "in" else v.call.outputs)[k]
            ps = input_placements(combo, k) if side == "in" else output_placements(combo, k)
            b = e.nbytes * _local(m, ps, self.mesh_shape).nbytes / max(m.nbytes, 1)
            total += b if e.fp32 else self._act(b, m.dtype)
        return total

    def saved_bytes(self, v: NodeVar, combo) -> float:
        """Bytes per device an op node keeps for backward (``v.kept``, from
        ``autopar.analysis.saved``: the outputs autograd saves, its own or a consumer's, and
        the tensors the op saves inside, each the local share of what it follows; the loss
        node's gradients beside them are :meth:`loss_grad_bytes`). A layer output that
        recomputation keeps (``recompute_kept``) is kept whole."""
        kept, view = v.kept, v.call.op in VIEW_OPS
        if kept is None and view:
            return 0.0
        if kept is None or (not view and self.recompute_kept and self._keeps(v)):
            kept = Kept((1.0,) * len(v.call.outputs))
        local = lambda m, ps: _local(m, ps, self.mesh_shape).nbytes  # noqa: E731
        if self.mixed and not self.native and kept.mixed is not None:
            # as autocast runs it (analysis.autocast): fp32 values kept in fp32, 16-bit
            # ones in 16 bits, and each 16-bit op's own copies of the fp32 inputs it saves
            total = sum(f * local(m, output_placements(combo, k))
                        for k, (f, m) in enumerate(zip(kept.mixed, v.call.outputs)) if f)
            total += self._extras_bytes(v, combo, kept.extras + kept.casts)
        else:
            total = sum(self._act(share * local(m, output_placements(combo, k)), m.dtype)
                        for k, (share, m) in enumerate(zip(kept.outputs, v.call.outputs)) if share)
            total += self._extras_bytes(v, combo, kept.extras)
        if v.call.op is EXPERTS_OP:
            total += self._act(experts_saved_bytes(v.call, combo, self.mesh_shape, self.expert_imbalance),
                               v.call.inputs[0].dtype)
        return total
