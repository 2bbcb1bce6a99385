"""The sharding problem: for every graph node the ways it can be placed, and the edges.

Built from a captured graph, a mesh shape and the user's pins; holds no costs (those come
from ``autopar.pricing.costing``) and no solver (``autopar.solver.ilp``).

Repeated layers share one solution: nodes of ``h.1``, ``h.2``, ... whose op sequence and
shapes equal those of ``h.0`` are *members* of ``h.0``'s node and take its choice, so the
ILP is as large as one layer whatever the depth.
"""
from __future__ import annotations

import itertools
import operator
import re
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

from autopar.analysis.fp8_layers import fp8_experts, fp8_linears, module_name
from autopar.analysis.saved import Kept, merge, saved_activations
from autopar.capture import Captured, layer_of
from autopar.capture.experts import expert_stacks
from autopar.ops.experts import EXPERTS_OP
from autopar.sharding.rules.attention import context_axes
from autopar.errors import PinError
from autopar.mesh_roles import NO_ROLES, MeshRoles
from autopar.ops.attention import is_attention
from autopar.placement import Replicate, Shard, local_shape
from autopar.sharding.registry import (
    OpCall, Strategy, TensorMeta, axis_strategies, make_call, mesh_strategies, shards_divide,
)

R = Replicate()
aten = torch.ops.aten

Combo = tuple  # tuple[Strategy, ...], one per mesh axis

# Ops whose output aliases an input: they hold no memory of their own.
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.transpose.int, aten.permute.default, aten.t.default, aten.expand.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor,
            aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
            aten.alias.default, aten.detach.default, aten.flatten.using_ints,
            aten.contiguous.default, aten.chunk.default, aten.unflatten.int}


_UNARY = {"relu", "gelu", "silu", "sigmoid", "tanh", "neg", "exp", "log", "sqrt", "rsqrt",
          "dropout", "clone", "to", "_to_copy", "type_as", "pow", "mul", "div", "add", "sub",
          "cos", "sin", "reciprocal", "abs", "erf", "contiguous", "alias", "detach"}


def is_unary_elementwise(op) -> bool:
    """An elementwise op (it has one tensor input when it is a follower candidate)."""
    name = getattr(op, "_opname", None) or str(op).split(".")[-2]
    return name in _UNARY


@dataclass
class NodeVar:
    """One decision of the solver: a node (and the repeated-layer members that copy it)."""
    name: str
    kind: str                       # "param" | "buffer" | "input" | "op"
    meta: TensorMeta | None         # the placeholder's tensor (placeholders only)
    call: OpCall | None             # the op call (ops only)
    options: list[Combo]
    members: list[str] = field(default_factory=list)   # including itself
    kept: Kept | None = None
    """What backward keeps of the op's outputs (``autopar.analysis.saved``), averaged over
    the members; None: every output (a problem not built from a captured graph)."""

    @property
    def outputs(self) -> tuple[TensorMeta, ...]:
        return (self.meta,) if self.meta is not None else self.call.outputs


@dataclass(frozen=True)
class Edge:
    """Output ``src_out`` of node ``src`` feeds tensor input ``dst_in`` of node ``dst``
    (names of the representative nodes); ``count`` edges of the graph share it."""
    src: str
    src_out: int
    dst: str
    dst_in: int
    meta: TensorMeta
    count: int = 1
    needs_grad: bool = True
    """The value depends on a parameter: its gradient flows back (a buffer's slice, such as
    a rotary table, or a mask does not, and costs no collective in backward)."""


@dataclass
class Problem:
    mesh_shape: tuple[int, ...]
    vars: dict[str, NodeVar]
    edges: list[Edge]
    rep: dict[str, str]             # every graph node -> its representative
    sink: tuple[str, int] | None    # the loss (must end replicated)
    param_names: dict[str, list[str]]
    optimizer_states: int           # optimizer tensors per parameter (AdamW: 2)
    fp8: dict = field(default_factory=dict)
    """The ops precision="fp8" may run in fp8 (``analysis.fp8_layers``): each representative
    -> the module names of its members' linears or experts modules (``pricing.fp8.fp8_nodes``
    keeps those the options run in fp8)."""


