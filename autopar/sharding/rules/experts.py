"""Rules for a mixture of experts' expert computation (``autopar::moe_experts``).

``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k], stacks [E, ...]...)
-> [T, H]`` is a sum over experts of each token's routed terms (``autopar.ops.experts``).
On one mesh axis it runs:

- tokens split:  ``S(0),S(0),S(0),R.. -> S(0)``  (data parallel; the model's own forward);
- experts split, tokens whole: ``R,R,R,S(0).. -> P`` (the all-gather dispatch: each rank
  computes its experts' terms for every token; the sum is the all-reduce or reduce-scatter
  the rewrite inserts after it, and the hidden state's and router's gradients come back
  partial, summed as Megatron's column-parallel input is);
- experts and tokens split: ``S(0),S(0),S(0),S(0).. -> S(0)`` (the all-to-all dispatch:
  each token-expert pair is sent to its expert's rank and back, inside the op; its cost is
  priced with the op, ``autopar.pricing.costing``);
- every expert split (tensor-sharded experts, Megatron's column- then row-parallel MLP in
  each expert): ``R,R,R,S(1/2),S(2) -> P``, the gated ``gate_up`` stack ``[E, 2I, H]``
  strided (each rank keeps its block of the gate half and of the up half, so that the
  expert's ``chunk(2)`` still pairs them), ``down`` ``[E, H, I]`` on its input dim; only for
  experts whose stacks are laid out so (concatenated, not transposed, without biases, which
  a partial sum would add once per rank: Mixtral, Qwen3-MoE, DeepSeek, OLMoE; not GPT-OSS).

Expert parallelism is therefore a placement the solver chooses per MoE layer, like any
other: an expert stack split on dim 0 over an axis.
"""
from __future__ import annotations

from autopar.ops.experts import EXPERTS_OP, run_experts, run_whole, template
from autopar.placement import Partial, Replicate, Shard
from autopar.sharding.registry import OpCall, Strategy, register_local, register_rule

R, P, S0 = Replicate(), Partial(), Shard(0)


def split_axes(combo) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(axes splitting the experts, those of them splitting the tokens too) of one option."""
    axes = tuple(a for a, s in enumerate(combo) if s.inputs[3] == S0)
    return axes, tuple(a for a in axes if isinstance(combo[a].inputs[0], Shard))


def tensor_split(call: OpCall) -> tuple | None:
    """The stacks' placements that split every expert's MLP (module docstring), or None
    where the experts' layout does not allow it."""
    t = template(call.args[4])
    m = t.module
    if (getattr(m, "is_transposed", True) or getattr(m, "has_bias", True)
            or not getattr(m, "is_concatenated", False) or getattr(m, "has_post_expert_norm", False)
            or t.names not in (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))):
        return None
    up = Shard(1, 2) if t.names[0] == "gate_up_proj" else Shard(1)
    return up, Shard(2)


@register_rule(EXPERTS_OP)
def experts(call: OpCall) -> list[Strategy]:
    n = len(call.inputs) - 3
    res = [
        Strategy((S0, S0, S0) + (R,) * n, (S0,)),
        Strategy((R, R, R) + (S0,) * n, (P,)),
        Strategy((S0, S0, S0) + (S0,) * n, (S0,)),
    ]
    tp = tensor_split(call)
    if tp is not None:
        res.append(Strategy((R, R, R) + tp, (P,)))
    return res


@register_local(EXPERTS_OP)
def experts_local(call: OpCall, combo, mesh_shape):
    axes, dispatch = split_axes(combo)
    hidden, index, weights, stacks, key = call.args
    if not axes:       # tokens or each expert split only, or none: the model's own forward
        return run_whole, (hidden, index, weights, stacks, key), {}
    return run_experts, (hidden, index, weights, stacks, key), {"axes": axes, "dispatch": dispatch}


experts_local.always = True        # replicated too: run_whole, not the op's recomputing backward
