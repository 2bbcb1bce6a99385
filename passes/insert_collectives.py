"""The rewrite: a captured global graph + a Plan -> the per-rank graph every rank runs.

For each node in order:
- a parameter or buffer becomes a ``get_attr`` of its local shard on the module;
- a user input (every rank passes the whole global batch) is cut to this rank's slice;
- an op gets each tensor input moved from its producer's placement to the placement the
  plan chose for it (the steps of ``autopar.sharding.redistribute``, each an
  autograd-aware collective node), and then runs with its shape constants made local
  (``autopar.sharding.registry.localize``);
- the result (the loss, or the model's outputs) is made replicated.

Gradient synchronisation of replicated parameters (data parallelism) belongs to the step,
not to each use: where every use of a parameter on a mesh axis reads it replicated into
an op whose output is not replicated there, no collective is inserted; the axis is
returned in ``Rewritten.grad_sync[attr]`` and the runtime all-reduces the gradient once,
bucketed and overlapped with backward. The same holds through values computed from
parameters alone, replicated on the axis (GPT's position embedding ``wpe[arange]`` added to
the batch-sharded token embedding): backward is linear in the gradient and such a value is
the same on every rank, so its parameters' gradients are partial too; no activation
gradient is all-reduced for it.

``defer_loss=True``: the loss is returned as this rank's term where summing it over ranks
is all that is left (``Rewritten.loss_sync`` names the axes); the runtime sums it
asynchronously, beside backward (its gradient is the same: an all-reduce's is the identity).
A mean cross-entropy over batch-sharded targets divides by the global count of
non-ignored targets, computed from the whole target every rank holds
(``passes.loss_count``) rather than all-reduced.

One conversion per value and placement: readers of one value that need it in the same
placement (with the same partial-gradient flags) share one chain of collective nodes,
emitted before the first of them (Llama's q, k and v projections gather the normed,
sequence-sharded hidden state once, as Megatron-LM does). Autograd sums the readers'
gradients into the shared tensor, so backward runs the reverse collective once on the
sum; readers whose gradients come back partial on an axis never share with readers whose
gradients do not, since a sum of a partial and a whole gradient is neither. Not shared:
a parameter's conversions (ZeRO-3 frees a gathered weight after its use and gathers it
again; the step syncs replicated gradients), the conversions of a branch-parallel plan
(``passes.branch_parallel`` rewires each branch's own), and, with ``stage_of`` (a
pipeline's stage of every captured node), conversions across stages: each stage
converts what it reads, so a stage never receives a converted copy (its crossing bytes
are the value's own). Under recomputation (``plan.recompute``) sharing stays within one
repeated layer, so a layer's region recomputes its own conversions. The solver prices
the same sharing (``autopar.pricing.prices.PriceTable.shared``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from autopar.capture import Captured, layer_of
from autopar.placement import Replicate
from autopar.plan import Plan, PlanError
from autopar.ops import collectives
from autopar.passes.loss_count import global_loss_counts
from autopar.sharding.redistribute import Step, Unsupported, plan_steps
from autopar.sharding.registry import (
    Strategy, TensorMeta, localize, make_call,
)

R = Replicate()
aten = torch.ops.aten

_STEP_FN: dict[str, Callable] = {
    "all_gather": collectives.all_gather, "all_reduce": collectives.all_reduce,
    "grad_all_reduce": collectives.grad_all_reduce, "scatter": collectives.scatter,
    "reduce_scatter": collectives.reduce_scatter, "all_to_all": collectives.all_to_all,
    "to_partial": collectives.to_partial, "shard_to_partial": collectives.shard_to_partial,
}


def _step_kwargs(step: Step) -> dict:
    k = step.kind
    if k in ("all_gather", "all_reduce"):
        kw = {"axis": step.axis}
        if k == "all_gather":
            kw["dim"] = step.dim
        if step.grad_partial:
            kw["grad_partial"] = True
        if step.groups > 1:
            kw["groups"] = step.groups
        return kw
    if k in ("scatter", "reduce_scatter"):
        kw = {"axis": step.axis, "dim": step.dim}
        if step.groups > 1:
            kw["groups"] = step.groups
        return kw
    if k == "all_to_all":
        return {"axis": step.axis, "split_dim": step.dim, "cat_dim": step.dim2}
    if k == "shard_to_partial":
        return {"axis": step.axis, "dim": step.dim}
    return {"axis": step.axis}


def _combo(plan: Plan, name: str, n_in: int, n_out: int) -> tuple[Strategy, ...]:
    try:
        np = plan.nodes[name]
    except KeyError as e:
        raise PlanError(f"the plan has no placement for node {name!r}: it was made for another "
                        "graph (a different model, input shape or torch version); plan again") from e
    n_axes = len(plan.mesh_shape)
    ins = [np.input(k) for k in range(n_in)]
    outs = [np.output(k) for k in range(n_out)]
    return tuple(Strategy(tuple(p[a] for p in ins), tuple(p[a] for p in outs)) for a in range(n_axes))


def _grad_partial(combo, k) -> tuple[bool, ...]:
    return tuple(isinstance(s.inputs[k], Replicate)
                 and any(not isinstance(p, Replicate) for p in s.outputs) for s in combo)


@dataclass(frozen=True)
class Rewritten:
    """The per-rank program and what the step must do beside it: ``grad_sync`` maps a
    parameter's attribute path to the mesh axes its gradient is summed over once per step."""
    gm: GraphModule
    grad_sync: dict[str, tuple[int, ...]]
    loss_sync: tuple[int, ...] = ()      # defer_loss: axes the returned loss is summed over


