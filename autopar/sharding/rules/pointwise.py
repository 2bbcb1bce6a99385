"""Pointwise ops (with broadcasting), and the helpers the other rule families share.

A pointwise op shards any output dim; each tensor input follows with the dim it has there,
or stays Replicate where it broadcasts (a size-1 or missing dim): the local op broadcasts
the same way on the local shards. ``Partial`` passes through only where the op is linear in
that input (``LINEAR`` below): add/sub of two P, mul/div of a P by an R, neg, copies and
float-to-float casts. Never for a non-linear op (gelu, exp, ...), nor for ``x + 1``
(every rank would add the 1).

``dropout`` with ``p > 0`` under a sharded input draws its mask independently on every rank:
the same distribution as one device (i.i.d. Bernoulli per element), not the same bits.
Tests compare with ``p = 0`` or in eval mode.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.sharding.registry import OpCall, Strategy, TensorMeta, register_rule

aten = torch.ops.aten
R = Replicate()
P = Partial()


# --------------------------------------------------------------------------------------
# Shared helpers (used by every family module).

def ops(*names: str) -> list:
    """``"add.Tensor"`` -> ``aten.add.Tensor``, skipping overloads this torch lacks."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        p = getattr(aten, packet, None)
        if p is not None and hasattr(p, overload or "default"):
            out.append(getattr(p, overload or "default"))
    return out


def is_tensor(a) -> bool:
    return isinstance(a, TensorMeta)


