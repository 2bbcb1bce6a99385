"""Where a captured graph can be cut into pipeline stages (analysis of the global graph;
the cutting itself is ``autopar.passes.split_stages``).

The chain of op nodes the stage DP cuts (``chain``), the nodes that must stay with the loss
(``loss_tail``: everything that depends on the target), which stage every node lands in for
a list of cut nodes (``assign_stages``), the chain nodes that read a parameter (a stage
must hold one: ``parameter_positions``), the bytes live across every candidate cut
(``crossing_bytes``), the values every stage recomputes instead of receiving
(``free_nodes``), and a crossing value's local shape under a plan (``local_meta``).
"""
from __future__ import annotations

import bisect
import operator
import weakref
from typing import Callable

import torch
from torch.fx import Graph, Node

from autopar.capture import Captured
from autopar.errors import AutoparInputError
from autopar.placement import local_shape


class SplitError(AutoparInputError):
    """The graph cannot be cut as asked."""


# ---- the global graph -----------------------------------------------------------------------


def loss_tail(cap: Captured) -> set[str]:
    """Names of nodes that depend on the target (they run in the last stage, with the loss)."""
    return set(_facts(cap).tail)


def _loss_tail(cap: Captured) -> frozenset[str]:
    if not cap.takes_target:
        return frozenset()
    target = cap.inputs[-1]
    tail: set[str] = {target}
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and any(a.name in tail for a in n.all_input_nodes):
            tail.add(n.name)
    return frozenset(tail)


def chain(cap: Captured) -> list[str]:
    """Op nodes in graph order that a cut may fall before (the DP's layers)."""
    return list(_facts(cap).chain)


class _Facts:
    """What this module works out from a graph's structure alone (its loss tail, chain,
    chain positions and which chain span each value is live across), kept per graph while
    its node names and target stay the same: the pipeline search asks for them for every
    plan it prices (~40 per plan of the Llama 3 405B, ~0.5 s each)."""

    def __init__(self, cap: Captured):       # (holds no node: the graph is its memo's key)
        self.tail = _loss_tail(cap)
        self.chain = tuple(n.name for n in cap.gm.graph.nodes
                           if n.op == "call_function" and n.target is not operator.getitem
                           and n.name not in self.tail
                           and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list)))
        self._index = self._spans = None
        self.from_buffers: set[str] | None = None   # values_skip_stages' (_from_buffers)

    def index(self, cap: Captured) -> dict[str, int]:
        if self._index is None:
            self._index = _chain_index(cap, list(self.chain), self.tail)
        return self._index

    def spans(self, cap: Captured) -> list[tuple[int, int, int]]:
        """(graph position of the value's node, src + 1, far + 1) of every value live
        across a cut, in graph order."""
        if self._spans is None:
            self._spans = _spans(cap, self.chain, self.index(cap))
        return self._spans


_FACTS: "weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple]" = weakref.WeakKeyDictionary()


def _facts(cap: Captured) -> _Facts:
    key = (tuple(n.name for n in cap.gm.graph.nodes), cap.takes_target,
           cap.inputs[-1] if cap.takes_target else None)
    hit = _FACTS.get(cap.gm)
    if hit is None or hit[0] != key:
        hit = _FACTS[cap.gm] = (key, _Facts(cap))
    return hit[1]