def insert_collectives(cap: Captured, plan: Plan, root: torch.nn.Module,
                       attr_of: dict[str, str], returns: str = "loss",
                       defer_loss: bool = False, stage_of: dict[str, int] | None = None) -> Rewritten:
    """Build the per-rank GraphModule. ``attr_of`` maps a parameter/buffer placeholder to its
    attribute path on ``root``; ``returns`` is ``"loss"`` or ``"model"`` (the model's
    outputs, as a flat tuple); ``defer_loss``: see the module's docstring; ``stage_of``:
    the pipeline stage of every captured op (``analysis.stages.assign_stages``), so no
    conversion is shared across stages."""
    rw = _Rewriter(cap, plan, attr_of, stage_of)
    names = [cap.loss] if returns == "loss" else list(cap.output)
    needed = _needed(cap, names)
    for node in cap.gm.graph.nodes:
        if node.op != "output" and node.name not in needed:
            continue       # e.g. the target and the loss in the forward-only program
        if node.op == "placeholder":
            rw.placeholder(node)
        elif node.op == "call_function" and node.target is operator.getitem:
            base, k = node.args
            local, outs = rw.env[base.name]
            rw.env[node.name] = (rw.g.call_function(operator.getitem, (local, k)), [outs[k]])
        elif node.op == "call_function" and node.name not in plan.nodes and not node.users:
            continue   # a check on metadata (aten._assert_tensor_metadata): runs on one device only
        elif node.op == "call_function":
            rw.call(node)
        elif node.op == "output":
            loss_sync = rw.partial_loss(names[0]) if returns == "loss" and defer_loss else None
            results = [rw.replicated(name) for name in names] if loss_sync is None else \
                [rw.env[names[0]][0]]
            rw.g.output(results[0] if returns == "loss" else tuple(results))
    global_loss_counts(rw.g, cap)
    rw.g.eliminate_dead_code()
    return Rewritten(GraphModule(root, rw.g),
                     {attr_of[p]: tuple(axes) for p, axes in rw.deferred.items()
                      if axes and p in cap.params},
                     loss_sync or ())


