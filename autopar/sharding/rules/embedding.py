"""``embedding(weight [V, H], indices [...]) -> [..., H]``.

- indices sharded on any dim, weight R            -> output shards that dim
- weight S(1) (hidden), indices R                  -> output S(-1)
- weight S(0) (vocabulary-parallel), indices R     -> output P: each rank looks up the rows
  it holds and gives zeros for the others (``local_ops.vocab_parallel_embedding``; its
  offset is read from the rank's mesh coordinate at run time). The same ``S(0)`` weight
  serves a tied ``lm_head`` (``linear`` with the weight ``S(0)`` gives vocabulary-sharded
  logits); the two gradients add up on the shard.
- weight P, indices R                              -> P (the lookup is linear in the weight)
"""
from __future__ import annotations

from autopar.ops import local_ops
from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule
from autopar.sharding.rules.pointwise import P, R, Shard, is_float, ops, partial_strategy


@register_rule(*ops("embedding"))
def embedding(call: OpCall) -> list[Strategy]:
    w, idx = call.inputs
    out = call.outputs[0]
    res = [Strategy((R, Shard(d)), (Shard(d),)) for d in range(idx.ndim)]
    res.append(Strategy((Shard(1), R), (Shard(out.ndim - 1),)))
    if is_float(w):
        res.append(Strategy((Shard(0), R), (P,)))
        res += partial_strategy(call, [0])
    return res


@register_local(*ops("embedding"))
def embedding_local(call: OpCall, combo, mesh_shape):
    axes = tuple(a for a, s in enumerate(combo) if s.inputs[0] == Shard(0))
    if not axes:
        return call.op, call.args, call.kwargs
    return local_ops.vocab_parallel_embedding, call.args, {**call.kwargs, "axes": axes}