def placeholder_options(meta: TensorMeta, mesh_shape: Sequence[int]) -> list[Combo]:
    """Every per-axis choice of R or S(d) that divides evenly."""
    per_axis = [R] + [Shard(d) for d in range(meta.ndim)]
    out = []
    for ps in itertools.product(per_axis, repeat=len(mesh_shape)):
        if local_shape(meta.shape, ps, mesh_shape) is not None:
            out.append(tuple(Strategy((), (p,)) for p in ps))
    return out


def build_problem(cap: Captured, mesh_shape: Sequence[int], roles: MeshRoles = NO_ROLES, *,
                  zero: int = 0, optimizer_states: int = 2) -> Problem:
    """The problem of ``cap`` on ``mesh_shape`` whose axes play ``roles`` (each role's axis
    pins what the options may do there; no roles: the solver chooses per op): a decision per
    node (repeated layers' nodes join their first layer's), an edge per tensor that flows
    between decisions."""
    mesh_shape = tuple(mesh_shape)
    index = graph_index(cap)
    walk = index.walk(cap)
    vars: dict[str, NodeVar] = {}
    stacks = expert_stacks(cap.gm)
    for d in walk.decisions:
        if isinstance(d, str):
            raise NotImplementedError(d)
        name, kind, shape, dtype, node, from_batch = d
        if kind == "op":
            call = index.call(node)
            opts = _op_choices(cap, index.tensor_args(node), node, call, mesh_shape, roles, from_batch)
            vars[name] = NodeVar(name, kind, None, call, opts, list(walk.members[name]))
        else:
            meta = TensorMeta(shape, dtype)
            opts = _placeholder_choices(name, kind, meta, mesh_shape, roles, zero, name in stacks)
            vars[name] = NodeVar(name, kind, meta, None, opts, list(walk.members[name]))
    for v in vars.values():
        if not v.options:
            raise PinError(f"node {v.name} has no placement that satisfies the pins on mesh "
                           f"{mesh_shape}: {_describe(v)}")
    if walk.kept is None:
        saved = saved_activations(cap)
        walk.kept = {v.name: merge([saved[m] for m in v.members]) for v in vars.values() if v.kind == "op"}
    for v in vars.values():
        if v.kind == "op":
            v.kept = walk.kept[v.name]
    fp8: dict = {}
    named = {n: module_name(w) for n, w in fp8_linears(cap).items()} | fp8_experts(cap)
    for n, m in named.items():
        rep = index.repetition.get(n, n)
        fp8[rep] = (*fp8.get(rep, ()), m)
    return Problem(mesh_shape, vars, list(walk.edges), index.repetition, walk.sink, dict(cap.params),
                   optimizer_states, fp8)


@dataclass
class Walk:
    """What ``build_problem`` reads of a graph's nodes whatever the mesh and pins: the
    decisions in graph order (name, kind, placeholder shape and dtype, node, computed from
    the batch; or the message of a node that cannot be placed, raised where the walk met
    it), each decision's members, the edges, the loss and what backward keeps (filled by
    the first problem built)."""
    decisions: list
    members: dict[str, list[str]]
    edges: list[Edge]
    sink: tuple[str, int] | None
    kept: dict | None = None


def _walk(cap: Captured, index: GraphIndex) -> Walk:
    graph = cap.gm.graph
    rep = index.repetition
    decisions: list = []
    members: dict[str, list[str]] = {}
    alias: dict[str, tuple[str, int]] = {}   # getitem node -> (producer, output index)
    edges: dict[tuple, list] = {}
    learned: set[tuple] = set()             # edges whose value depends on a parameter
    batch_nodes = set(cap.inputs)           # nodes computed from the batch
    grad_nodes = set(cap.params)            # nodes computed from a parameter

    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            kind = ("param" if node.name in cap.params else
                    "buffer" if node.name in cap.buffers else "input")
            r = rep.get(node.name, node.name)
            if r != node.name:
                members[r].append(node.name)
                continue
            decisions.append((node.name, kind, tuple(int(s) for s in val.shape), val.dtype, node, False))
            members[r] = [node.name]
        elif node.op == "call_function":
            if node.target is operator.getitem:
                src, k = node.args
                if src.name in batch_nodes:
                    batch_nodes.add(node.name)
                if src.name in grad_nodes:
                    grad_nodes.add(node.name)
                base = alias.get(src.name, (src.name, 0))
                alias[node.name] = (base[0], k)
                continue
            tensor_out = index.tensor_output(node)
            if not tensor_out and not node.users:
                continue   # a check such as aten._assert_tensor_metadata: nothing to place
            if not tensor_out:
                decisions.append(
                    f"node {node.name} ({node.target}) returns no tensor: symbolic shapes "
                    "are not supported; export with static example inputs")
                break
            call = index.call(node)
            r = rep.get(node.name, node.name)
            if any(a.name in batch_nodes for a in node.all_input_nodes):
                batch_nodes.add(node.name)
            if any(a.name in grad_nodes for a in node.all_input_nodes):
                grad_nodes.add(node.name)
            if r == node.name:
                decisions.append((node.name, "op", None, None, node, node.name in batch_nodes))
                members[r] = [node.name]
            else:
                members[r].append(node.name)
            k_in = 0
            for a in index.tensor_args(node):
                src, out = alias.get(a.name, (a.name, 0))
                key = (rep.get(src, src), out, r, k_in)
                edges.setdefault(key, []).append(call.inputs[k_in])
                if a.name in grad_nodes:
                    learned.add(key)
                k_in += 1
    sink = None
    if cap.loss:
        src, out = alias.get(cap.loss, (cap.loss, 0))
        sink = (rep.get(src, src), out)
    edge_list = [Edge(s, so, d, di, metas[0], len(metas), (s, so, d, di) in learned)
                 for (s, so, d, di), metas in edges.items()]
    return Walk(decisions, members, edge_list, sink)


