"""Reductions: a kept dim shards through; a sharded reduced dim gives a Partial output
only for sums (and means, whose localizer divides the local sum by the GLOBAL count).
max/min/var/norm over a sharded dim would need a collective inside the op: not offered.
Scans (cumsum) shard any dim but the scanned one.
"""
from __future__ import annotations

from autopar.ops import local_ops
from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule
from autopar.sharding.rules.pointwise import (
    P, R, Shard, is_float, norm_dim, norm_dims, ops, partial_strategy,
)


def _kept(ndim: int, reduced: list[int], keepdim: bool) -> dict[int, int]:
    """Input dim -> output dim for the dims a reduction keeps."""
    out, k = {}, 0
    for d in range(ndim):
        if d in reduced:
            if keepdim:
                k += 1
            continue
        out[d] = k
        k += 1
    return out


def reduction_strategies(call: OpCall, reduced: list[int], keepdim: bool,
                         linear: bool) -> list[Strategy]:
    """Kept dims shard through (every output shards alike); with ``linear`` a sharded
    reduced dim gives P, and P passes through."""
    x = call.inputs[0]
    extra = tuple(R for _ in call.inputs[1:])
    res = [Strategy((Shard(d),) + extra, tuple(Shard(o) for _ in call.outputs))
           for d, o in _kept(x.ndim, reduced, keepdim).items()]
    if linear and is_float(call.outputs[0]):
        res += [Strategy((Shard(d),) + extra, (P,) * len(call.outputs)) for d in reduced]
        res += partial_strategy(call, [0])
    return res


def _dims_keep(call: OpCall, dim_pos: int, keep_pos: int, dim_name="dim"):
    x = call.inputs[0]
    return norm_dims(call.arg(dim_pos, dim_name), x.ndim), bool(call.arg(keep_pos, "keepdim", False))


@register_rule(*ops("sum.dim_IntList", "mean.dim"))
def sum_dim(call: OpCall) -> list[Strategy]:
    reduced, keep = _dims_keep(call, 1, 2)
    return reduction_strategies(call, reduced, keep, linear=True)


@register_rule(*ops("sum.default", "mean.default"))
def sum_all(call: OpCall) -> list[Strategy]:
    return reduction_strategies(call, list(range(call.inputs[0].ndim)), False, linear=True)


@register_local(*ops("mean.dim", "mean.default"))
def mean_local(call: OpCall, combo, mesh_shape):
    """Sharded reduced dims: local sum / global count."""
    x = call.inputs[0]
    if call.op == ops("mean.default")[0]:
        reduced, dim, keep = list(range(x.ndim)), None, False
    else:
        reduced, keep = _dims_keep(call, 1, 2)
        dim = call.arg(1, "dim")
    shards = 1
    for s, n in zip(combo, mesh_shape):
        p = s.inputs[0]
        if isinstance(p, Shard) and p.dim in reduced:
            shards *= n
    if shards == 1:
        return call.op, call.args, call.kwargs
    return (local_ops.mean_over_shards, (x, dim, keep),
            {"dtype": call.kwargs.get("dtype"), "shards": shards})


@register_rule(*ops("amax", "amin", "logsumexp", "any.dims", "all.dims"))
def amax(call: OpCall) -> list[Strategy]:
    reduced, keep = _dims_keep(call, 1, 2)
    return reduction_strategies(call, reduced, keep, linear=False)


@register_rule(*ops("max.dim", "min.dim", "prod.dim_int", "any.dim", "all.dim", "argmax",
                    "argmin", "median.dim", "mode"))
def max_dim(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = call.arg(1, "dim", -1 if call.op in ops("mode") else None)
    if dim is None:   # argmax over the flattened tensor
        return []
    return reduction_strategies(call, [norm_dim(dim, x.ndim)], bool(call.arg(2, "keepdim", False)),
                                linear=False)


@register_rule(*ops("var.correction", "std.correction", "var_mean.correction",
                    "std_mean.correction"))
def var_correction(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    reduced = norm_dims(call.arg(1, "dim"), x.ndim)
    keep = bool(call.kwargs.get("keepdim", call.arg(3, "keepdim", False)))
    return reduction_strategies(call, reduced, keep, linear=False)


@register_rule(*ops("var.dim", "std.dim"))
def var_dim(call: OpCall) -> list[Strategy]:
    reduced, keep = _dims_keep(call, 1, 3)
    return reduction_strategies(call, reduced, keep, linear=False)


@register_rule(*ops("linalg_vector_norm"))
def vector_norm(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    reduced = norm_dims(call.arg(2, "dim"), x.ndim)
    return reduction_strategies(call, reduced, bool(call.arg(3, "keepdim", False)), linear=False)


@register_rule(*ops("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"))
def cumsum(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    res = [Strategy((Shard(d),), tuple(Shard(d) for _ in call.outputs))
           for d in range(x.ndim) if d != dim]
    if call.op == ops("cumsum")[0]:
        res += partial_strategy(call, [0])
    return res
