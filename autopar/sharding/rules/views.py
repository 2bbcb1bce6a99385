"""Views, shape ops, indexing, concatenation.

Reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``):
input dim ``i`` sharded becomes output dim ``o`` sharded exactly when the product of the
sizes from ``i`` to the end equals that from ``o`` to the end: both dims then cut the
row-major order of the elements into the same contiguous blocks. That covers a split dim
``[a*b] -> [a, b]`` (the first factor shards) and merged dims (the shard must be on the
outermost of them); the registry's divisibility filter checks both sizes.

Every localizer rewrites shape arguments to the LOCAL shape the output placement implies
(``view(x, [2, 16, 4, 16])`` -> ``view(x, [1, 16, 4, 16])``): derived, never guessed.

Shape ops that do not read a dim (permute, split on another dim, cat/stack on another dim,
slice/select of another dim, index on another dim) shard through; ``Partial`` passes
through every op here that moves values without combining them (all are linear).
"""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.placement import local_shape
from autopar.sharding.registry import (
    OpCall, Strategy, output_placements, register_local, register_rule,
)
from autopar.sharding.rules.pointwise import (
    P, R, Shard, is_float, is_tensor, norm_dim, norm_dims, ops, partial_strategy,
)


# --- helpers ---------------------------------------------------------------------------