def _placeholder_choices(name, kind, meta, mesh_shape, roles: MeshRoles, zero: int,
                         stack: bool = False) -> list[Combo]:
    """The options of a parameter, buffer or input on axes playing ``roles`` (``stack``: a
    mixture of experts' weight stack, experts on dim 0)."""
    opts = placeholder_options(meta, mesh_shape)
    context_axis, expert_axis = roles.context, roles.expert
    if context_axis is not None:
        # the sequence (dim 1 of an input that has one) split on the context axis; buffers
        # and per-sample inputs whole there, and weights too unless ZeRO-3 shards them over
        # it as over the data axis (gathered where used, their gradients reduce-scattered:
        # torchtitan's FSDP over data x context ranks), wherever a dim divides
        want = Shard(1) if kind == "input" and meta.ndim >= 2 else Replicate()
        on = [o for o in opts if o[context_axis].outputs[0] == want]
        if kind == "param" and zero >= 3:
            on = [o for o in opts if isinstance(o[context_axis].outputs[0], Shard)] or on
        opts = on
        if not opts:
            raise PinError(
                f"input {name!r} of shape {list(meta.shape)}: its sequence dim (dim 1, size "
                f"{meta.shape[1]}) cannot be split over the context-parallel axis of size "
                f"{mesh_shape[context_axis]}; use a sequence length divisible by the context "
                "degree (or pin a smaller context=)")
    if kind == "buffer":
        opts = [o for o in opts if all(isinstance(s.outputs[0], Replicate) for s in o)]
    if expert_axis is not None:
        want = Shard(0) if kind == "input" or stack else Replicate()
        opts = [o for o in opts if o[expert_axis].outputs[0] == want]
        if not opts:
            raise PinError(
                f"{kind} {name!r} of shape {list(meta.shape)}: dim 0 cannot be split over the "
                f"expert-parallel axis of size {mesh_shape[expert_axis]}; use a global batch (or a "
                "number of experts) divisible by the expert-parallel degree, or pin a smaller expert=")
    return _apply_pins(name, kind, meta, opts, roles, zero, mesh_shape)


def _op_choices(cap: Captured, args: list, node, call: OpCall, mesh_shape, roles: MeshRoles,
                from_batch: bool) -> list[Combo]:
    """The options of an op node (tensor inputs ``args``) on axes playing ``roles``
    (``from_batch``: computed from the batch): :func:`_filtered_choices`, which every
    option of the node's rule over the mesh passes through, unless :func:`_axis_choices`
    finds the same options by filtering each axis's strategies first."""
    if FILTER_AXES_FIRST and any(a is not None for a in (roles.data, roles.tensor, roles.expert,
                                                         roles.context)):
        got = _axis_choices(cap, args, node, call, mesh_shape, roles, from_batch)
        if got:
            return got
    return _filtered_choices(cap, args, node, call, mesh_shape, roles, from_batch)


FILTER_AXES_FIRST = True
"""Whether :func:`_op_choices` tries :func:`_axis_choices` first (the same options, fewer
combinations checked; ``tests/test_axis_choices.py`` holds both to one list on every test
model's problems). False: :func:`_filtered_choices` alone, as before; a switch for tests
and measurement."""


