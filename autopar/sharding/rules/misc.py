"""Ops that fit no family: export's metadata asserts, sorts, one_hot.

Factory ops (``arange``, ``full``, ``zeros``, ``ones``, ``empty``, ``new_zeros``...) have
no rule: they run replicated, which costs nothing to move from (a replicated tensor is
sliced locally to any Shard).
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule
from autopar.sharding.rules.pointwise import P, Shard, norm_dim, ops


@register_rule(*ops("_assert_tensor_metadata"))
def assert_metadata(call: OpCall) -> list[Strategy]:
    """Checks dtype / device / layout only once localized: any placement, no output."""
    x = call.inputs[0]
    return [Strategy((Shard(d),), ()) for d in range(x.ndim)] + [Strategy((P,), ())]


@register_local(*ops("_assert_tensor_metadata"))
def assert_metadata_local(call: OpCall, combo, mesh_shape):
    """Drop the global ``size`` / ``stride``: the local tensor has its own."""
    kwargs = {k: v for k, v in call.kwargs.items() if k not in ("size", "stride")}
    args = call.args[:1] + (None, None) + tuple(call.args[3:]) if len(call.args) > 1 else call.args
    return call.op, args, kwargs


@register_rule(*ops("sort", "sort.stable", "argsort", "argsort.stable", "topk", "kthvalue"))
def sort(call: OpCall) -> list[Strategy]:
    """Any dim but the sorted one."""
    x = call.inputs[0]
    pos = 2 if call.op in ops("topk", "kthvalue") else 1
    dim = norm_dim(call.arg(pos, "dim", -1), max(x.ndim, 1))
    return [Strategy((Shard(d),), tuple(Shard(d) for _ in call.outputs))
            for d in range(x.ndim) if d != dim]


@register_rule(*ops("one_hot"))
def one_hot(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    if int(call.arg(1, "num_classes", -1)) < 0:
        return []   # the class count is read from the data: a shard could see fewer
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim)]
