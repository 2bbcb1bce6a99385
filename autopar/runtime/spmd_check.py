"""A static SPMD type check of one rank's rewritten program (issue 43, item 1).

Every value of the program gets a type on each mesh axis: ``R`` (replicated: every rank of
the axis holds the whole value), ``S(d)`` / ``S(d/g)`` (sharded on dim ``d``, strided in
``g`` groups: ``autopar.placement``), ``P`` (partial: the value is the sum of the ranks'
terms) or ``V`` (varying per rank in no way the plan names). The types are inferred forward
over the program, in graph order, together with each value's local shape (FakeTensors: no
memory, no data):

- a user input is ``R`` (every rank passes the whole global batch), with its global shape;
- a parameter or buffer (``get_attr``) has the plan's placements; its local shard must have
  the global shape divided by the shard counts (:func:`autopar.placement.local_shape`);
- a call of ``autopar.ops.collectives`` must receive the type it converts from on its axis
  and gives the one it converts to (the table :data:`COLLECTIVES`: ``all_reduce`` P -> R,
  ``all_gather(dim)`` S(dim) -> R, ``reduce_scatter(dim)`` P -> S(dim), ``scatter(dim)``
  R -> S(dim), ``all_to_all(split, cat)`` S(cat) -> S(split), ``grad_all_reduce`` R -> R,
  ``to_partial`` R -> P, ``shard_to_partial(dim)`` S(dim) -> P), with the shape it implies;
- an op of the plan (``node.meta['source']``, a captured node) must receive, as its k-th
  tensor input (``node.meta['inputs']``), the placements the plan chose for that input on
  every axis of more than one rank (the strategy the solver picked, which must be one the
  op's rule in ``autopar.sharding.registry`` offers), and gives the plan's output placements. It is run on
  FakeTensors of its local inputs (ops of ``autopar.ops``, which talk to the communicator,
  are not run: their outputs take the plan's local shapes), and each output's local shape
  must be the global one divided by the shard counts: a shape constant left global after
  sharding (``view(x, [64, 32])`` of a local ``[32, 32]``) fails here;
- any other op (the rewrite's own: the loss's global target count; ``operator.getitem``
  picks an output's type) is ``R`` on an axis where all its tensor inputs are, else ``V``;
- the program's results: the model's outputs ``R``; the loss ``R``, or ``P`` on the axes
  the step still sums it over (``RankPrograms.loss_sync``).

Gradients: every parameter's gradient must be reduced exactly once over each axis it is
partial on: the backward walk of ``passes.check_grad_sync`` on the same program (its
checkpointed layers inlined, :func:`flat_program`), against the step's gradient sync.

A failure is a :class:`autopar.errors.StaticCheckError` naming the program, the node, its
op, the mesh axis, what was expected and what it got.

Why not ``spmd-types`` (PyPI, v0.3.1, torchtitan's checker)? Read for this: it checks a
program as it runs, under a ``TorchFunctionMode`` over a ``torch.distributed`` process group
(one rank per process, the ``fake`` backend), with its own collectives
(``spmd_types.all_reduce(x, group, src=P, dst=R)``). Its local types (R, I, V, P) carry no
shard dim, so an all-gather on the wrong dim or a shape constant left global is not a type
error there; its global types propagate through DTensor's sharding rules, not the strategy
autopar's solver chose per node. autopar's programs call their own autograd functions
(``autopar.ops.collectives``) through a communicator, and every rank of a plan is checked in
one process without running anything. So the inference is written here, on autopar's own
placements and plan.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from autopar.device import HOST
from autopar.errors import StaticCheckError
from autopar.ops import collectives as C
from autopar.passes.check_grad_sync import GradSyncMismatch, check_grad_sync, read_inputs
from autopar.placement import Partial, Replicate, Shard, local_shape, normalize
from autopar.runtime.precision import autocast, compute_dtype
from autopar.sharding.registry import Strategy, axis_strategies, make_call

R, P = Replicate(), Partial()
FIX = "this is an autopar bug: report it with the plan file (`autopar plan ... -o plan.json`)"


class Varying:
    """``V``: a value that differs by rank in no way a placement names."""

    def __str__(self) -> str:
        return "V"

    def __eq__(self, other) -> bool:
        return isinstance(other, Varying)

    def __hash__(self) -> int:
        return hash("V")


V = Varying()


@dataclass
class Typed:
    """One tensor value: its type on each mesh axis and its local value (a FakeTensor, or
    None where its shape is not known statically)."""
    types: tuple
    val: torch.Tensor | None


@dataclass(frozen=True)
class Context:
    """What the check reads beside the program: its name (``"train"`` / ``"forward"``), the
    capture, the plan it runs (a stage's under a pipeline), each parameter placeholder's
    attribute path, the axes the returned loss is still summed over, the axes each
    parameter's gradient is summed over by the step; ``rules``: each captured op's
    strategies on one axis (``registry.axis_strategies``), filled as the check reads them
    (one dict for every rank of a plan: the rules do not depend on the rank)."""
    which: str
    cap: object
    plan: object
    attr_of: dict
    loss_sync: tuple = ()
    grad_sync: dict | None = None
    rules: dict = field(default_factory=dict, repr=False, compare=False)


COLLECTIVES: dict[Callable, Callable] = {
    C.all_gather: lambda a: (Shard(a["dim"], a["groups"]), R, {a["dim"]: "*"}),
    C.all_reduce: lambda a: (P, R, {}),
    C.grad_all_reduce: lambda a: (R, R, {}),
    C.scatter: lambda a: (R, Shard(a["dim"], a["groups"]), {a["dim"]: "/"}),
    C.reduce_scatter: lambda a: (P, Shard(a["dim"]), {a["dim"]: "/"}),
    C.all_to_all: lambda a: (Shard(a["cat_dim"]), Shard(a["split_dim"]),
                             {a["cat_dim"]: "*", a["split_dim"]: "/"}),
    C.to_partial: lambda a: (R, P, {}),
    C.shard_to_partial: lambda a: (Shard(a["dim"]), P, {a["dim"]: "*"}),
    C.all_to_all_v: lambda a: (None, V, None),
}
"""Each collective of ``autopar.ops.collectives``: the type it takes on its axis (None: any),
the type it gives, and how it changes the local shape (dim -> ``*`` times the axis size,
``/`` divided by it; None: not known statically)."""


def _bind(fn: Callable, node: Node) -> dict:
    b = inspect.signature(fn).bind(*node.args, **node.kwargs)
    b.apply_defaults()
    return dict(b.arguments)


def flat_program(gm: GraphModule) -> GraphModule:
    """``gm`` with each checkpointed layer (``passes.recompute``: a ``call_module`` whose
    module's ``body`` is a GraphModule) inlined, so that one walk sees every op in the order
    it runs. Nodes keep their names and metadata; ``gm`` is left alone."""
    if not any(n.op == "call_module" for n in gm.graph.nodes):
        return gm
    g = Graph()
    env: dict[Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(getattr(gm.get_submodule(node.target), "body", None),
                                                   GraphModule):
            body = gm.get_submodule(node.target).body
            inner: dict[Node, object] = {}
            args = iter(node.args)
            for b in body.graph.nodes:
                if b.op == "placeholder":
                    inner[b] = env[next(args)]
                elif b.op == "output":
                    env[node] = list(pytree.tree_leaves(pytree.tree_map(
                        lambda x: inner[x] if isinstance(x, Node) else x, b.args[0],
                        is_leaf=lambda x: isinstance(x, Node))))
                else:
                    inner[b] = g.node_copy(b, lambda a: inner[a])
            continue
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(env.get(node.args[0]), list):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        env[node] = g.node_copy(node, lambda a: env[a])
    return GraphModule(gm, g)


class _Checker:
    def __init__(self, gm: GraphModule, ctx: Context):
        self.gm, self.ctx, self.plan, self.cap = gm, ctx, ctx.plan, ctx.cap
        self.mesh = tuple(ctx.plan.mesh_shape)
        self.axes = tuple(ctx.plan.mesh_axes)
        self.ph_of = {attr: ph for ph, attr in ctx.attr_of.items()}
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.env: dict[Node, object] = {}
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    # --- errors -------------------------------------------------------------------------
    def fail(self, node: Node, what: str) -> None:
        op = getattr(node.target, "__name__", str(node.target))
        src = node.meta.get("source")
        of = f", from captured node {src!r}" if src else ""
        raise StaticCheckError(f"the {self.ctx.which} program: node {node.name!r} ({op}{of}): "
                               f"{what}; {FIX}")

    def axis(self, a: int) -> str:
        return f"mesh axis {a} ({self.axes[a]}, {self.mesh[a]} ranks)"

    def fake(self, shape, dtype) -> torch.Tensor:
        with self.mode:
            return torch.empty(tuple(shape), dtype=dtype)

    # --- the walk -----------------------------------------------------------------------
    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                v = self.cap.node(node.name).meta["val"]
                self.env[node] = Typed((R,) * len(self.mesh), self.fake(v.shape, v.dtype))
            elif node.op == "get_attr":
                self.env[node] = self.attr(node)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                self.output(node)
            else:
                self.fail(node, f"a {node.op} node the check does not know")

    def attr(self, node: Node) -> Typed | None:
        t = fetch_attr(self.gm, node.target)
        if not isinstance(t, torch.Tensor):
            return None
        ph = self.ph_of.get(node.target)
        if ph is None:                       # a constant the capture lifted: the same on every rank
            return Typed((R,) * len(self.mesh), self.fake(t.shape, t.dtype))
        placements = self.plan.nodes[ph].output(0)
        whole = tuple(self.cap.node(ph).meta["val"].shape)
        want = local_shape(whole, placements, self.mesh)
        if tuple(t.shape) != want:
            self.fail(node, f"parameter {node.target!r} of global shape {list(whole)} placed "
                      f"{''.join(map(str, placements))} on mesh {list(self.mesh)} should hold a "
                      f"local shard of shape {list(want) if want else 'none (uneven)'}, but holds "
                      f"{list(t.shape)}")
        return Typed(tuple(placements), self.fake(t.shape, t.dtype))

    def call(self, node: Node):
        if node.target is operator.getitem:
            base = self.env.get(node.args[0])
            return base[node.args[1]] if isinstance(base, (list, tuple)) else None
        if node.target in COLLECTIVES:
            return self.collective(node)
        if getattr(node.target, "__module__", "") == "autopar.ops.param_buckets":
            return None        # a bucket of ZeRO-3 shards: its members are typed at their gathers
        src = node.meta.get("source")
        if src is not None and src in self.plan.nodes:
            return self.planned(node, src)
        return self.unplanned(node)

    def collective(self, node: Node) -> Typed:
        a = _bind(node.target, node)
        x = self.env.get(node.args[0])
        ax = a["axis"]
        if not isinstance(x, Typed):
            self.fail(node, "its input is not a tensor value of the program")
        if not 0 <= ax < len(self.mesh):
            self.fail(node, f"axis {ax} is not one of the mesh's {len(self.mesh)} axes")
        takes, gives, dims = COLLECTIVES[node.target](a)
        ndim = x.val.ndim if x.val is not None else 0
        got = x.types[ax]
        # on a branch axis each rank runs its own branches and contributes zeros for the
        # others (passes/branch_parallel.py): the sum that joins them takes a partial no
        # placement of the plan names, so its input's type there is not checked
        own_branches = self.axes[ax] == "branch"
        if self.mesh[ax] > 1 and takes is not None and not own_branches and \
                normalize(got, ndim) != normalize(takes, ndim):
            self.fail(node, f"on {self.axis(ax)} it takes a {takes} value and gives {gives}, "
                      f"but its input {node.args[0].name!r} is {got} there")
        types = list(x.types)
        types[ax] = gives
        val = x.val
        if val is not None and dims is not None and self.mesh[ax] > 1:
            shape, n = list(val.shape), self.mesh[ax]
            for d, how in dims.items():
                d = d % len(shape)
                if how == "/" and shape[d] % n:
                    self.fail(node, f"dim {d} of local shape {shape} does not divide by the "
                              f"{n} ranks of {self.axis(ax)}")
                shape[d] = shape[d] * n if how == "*" else shape[d] // n
            dtype = a.get("dtype") or val.dtype
            val = self.fake(shape, dtype)
        elif dims is None:
            val = None
        return Typed(tuple(types), val)

    def planned(self, node: Node, src: str):
        cnode = self.cap.node(src)
        call = make_call(cnode)
        np = self.plan.nodes[src]
        self.rule(node, src, call, np)
        for k, inp in enumerate(read_inputs(node, self.by_name)):
            x = self.env.get(inp)
            want = np.input(k)
            if not isinstance(x, Typed):
                self.fail(node, f"its input {k} ({inp.name!r}) is not a tensor value of the "
                          "program (a node no longer in it)")
            meta = call.inputs[k]
            for a, n in enumerate(self.mesh):
                if n > 1 and normalize(x.types[a], meta.ndim) != normalize(want[a], meta.ndim):
                    self.fail(node, f"its sharding rule reads input {k} ({inp.name!r}) as "
                              f"{want[a]} on {self.axis(a)} (the plan's strategy "
                              f"{''.join(map(str, want))}), but it is {x.types[a]} there")
            exp = local_shape(meta.shape, want, self.mesh)
            if x.val is not None and exp is not None and tuple(x.val.shape) != exp:
                self.fail(node, f"input {k} ({inp.name!r}) should have the local shape {list(exp)} "
                          f"(global {list(meta.shape)} placed {''.join(map(str, want))}), but has "
                          f"{list(x.val.shape)}")
        outs = [np.output(k) for k in range(len(call.outputs))]
        expected = [local_shape(m.shape, o, self.mesh) for m, o in zip(call.outputs, outs)]
        vals = self.execute(node) if not _is_autopar_op(node.target) else None
        if vals is None:
            vals = [self.fake(e, m.dtype) if e is not None else None
                    for e, m in zip(expected, call.outputs)]
        if len(vals) != len(outs):
            self.fail(node, f"it gives {len(vals)} tensors where the captured op gives {len(outs)}")
        for k, (v, e) in enumerate(zip(vals, expected)):
            if v is not None and e is not None and tuple(v.shape) != e:
                self.fail(node, f"output {k} has the local shape {list(v.shape)}, but the global "
                          f"shape {list(call.outputs[k].shape)} placed "
                          f"{''.join(map(str, outs[k]))} on mesh {list(self.mesh)} is {list(e)} on "
                          "each rank: a shape constant of the op was not made local")
        typed = [Typed(tuple(o), v) for o, v in zip(outs, vals)]
        multi = isinstance(cnode.meta.get("val"), (list, tuple))
        return typed if multi else typed[0]

    def rule(self, node: Node, src: str, call, np) -> None:
        """The plan's strategy for ``src`` on each axis of more than one rank is one its
        sharding rule offers (``autopar.sharding.registry``)."""
        offered = self.ctx.rules.get(src)
        if offered is None:
            offered = self.ctx.rules[src] = set(axis_strategies(call))
        for a, n in enumerate(self.mesh):
            if n == 1:
                continue
            chosen = Strategy(tuple(np.input(k)[a] for k in range(len(call.inputs))),
                              tuple(np.output(k)[a] for k in range(len(call.outputs))))
            if chosen not in offered:
                self.fail(node, f"the plan runs {call.op} as {chosen} on {self.axis(a)}, which "
                          f"its sharding rule does not offer ({len(offered)} strategies: "
                          f"{', '.join(map(str, list(offered)[:6]))}...)")

    def unplanned(self, node: Node) -> Typed | None:
        ins = [self.env.get(a) for a in _node_args(node)]
        ins = [x for x in ins if isinstance(x, Typed)]
        types = tuple(R if all(x.types[a] == R for x in ins) else V for a in range(len(self.mesh)))
        vals = self.execute(node) if not _is_autopar_op(node.target) else None
        val = vals[0] if vals and len(vals) == 1 else None
        return Typed(types, val)

    def execute(self, node: Node) -> list | None:
        """The node's outputs on FakeTensors of its local inputs; None where an input's shape
        is not known."""
        missing = []

        def value(n):
            if not isinstance(n, Node):
                return n
            x = self.env.get(n)
            if isinstance(x, Typed):
                if x.val is None:
                    missing.append(n)
                return x.val
            return x
        args = pytree.tree_map(value, node.args, is_leaf=lambda x: isinstance(x, Node))
        kwargs = pytree.tree_map(value, dict(node.kwargs), is_leaf=lambda x: isinstance(x, Node))
        if missing:
            return None
        try:
            # under the plan's autocast, as the rank runs its programs (runtime.precision):
            # a ZeRO-3 weight gathered in 16 bits meets an fp32 activation there
            with self.mode, autocast(torch.device(HOST), compute_dtype(self.ctx.plan.options)):
                out = node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure on local shapes is the finding
            self.fail(node, f"it fails on its local inputs' shapes "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): a shape "
                      "constant of the op was not made local")
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    def output(self, node: Node) -> None:
        leaves = [x for x in pytree.tree_leaves(node.args, is_leaf=lambda x: isinstance(x, Node))
                  if isinstance(x, Node)]
        for leaf in leaves:
            x = self.env.get(leaf)
            if not isinstance(x, Typed):
                continue
            for a, n in enumerate(self.mesh):
                want = P if (self.ctx.which == "train" and a in self.ctx.loss_sync) else R
                if n > 1 and x.types[a] != want:
                    what = "the loss" if self.ctx.which == "train" else "the model's output"
                    self.fail(node, f"{what} {leaf.name!r} is {x.types[a]} on {self.axis(a)}, but "
                              f"the program must return it {want} there")


def _is_autopar_op(target) -> bool:
    return getattr(target, "__module__", "").startswith("autopar.")


def _node_args(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                          is_leaf=lambda x: isinstance(x, Node)) if isinstance(a, Node)]


def fetch_attr(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def check_program(gm: GraphModule, ctx: Context) -> dict[str, int]:
    """Type-check one rank's program ``gm`` (module docstring); raise
    :class:`StaticCheckError` at the first value that does not check. With
    ``ctx.grad_sync`` (the program whose gradients the step syncs), also the gradients'
    reduction (``passes.check_grad_sync``). Returns each tensor node's local number of
    elements, by name, where its shape is known."""
    flat = flat_program(gm)
    checker = _Checker(flat, ctx)
    checker.run()
    # a branch axis's gradients: each rank's branches' own, joined by the branch rewrite's
    # sums, which the backward walk does not model (it saw a whole gradient where the sum's
    # backward expects a partial one on ex-inception, branch=2, a plan equal to one device):
    # checked at build time and by the sweep's numbers, not here
    if ctx.grad_sync is not None and "branch" not in ctx.plan.mesh_axes:
        try:
            check_grad_sync(flat, ctx.grad_sync, ctx.cap, ctx.plan, ctx.attr_of)
        except GradSyncMismatch as e:
            raise StaticCheckError(f"the {ctx.which} program: {e}; {FIX}") from e
    return {n.name: x.val.numel() for n, x in checker.env.items()
            if isinstance(x, Typed) and x.val is not None}
