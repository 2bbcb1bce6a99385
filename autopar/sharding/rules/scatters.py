"""Functional writes into a tensor: ``slice_scatter``, ``select_scatter``, ``scatter``.

Capture turns in-place writes into fresh tensors into these (``autopar.capture.inplace``:
``k[..., :n] = a; k[..., n:] = b`` in DeepSeek's latent attention, a ``scatter_`` of ones
into a routing mask). Each writes along one dim, so every other dim splits:

- ``slice_scatter(input, src, dim, ...)``: ``input``, ``src`` and the output split alike on
  any dim but ``dim`` (their shapes agree there); all Partial for floats (the result is linear
  in both: a sum of terms, each written into a sum of terms);
- ``select_scatter(input, src, dim, index)``: the same, ``src`` lacking ``dim``;
- ``scatter(self, dim, index, src|value)``: ``self``, ``index`` (and ``src``) split alike on a
  dim other than ``dim`` where their sizes agree.
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_rule
from autopar.sharding.rules.pointwise import P, Shard, is_float, norm_dim, ops


@register_rule(*ops("slice_scatter"))
def slice_scatter(call: OpCall) -> list[Strategy]:
    x, src = call.inputs[0], call.inputs[1]
    dim = norm_dim(int(call.arg(2, "dim", 0)), x.ndim)
    res = [Strategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(x.ndim)
           if d != dim and x.shape[d] == src.shape[d]]
    if is_float(x) and is_float(src):
        res.append(Strategy((P, P), (P,)))
    return res


@register_rule(*ops("select_scatter"))
def select_scatter(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(int(call.arg(2, "dim")), x.ndim)
    res = [Strategy((Shard(d), Shard(d if d < dim else d - 1)), (Shard(d),))
           for d in range(x.ndim) if d != dim]
    if is_float(x) and is_float(call.inputs[1]):
        res.append(Strategy((P, P), (P,)))
    return res


@register_rule(*ops("scatter.value", "scatter.src"))
def scatter(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(int(call.arg(1, "dim")), x.ndim)
    return [Strategy(tuple(Shard(d) for _ in call.inputs), (Shard(d),)) for d in range(x.ndim)
            if d != dim and all(m.ndim == x.ndim and m.shape[d] == x.shape[d] for m in call.inputs)]
