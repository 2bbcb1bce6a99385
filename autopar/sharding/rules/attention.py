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
- the sequence, on one axis (context parallelism): q, k, v and the mask's rows shard their
  sequence dim alike and the output is q's rows; the local call is
  ``autopar.ops.context_attention.context_sdpa``, which passes K/V around the axis (a ring)
  or gathers them (the plan's ``context_attention``), so each rank's queries see every key.
  Self-attention only (L == S), without dropout; a mask only boolean (an additive float mask
  may be learned, and its gradient is not computed by the ring).
- v Partial -> output Partial (attention is linear in v), without dropout only: with
  ``dropout_p > 0`` each rank would draw its own mask, and per-rank masks are also why any
  sharded strategy with dropout matches one device in distribution only.
"""
from __future__ import annotations

import torch

from autopar.ops import context_attention as cp
from autopar.ops.attention import SDPA
from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule
from autopar.sharding.rules.pointwise import (
    P, R, is_float, is_tensor, norm_dim, ops, placement_in, Shard,
)


@register_rule(*ops("softmax.int", "log_softmax.int", "_softmax", "_log_softmax",
                    "_safe_softmax"))
def softmax(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_rule(SDPA)
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
    s_dim = q.ndim - 2
    if dropout == 0.0 and q.ndim == 4 and k.shape[s_dim] == q.shape[s_dim] == v.shape[s_dim] \
            and (mask is None or (mask.ndim == 4 and mask.shape[-1] == k.shape[s_dim]
                                  and mask.dtype == torch.bool)):
        rows = (() if mask is None else
                (Shard(2) if mask.shape[2] == q.shape[s_dim] else R,))
        res.append(Strategy((Shard(s_dim),) * 3 + rows, (Shard(s_dim),)))
    return res


def context_axes(combo, q_ndim: int = 4) -> list[int]:
    """The mesh axes on which an SDPA option splits the keys' sequence (context parallelism)."""
    return [a for a, s in enumerate(combo) if s.inputs[1] == Shard(q_ndim - 2)]


@register_local(SDPA)
def sdpa_local(call: OpCall, combo, mesh_shape):
    axes = [a for a in context_axes(combo, call.inputs[0].ndim) if mesh_shape[a] > 1]
    if not axes:
        return call.op, call.args, call.kwargs
    if len(axes) > 1:
        raise NotImplementedError(f"node {call.node}: the sequence split through attention on "
                                  f"mesh axes {axes}; context parallelism runs on one axis")
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    kw = {n: call.arg(3 + i, n, d) for i, (n, d) in enumerate(zip(names, (None, 0.0, False, None, False)))}
    return cp.context_sdpa, tuple(call.args[:3]), {**kw, "axis": axes[0]}
