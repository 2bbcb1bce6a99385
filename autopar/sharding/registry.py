"""The registry of per-op sharding rules, keyed by ATen op.

A *rule* looks at one call of an op (shapes and non-tensor arguments, no data) and lists the
ways it can run on ONE mesh axis: a :class:`Strategy` gives a placement for every tensor
input and every tensor output. :func:`mesh_strategies` expands a rule to an N-D mesh (the
product over axes, filtered to shapes that divide evenly). An op without a rule runs
replicated: correct, and listed by ``autopar.coverage``. The rule modules (``rules/``) fill
the registry when they are imported; the ``autopar.sharding`` package imports them all, so
anything that imports this module has every rule.

A *localizer* turns a call with global arguments into the call each rank makes on its
local shards (shape constants such as ``view``'s size become local sizes; a mean over a
sharded dim becomes a sum over the global count). Ops without one run unchanged locally.

Writing a rule::

    @register_rule(aten.gelu.default)
    def gelu(call: OpCall) -> list[Strategy]:
        x = call.inputs[0]
        return [Strategy((Shard(d),), (Shard(d),)) for d in range(x.ndim)] + [Strategy((P,), (P,))]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.placement import Placement, Replicate, local_shape, normalize

R = Replicate()


@dataclass(frozen=True, eq=False)
class TensorMeta:
    """Shape and dtype of one tensor argument or result (global, unsharded).

    Compared by identity: the rewrite finds each tensor argument again by ``is``.
    """
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def carries_grad(self) -> bool:
        """Whether a gradient can flow through it: floating or complex (ids, masks and
        positions carry none; a rotary embedding's complex product does)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"T{list(self.shape)}:{str(self.dtype).replace('torch.', '')}"


@dataclass
class OpCall:
    """What a rule sees of one graph node: the op, its arguments with every tensor replaced
    by a :class:`TensorMeta`, and the flattened tensor inputs and outputs in order."""
    node: str
    op: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    def arg(self, i: int, name: str, default=None):
        """Positional argument ``i`` or keyword ``name`` (ATen schemas allow both)."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on one mesh axis."""
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]

    def __str__(self) -> str:
        ins = ",".join(str(p) for p in self.inputs)
        outs = ",".join(str(p) for p in self.outputs)
        return f"{ins}->{outs}"


RuleFn = Callable[[OpCall], list[Strategy]]
# A localizer returns (target, args, kwargs) for the local call; tensor positions keep the
# TensorMeta objects of ``call`` so the rewrite can put the local values back in.
LocalFn = Callable[[OpCall, tuple[Strategy, ...], tuple[int, ...]], tuple[Any, tuple, dict]]

RULES: dict[Any, RuleFn] = {}
LOCALIZERS: dict[Any, LocalFn] = {}


def register_rule(*ops) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the sharding rule of each op (overloads or packets)."""
    def deco(fn: RuleFn) -> RuleFn:
        for op in _overloads(ops):
            RULES[op] = fn
        return fn
    return deco


def register_local(*ops) -> Callable[[LocalFn], LocalFn]:
    """Register ``fn`` as the localizer of each op."""
    def deco(fn: LocalFn) -> LocalFn:
        for op in _overloads(ops):
            LOCALIZERS[op] = fn
        return fn
    return deco


def _overloads(ops):
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                yield getattr(op, name)
        else:
            yield op


def has_rule(op) -> bool:
    return op in RULES


def replicated(call: OpCall) -> Strategy:
    return Strategy(tuple(R for _ in call.inputs), tuple(R for _ in call.outputs))


def axis_strategies(call: OpCall) -> list[Strategy]:
    """The rule's strategies on one axis, dims normalized, deduplicated; all-Replicate first."""
    out = [replicated(call)]
    rule = RULES.get(call.op)
    if rule is not None:
        for s in rule(call):
            s = Strategy(
                tuple(normalize(p, m.ndim) for p, m in zip(s.inputs, call.inputs)),
                tuple(normalize(p, m.ndim) for p, m in zip(s.outputs, call.outputs)),
            )
            if len(s.inputs) != len(call.inputs) or len(s.outputs) != len(call.outputs):
                raise ValueError(
                    f"sharding rule for {call.op} at node {call.node!r} returned {s} for "
                    f"{len(call.inputs)} inputs and {len(call.outputs)} outputs")
            if s not in out:
                out.append(s)
    return out


def mesh_strategies(call: OpCall, mesh_shape: Sequence[int]) -> list[tuple[Strategy, ...]]:
    """Every combination of one-axis strategies over the mesh whose shards divide evenly."""
    per_axis = axis_strategies(call)
    result = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        if shards_divide(call, combo, mesh_shape):
            result.append(tuple(combo))
    return result


def shards_divide(call: OpCall, combo, mesh_shape) -> bool:
    """Whether every input and output of ``call`` divides evenly under ``combo`` (one
    strategy per mesh axis) on ``mesh_shape``."""
    for i, m in enumerate(call.inputs):
        if local_shape(m.shape, [s.inputs[i] for s in combo], mesh_shape) is None:
            return False
    for i, m in enumerate(call.outputs):
        if local_shape(m.shape, [s.outputs[i] for s in combo], mesh_shape) is None:
            return False
    return True


def local_meta(meta: TensorMeta, placements: Sequence[Placement],
               mesh_shape: Sequence[int]) -> TensorMeta:
    shape = local_shape(meta.shape, placements, mesh_shape)
    if shape is None:
        raise ValueError(f"{meta} does not divide evenly under {placements} on mesh {mesh_shape}")
    return TensorMeta(shape, meta.dtype)


def output_placements(combo: Sequence[Strategy], k: int) -> tuple[Placement, ...]:
    return tuple(s.outputs[k] for s in combo)


def input_placements(combo: Sequence[Strategy], k: int) -> tuple[Placement, ...]:
    return tuple(s.inputs[k] for s in combo)


def localize(call: OpCall, combo: tuple[Strategy, ...], mesh_shape: tuple[int, ...]):
    """(target, args, kwargs) of the local call; unchanged when no localizer applies or
    nothing is sharded (unless the localizer says ``always``: the experts op, whose eager
    local call differs from the op). An axis of one rank counts as replicated (a shard or a
    partial term over one rank is the whole tensor), so no local op crosses it."""
    fn = LOCALIZERS.get(call.op)
    combo = tuple(s if mesh_shape[a] > 1 else Strategy((R,) * len(s.inputs), (R,) * len(s.outputs))
                  for a, s in enumerate(combo))
    if fn is None or (not getattr(fn, "always", False) and all(_is_replicated(s) for s in combo)):
        return call.op, call.args, call.kwargs
    return fn(call, combo, mesh_shape)


def _is_replicated(s: Strategy) -> bool:
    return all(isinstance(p, Replicate) for p in s.inputs + s.outputs)


def make_call(node: torch.fx.Node) -> OpCall:
    """Build the :class:`OpCall` of an fx node whose inputs carry ``meta['val']``."""
    inputs: list[TensorMeta] = []

    def conv(a):
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                m = TensorMeta(tuple(int(s) for s in val.shape), val.dtype)
                inputs.append(m)
                return m
            return val  # a symbolic or python scalar produced by another node
        return a

    args = pytree.tree_map(conv, node.args, is_leaf=lambda a: isinstance(a, torch.fx.Node))
    kwargs = pytree.tree_map(conv, dict(node.kwargs), is_leaf=lambda a: isinstance(a, torch.fx.Node))
    outs = [TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
            for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return OpCall(node.name, node.target, tuple(args), kwargs, tuple(inputs), tuple(outs))
