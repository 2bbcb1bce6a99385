"""Softmax and scaled dot-product attention.

softmax / log_softmax shard any dim but the softmax dim.

``scaled_dot_product_attention(q [..., L, E], k [..., S, E], v [..., S, Ev])``:

- batch and heads (every leading dim): q, k, v, the mask (where it does not broadcast) and
  the output shard alike. With ``enable_gqa`` the kv heads shard too: contiguous blocks keep
  each query head with its kv head.
- query length L, non-causal only: q and the mask shard L, k and v stay Replicate. (A causal
  mask is aligned to the local positions, so it would be wrong on all but the first shard.)
- never E: the default ``scale`` is 1/sqrt(E) of the local head dim; never S (the softmax
  crosses it).
- v Partial -> output Partial (attention is linear in v), without dropout only: with
  ``dropout_p > 0`` each rank would draw its own mask, and per-rank masks are also why any
  sharded strategy with dropout matches one device in distribution only.
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_rule
from autopar.sharding.rules.pointwise import (
    P, R, is_float, is_tensor, norm_dim, ops, placement_in, Shard,
)


@register_rule(*ops("softmax.int", "log_softmax.int", "_softmax", "_log_softmax",
                    "_safe_softmax"))
def softmax(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_rule(*ops("scaled_dot_product_attention"))
def sdpa(call: OpCall) -> list[Strategy]:
    q, k, v = call.inputs[:3]
    out = call.outputs[0]
    mask = call.inputs[3] if is_tensor(call.arg(3, "attn_mask")) else None
    causal = bool(call.arg(5, "is_causal", False))
    dropout = float(call.arg(4, "dropout_p", 0.0))
    if q.ndim < 3 or len(call.outputs) != 1:
        return []

    def with_mask(ins, d):
        return ins + ((placement_in(mask, out, d),) if mask is not None else ())

    gqa = bool(call.arg(7, "enable_gqa", False))

    def kv(m, d):   # k / v follow q's leading dim unless they broadcast on it
        return Shard(d) if m.shape[d] == q.shape[d] or (gqa and d == q.ndim - 3) else R

    res = []
    for d in range(q.ndim - 2):
        res.append(Strategy(with_mask((Shard(d), kv(k, d), kv(v, d)), d), (Shard(d),)))
    if not causal:
        d = q.ndim - 2
        res.append(Strategy(with_mask((Shard(d), R, R), d), (Shard(d),)))
    if dropout == 0.0 and is_float(v):
        res.append(Strategy((R, R, P) + ((R,) if mask is not None else ()), (P,)))
    return res
