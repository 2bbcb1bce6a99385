"""A static check of a rewritten program: is every parameter's gradient summed exactly where
it is a partial sum?

On each mesh axis, each rank's local gradient of a value is either *whole* (it follows the
gradient convention of ``autopar.placement``: the whole gradient of an ``R`` or ``P`` value,
the shard of an ``S(d)`` one) or *partial* (an ``R`` value whose gradients on the ranks of
the axis add up to the whole one). This pass walks the per-rank program backwards, from the
loss (whose gradient, 1, is whole on every rank: a replicated loss, or a deferred loss's
term, ``P``) to the parameters, and derives each value's state from what backward does:

- an op of the plan (``meta['source']``) with an ``R`` input and a non-``R`` output on the
  axis makes that input's gradient partial (each rank saw its part of the output); with
  every output ``R``, the input's gradient has the outputs' state (backward is linear in
  them); a sharded or partial input needs whole output gradients;
- a collective's backward (``autopar.ops.collectives``): ``grad_all_reduce`` and an
  ``all_reduce`` / ``all_gather`` with ``grad_partial`` sum a partial gradient into a whole
  one; the others pass a whole gradient on. Each must receive the state its backward
  expects: summing a whole gradient multiplies it by the axis size, slicing a partial one
  leaves a shard nobody completes;
- a value read several times gets the sum of its readers' gradients, which is whole or
  partial only if all of them are.

At each parameter the state must match the gradient sync the runtime installs
(``Rewritten.grad_sync``): partial on exactly the axes the step sums it over (axes of one
rank aside). Anything else is :class:`GradSyncMismatch`, an internal error naming the
parameter, the axis and both sides: raised when the module is built, never a wrong number.
"""
from __future__ import annotations

import operator

from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from autopar.capture import Captured
from autopar.ops import collectives
from autopar.placement import Replicate
from autopar.plan import Plan
from autopar.sharding.registry import make_call

WHOLE, PARTIAL = "whole", "partial"

# collective -> (the gradient state its backward expects on its axis, given grad_partial)
_EXPECTS = {
    collectives.grad_all_reduce: lambda gp: PARTIAL,
    collectives.all_reduce: lambda gp: PARTIAL if gp else WHOLE,
    collectives.all_gather: lambda gp: PARTIAL if gp else WHOLE,
    collectives.scatter: lambda gp: WHOLE,
    collectives.reduce_scatter: lambda gp: WHOLE,
    collectives.all_to_all: lambda gp: WHOLE,
    collectives.to_partial: lambda gp: WHOLE,
    collectives.shard_to_partial: lambda gp: WHOLE,
}


class GradSyncMismatch(RuntimeError):
    """A bug in autopar: the rewritten program and the gradient sync disagree on how a
    parameter's gradient is shared over a mesh axis."""


class _Bad(str):
    """A state that is neither whole nor partial, with the reason (the first place it arose)."""


def _combine(states: list, what: str, axis: int):
    """The state of a sum of gradients of ``what`` on ``axis``."""
    bad = [s for s in states if isinstance(s, _Bad)]
    if bad:
        return bad[0]
    if len(set(states)) > 1:
        return _Bad(f"the gradient of {what} is a sum of whole and partial terms on axis {axis}")
    return states[0]


def check_grad_sync(gm: GraphModule, grad_sync: dict[str, tuple[int, ...]], cap: Captured,
                    plan: Plan, attr_of: dict[str, str]) -> None:
    """Raise :class:`GradSyncMismatch` where the gradient of a parameter reaches the step of
    ``gm`` (``insert_collectives``' program for ``cap`` under ``plan``) partial on an axis
    ``grad_sync`` does not sum it over, or whole on one it does. ``attr_of``: each
    parameter placeholder's attribute path."""
    params = {attr_of[p] for p in cap.params}
    # ``meta["inputs"]`` names the nodes insert_collectives made; a pass that copies the
    # program (passes.copy_program, passes.recompute) keeps their names, not the nodes
    by_name = {n.name: n for n in gm.graph.nodes}
    mesh = tuple(plan.mesh_shape)
    n = len(mesh)
    grads: dict[Node, dict[int, list[tuple]]] = {}     # node -> output index -> readers' states

    def add(node, k: int, state: tuple) -> None:
        if isinstance(node, Node):
            grads.setdefault(node, {}).setdefault(k, []).append(state)

    def out_state(node: Node, k: int):
        terms = grads.get(node, {}).get(k)
        if not terms:
            return None
        return tuple(_combine([t[a] for t in terms], node.name, a) for a in range(n))

    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            for leaf in pytree.tree_leaves(node.args):
                add(leaf, 0, (WHOLE,) * n)     # the loss's gradient, 1: whole on every rank
            continue
        if node.op == "get_attr":
            if node.target in params:
                _check_param(node.target, out_state(node, 0), grad_sync.get(node.target, ()), mesh)
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            st = out_state(node, 0)
            if st is not None:
                add(node.args[0], node.args[1], st)
            continue
        if node.target in _EXPECTS:
            st = out_state(node, 0)
            if st is not None:
                add(node.args[0], 0, _through_collective(node, st))
            continue
        outs = sorted(grads.get(node, {}))
        if not outs:
            continue
        states = {k: out_state(node, k) for k in outs}
        source = node.meta.get("source")
        if source is None or source not in plan.nodes:
            # an op of the rewrite's own (the loss's global target count): linear pass-through
            st = tuple(_combine([s[a] for s in states.values()], node.name, a) for a in range(n))
            for leaf in _tensor_inputs(node):
                add(leaf, 0, st)
            continue
        _through_op(node, cap.node(source), plan, states, add, n, read_inputs(node, by_name))


