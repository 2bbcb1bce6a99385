"""Normalizations: shard only dims the statistics do not cross.

- ``layer_norm`` / ``rms_norm``: any dim before the normalized ones; weight and bias stay
  Replicate (their gradient is partial and the runtime all-reduces it). A norm over a
  sharded hidden dim would need partial sums of mean and variance: not offered (the solver
  gathers first, or keeps the hidden dim whole around the norm: sequence parallelism).
- ``group_norm``: the batch dim only (a channel shard would have to keep whole groups).
- ``batch_norm`` in training: the channel dim only (dim 1), with weight, bias and running
  statistics ``Shard(0)``. NOT the batch dim: training statistics cross the batch, and we
  choose not to synchronize them inside the op (no SyncBatchNorm), so a batch-sharded
  input is gathered first. The running statistics are updated on the local channel slice,
  which is exact. In eval mode (running statistics, ``training=False``) the op is
  per-element affine: every dim shards (channel-sharded parameters follow dim 1).
"""
from __future__ import annotations

from autopar.sharding.registry import OpCall, Strategy, register_rule
from autopar.sharding.rules.pointwise import R, Shard, is_tensor, ops, same_dim_strategies


@register_rule(*ops("layer_norm", "rms_norm"))
def layer_norm(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    normalized = len(call.arg(1, "normalized_shape"))
    return same_dim_strategies(call, range(x.ndim - normalized))


@register_rule(*ops("group_norm"))
def group_norm(call: OpCall) -> list[Strategy]:
    return same_dim_strategies(call, [0])


@register_rule(*ops("batch_norm", "instance_norm"))
def batch_norm(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    params = tuple(Shard(0) for _ in call.inputs[1:])
    res = [Strategy((Shard(1),) + params, tuple(Shard(1) for _ in call.outputs))]
    training = call.arg(5, "training" if call.op == ops("batch_norm")[0] else "use_input_stats")
    has_stats = is_tensor(call.arg(3, "running_mean"))
    if call.op == ops("batch_norm")[0] and not training and has_stats:
        others = tuple(R for _ in call.inputs[1:])
        res += [Strategy((Shard(d),) + others, tuple(Shard(d) for _ in call.outputs))
                for d in range(x.ndim) if d != 1]
    return res
