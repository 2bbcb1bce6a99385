"""Losses. ``reduction``: 0 none, 1 mean, 2 sum (ATen's enum).

``cross_entropy_loss`` / ``nll_loss_nd`` / ``nll_loss`` with class-index targets
(input ``[N, C, d1...]`` or ``[C]``, target ``[N, d1...]``), on one mesh axis:

- batch-like dim (N or a d_i) of input and target sharded -> ``none``: the target's dim
  sharded; ``sum``: P; ``mean``: P whose local term is local sum / GLOBAL count of
  non-ignored targets (weighted by ``weight`` if given), the count all-reduced over the
  axis (no gradient flows through it).
- class dim sharded, target R (vocabulary-parallel) -> R: the max and the sum of
  exponentials cross the shards (``local_ops.sharded_cross_entropy``); ``weight`` None and
  ``label_smoothing`` 0 only.

With probability targets (float, input-shaped) the batch-like dims shard (``mean`` divides
by the element count: local mean / shards).

Pointwise losses (mse, l1, smooth_l1, huber, bce_with_logits, kl_div) shard any dim of
their broadcast inputs: ``none`` -> that dim, ``sum`` -> P, ``mean`` -> P with the local
mean scaled by 1/shards.
"""
from __future__ import annotations

from autopar.ops import local_ops
from autopar.sharding.registry import (
    OpCall, Strategy, TensorMeta, register_local, register_rule,
)
from autopar.sharding.rules.pointwise import (
    P, R, Shard, broadcast_strategies, is_tensor, ops, placement_in,
)

_CE = ops("cross_entropy_loss")
_NLL = ops("nll_loss_nd", "nll_loss", "nll_loss2d")


def _ce_args(call: OpCall):
    """(weight meta or None, reduction, ignore_index, label_smoothing)."""
    weight = call.arg(2, "weight")
    reduction = call.arg(3, "reduction", 1)
    ignore = call.arg(4, "ignore_index", -100)
    smoothing = call.arg(5, "label_smoothing", 0.0) if call.op in _CE else 0.0
    return (weight if is_tensor(weight) else None), reduction, ignore, smoothing


@register_rule(*_CE, *_NLL)
def cross_entropy(call: OpCall) -> list[Strategy]:
    x, t = call.inputs[:2]
    weight, reduction, _, smoothing = _ce_args(call)
    if len(call.outputs) != 1:
        return []
    soft = t.dtype.is_floating_point
    cdim = 1 if x.ndim >= 2 else 0
    w = (R,) if weight is not None else ()
    res = []
    for d in range(x.ndim):
        if d == cdim:
            continue
        od = d if d < cdim else d - 1          # the dim in the per-element loss
        td = d if soft else od                 # probability targets have the class dim
        out = Shard(od) if reduction == 0 else P
        res.append(Strategy((Shard(d), Shard(td)) + w, (out,)))
    if not soft and weight is None and smoothing == 0:
        res.append(Strategy((Shard(cdim), R), (R,)))
    return res


@register_local(*_CE, *_NLL)
def cross_entropy_local(call: OpCall, combo, mesh_shape):
    x, t = call.inputs[:2]
    weight, reduction, ignore, smoothing = _ce_args(call)
    cdim = 1 if x.ndim >= 2 else 0
    class_axes = tuple(a for a, s in enumerate(combo) if s.inputs[0] == Shard(cdim))
    batch_axes = tuple(a for a, s in enumerate(combo)
                       if isinstance(s.inputs[0], Shard) and s.inputs[0].dim != cdim)
    if t.dtype.is_floating_point:
        if reduction != 1 or not batch_axes:
            return call.op, call.args, call.kwargs
        shards = 1
        for a in batch_axes:
            shards *= mesh_shape[a]
        return local_ops.scaled, (call.op,) + tuple(call.args), {**call.kwargs,
                                                                 "scale": 1.0 / shards}
    if not class_axes and (reduction != 1 or not batch_axes):
        return call.op, call.args, call.kwargs
    return local_ops.sharded_cross_entropy, (x, t, weight, reduction, ignore, smoothing), {
        "class_axes": class_axes, "batch_axes": batch_axes, "log_probs": call.op in _NLL}


# --- pointwise losses ---------------------------------------------------------------------

_POINTWISE = {op: pos for pos, names in ((2, ("mse_loss", "l1_loss", "smooth_l1_loss",
                                              "huber_loss", "kl_div", "soft_margin_loss")),
                                         (3, ("binary_cross_entropy",)),
                                         (4, ("binary_cross_entropy_with_logits",)))
              for op in ops(*names)}


def _broadcast_meta(call: OpCall) -> TensorMeta:
    """The broadcast shape of all tensor inputs (what ``reduction='none'`` returns)."""
    shape: list[int] = []
    for m in call.inputs:
        lead = m.ndim - len(shape)
        if lead > 0:
            shape = list(m.shape[:lead]) + shape
        for i, s in enumerate(m.shape):
            k = len(shape) - m.ndim + i
            shape[k] = max(shape[k], s)
    return TensorMeta(tuple(shape), call.inputs[0].dtype)


@register_rule(*_POINTWISE)
def pointwise_loss(call: OpCall) -> list[Strategy]:
    full = _broadcast_meta(call)
    if call.arg(_POINTWISE[call.op], "reduction", 1) == 0:
        return broadcast_strategies(call, full)
    res = [tuple(placement_in(m, full, d) for m in call.inputs) for d in range(full.ndim)]
    return [Strategy(ins, (P,)) for ins in res if any(isinstance(p, Shard) for p in ins)]


@register_local(*_POINTWISE)
def pointwise_loss_local(call: OpCall, combo, mesh_shape):
    if call.arg(_POINTWISE[call.op], "reduction", 1) != 1:
        return call.op, call.args, call.kwargs
    shards = 1
    for s, n in zip(combo, mesh_shape):
        if s.outputs[0] == P:
            shards *= n
    return local_ops.scaled, (call.op,) + tuple(call.args), {**call.kwargs, "scale": 1.0 / shards}
