"""The sequence in a causally balanced order, for context parallelism (pin ``context=c``).

Under a causal mask, position ``p`` attends to ``p + 1`` keys: split contiguously over ``c``
ranks, the last rank's queries do nearly twice the mean work ((2c-1)/c;
``ops.context_attention.causal_work``) and the step waits for it. Cut into ``2c`` chunks
instead, rank ``r`` holding chunks ``r`` and ``2c-1-r`` (a head and a tail), every rank does
the same work. This pass makes that layout a plain contiguous split: it rewrites the graph
so that the model's token stream runs over the sequence in the order ``perm`` = chunks
``0, 2c-1, 1, 2c-2, ...`` (:func:`balanced_order`), whose contiguous ``c``-way split gives
rank ``r`` exactly chunks ``r`` and ``2c-1-r``. Everything else (the sharding rules, the
redistributions, the runtime) is unchanged.

Which tensors are reordered. A position-wise op (a matmul over features, a norm, a
pointwise op, a loss summed over positions) gives the same values in any order of the
positions, so a graph whose token stream is permuted computes the permuted values, as long
as every tensor that meets the stream is permuted alike. The *stream* is every node computed
from a parameter (the embedding's output and all it flows into). The rest, computed only
from the inputs and constants, stays in sequence order: position ids, rotary tables, the
masks transformers builds (whose packed-sequence detection reads the positions in order),
the targets, a label shift inside the model's own loss. Where such a tensor enters the
stream, each of its dims that runs over the sequence is reordered by ``perm``
(``aten.index_select``): the token ids at the embedding, the rotary cos/sin at their
product with the queries, the targets at the loss. Which dims run over the sequence is
not read from their length (BLOOM's ALiBi bias is [batch * heads, 1, seq], its first dim
as long as the sequence at 4 x 4 = 16) but from the graph run again at another length on
the meta device (``autopar.capture.sequence_dims``); a tensor it cannot tell is refused. A value that has lost its sequence dim
by a view (targets flattened for a cross-entropy, then cast) is reordered before the view;
one whose shape follows the sequence's length through other ops is refused. Attention's
mask is reordered on its rows only: the context-parallel attention reads its columns in
sequence order, a key block's positions being known (``context_attention``'s balanced
layout). The model's outputs are put back in sequence order (``inverse``).

An op of the stream that reads the sequence in order (a cumulative sum, a shift, a slice or
pad along it, a causal convolution) would compute something else: it is refused, naming
the node, as is a batch as long as the sequence (an op's dim of that length is taken for
the sequence). Attention must then run context-parallel on the context axis (the
problem builder insists), where the balanced layout is known.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from autopar.capture.causal_mask import causal_masks_to_flags
from autopar.capture.grouped_kv import ungroup_kv
from autopar.capture.sequence_dims import SequenceDims
from autopar.errors import PinError
from autopar.ops.attention import is_attention

aten = torch.ops.aten

_LAYOUT: contextvars.ContextVar[int | None] = contextvars.ContextVar("autopar_sequence_layout",
                                                                    default=None)

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.flatten.using_ints, aten.alias.default, aten.clone.default,
         aten.contiguous.default, aten.unsqueeze.default, aten.squeeze.dim,
         aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}
"""Ops that may carry a sequence dim into a shape without it (the targets' flatten), and the
casts between them (transformers' loss casts its flattened targets: ``to(int64)``)."""

IN_ORDER = {aten.cumsum.default, aten.cumprod.default, aten.diff.default, aten.roll.default,
            aten.flip.default, aten.constant_pad_nd.default, aten.pad.default,
            aten.narrow.default, aten.conv1d.default, aten.convolution.default}
"""Stream ops refused when they touch a sequence-long dim (they read it in order)."""


@contextlib.contextmanager
def sequence_layout(c: int | None):
    """Captures inside this block put the sequence in the balanced order of ``c`` ranks
    (None or 1: as it is)."""
    token = _LAYOUT.set(c if c and c > 1 else None)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> int | None:
    return _LAYOUT.get()


def balanced_order(seq: int, c: int) -> torch.Tensor:
    """``perm``: the sequence positions in the order whose contiguous ``c``-way split gives
    rank ``r`` chunks ``r`` and ``2c-1-r`` of ``2c`` (reference for the graph's own)."""
    n = seq // (2 * c)
    return torch.cat([torch.arange(ch * n, ch * n + n) for r in range(c) for ch in (r, 2 * c - 1 - r)])


def balance_sequence(cap, c: int):
    """``cap`` with its token stream in the balanced order of ``c`` ranks (module docstring);
    the graph is changed in place and ``cap`` returned."""
    gm, graph = cap.gm, cap.gm.graph
    first = cap.node(cap.inputs[0]).meta["val"]
    if first.dim() < 2:
        raise PinError(f"context={c} splits the sequence (dim 1 of the inputs); the first input "
                       f"has shape {list(first.shape)}")
    seq = int(first.shape[1])
    if int(first.shape[0]) == seq:
        raise PinError(f"context={c}: the batch ({first.shape[0]}) is as long as the sequence, "
                       "and a dim of that length could be either; use a batch size other than "
                       "the sequence length")
    if seq % (2 * c):
        raise PinError(f"context={c} balances causal attention by cutting the sequence into "
                       f"{2 * c} equal chunks: {seq} positions do not divide; use a sequence "
                       f"length divisible by {2 * c}")
    causal_masks_to_flags(cap, seq)      # transformers' built causal mask: is_causal=True
    ungroup_kv(cap)                      # K/V passed between ranks before their head copies
    stream = _stream(cap)
    probe = SequenceDims(graph, seq, 2 * c)
    ins = [n for n in graph.nodes if n.op != "placeholder"][0]
    with graph.inserting_before(ins):
        perm = _order(graph, seq, c, first, inverse=False)
        inv = _order(graph, seq, c, first, inverse=True)
    made: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in stream:
            continue
        _refuse_in_order(node, seq)
        sdpa = is_attention(node.target)
        for k, a in enumerate(node.args):
            node.update_arg(k, _map(a, lambda x, rows=(sdpa and k == 3): _reordered(
                graph, x, probe, perm, made, node, rows) if x.name not in stream and x is not perm
                else x))
        for key, a in dict(node.kwargs).items():
            node.update_kwarg(key, _map(a, lambda x, rows=(sdpa and key == "attn_mask"): _reordered(
                graph, x, probe, perm, made, node, rows) if x.name not in stream and x is not perm
                else x))
    out = next(n for n in graph.nodes if n.op == "output")
    _restore_outputs(graph, out, cap, stream, seq, inv)
    graph.lint()
    gm.recompile()
    cap.__post_init__()          # the name index, with the new nodes
    cap.sequence_balanced = c
    return cap


def _map(a, fn):
    """``a`` with ``fn`` applied to each graph node in it (lists of nodes too)."""
    if isinstance(a, torch.fx.Node):
        return fn(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_map(x, fn) for x in a)
    return a


def _stream(cap) -> set[str]:
    """Names of the nodes computed from a parameter."""
    out = set(cap.params)
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


def _new(graph, target, args, val):
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _order(graph, seq: int, c: int, like: torch.Tensor, inverse: bool) -> torch.fx.Node:
    """Graph nodes computing ``perm`` (the position at each place of the balanced order) or
    its inverse (the place of each position), from ``arange`` and integer arithmetic."""
    n = seq // (2 * c)
    val = like.new_empty((seq,), dtype=torch.long)
    p = _new(graph, aten.arange.default, (seq,), val)
    p.kwargs = {"dtype": torch.long, "device": like.device}
    if not inverse:
        # place p: rank r = p // 2n, w = p % 2n; chunk r if w < n else 2c-1-r; position chunk*n + w % n
        r = _new(graph, aten.floor_divide.default, (p, 2 * n), val)
        w = _new(graph, aten.remainder.Scalar, (p, 2 * n), val)
        head = _new(graph, aten.lt.Scalar, (w, n), like.new_empty((seq,), dtype=torch.bool))
        tail = _new(graph, aten.rsub.Scalar, (r, 2 * c - 1), val)
        chunk = _new(graph, aten.where.self, (head, r, tail), val)
        base = _new(graph, aten.mul.Tensor, (chunk, n), val)
        off = _new(graph, aten.remainder.Scalar, (w, n), val)
        return _new(graph, aten.add.Tensor, (base, off), val)
    # position q: chunk = q // n, w = q % n; rank chunk (head) or 2c-1-chunk (tail)
    chunk = _new(graph, aten.floor_divide.default, (p, n), val)
    w = _new(graph, aten.remainder.Scalar, (p, n), val)
    head = _new(graph, aten.lt.Scalar, (chunk, c), like.new_empty((seq,), dtype=torch.bool))
    as_head = _new(graph, aten.mul.Tensor, (chunk, 2 * n), val)
    r = _new(graph, aten.rsub.Scalar, (chunk, 2 * c - 1), val)
    as_tail = _new(graph, aten.add.Tensor, (_new(graph, aten.mul.Tensor, (r, 2 * n), val), n), val)
    place = _new(graph, aten.where.self, (head, as_head, as_tail), val)
    return _new(graph, aten.add.Tensor, (place, w), val)


def _seq_dims(val, seq: int) -> list[int]:
    """The dims of ``val`` as long as the sequence (the batch is not: ``balance_sequence``
    refuses a batch of that length)."""
    return [d for d, s in enumerate(val.shape) if s == seq]


def _reordered(graph, a: torch.fx.Node, probe: SequenceDims, perm, made: dict, user, rows: bool):
    """``a`` (in sequence order) as the stream consumer ``user`` must read it: reordered by
    ``perm`` along its dims that run over the sequence (``probe``; ``rows``: attention's
    mask, dim 2 only); through a view chain when ``a`` itself has no dim as long as the
    sequence; ``a`` when there is nothing to reorder."""
    seq = probe.seq
    val = a.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return a
    dims = [2] if rows and val.dim() == 4 and val.shape[2] == seq else \
        ([] if rows else _seq_dims(val, seq))
    if dims and not rows:
        dims = probe.dims(a)
        if dims is None:
            raise PinError(
                f"context=: node {a.name} (shape {list(val.shape)}), computed from the inputs, meets "
                f"the token stream at {user.name} with a dim as long as the sequence ({seq}), and "
                "autopar cannot tell which of its dims run over the sequence (its graph does not "
                f"run again on the meta device at {probe.probe} positions; "
                "autopar.capture.sequence_dims); plan without context=")
        if not dims:       # as long as the sequence, yet not it (BLOOM's ALiBi: batch x heads)
            return a
    if dims:
        key = (a.name, tuple(dims))
        if key not in made:       # before its first reader (the walk is in graph order)
            with graph.inserting_before(user):
                x = a
                for d in dims:
                    x = _new(graph, aten.index_select.default, (x, d, perm), val)
                made[key] = x
        return made[key]
    chain, x = [], a
    while x.op == "call_function" and x.target in VIEWS and isinstance(x.args[0], torch.fx.Node):
        chain.append(x)
        x = x.args[0]
        xv = x.meta.get("val")
        if isinstance(xv, torch.Tensor) and any(s == seq for s in xv.shape):
            break
    else:
        if probe.dims(a) is None:    # its shape follows the sequence, and no view chain says how
            raise PinError(
                f"context=: node {a.name} (shape {list(val.shape)}), computed from the inputs, meets "
                f"the token stream at {user.name}, and its shape follows the sequence's length "
                f"through ops autopar cannot trace back to a dim of the sequence (only views and "
                "casts: sequence_layout.VIEWS), so it cannot be put in the balanced "
                "order (autopar.capture.sequence_layout); plan without context=")
        return a
    key = (a.name, "view")
    if key in made:
        return made[key]
    src = _reordered(graph, x, probe, perm, made, user, False)
    if src is x:
        return a
    prev = src
    with graph.inserting_before(user):
        for v in reversed(chain):
            prev = graph.call_function(v.target, (prev,) + tuple(v.args[1:]), dict(v.kwargs))
            prev.meta["val"] = v.meta["val"]
    made[key] = prev
    return prev


def _refuse_in_order(node, seq: int) -> None:
    val_in = [a.meta.get("val") for a in node.all_input_nodes]
    long_in = [v for v in val_in if isinstance(v, torch.Tensor) and seq in tuple(v.shape)]
    if not long_in:
        return
    bad = node.target in IN_ORDER
    if node.target is aten.slice.Tensor:
        x = node.args[0].meta["val"]
        dim = node.args[1] if len(node.args) > 1 else 0
        dim = dim % x.dim()
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        full = (start in (None, 0)) and (end is None or end >= x.shape[dim])
        bad = x.shape[dim] == seq and not full
    if node.target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        out = node.meta.get("val")
        bad = isinstance(out, torch.Tensor) and out.shape[dim % out.dim()] != seq and \
            any(v.shape[dim % v.dim()] == seq for v in long_in if v.dim() == out.dim())
    if bad:
        raise PinError(f"context=: node {node.name} ({node.target}) reads the sequence in order; "
                       "context parallelism runs the model's token stream in a causally balanced "
                       "order (autopar.capture.sequence_layout), where such an op would compute "
                       "something else. Shift targets outside the model, or plan without context=")


def _restore_outputs(graph, out, cap, stream, seq, inv) -> None:
    """The model's outputs back in sequence order (the loss is order-free)."""
    made: dict[str, torch.fx.Node] = {}

    def fix(a):
        if not isinstance(a, torch.fx.Node) or a.name not in stream or a.name == cap.loss:
            return a
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return a
        dims = [d for d, s in enumerate(val.shape) if s == seq]
        if not dims:
            return a
        if a.name not in made:
            with graph.inserting_before(out):
                x = a
                for d in dims:
                    x = _new(graph, aten.index_select.default, (x, d, inv), val)
            made[a.name] = x
        return made[a.name]

    out.args = torch.utils._pytree.tree_map(fix, out.args)
    # the forward program returns the nodes ``cap.output`` names: the restored ones (they
    # named the balanced-order nodes, so pm(x) returned its sequence shuffled)
    cap.output = [made[n].name if n in made else n for n in cap.output]


__all__ = ["balance_sequence", "balanced_order", "current_layout", "sequence_layout"]