class _Rewriter:
    """The per-rank graph under construction: each global node's local node and placements."""

    def __init__(self, cap: Captured, plan: Plan, attr_of: dict[str, str],
                 stage_of: dict[str, int] | None = None):
        self.cap, self.plan, self.attr_of = cap, plan, attr_of
        self.mesh = tuple(plan.mesh_shape)
        self.calls = {n.name: make_call(n) for n in cap.gm.graph.nodes
                      if n.op == "call_function" and n.target is not operator.getitem}
        self.deferred = _deferred_grad_sync(cap, plan, self.calls)
        self.regather = plan.options.zero_stage >= 3
        self.g = Graph()
        self.env: dict[str, tuple[Node, list]] = {}   # name -> (local node, placements per output)
        # one conversion per (value, placement, partial-gradient flags, region): module docstring
        self.share = not plan.branches
        self.stage_of, self.by_layer = stage_of, bool(plan.recompute)
        self.converted: dict[tuple, Node] = {}

    def region(self, node: Node) -> tuple:
        """Where a conversion read by ``node`` may be shared: its pipeline stage, and its
        repeated layer under recomputation (module docstring)."""
        return (None if self.stage_of is None else self.stage_of.get(node.name),
                layer_of(node) if self.by_layer else None)

    def move(self, local: Node, meta_src, dst, gp, from_param: str | None,
             deferred: tuple[int, ...] = ()) -> Node:
        """``local`` (placed ``meta_src``) moved to placements ``dst`` by collective nodes;
        no gradient all-reduce on the ``deferred`` axes (the step sums those gradients)."""
        try:
            steps = plan_steps(meta_src, dst, gp)
        except Unsupported as e:
            raise PlanError(f"the plan asks for an unsupported conversion {e}") from e
        for st in steps:
            if self.mesh[st.axis] == 1:
                continue       # a group of one rank: every step is the identity there
            if st.kind == "grad_all_reduce" and st.axis in deferred:
                continue
            kwargs = _step_kwargs(st)
            if st.kind == "all_gather" and from_param and self.regather:
                kwargs["regather"] = True     # ZeRO-3: free after use, gather again in backward
            local = self.g.call_function(_STEP_FN[st.kind], (local,), kwargs)
        return local

    def replicated(self, name: str) -> Node:
        local, outs = self.env[name]
        n = len(self.mesh)
        return self.move(local, outs[0], (R,) * n, (False,) * n, None)

    def partial_loss(self, name: str) -> tuple[int, ...] | None:
        """The axes over which only a sum (an all-reduce, its gradient the identity) makes
        the scalar ``name`` replicated; None when anything else is needed."""
        local, outs = self.env[name]
        n = len(self.mesh)
        try:
            steps = plan_steps(outs[0], (R,) * n, (False,) * n)
        except Unsupported:
            return None
        steps = [st for st in steps if self.mesh[st.axis] > 1]
        if any(st.kind != "all_reduce" or st.grad_partial for st in steps):
            return None
        return tuple(st.axis for st in steps)

    def placeholder(self, node: Node) -> None:
        """A parameter or buffer: its local shard; a user input: this rank's slice of it."""
        if node.name not in self.plan.nodes:
            raise PlanError(f"the plan has no placement for input {node.name!r}")
        outs = [self.plan.nodes[node.name].output(0)]
        n = len(self.mesh)
        if node.name in self.attr_of:
            local = self.g.get_attr(self.attr_of[node.name])
        else:
            local = self.g.placeholder(node.name)
            local = self.move(local, (R,) * n, outs[0], (False,) * n, None)
        local.meta["placements"] = outs[0]
        self.env[node.name] = (local, outs)

    def call(self, node: Node) -> None:
        """An op: its inputs moved to the placements the plan chose, its shapes made local."""
        call = self.calls[node.name]
        combo = _combo(self.plan, node.name, len(call.inputs), len(call.outputs))
        local_of, read = {}, []
        for k, name in enumerate(_tensor_arg_names(node)):
            local, outs = self.env[name]
            dst = tuple(s.inputs[k] for s in combo)
            param = name if name in self.cap.params else None
            gp = _grad_partial(combo, k)
            if not call.inputs[k].carries_grad:
                gp = (False,) * len(self.mesh)      # ids, masks, positions carry no gradient
            key = (name, dst, gp, self.region(node)) if self.share and param is None else None
            moved = self.converted.get(key) if key is not None else None
            if moved is None:
                moved = self.move(local, outs[0], dst, gp, param, tuple(self.deferred.get(name, ())))
                if key is not None:
                    self.converted[key] = moved
            local_of[id(call.inputs[k])] = moved
            read.append(moved)
        target, args, kwargs = localize(call, combo, self.mesh)
        if target is aten.view.default:
            # local tensors may be laid out differently from the global ones (a shard
            # is a fresh contiguous block), so a view the global graph could take may
            # need a copy here: reshape is view where possible, copy otherwise
            target = aten.reshape.default
        sub = lambda v: local_of[id(v)] if isinstance(v, TensorMeta) else v  # noqa: E731
        new = self.g.call_function(target, pytree.tree_map(sub, args), pytree.tree_map(sub, kwargs))
        new.meta["source"] = node.name
        new.meta["inputs"] = tuple(read)     # the local node read as the op's k-th tensor input
        outs = [tuple(s.outputs[k] for s in combo) for k in range(len(call.outputs))]
        self.env[node.name] = (new, outs)