def _suffix(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        acc *= shape[d]
        out[d] = acc
    return out


def reshape_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
    """(input dim, output dim) pairs a reshape from ``src`` to ``dst`` keeps sharded."""
    si, so = _suffix(src), _suffix(dst)
    return [(i, o) for i in range(len(src)) if src[i] > 1
            for o in range(len(dst)) if dst[o] > 1 and si[i] == so[o]]


def dim_map_strategies(call: OpCall, mapping: dict[int, int] | list[tuple[int, int]],
                       linear: bool = True) -> list[Strategy]:
    """Input 0 S(i) -> every output S(o) for each (i, o); other inputs R; plus P -> P."""
    items = mapping.items() if isinstance(mapping, dict) else mapping
    extra = tuple(R for _ in call.inputs[1:])
    res = [Strategy((Shard(i),) + extra, tuple(Shard(o) for _ in call.outputs))
           for i, o in items]
    if linear:
        res += partial_strategy(call, [0])
    return res


def local_out_shape(call: OpCall, combo, mesh_shape, k: int = 0) -> list[int]:
    shape = local_shape(call.outputs[k].shape, output_placements(combo, k), mesh_shape)
    if shape is None:
        raise ValueError(f"node {call.node!r} ({call.op}): output {call.outputs[k]} does not "
                         f"divide under {output_placements(combo, k)} on mesh {tuple(mesh_shape)}")
    return list(shape)


def with_arg(call: OpCall, pos: int, name: str, value):
    """(args, kwargs) of ``call`` with argument ``pos`` / ``name`` replaced."""
    if pos < len(call.args):
        args = list(call.args)
        args[pos] = value
        return tuple(args), dict(call.kwargs)
    return tuple(call.args), {**call.kwargs, name: value}


# --- reshapes ---------------------------------------------------------------------------

@register_rule(*ops("view", "reshape", "_unsafe_view", "view_copy", "flatten.using_ints",
                    "unflatten.int", "squeeze", "squeeze.dim", "squeeze.dims", "unsqueeze",
                    "unsqueeze_copy", "squeeze_copy.dim"))
def reshape(call: OpCall) -> list[Strategy]:
    return dim_map_strategies(call, reshape_pairs(call.inputs[0].shape, call.outputs[0].shape))


@register_local(*ops("view", "reshape", "_unsafe_view", "view_copy", "expand", "expand_copy"))
def shape_arg_local(call: OpCall, combo, mesh_shape):
    args, kwargs = with_arg(call, 1, "size", local_out_shape(call, combo, mesh_shape))
    return call.op, args, kwargs


@register_local(*ops("squeeze"))
def squeeze_all_local(call: OpCall, combo, mesh_shape):
    """``squeeze(x)`` drops every dim of size 1, and a dim sharded to one row per rank is of
    size 1 locally (global ``[4, 1]`` as ``S(0)`` on 4 ranks: ``[1, 1]``, squeezed to ``[]``
    where the output's local shape is ``[1]``): the local op names the dims of global size 1."""
    x = call.inputs[0]
    dims = [d for d in range(x.ndim) if x.shape[d] == 1]
    return torch.ops.aten.squeeze.dims, (call.args[0], dims), {}


@register_local(*ops("unflatten.int"))
def unflatten_local(call: OpCall, combo, mesh_shape):
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    n = len(call.arg(2, "sizes"))
    local = local_out_shape(call, combo, mesh_shape)[dim: dim + n]
    args, kwargs = with_arg(call, 2, "sizes", local)
    return call.op, args, kwargs


@register_rule(*ops("expand", "expand_copy", "expand_as", "broadcast_to"))
def expand(call: OpCall) -> list[Strategy]:
    """A dim the input has shards through; a broadcast dim shards the output only (each
    rank expands its replicated input to its local size)."""
    x, out = call.inputs[0], call.outputs[0]
    lead = out.ndim - x.ndim
    extra = lambda d: tuple(Shard(d) for _ in call.inputs[1:])  # noqa: E731  expand_as' other
    res = []
    for d in range(out.ndim):
        di = d - lead
        xp = Shard(di) if di >= 0 and x.shape[di] == out.shape[d] else R
        res.append(Strategy((xp,) + extra(d), (Shard(d),)))
    if is_float(x):
        res.append(Strategy((P,) + tuple(R for _ in call.inputs[1:]), (P,)))
    return res


# --- permutations ------------------------------------------------------------------------

def _perm(call: OpCall) -> list[int]:
    """Output dim o holds input dim perm[o]."""
    x = call.inputs[0]
    n = x.ndim
    op = call.op
    perm = list(range(n))
    if op in ops("permute", "permute_copy"):
        return [norm_dim(d, n) for d in call.arg(1, "dims")]
    if op in ops("transpose.int", "swapaxes", "transpose_copy.int"):
        a, b = norm_dim(call.arg(1, "dim0"), n), norm_dim(call.arg(2, "dim1"), n)
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if op in ops("t", "numpy_T"):
        return perm[::-1]
    if op in ops("mT"):
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return perm
    if op in ops("movedim.int"):
        src, dst = norm_dim(call.arg(1, "source"), n), norm_dim(call.arg(2, "destination"), n)
        perm.remove(src)
        perm.insert(dst, src)
        return perm
    raise NotImplementedError(op)


@register_rule(*ops("permute", "permute_copy", "transpose.int", "transpose_copy.int", "swapaxes",
                    "t", "numpy_T", "mT", "movedim.int"))
def permute(call: OpCall) -> list[Strategy]:
    return dim_map_strategies(call, [(i, o) for o, i in enumerate(_perm(call))])


# --- split / cat ------------------------------------------------------------------------

@register_rule(*ops("split.Tensor", "split_with_sizes", "chunk", "tensor_split.sections",
                    "split_copy.Tensor"))
def split(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    res = dim_map_strategies(call, {d: d for d in range(x.ndim) if d != dim})
    sizes = {o.shape[dim] for o in call.outputs}
    g = len(call.outputs)
    if g > 1 and len(sizes) == 1:
        # the split undoes a fused projection: a strided shard with one group per output
        # leaves every output plainly sharded on the same dim
        res.append(Strategy((Shard(dim, g),), tuple(Shard(dim) for _ in call.outputs)))
    return res


@register_local(*ops("split.Tensor", "split_with_sizes", "split_copy.Tensor"))
def split_local(call: OpCall, combo, mesh_shape):
    """Split sizes become the outputs' local sizes (they shrink when the split dim holds a
    strided shard; elsewhere they stay as they are)."""
    dim = norm_dim(call.arg(2, "dim", 0), call.inputs[0].ndim)
    sizes = [local_out_shape(call, combo, mesh_shape, k)[dim] for k in range(len(call.outputs))]
    if call.op in ops("split_with_sizes"):
        args, kwargs = with_arg(call, 1, "split_sizes", sizes)
    else:
        args, kwargs = with_arg(call, 1, "split_size", sizes[0])
    return call.op, args, kwargs


@register_rule(*ops("unbind.int"))
def unbind(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    return dim_map_strategies(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim})


@register_rule(*ops("cat", "concat"))
def cat(call: OpCall) -> list[Strategy]:
    out = call.outputs[0]
    if any(m.ndim != out.ndim for m in call.inputs):
        return []   # legacy 1-D empty inputs
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    res = [Strategy(tuple(Shard(d) for _ in call.inputs), (Shard(d),))
           for d in range(out.ndim) if d != dim]
    return res + partial_strategy(call, range(len(call.inputs)))


@register_rule(*ops("stack"))
def stack(call: OpCall) -> list[Strategy]:
    out = call.outputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    res = [Strategy(tuple(Shard(d) for _ in call.inputs), (Shard(d + (d >= dim)),))
           for d in range(out.ndim - 1)]
    return res + partial_strategy(call, range(len(call.inputs)))


# --- slicing and indexing ---------------------------------------------------------------

def _full_slice(call: OpCall) -> bool:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    return (start in (None, 0) and (end is None or end >= x.shape[dim]) and step == 1)


@register_rule(*ops("slice.Tensor", "slice_copy.Tensor"))
def slice_(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    full = _full_slice(call)
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d != dim or full})


@register_local(*ops("slice.Tensor", "slice_copy.Tensor"))
def slice_local(call: OpCall, combo, mesh_shape):
    """A whole-dim slice of a sharded dim is the whole local dim."""
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    if not any(s.inputs[0] == Shard(dim) for s in combo):
        return call.op, call.args, call.kwargs
    return call.op, (x, dim, None, None, 1), {}


@register_rule(*ops("narrow"))
def narrow(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d != dim})


