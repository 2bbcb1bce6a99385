"""Ops Hugging Face models use to build attention masks and position buckets.

``transformers``' mask helpers (``masking_utils.create_causal_mask``) export to a few ops no
other family covers: ``aten.__and__.Tensor`` (``mask_a & mask_b`` on bool masks),
``aten.diff`` (packed-sequence detection over position ids), ``aten.new_ones`` (the
all-true starting mask); T5's relative position buckets use ``aten.min.other``
(``torch.min(a, b)``). They are cheap, but without a rule each one forces its input to be
gathered.

- ``__and__`` / ``__or__`` / ``__xor__`` (Tensor) and ``min.other`` / ``max.other``: pointwise
  with broadcasting, like ``bitwise_and`` and ``minimum``; no Partial (not linear).
- ``diff(x, n, dim, prepend, append)``: any dim but ``dim``, the prepended / appended tensors
  sharded the same way (they match ``x`` off ``dim``); linear, so all-Partial passes for
  floating point.
- ``new_ones`` / ``new_zeros`` / ``new_full`` / ``new_empty(x, size)``: ``x`` gives only dtype
  and device, the size is a constant: any placement of ``x``; the output replicated, or
  split on any dim (a block of a constant tensor is that constant; of an empty one, empty),
  its size made local (DeepSeek's latent attention builds its keys in a ``new_empty`` the
  size of the batch, then writes the halves into it).
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule
from autopar.sharding.rules.views import local_out_shape, with_arg
from autopar.sharding.rules.pointwise import (
    P, R, Shard, broadcast_strategies, is_float, norm_dim, ops,
)


@register_rule(*ops("__and__.Tensor", "__or__.Tensor", "__xor__.Tensor", "min.other",
                    "max.other"))
def logical_pointwise(call: OpCall) -> list[Strategy]:
    return broadcast_strategies(call, call.outputs[0])


@register_rule(*ops("diff"))
def diff(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(int(call.arg(2, "dim", -1)), max(x.ndim, 1))
    res = [Strategy(tuple(Shard(d) for _ in call.inputs), (Shard(d),))
           for d in range(x.ndim) if d != dim]
    if all(is_float(m) for m in call.inputs) and is_float(call.outputs[0]):
        res.append(Strategy(tuple(P for _ in call.inputs), (P,)))
    return res


@register_rule(*ops("new_ones", "new_zeros", "new_full", "new_empty"))
def new_factory(call: OpCall) -> list[Strategy]:
    x, out = call.inputs[0], call.outputs[0]
    res = []
    for o in [R] + [Shard(d) for d in range(out.ndim)]:
        res += [Strategy((Shard(d),), (o,)) for d in range(x.ndim)]
    # a Partial x only with a replicated output: making x partial is free in time but, from
    # a shard, allocates the whole tensor (zeros around the block)
    res += [Strategy((P,), (R,))] + [Strategy((R,), (Shard(d),)) for d in range(out.ndim)]
    return res


@register_local(*ops("new_ones", "new_zeros", "new_full", "new_empty"))
def new_factory_local(call: OpCall, combo, mesh_shape):
    args, kwargs = with_arg(call, 1, "size", local_out_shape(call, combo, mesh_shape))
    return call.op, args, kwargs