def _needed(cap: Captured, outputs: list[str]) -> set[str]:
    """Nodes the outputs depend on, plus side effects (a buffer update such as BatchNorm's
    ``num_batches_tracked.add_``) whose inputs those already need; parameters and buffers
    always (the module holds them)."""
    need: set[str] = set()
    stack = list(outputs) + list(cap.params) + list(cap.buffers)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(a.name for a in cap.node(n).all_input_nodes)
    for node in cap.gm.graph.nodes:
        if (node.op == "call_function" and not node.users and node.name not in need
                and getattr(node.target, "_schema", None) is not None and node.target._schema.is_mutable
                and all(a.name in need for a in node.all_input_nodes)):
            need.add(node.name)
    return need


def _deferred_grad_sync(cap: Captured, plan: Plan, calls) -> dict[str, list[int]]:
    """Node -> mesh axes on which its gradient is partial at every use, to be summed once per
    step: a parameter replicated there, or a value computed from such parameters (and
    constants) alone, replicated there, every use of which reads it replicated into an op
    whose output is not replicated (``_grad_partial``) or into another such value. Only the
    parameters' entries matter to the step; the others let the rewrite skip their gradient
    all-reduce. A value whose input is dropped is dropped too: its partial gradient would
    reach that input, whose gradient must be whole (Gemma's free plan under a budget, its
    batch not split: the first layer's norm output read only by column-parallel linears,
    its input also by the residual add)."""
    out: dict[str, list[int]] = {ph: [] for ph in cap.params}
    const = _gradient_free(cap)
    for a in range(len(plan.mesh_shape)):
        cand = {ph for ph in cap.params if isinstance(plan.nodes[ph].output(0)[a], Replicate)}
        for node in cap.gm.graph.nodes:       # topological: inputs are decided first
            if _replicated_from(node, a, cand, const, plan, calls):
                cand.add(node.name)
        changed = True
        while changed:     # drop any with a use that is not partial, or an input dropped
            changed = False
            for name in list(cand):
                node = cap.node(name)
                if not _uses_partial(node, a, cand, plan, calls) or (
                        name not in cap.params and not _replicated_from(node, a, cand, const, plan, calls)):
                    cand.discard(name)
                    changed = True
        for name in cand:
            out.setdefault(name, []).append(a)
    return out


def _gradient_free(cap: Captured) -> set[str]:
    """Nodes no gradient flows through: buffers, and ops on them and on constants only."""
    free: set[str] = set(cap.buffers)
    for node in cap.gm.graph.nodes:
        if node.op == "call_function" and all(i.name in free for i in node.all_input_nodes):
            free.add(node.name)
    return free


def _replicated_from(node: Node, a: int, cand: set[str], const: set[str], plan: Plan, calls) -> bool:
    """``node`` is an op replicated on axis ``a`` whose floating inputs are all candidates
    (read replicated) or gradient free: its value is the same on every rank of ``a``."""
    call = calls.get(node.name)
    if call is None or node.name not in plan.nodes or len(call.outputs) != 1 or node.name in const:
        return False
    combo = _combo(plan, node.name, len(call.inputs), len(call.outputs))
    if not isinstance(combo[a].outputs[0], Replicate):
        return False
    has_cand = False
    for k, name in enumerate(_tensor_arg_names(node)):
        if not isinstance(combo[a].inputs[k], Replicate):
            return False
        if name in cand:
            has_cand = True
        elif call.inputs[k].carries_grad and name not in const:
            return False
    return has_cand


def _uses_partial(node: Node, a: int, cand: set[str], plan: Plan, calls) -> bool:
    ok = bool(node.users)
    for user in node.users:
        if user.op == "call_function" and user.name not in plan.nodes and not user.users:
            continue   # a metadata check (aten._assert_tensor_metadata): reads no value
        # the graph's output (the loss, the model's outputs) reads the value whole: not partial
        if user.name in cand:
            continue
        call = calls.get(user.name)
        if call is None:
            return False
        combo = _combo(plan, user.name, len(call.inputs), len(call.outputs))
        for k, t in enumerate(_tensor_arg_names(user)):
            if t == node.name and not (isinstance(combo[a].inputs[k], Replicate)
                                       and _grad_partial(combo, k)[a]):
                return False
    return ok


def _tensor_arg_names(node: Node) -> list[str]:
    return [a.name for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                              is_leaf=lambda x: isinstance(x, Node))
            if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]