@register_rule(*ops("select.int", "select_copy.int"))
def select(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return dim_map_strategies(call, {d: d - (d > dim) for d in range(x.ndim) if d != dim})


@register_rule(*ops("index.Tensor", "_unsafe_index.Tensor"))
def index(call: OpCall) -> list[Strategy]:
    """``x[..., idx, ...]`` with integer index tensors: x's other dims shard through (index
    tensors R); or the index tensors shard a dim of their broadcast shape (x R)."""
    x, out = call.inputs[0], call.outputs[0]
    indices = list(call.arg(1, "indices"))
    pos = [i for i, t in enumerate(indices) if t is not None]
    metas = [t for t in indices if is_tensor(t)]
    if not pos or any(m.dtype.is_floating_point or m.dtype == torch.bool for m in metas):
        return []
    nb = out.ndim - (x.ndim - len(pos))
    start = pos[0] if pos == list(range(pos[0], pos[-1] + 1)) else 0
    others = [d for d in range(x.ndim) if d not in pos]
    mapping = {}
    after = 0
    for d in others:
        if start and d < start:
            mapping[d] = d
        else:
            mapping[d] = start + nb + after
            after += 1
    res = dim_map_strategies(call, mapping)
    bshape = out.shape[start: start + nb]
    for j in range(nb):
        ins = [R]
        for m in metas:
            jm = j - (nb - m.ndim)
            ins.append(Shard(jm) if jm >= 0 and m.shape[jm] == bshape[j] else R)
        res.append(Strategy(tuple(ins), (Shard(start + j),)))
    return res


@register_rule(*ops("index_select"))
def index_select(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    res = dim_map_strategies(call, {d: d for d in range(x.ndim) if d != dim})
    return res + [Strategy((R, Shard(0)), (Shard(dim),))]


@register_rule(*ops("gather"))
def gather(call: OpCall) -> list[Strategy]:
    x, idx = call.inputs[:2]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    res = [Strategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(x.ndim)
           if d != dim and x.shape[d] == idx.shape[d]]
    return res + partial_strategy(call, [0])


# --- repeats, flips, pads ---------------------------------------------------------------

@register_rule(*ops("repeat_interleave.self_int"))
def repeat_interleave(call: OpCall) -> list[Strategy]:
    """Every dim, even the repeated one: block i of x repeats into block i of the output."""
    x = call.inputs[0]
    if call.arg(2, "dim") is None:
        return []
    return dim_map_strategies(call, {d: d for d in range(x.ndim)})


@register_local(*ops("repeat_interleave.self_int"))
def repeat_interleave_local(call: OpCall, combo, mesh_shape):
    if call.kwargs.get("output_size") is None:
        return call.op, call.args, call.kwargs
    x = call.inputs[0]
    dim = norm_dim(call.arg(2, "dim"), x.ndim)
    kwargs = {**call.kwargs, "output_size": local_out_shape(call, combo, mesh_shape)[dim]}
    return call.op, call.args, kwargs


@register_rule(*ops("repeat"))
def repeat(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    reps = list(call.arg(1, "repeats"))
    lead = len(reps) - x.ndim
    return dim_map_strategies(call, {d: d + lead for d in range(x.ndim) if reps[d + lead] == 1})


@register_rule(*ops("flip", "roll"))
def flip(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    dims = call.arg(1 if call.op in ops("flip") else 2, "dims")
    if not dims:
        return []   # roll of the flattened tensor
    moved = norm_dims(dims, x.ndim)
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d not in moved})


@register_rule(*ops("tril", "triu"))
def tril(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    return dim_map_strategies(call, {d: d for d in range(x.ndim - 2)})


@register_rule(*ops("constant_pad_nd", "pad"))
def pad(call: OpCall) -> list[Strategy]:
    x = call.inputs[0]
    widths = list(call.arg(1, "pad"))
    padded = {x.ndim - 1 - i for i in range(len(widths) // 2)
              if widths[2 * i] or widths[2 * i + 1]}
    if call.op in ops("pad"):
        mode, value = call.arg(2, "mode", "constant"), call.arg(3, "value")
    else:
        mode, value = "constant", call.arg(2, "value", 0)
    linear = mode == "constant" and not value
    return dim_map_strategies(call, {d: d for d in range(x.ndim) if d not in padded},
                              linear=linear)