def _axis_choices(cap: Captured, args: list, node, call: OpCall, mesh_shape, roles: MeshRoles,
                  from_batch: bool) -> list[Combo]:
    """:func:`_filtered_choices`' options where they are every option of the rule whose
    strategy on each role's axis passes that role's tests (empty where none is: then the
    caller filters as :func:`_filtered_choices` does, whose fallbacks keep what a test would
    leave empty).

    Why it is the same list: every filter of :func:`_filtered_choices` keeps the options
    whose strategy on one axis passes a test (``t``), or keeps all of them where none
    passes (``t or opts``), except two that read several axes at once: evenly dividing
    shards (``mesh_strategies``) and the attention's sequence split over one axis at most.
    The filters only ever remove options, so when the options passing every test and the
    two joint checks are not none, no test ever left its filter empty: none fell back, and
    the result is exactly those options, in the rule's order (``itertools.product`` over
    each axis's passing strategies keeps the order of the product over all of them). It is
    cheaper because a role's axis keeps a few of the rule's strategies, so the product
    checks a few combinations for even shards where the whole one checks hundreds (a
    DeepSeek-V3 stage mesh of data x expert x tensor: 164 a node on average)."""
    tests, everywhere = _axis_tests(cap, args, node, call, roles, from_batch)
    per_axis = axis_strategies(call)
    lists = [[s for s in per_axis if all(t(s) for t in (*everywhere, *tests.get(a, ())))]
             for a in range(len(mesh_shape))]
    attention = is_attention(call.op)
    ndim = call.inputs[0].ndim if attention else 0
    out = []
    for combo in itertools.product(*lists):
        if attention and sum(1 for a in context_axes(combo, ndim) if mesh_shape[a] > 1) > 1:
            continue
        if shards_divide(call, combo, mesh_shape):
            out.append(combo)
    return out


def _axis_tests(cap: Captured, args: list, node, call: OpCall, roles: MeshRoles,
                from_batch: bool) -> tuple[dict[int, list], list]:
    """(axis -> the tests, one strategy -> bool, :func:`_filtered_choices` puts that axis's
    strategies to; the tests it puts every axis's strategies to)."""
    data_axis, tensor_axis = roles.data, roles.tensor
    expert_axis, context_axis = roles.expert, roles.context
    param_inputs = [k for k, a in enumerate(args) if a.name in cap.params]
    stacks = [k for k in param_inputs if call.op is EXPERTS_OP and k >= 3]
    fixed = _mutated(node, call)
    tests: dict[int, list] = {}

    def on(axis, *ts):
        if axis is not None:
            tests.setdefault(axis, []).extend(ts)

    def parallel(axis):       # _data_parallel's two tests
        on(axis, lambda s: all(isinstance(s.inputs[k], Replicate) for k in param_inputs))
        if from_batch:
            on(axis, lambda s: any(not isinstance(p, Replicate) for p in s.outputs))

    everywhere = []
    if fixed:
        everywhere.append(lambda s: all(isinstance(s.inputs[k], Replicate) for k in fixed))
    parallel(data_axis)
    if expert_axis is not None:
        if stacks:
            on(expert_axis, lambda s: all(s.inputs[k] == Shard(0) for k in stacks))
        else:
            parallel(expert_axis)
            if from_batch:
                on(expert_axis, lambda s: all(p == Shard(0) for p in s.outputs))
    if context_axis is not None:
        parallel(context_axis)
        if is_attention(call.op):
            ndim = call.inputs[0].ndim
            on(context_axis, lambda s: s.inputs[1] == Shard(ndim - 2))
    if call.op is EXPERTS_OP and roles.dispatch is not None:
        everywhere.append(lambda s: _dispatched(s, roles.dispatch))
    if tensor_axis is not None:
        weights = [k for k in param_inputs if call.inputs[k].ndim >= 2]
        on(tensor_axis, lambda s: all(not isinstance(s.inputs[k], Replicate) for k in weights))
    return tests, everywhere