def is_float(m: TensorMeta) -> bool:
    return m.dtype.is_floating_point or m.dtype.is_complex


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def norm_dims(dims, ndim: int) -> list[int]:
    """A dim argument (int, list, None or []) -> sorted non-negative dims; None/[] = all."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(ndim))
    return sorted({norm_dim(int(d), max(ndim, 1)) for d in dims})


def placement_in(inp: TensorMeta, out: TensorMeta, d: int) -> Placement:
    """Placement of ``inp`` when the output is sharded on ``d`` and ``inp`` broadcasts to
    ``out`` (right-aligned): the matching dim, or Replicate where ``inp`` broadcasts."""
    di = d - (out.ndim - inp.ndim)
    if di >= 0 and inp.shape[di] == out.shape[d]:
        return Shard(di)
    return R


def broadcast_strategies(call: OpCall, out: TensorMeta | None = None,
                         skip: Sequence[int] = ()) -> list[Strategy]:
    """Shard every output dim (but ``skip``) with the inputs following by broadcasting.
    All outputs get the same placement (they all have the broadcast shape)."""
    out = out or call.outputs[0]
    res = []
    for d in range(out.ndim):
        if d in skip:
            continue
        ins = tuple(placement_in(m, out, d) for m in call.inputs)
        res.append(Strategy(ins, tuple(Shard(d) if o.ndim == out.ndim else R
                                       for o in call.outputs)))
    return [s for s in res if all(isinstance(p, Shard) for p in s.outputs)]


def same_dim_strategies(call: OpCall, dims: Iterable[int],
                        others: Placement = R) -> list[Strategy]:
    """Input 0 and output 0 sharded on the same dim ``d`` for each ``d`` in ``dims``;
    every other input gets ``others``, every other output the same Shard."""
    res = []
    for d in dims:
        ins = (Shard(d),) + tuple(others for _ in call.inputs[1:])
        res.append(Strategy(ins, tuple(Shard(d) for _ in call.outputs)))
    return res


def partial_strategy(call: OpCall, partial_inputs: Iterable[int]) -> list[Strategy]:
    """Inputs in ``partial_inputs`` P, the others R, every output P; only for float data."""
    idx = set(partial_inputs)
    if not idx or not all(is_float(o) for o in call.outputs):
        return []
    if not all(is_float(call.inputs[i]) for i in idx):
        return []
    ins = tuple(P if i in idx else R for i in range(len(call.inputs)))
    return [Strategy(ins, tuple(P for _ in call.outputs))]


def tensor_positions(call: OpCall, positions: Sequence[int]) -> list[int]:
    """Indices into ``call.inputs`` of the positional args ``positions`` that are tensors
    (the flattened input order follows the positional order for pointwise ops)."""
    flat, k = {}, 0
    for i, a in enumerate(call.args):
        if is_tensor(a):
            flat[i] = k
            k += 1
    return [flat[p] for p in positions if p in flat]


# --------------------------------------------------------------------------------------
# Rules.

UNARY = ops(
    "abs", "neg", "positive", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10",
    "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin",
    "acos", "atan", "sigmoid", "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu",
    "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "softplus", "erf", "erfc",
    "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "square",
    "clamp", "clamp_min", "clamp_max", "clamp.Tensor", "logical_not", "bitwise_not",
    "isnan", "isinf", "isfinite", "nan_to_num", "pow.Tensor_Scalar", "logit",
    "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "dropout", "feature_dropout",
    "to.dtype", "to.dtype_layout", "to.device", "_to_copy", "type_as",
    "add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar", "rsub.Scalar",
    "pow.Scalar", "remainder.Scalar", "fmod.Scalar", "floor_divide.Scalar",
    "eq.Scalar", "ne.Scalar", "lt.Scalar", "le.Scalar", "gt.Scalar", "ge.Scalar",
    "masked_fill.Scalar", "masked_fill.Tensor",
    "zeros_like", "ones_like", "full_like", "empty_like", "fill.Scalar",
)
BINARY = ops(
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "div.Tensor_mode", "rsub.Tensor",
    "pow.Tensor_Tensor", "maximum", "minimum", "fmax", "fmin", "atan2", "remainder.Tensor",
    "fmod.Tensor", "floor_divide", "eq.Tensor", "ne.Tensor", "lt.Tensor", "le.Tensor",
    "gt.Tensor", "ge.Tensor", "logical_and", "logical_or", "logical_xor", "bitwise_and.Tensor",
    "bitwise_or.Tensor", "bitwise_xor.Tensor", "where.self", "where.ScalarSelf",
    "where.ScalarOther", "lerp.Scalar", "lerp.Tensor", "addcmul", "addcdiv", "copysign.Tensor",
    "hypot", "xlogy.Tensor", "threshold_backward", "masked_fill.Tensor",
)


def _linear_inputs(call: OpCall) -> list[list[int]]:
    """Sets of inputs (indices into ``call.inputs``) in which the op is jointly linear:
    those inputs P, the rest R, give a P output."""
    op = call.op
    tensors = [i for i, a in enumerate(call.args[:2]) if is_tensor(a)]
    if op in ops("neg", "positive", "clone", "contiguous", "alias", "lift_fresh_copy",
                 "mul.Scalar", "div.Scalar"):
        return [[0]]
    if op in ops("to.dtype", "to.dtype_layout", "to.device", "_to_copy", "type_as"):
        return [[0]]   # partial_strategy checks that input and output are float
    if op in ops("add.Tensor", "sub.Tensor", "rsub.Tensor"):
        return [[0, 1]] if len(tensors) == 2 else []
    if op == aten.mul.Tensor:
        return [[0], [1]] if len(tensors) == 2 else [[0]]
    if op in ops("div.Tensor"):
        return [[0]]
    if op == aten.where.self:
        return [[1, 2]]
    if op == aten.masked_fill.Scalar and call.arg(2, "value") == 0:
        return [[0]]
    if op == aten.zeros_like.default:
        return [[0]]
    return []


@register_rule(*UNARY, *BINARY)
def pointwise(call: OpCall) -> list[Strategy]:
    out = call.outputs[0]
    res = broadcast_strategies(call, out)
    for group in _linear_inputs(call):
        res += partial_strategy(call, group)
    return res


@register_rule(*ops("broadcast_tensors"))
def broadcast_tensors(call: OpCall) -> list[Strategy]:
    """``broadcast_tensors(list)`` -> every output has the broadcast shape."""
    res = broadcast_strategies(call, call.outputs[0])
    return res + partial_strategy(call, range(len(call.inputs)))