def _through_collective(node: Node, st: tuple) -> tuple:
    axis = node.kwargs.get("axis", node.args[1] if len(node.args) > 1 else None)
    gp = bool(node.kwargs.get("grad_partial", False))
    expected = _EXPECTS[node.target](gp)
    out = list(st)
    if not isinstance(st[axis], _Bad):
        if st[axis] != expected:
            what = node.target.__name__ + (" (grad_partial)" if gp else "")
            out[axis] = _Bad(f"{node.name} = {what} on axis {axis} receives a {st[axis]} gradient "
                             f"but its backward expects a {expected} one")
        else:
            out[axis] = WHOLE
    return tuple(out)


def _through_op(node: Node, src: Node, plan: Plan, states: dict, add, n: int,
                read: list[Node]) -> None:
    call = make_call(src)
    np = plan.nodes[src.name]
    ins = [np.input(k) for k in range(len(call.inputs))]
    outs = [np.output(k) for k in range(len(call.outputs))]
    for k, local in enumerate(read):
        if not call.inputs[k].carries_grad:
            continue
        st = []
        for a in range(n):
            terms = [s[a] for s in states.values()]
            if isinstance(ins[k][a], Replicate):
                if any(not isinstance(o[a], Replicate) for o in outs):
                    st.append(PARTIAL)
                else:
                    st.append(_combine(terms, node.name, a))
            else:
                c = _combine(terms, node.name, a)
                st.append(c if c in (WHOLE,) or isinstance(c, _Bad) else _Bad(
                    f"{node.name} ({src.target}) reads {ins[k][a]} input {k} on axis {a} "
                    "but its output's gradient is partial there"))
        add(local, 0, tuple(st))


def _check_param(attr: str, st, synced: tuple[int, ...], mesh: tuple[int, ...]) -> None:
    if st is None:
        return       # no gradient reaches it (a frozen or unused parameter)
    for a, s in enumerate(st):
        if mesh[a] == 1:
            continue     # a sum over one rank: nothing to get wrong
        if isinstance(s, _Bad):
            raise GradSyncMismatch(f"internal error (a bug in autopar): the gradient of {attr!r} "
                                   f"on mesh axis {a}: {s}")
        want = s == PARTIAL
        if want != (a in synced):
            program = ("partial sums on each rank" if want
                       else "whole on every rank (each rank computed all of it)")
            step = (f"summed over axis {a} once per step" if a in synced
                    else f"not summed over axis {a}")
            effect = (f"every gradient would be {mesh[a]}x too large" if a in synced
                      else "each rank would step on its own part of the gradient")
            raise GradSyncMismatch(
                f"internal error (a bug in autopar): the gradient of parameter {attr!r} on "
                f"mesh axis {a} (size {mesh[a]}) is {program} in the rewritten program, but "
                f"the gradient sync has it {step}: {effect}")


def read_inputs(node: Node, by_name: dict[str, Node]) -> list[Node]:
    """The nodes ``node`` (an op of the plan) reads as its tensor inputs, in the captured op's
    order: ``node.meta["inputs"]``, which insert_collectives wrote, found again by name in
    the program at hand (a copy made by a later pass keeps the names, not the nodes). Where
    one of them is no longer read by ``node`` (a later edit replaced it) and ``node`` reads
    as many tensors as the op has inputs, the k-th node it reads."""
    read = list(node.meta.get("inputs", ()))
    args = _tensor_inputs(node)
    found = [by_name.get(r.name) for r in read]
    if all(f is not None and f in args for f in found):
        return found
    if len(args) == len(read):
        return args
    return [f if f is not None else r for f, r in zip(found, read)]


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                          is_leaf=lambda x: isinstance(x, Node))
            if isinstance(a, Node)]
