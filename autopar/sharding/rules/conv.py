"""Convolutions and pooling.

``conv{1,2,3}d`` / ``convolution`` (``groups == 1``), on one mesh axis:

- batch:        x S(0),  W R,    b R     -> S(0)
- out-channel:  x R,     W S(0), b S(0)  -> S(1)      (the weight's output-channel dim)
- in-channel:   x S(1),  W S(1), b P     -> P         (each rank convolves its channels;
                                                        the bias is added once)
- linearity:    x P, W R, b P -> P;  x R, W P, b P -> P

Grouped convolutions shard the batch only (a channel shard would split groups). Transposed
convolutions keep their weight as ``[in, out, ...]``: the two channel dims swap. A spatial
shard would need halo exchange: not offered.

Pooling shards every leading (batch, channel) dim; average pools are linear (P -> P).
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_rule
from autopar.sharding.rules.pointwise import P, R, Shard, is_float, ops, partial_strategy


@register_rule(*ops("conv1d", "conv2d", "conv3d", "conv1d.padding", "conv2d.padding",
                    "conv3d.padding", "convolution", "conv_transpose1d", "conv_transpose2d.input",
                    "conv_transpose3d.input"))
def conv(call: OpCall) -> list[Strategy]:
    x, w = call.inputs[:2]
    has_bias = len(call.inputs) == 3
    name = str(call.op)
    if "convolution" in name:
        transposed, groups = bool(call.arg(6, "transposed")), int(call.arg(8, "groups", 1))
    elif "conv_transpose" in name:
        transposed, groups = True, int(call.arg(6, "groups", 1))
    else:
        transposed, groups = False, int(call.arg(6, "groups", 1))
    batched = x.ndim == w.ndim
    cdim = 1 if batched else 0
    b = lambda p: (p,) if has_bias else ()  # noqa: E731
    res = []
    if batched:
        res.append(Strategy((Shard(0), R) + b(R), (Shard(0),)))
    if groups == 1:
        w_out, w_in = (1, 0) if transposed else (0, 1)
        res.append(Strategy((R, Shard(w_out)) + b(Shard(0)), (Shard(cdim),)))
        if is_float(call.outputs[0]):
            res.append(Strategy((Shard(cdim), Shard(w_in)) + b(P), (P,)))
    if is_float(call.outputs[0]):
        res += partial_strategy(call, [0, 2] if has_bias else [0])
        res += partial_strategy(call, [1, 2] if has_bias else [1])
    return res


_POOL_SPATIAL = {
    **{op: 1 for op in ops("max_pool1d", "avg_pool1d", "adaptive_avg_pool1d",
                           "adaptive_max_pool1d", "upsample_nearest1d.vec")},
    **{op: 2 for op in ops("max_pool2d", "max_pool2d_with_indices", "avg_pool2d",
                           "adaptive_avg_pool2d", "adaptive_max_pool2d",
                           "upsample_nearest2d.vec", "upsample_bilinear2d.vec")},
    **{op: 3 for op in ops("max_pool3d", "avg_pool3d", "adaptive_avg_pool3d")},
}
_LINEAR_POOLS = set(ops("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                        "adaptive_avg_pool2d", "adaptive_avg_pool3d", "upsample_nearest1d.vec",
                        "upsample_nearest2d.vec", "upsample_bilinear2d.vec"))


@register_rule(*_POOL_SPATIAL)
def pool(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    lead = x.ndim - _POOL_SPATIAL[call.op]
    res = [Strategy((Shard(d),), tuple(Shard(d) for _ in call.outputs)) for d in range(lead)]
    if call.op in _LINEAR_POOLS:
        res += partial_strategy(call, [0])
    return res