def _filtered_choices(cap: Captured, args: list, node, call: OpCall, mesh_shape, roles: MeshRoles,
                      from_batch: bool) -> list[Combo]:
    """Every option of the node's rule over the mesh (``mesh_strategies``), through the
    roles' filters one after another."""
    data_axis, tensor_axis = roles.data, roles.tensor
    expert_axis, context_axis = roles.expert, roles.context
    opts = mesh_strategies(call, mesh_shape)
    if is_attention(call.op):
        # the sequence split through attention on one axis at most (context parallelism)
        opts = [o for o in opts if sum(1 for a in context_axes(o, call.inputs[0].ndim)
                                       if mesh_shape[a] > 1) <= 1]
    opts = _restrict_mutations(node, call, opts)
    param_inputs = [k for k, a in enumerate(args) if a.name in cap.params]
    stacks = [k for k in param_inputs if call.op is EXPERTS_OP and k >= 3]
    if data_axis is not None:
        opts = _data_parallel(opts, data_axis, from_batch, param_inputs)
    if expert_axis is not None:
        if stacks:
            opts = [o for o in opts if all(o[expert_axis].inputs[k] == Shard(0) for k in stacks)]
        else:
            opts = _data_parallel(opts, expert_axis, from_batch, param_inputs)
            if from_batch:
                opts = samples_split(opts, expert_axis)
    if context_axis is not None:
        opts = _data_parallel(opts, context_axis, from_batch, param_inputs)
        if is_attention(call.op):
            # attention on the context axis is context-parallel: the sequence split through it
            # (the graph's token stream is in the balanced order only that op knows)
            opts = [o for o in opts if context_axis in context_axes(o, call.inputs[0].ndim)]
            if not opts:
                raise PinError(
                    f"node {node.name} (scaled_dot_product_attention, q {list(call.inputs[0].shape)}, "
                    f"k {list(call.inputs[1].shape)}) cannot split its sequence over the context "
                    f"axis of size {mesh_shape[context_axis]}: context parallelism needs "
                    "self-attention (as many keys as queries), no dropout and a boolean mask if "
                    "any, and a sequence the mesh divides; plan without context=")
    if call.op is EXPERTS_OP and roles.dispatch is not None:
        opts = [o for o in opts if all(_dispatched(s, roles.dispatch) for s in o)]
    if tensor_axis is not None:
        weights = [k for k in param_inputs if call.inputs[k].ndim >= 2]
        opts = [o for o in opts if all(not isinstance(o[tensor_axis].inputs[k], Replicate)
                                       for k in weights)] or opts
    return opts


def _describe(v: NodeVar) -> str:
    return f"shape {list(v.meta.shape)}" if v.meta is not None else f"op {v.call.op}"