def assign_stages(cap: Captured, cuts: tuple[str, ...] | list[str], n_stages: int) -> dict[str, int]:
    """Stage of every call_function node: a chain node is in stage k once k cut nodes are at or
    before it; getitems follow their producer; the loss tail goes to the last stage."""
    units = chain(cap)
    if len(cuts) != n_stages - 1:
        raise SplitError(f"{n_stages} stages need {n_stages - 1} cut nodes, got {len(cuts)}")
    pos = {name: i for i, name in enumerate(units)}
    missing = [c for c in cuts if c not in pos]
    if missing:
        raise SplitError(f"cut node(s) {missing} are not op nodes of this graph: the plan was made "
                         "for another graph; plan again")
    idx = [pos[c] for c in cuts]
    if idx != sorted(idx) or len(set(idx)) != len(idx) or (idx and idx[0] == 0):
        raise SplitError(f"cut nodes {list(cuts)} are not strictly increasing after the first node")
    tail = loss_tail(cap)
    stage, k, out = 0, 0, {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.name in tail:
            out[n.name] = n_stages - 1
            continue
        if n.target is operator.getitem:
            out[n.name] = out[n.args[0].name]
            continue
        while k < len(cuts) and n.name == cuts[k]:
            stage, k = stage + 1, k + 1
        out[n.name] = stage
    return out


def chain_index(cap: Captured, units: list[str]) -> dict[str, int]:
    """Chain position of every call_function node: its own, its producer's (getitem), the
    last one (the loss tail), or the latest before it (anything else) — the stage
    ``split.assign_stages`` puts it in."""
    facts = _facts(cap)
    if tuple(units) == facts.chain:
        return dict(facts.index(cap))
    return _chain_index(cap, units, facts.tail)


def _chain_index(cap: Captured, units: list[str], tail) -> dict[str, int]:
    pos = {n: i for i, n in enumerate(units)}
    out, last = {}, 0
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.name in pos:
            last = pos[n.name]
            out[n.name] = last
        elif n.name in tail:
            out[n.name] = len(units) - 1
        elif n.target is operator.getitem and n.args[0].name in out:
            out[n.name] = out[n.args[0].name]
        else:
            out[n.name] = last
    return out


def parameter_positions(cap: Captured) -> tuple[int, ...]:
    """Chain positions (``chain_index``) of the nodes that read a parameter, ascending, each
    once. A stage holds the parameters its nodes read (``passes.split_stages``: a tied
    weight is held by every stage that reads it), so a stage with none of these positions
    holds no parameter: its rank has nothing to train (``torch.optim.SGD(pm.parameters())``
    raises "optimizer got an empty parameter list") and is hardware spent on nothing. At
    most ``len(parameter_positions(cap))`` stages can each hold one."""
    at = chain_index(cap, chain(cap))
    out: set[int] = set()
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder" and n.name in cap.params:
            out.update(at[u.name] for u in n.users if u.name in at)
    return tuple(sorted(out))


def crossing_bytes(cap: Captured, local_bytes: Callable[[Node], float]) -> list[float]:
    """Bytes live across the cut before chain node i, for i = 1 .. L-1 (per rank, through
    ``local_bytes``). Values that depend on no input or parameter are recomputed, not sent."""
    facts = _facts(cap)
    L = len(facts.chain)
    diff = [0.0] * (L + 2)
    nodes = list(cap.gm.graph.nodes)
    recomputed = _recomputed_by_stages(cap, facts)
    for k, a, b_ in facts.spans(cap):
        if nodes[k].name in recomputed:
            continue
        b = local_bytes(nodes[k])
        diff[a] += b
        diff[b_] -= b
    out, acc = [], 0.0
    for i in range(L + 1):
        acc += diff[i]
        if 1 <= i <= L - 1:
            out.append(max(acc, 0.0))
    return out


def values_skip_stages(cap: Captured, cuts) -> bool:
    """Whether a value crosses two or more of the chain cuts ``cuts`` (each the chain index
    a stage starts at): a value sent past the next stage, which the pipeline runtime sends
    point to point on its own (``passes.split_stages``' skip edges). Values that depend on
    no input or parameter are recomputed, not sent (as in :func:`crossing_bytes`)."""
    marks = sorted(set(int(c) for c in cuts))
    if len(marks) < 2:
        return False
    facts = _facts(cap)
    recomputed = _recomputed_by_stages(cap, facts)
    nodes = list(cap.gm.graph.nodes)
    for k, a, b in facts.spans(cap):
        if nodes[k].name in recomputed:
            continue
        # live across cut i for a <= i < b: a skip where the second cut at or after a is < b
        i = bisect.bisect_left(marks, a)
        if i + 1 < len(marks) and marks[i + 1] < b:
            return True
    return False


def _recomputed_by_stages(cap: Captured, facts: _Facts) -> set[str]:
    """:func:`_from_buffers`, once per graph."""
    if facts.from_buffers is None:
        facts.from_buffers = _from_buffers(cap)
    return facts.from_buffers


def _from_buffers(cap: Captured) -> set[str]:
    """Nodes of the captured graph computed from buffers and constants alone, its buffers
    being placeholders (the lifted graph's): what :func:`free_nodes` finds in a per-rank
    program, where buffers are attributes (a rotary embedding's cos and sin), so that every
    stage recomputes them and none is sent (``passes.split_stages``)."""
    free = set(cap.buffers)
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            continue
        if all(a.name in free for a in n.all_input_nodes):
            free.add(n.name)
    return free


def _spans(cap: Captured, units, at: dict[str, int]) -> list[tuple[int, int, int]]:
    """``crossing_bytes``' values: each with the diff slots it adds to and takes from."""
    L = len(units)
    pos = {name: i for i, name in enumerate(units)}
    free = free_nodes(cap.gm.graph)
    # where each reader runs (``chain_index``): an op that is not a chain node, such as a
    # check returning nothing (aten._assert_tensor_metadata), beside the chain node before
    # it, not at the graph's end
    out = []
    for k, n in enumerate(cap.gm.graph.nodes):
        if n.op != "call_function" or n.name in free:
            continue
        if n.target is operator.getitem:
            src = pos.get(n.args[0].name)
        elif isinstance(n.meta.get("val"), torch.Tensor):
            src = pos.get(n.name)
        else:
            continue          # a tuple: its getitems are the values
        if src is None:
            continue          # the loss tail
        far = src
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem:
                continue
            far = max(far, at.get(u.name, L - 1))
        if far > src:
            out.append((k, src + 1, far + 1))
    return out


def free_nodes(graph: Graph) -> set[str]:
    """Nodes computed from constants and buffers only (recomputed by every stage that needs
    them): no placeholder input, no parameter, no mutation."""
    free: set[str] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            continue
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            continue
        ins = n.all_input_nodes
        if all((a.name in free) or (a.op == "get_attr" and a.meta.get("is_buffer", False)) for a in ins):
            free.add(n.name)
    return free


def no_grad_ops(cap: Captured) -> frozenset[str]:
    """Op nodes whose floating outputs never carry a gradient, whatever their inputs do
    (``histc``, the routing counts of a mixture of experts): a pipeline stage must receive
    them as tensors that do not require grad, as on one device, else an op after them that
    autograd refuses (``cumsum(..., dtype=int32)`` on a float that requires grad) fails.

    Each op is asked once, on meta tensors of its inputs' shapes with every floating input
    requiring grad: an op whose floating output then does not require grad is one."""
    out = set()
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem \
                and not _output_differentiable(n):
            out.add(n.name)
    return frozenset(out)


_DIFFERENTIABLE: dict = {}      # op -> its floating outputs carry a gradient


def _output_differentiable(n: Node) -> bool:
    if n.target not in _DIFFERENTIABLE:
        answer = _probe_differentiable(n)
        if answer is None:          # no floating input here: ask again at the next use
            return True
        _DIFFERENTIABLE[n.target] = answer
    return _DIFFERENTIABLE[n.target]


def _probe_differentiable(n: Node) -> bool | None:
    """None where no input requires grad; True where the probe cannot run the op (the old
    assumption: inputs that need a gradient give outputs that carry one)."""
    grads = []

    def fake(a):
        if not isinstance(a, Node):
            return a
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise TypeError(a.name)
        grads.append(v.dtype.is_floating_point)
        return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta").requires_grad_(grads[-1])
    try:
        args = torch.fx.node.map_aggregate(n.args, fake)
        kwargs = torch.fx.node.map_aggregate(n.kwargs, fake)
        if not any(grads):
            return None
        with torch.enable_grad():
            out = n.target(*args, **kwargs)
    except Exception:       # noqa: BLE001 - data-dependent or meta-less ops keep the default
        return True
    outs = out if isinstance(out, (tuple, list)) else (out,)
    floats = [t for t in outs if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
    return not floats or any(t.requires_grad for t in floats)


# ---- the per-rank graph ---------------------------------------------------------------------


def local_meta(cap: Captured, intra_plan, local_node: Node) -> tuple[tuple[int, ...], torch.dtype]:
    """Local shape and dtype of a per-rank node that stands for a global op node (or a getitem
    of one), from the global shape and the plan's output placement."""
    if local_node.target is operator.getitem:
        base, k = local_node.args
        src = base.meta.get("source")
    else:
        src, k = local_node.meta.get("source"), 0
    if src is None:
        raise SplitError(f"{local_node.name} crosses a stage boundary but stands for no graph node")
    val = cap.node(src).meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[k]
    placements = intra_plan.nodes[src].output(k)
    shape = local_shape(tuple(val.shape), placements, intra_plan.mesh_shape)
    return tuple(shape), val.dtype
