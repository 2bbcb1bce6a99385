"""The matmul family, every rule derived from an einsum string.

For ``"bmk,bkn->bmn"`` on one mesh axis:

- a letter of the output (``b``, ``m``, ``n``): every operand holding it shards that dim,
  the others stay Replicate, the output shards the letter's dim;
- a contracted letter (``k``): every factor shards it, the output is Partial (each rank
  holds the product of its slices); an additive term (``addmm``'s bias, ``linear``'s bias)
  must then be Partial too, or every rank would add it: the runtime turns a replicated bias
  into Partial by keeping it on rank 0 only;
- linearity: one factor P, the other factors R, additive terms P -> P.

An operand whose dim has size 1 where the output's is larger broadcasts: Replicate there.
"""
from __future__ import annotations

from typing import Sequence

from autopar.sharding.registry import OpCall, Strategy, register_rule
from autopar.sharding.rules.pointwise import P, R, Shard, is_float, ops

_BATCH = "abcdefghij"   # never m, k, n


def einsum_strategies(call: OpCall, specs: Sequence[str], out_spec: str,
                      additive: Sequence[bool] = ()) -> list[Strategy]:
    """Strategies of an op computing ``einsum(specs -> out_spec)`` over ``call.inputs``
    (one spec per input, one letter per dim), plus the inputs flagged ``additive``."""
    n = len(call.inputs)
    additive = tuple(additive) or (False,) * n
    out = call.outputs[0]
    size: dict[str, int] = dict(zip(out_spec, out.shape))
    for spec, m in zip(specs, call.inputs):
        for letter, s in zip(spec, m.shape):
            size.setdefault(letter, s)

    def place(k: int, letter: str):
        spec = specs[k]
        if letter in spec:
            i = spec.index(letter)
            if call.inputs[k].shape[i] == size[letter]:
                return Shard(i)
        return R

    factors = [k for k in range(n) if not additive[k]]
    letters = list(dict.fromkeys("".join(specs) + out_spec))
    res = []
    for letter in letters:
        if letter in out_spec:
            ins = tuple(place(k, letter) for k in range(n))
            res.append(Strategy(ins, (Shard(out_spec.index(letter)),)))
        elif all(isinstance(place(k, letter), Shard) for k in factors) and is_float(out):
            ins = tuple(P if additive[k] else place(k, letter) for k in range(n))
            res.append(Strategy(ins, (P,)))
    if is_float(out):
        for k in factors:
            ins = tuple(P if (j == k or additive[j]) else R for j in range(n))
            res.append(Strategy(ins, (P,)))
    return res


def _right(spec: str, ndim: int) -> str:
    """The last ``ndim`` letters of ``spec`` (a broadcast operand aligns to the right)."""
    return spec[len(spec) - ndim:] if ndim else ""


@register_rule(*ops("mm"))
def mm(call: OpCall) -> list[Strategy]:
    return einsum_strategies(call, ["mk", "kn"], "mn")


@register_rule(*ops("bmm"))
def bmm(call: OpCall) -> list[Strategy]:
    return einsum_strategies(call, ["bmk", "bkn"], "bmn")


@register_rule(*ops("mv"))
def mv(call: OpCall) -> list[Strategy]:
    return einsum_strategies(call, ["mk", "k"], "m")


@register_rule(*ops("dot", "vdot"))
def dot(call: OpCall) -> list[Strategy]:
    return einsum_strategies(call, ["k", "k"], "")


@register_rule(*ops("outer", "ger"))
def outer(call: OpCall) -> list[Strategy]:
    return einsum_strategies(call, ["m", "n"], "mn")


@register_rule(*ops("addmm", "baddbmm"))
def addmm(call: OpCall) -> list[Strategy]:
    """``beta * bias + alpha * (a @ b)``: the bias broadcasts to the output."""
    out = "mn" if call.op == ops("addmm")[0] else "bmn"
    a, b = ("mk", "kn") if len(out) == 2 else ("bmk", "bkn")
    bias = _right(out, call.inputs[0].ndim)
    return einsum_strategies(call, [bias, a, b], out, additive=[True, False, False])


@register_rule(*ops("linear"))
def linear(call: OpCall) -> list[Strategy]:
    """``x @ W.T + b``: ``"...k,nk(,n)->...n"``. Row-parallel (x S(-1), W S(1)) gives a
    Partial output with the bias Partial (added once); column-parallel (W S(0)) shards
    the bias with the output's last dim."""
    x = call.inputs[0]
    batch = _BATCH[: x.ndim - 1]
    specs = [batch + "k", "nk"] + (["n"] if len(call.inputs) == 3 else [])
    additive = [False, False, True][: len(call.inputs)]
    return einsum_strategies(call, specs, batch + "n", additive) + fused_column(call)


FUSED_GROUPS = (2, 3)   # gate/up pairs, q/k/v triples


def fused_column(call: OpCall) -> list[Strategy]:
    """Column-parallel with a strided shard: the output features are ``g`` fused groups
    (q, k, v) and each rank holds its block of every group, so a later split into the
    groups stays head-aligned (see ``autopar.placement``)."""
    n_out = call.outputs[0].shape[-1]
    res = []
    for g in FUSED_GROUPS:
        if n_out % g == 0:
            w = Shard(0, g)
            ins = (R, w) + ((w,) if len(call.inputs) == 3 else ())
            res.append(Strategy(ins, (Shard(call.outputs[0].ndim - 1, g),)))
    return res


def matmul_specs(na: int, nb: int) -> tuple[str, str, str]:
    """einsum specs of ``torch.matmul`` for operands of ``na`` and ``nb`` dims."""
    if na == 1 and nb == 1:
        return "k", "k", ""
    if na == 1:
        batch = _BATCH[: nb - 2]
        return "k", batch + "kn", batch + "n"
    if nb == 1:
        batch = _BATCH[: na - 2]
        return batch + "mk", "k", batch + "m"
    batch = _BATCH[: max(na, nb) - 2]
    return _right(batch, na - 2) + "mk", _right(batch, nb - 2) + "kn", batch + "mn"


@register_rule(*ops("matmul"))
def matmul(call: OpCall) -> list[Strategy]:
    a, b = call.inputs
    sa, sb, so = matmul_specs(a.ndim, b.ndim)
    return einsum_strategies(call, [sa, sb], so)


@register_rule(*ops("einsum"))
def einsum(call: OpCall) -> list[Strategy]:
    """Explicit equations without ``...`` or repeated letters; others run replicated."""
    eq = str(call.arg(0, "equation")).replace(" ", "")
    if "->" not in eq or "." in eq:
        return []
    lhs, out = eq.split("->")
    specs = lhs.split(",")
    if len(specs) != len(call.inputs) or any(len(set(s)) != len(s) for s in specs + [out]):
        return []
    if any(len(s) != m.ndim for s, m in zip(specs, call.inputs)):
        return []
    return einsum_strategies(call, specs, out)
