"""Which dims of a tensor computed from the inputs and constants are the sequence.

``sequence_layout`` reorders, where a tensor computed without parameters meets the token
stream, each of its dims that runs over the sequence. A dim's length alone does not say so:
BLOOM's ALiBi bias is [batch * heads, 1, seq], and with a batch of 4 and 4 heads over 16
positions its first dim is as long as the sequence too. Reordered by position, each head
read another head's slopes: under ``context=4`` a 23% error in the attention weights'
gradients (sweep case ``bloom:context:774277``; ``context=2`` hid it, its chunks of 4 rows
moving whole samples, whose biases are equal).

So the graph that computes the tensor is run again on the ``meta`` device (shapes only, no
data) with the sequence another length (:func:`probe_length`): every dim of an input, a
buffer or a constant and every integer argument as long as the sequence takes the new
length (a buffer's table of positions as long as the sequence, ``ex-llama``'s rotary
cos/sin, is one). A dim is the sequence when it was ``seq`` and follows the new length; a
dim as long as the sequence that keeps its length is not: one made from shorter dims
(``repeat``, a product of two) or from sizes that are not the sequence's. A graph that does not run so, or whose shape
changes any other way, is not known: :func:`sequence_dims` returns None, and the caller
refuses (never a guess).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten

SKIPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
           aten.sym_constrain_range_for_size.default}
"""Checks of the captured shapes and dtypes: no value, and they name the old sizes."""


def probe_length(graph: torch.fx.Graph, seq: int, step: int) -> int:
    """A sequence length other than ``seq``, a multiple of ``step`` more, that is no dim of
    any value of ``graph`` (so a dim of the probe's length can only be the sequence's)."""
    sizes = {int(s) for n in graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
             if isinstance(v, torch.Tensor) for s in v.shape}
    probe = seq + step
    while probe in sizes:
        probe += step
    return probe


class SequenceDims:
    """``dims(node)``: the dims of ``node``'s value (a node computed from inputs and
    constants only) that are the sequence of ``seq`` positions, or None where the graph
    does not tell (module docstring)."""

    def __init__(self, graph: torch.fx.Graph, seq: int, step: int):
        self.seq = seq
        self.probe = probe_length(graph, seq, step)
        self._vals: dict[str, object] = {}

    def dims(self, node: torch.fx.Node) -> list[int] | None:
        val, got = node.meta.get("val"), self._value(node)
        if not isinstance(val, torch.Tensor) or not isinstance(got, torch.Tensor) \
                or got.dim() != val.dim():
            return None
        out = []
        for d, (old, new) in enumerate(zip(val.shape, got.shape)):
            if old == self.seq and new == self.probe:
                out.append(d)
            elif old != new:
                return None            # a shape that changed otherwise: not known
        return out

    def _value(self, node: torch.fx.Node):
        """``node``'s value on the meta device at the probe's length; None if it does not
        run so."""
        if node.name in self._vals:
            return self._vals[node.name]
        self._vals[node.name] = None            # a cycle cannot happen; a failure stays None
        order = []
        stack = [node]
        while stack:                            # the ancestors not yet run, inputs first
            n = stack.pop()
            if n.name in self._vals and n is not node:
                continue
            order.append(n)
            self._vals.setdefault(n.name, None)
            stack.extend(a for a in n.all_input_nodes if a.name not in self._vals)
        pos = {n: i for i, n in enumerate(node.graph.nodes)}
        for n in sorted(order, key=pos.__getitem__):
            self._vals[n.name] = self._run(n)
        return self._vals[node.name]

    def _run(self, n: torch.fx.Node):
        val = n.meta.get("val")
        if n.op in ("placeholder", "get_attr"):
            if not isinstance(val, torch.Tensor):
                return val if n.op == "placeholder" else None
            return torch.empty([self.probe if s == self.seq else s for s in val.shape],
                               dtype=val.dtype, device="meta")
        if n.op != "call_function" or n.target in SKIPPED:
            return None
        missing = [a for a in n.all_input_nodes if self._vals.get(a.name) is None
                   and a.op == "call_function" and a.target not in SKIPPED]
        if missing:
            return None

        def arg(a):
            if isinstance(a, torch.fx.Node):
                return self._vals.get(a.name)
            if isinstance(a, torch.device):
                return torch.device("meta")
            if isinstance(a, int) and not isinstance(a, bool) and a == self.seq:
                return self.probe
            return a

        leaf = lambda x: isinstance(x, torch.fx.Node)  # noqa: E731
        args = pytree.tree_map(arg, n.args, is_leaf=leaf)
        kwargs = pytree.tree_map(arg, dict(n.kwargs), is_leaf=leaf)
        try:
            return n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op that does not run on meta at the probe: not known
            return None


__all__ = ["SequenceDims", "probe_length"]