def _has_tensor_output(node) -> bool:
    val = node.meta.get("val")
    leaves = torch.utils._pytree.tree_leaves(val)
    return any(isinstance(x, torch.Tensor) for x in leaves)


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor inputs of a node in the order OpCall flattens them."""
    out = []
    for a in torch.utils._pytree.tree_leaves((node.args, dict(node.kwargs)),
                                            is_leaf=lambda x: isinstance(x, torch.fx.Node)):
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
    return out


def _dispatched(s: Strategy, dispatch: str) -> bool:
    """An experts op's option on one axis obeys ``expert_dispatch``: where the experts are
    split, the tokens are split too ("all-to-all") or whole ("all-gather"); "tensor" splits
    each expert instead."""
    stack = s.inputs[3]
    if not isinstance(stack, Shard):
        return True
    if dispatch == "tensor":
        return stack != Shard(0)
    return stack == Shard(0) and s.inputs[0] == (Shard(0) if dispatch == "all-to-all" else Replicate())


def _restrict_mutations(node, call: OpCall, opts: list[Combo]) -> list[Combo]:
    """Ops that write into a buffer (BatchNorm's running statistics, ``add_``) run on the
    buffer itself, so those inputs stay replicated."""
    fixed = _mutated(node, call)
    if fixed is None:
        return opts
    return [o for o in opts if all(isinstance(s.inputs[k], Replicate) for s in o for k in fixed)]


def _mutated(node, call: OpCall) -> list[int] | None:
    """The tensor inputs (their indices among ``call.inputs``) the op writes into; None
    when it writes into none of its arguments."""
    op = call.op
    mutable = [i for i, a in enumerate(op._schema.arguments) if a.alias_info and a.alias_info.is_write]
    if op is aten.batch_norm.default and call.arg(5, "training", False):
        mutable = [3, 4]
    if not mutable:
        return None
    tensor_pos = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node)]
    return [tensor_pos.index(i) for i in mutable if i in tensor_pos]


def samples_split(opts: list[Combo], axis: int) -> list[Combo]:
    """The options of an op computed from the batch on the expert axis ``axis``: outside the
    experts that axis is data parallelism over samples (as Megatron-Core folds expert
    parallelism into data parallelism), so the batch dim stays split there wherever the op
    has that option, never another dim (a sequence or hidden split over the expert ranks).
    Without it a 3-D stage mesh's program grows about ninefold: DeepSeek-V3's data 8 x
    expert 16 x tensor 8 stage (p = 2 on 2,048 H800) was 760,871 variables, which CBC did
    not solve in 8 minutes; with it 87,286, solved in 4 s (2026-11-30)."""
    return [o for o in opts if all(p == Shard(0) for p in o[axis].outputs)] or opts


def _data_parallel(opts: list[Combo], axis: int, from_batch: bool, param_inputs: list[int]) -> list[Combo]:
    """Data parallelism pinned on ``axis``: ops read parameters whole there (ZeRO-3 gathers
    them first), and an op computed from the batch keeps the batch split on that axis
    wherever it has such an option."""
    opts = [o for o in opts if all(isinstance(o[axis].inputs[k], Replicate) for k in param_inputs)] or opts
    if from_batch:
        split = [o for o in opts if any(not isinstance(p, Replicate) for p in o[axis].outputs)]
        opts = split or opts
    return opts


def _apply_pins(name, kind, meta, opts, roles: MeshRoles, zero: int, mesh_shape) -> list[Combo]:
    data_axis, tensor_axis = roles.data, roles.tensor

    def on(axis, o):
        return o[axis].outputs[0]

    if data_axis is not None:
        if kind == "input":
            want = [o for o in opts if on(data_axis, o) == Shard(0)]
            if not want:
                raise PinError(
                    f"input {name!r} of shape {list(meta.shape)}: its batch dim (dim 0, size "
                    f"{meta.shape[0] if meta.shape else 'scalar'}) cannot be split over the "
                    f"data-parallel axis of size {mesh_shape[data_axis]}; use a global "
                    "batch divisible by the data-parallel degree (or pin a smaller data=)")
            opts = want
        elif kind == "param":
            if zero >= 1:
                sharded = [o for o in opts if isinstance(on(data_axis, o), Shard)]
                if zero in (1, 2):
                    # the optimizer shard is a block of the working tensor (replicated on the
                    # data axis only): its dim is one no other axis splits
                    sharded = [o for o in sharded if not any(
                        isinstance(on(a, o), Shard) and on(a, o).dim == on(data_axis, o).dim
                        for a in range(len(mesh_shape)) if a != data_axis)]
                opts = sharded or [o for o in opts if isinstance(on(data_axis, o), Replicate)]
            else:
                opts = [o for o in opts if isinstance(on(data_axis, o), Replicate)]
    if tensor_axis is not None and kind == "input":
        opts = [o for o in opts if isinstance(on(tensor_axis, o), Replicate)]
    if tensor_axis is not None and kind == "param" and meta.ndim >= 2:
        # tensor parallelism pinned: every weight matrix is split over the tensor axis, and
        # the ops that use it read it split (activations move, weights stay)
        opts = [o for o in opts if isinstance(on(tensor_axis, o), Shard)] or opts
    return opts


def _signature(node: torch.fx.Node, index: GraphIndex) -> tuple:
    call = index.call(node) if node.op == "call_function" and node.target is not operator.getitem else None
    if call is None:
        return (str(node.target), len(node.args))
    # op, every argument (tensors by shape and dtype), every output: equal for the same
    # node of two identical layers
    return (str(call.op), tuple(map(repr, torch.utils._pytree.tree_leaves(call.args))),
            tuple(repr(m) for m in call.outputs))


@dataclass
class GraphIndex:
    """What ``build_problem`` reads of a graph whatever the mesh: the repeated-layer map and
    each node's op call, tensor inputs and whether it returns a tensor. A problem is built
    per mesh (and per pipeline candidate); this is worked out once per graph
    (``graph_index``)."""
    repetition: dict[str, str]
    calls: dict[str, OpCall] = field(default_factory=dict)
    args: dict[str, list] = field(default_factory=dict)
    outs: dict[str, bool] = field(default_factory=dict)
    walked: Walk | None = None

    def walk(self, cap: Captured) -> Walk:
        """``build_problem``'s walk of the graph (:class:`Walk`), made on first use."""
        if self.walked is None:
            self.walked = _walk(cap, self)
        return self.walked

    def call(self, node: torch.fx.Node) -> OpCall:
        got = self.calls.get(node.name)
        if got is None:
            got = self.calls[node.name] = make_call(node)
        return got

    def tensor_args(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """:func:`tensor_args` of ``node`` (read only)."""
        got = self.args.get(node.name)
        if got is None:
            got = self.args[node.name] = tensor_args(node)
        return got

    def tensor_output(self, node: torch.fx.Node) -> bool:
        """:func:`_has_tensor_output` of ``node``."""
        got = self.outs.get(node.name)
        if got is None:
            got = self.outs[node.name] = _has_tensor_output(node)
        return got


_INDEXES: "weakref.WeakKeyDictionary[torch.fx.GraphModule, GraphIndex]" = weakref.WeakKeyDictionary()
"""The GraphIndex of each captured graph alive, keyed by its GraphModule (a captured graph is
not rewritten in place: passes make new modules)."""


def graph_index(cap: Captured) -> GraphIndex:
    """The :class:`GraphIndex` of ``cap``'s graph, made on first use."""
    index = _INDEXES.get(cap.gm)
    if index is None:
        index = GraphIndex({})
        index.repetition = _repetition_map(cap, index)   # its op calls kept for the problems
        _INDEXES[cap.gm] = index
    return index


def _repetition_map(cap: Captured, index: GraphIndex) -> dict[str, str]:
    """Node name -> the name of the same node in the first layer of its container that it
    repeats. The layers of a container need not all be alike: each repeats the first one
    of its kind (DeepSeek-V3's three dense layers share one decision, its 58 mixture-of-
    experts layers another; MoE layers interleaved with dense ones likewise)."""
    layers: dict[str, dict[int, list[torch.fx.Node]]] = {}
    for node in cap.gm.graph.nodes:
        if node.op == "call_function":
            lay = layer_of(node)
            if lay is not None:
                layers.setdefault(lay[0], {}).setdefault(lay[1], []).append(node)
    rep: dict[str, str] = {}
    layer_rep: dict[str, dict[int, int]] = {}      # container -> layer -> the layer it repeats
    for prefix, by_idx in layers.items():
        idxs = sorted(by_idx)
        if len(idxs) < 2:
            continue
        kinds: list[tuple[int, list, list]] = []     # (first layer, its nodes, signature)
        for i in idxs:
            nodes = by_idx[i]
            sig = [_signature(n, index) for n in nodes]
            first = next((k for k in kinds if k[2] == sig and _same_wiring(nodes, k[1])), None)
            if first is None:
                kinds.append((i, nodes, sig))
                continue
            layer_rep.setdefault(prefix, {})[i] = first[0]
            for n, n0 in zip(nodes, first[1]):
                rep[n.name] = n0.name
    # parameters of repeated layers follow their layer
    by_param_name = {names[0]: ph for ph, names in cap.params.items()}
    for ph, names in cap.params.items():
        m = re.match(r"^(.*?)\.(\d+)\.(.*)$", names[0])
        if m and int(m.group(2)) in layer_rep.get(m.group(1), {}):
            first = f"{m.group(1)}.{layer_rep[m.group(1)][int(m.group(2))]}.{m.group(3)}"
            ph0 = by_param_name.get(first)
            if ph0 is not None and _same_shape(cap, ph, ph0) and _users_repeat(cap, ph, ph0, rep):
                rep[ph] = ph0
    return rep


def _same_wiring(nodes: list, first: list) -> bool:
    """Each node's inputs come from the same position of its layer as ``first``'s (or
    from outside it)."""
    local = {n.name: k for k, n in enumerate(nodes)}
    pos0 = {n.name: k for k, n in enumerate(first)}
    for n, n0 in zip(nodes, first):
        for a, a0 in zip(n.all_input_nodes, n0.all_input_nodes):
            if (a.name in local) != (a0.name in pos0) or (
                    a.name in local and local[a.name] != pos0[a0.name]):
                return False
    return True


def _same_shape(cap, a, b) -> bool:
    return tuple(cap.node(a).meta["val"].shape) == tuple(cap.node(b).meta["val"].shape)


def _users_repeat(cap, ph, ph0, rep) -> bool:
    users = sorted(rep.get(u.name, u.name) for u in cap.node(ph).users)
    users0 = sorted(u.name for u in cap.node(ph0).users)
    return users == users0
