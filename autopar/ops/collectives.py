"""Autograd-aware collectives: the functions the rewritten graph calls between ops.

Each function is one row of the table in ``autopar.sharding.redistribute``; its backward
keeps the gradient convention (the gradient of an R or P tensor is whole on every rank, of an
S(d) tensor its shard). They run on the communicator that is current
(``autopar.ops.comm.current_comm``), so the generated code is the same on every rank.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.ops.comm import current_comm
from autopar.ops.fp8 import E4M3, HP, fp8_weight, scaled, weight_scales


def _slice(t: torch.Tensor, axis: int, dim: int, groups: int = 1) -> torch.Tensor:
    """This rank's block along ``dim`` (of every one of ``groups`` groups)."""
    comm = current_comm()
    n, i = comm.size(axis), comm.coord[axis]
    if groups == 1:
        return t.chunk(n, dim=dim)[i].contiguous()
    return t.unflatten(dim, (groups, -1)).chunk(n, dim=dim + 1)[i].flatten(dim, dim + 1).contiguous()


def _rank_major(t: torch.Tensor, dim: int, n: int, groups: int) -> torch.Tensor:
    """[g0b0 g0b1 | g1b0 g1b1] -> [g0b0 g1b0 | g0b1 g1b1]: the order a collective over
    ranks sends and receives a strided shard in."""
    if groups == 1:
        return t
    return t.unflatten(dim, (groups, n, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


def _group_major(t: torch.Tensor, dim: int, n: int, groups: int) -> torch.Tensor:
    """The inverse of :func:`_rank_major`."""
    if groups == 1:
        return t
    return t.unflatten(dim, (n, groups, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2).contiguous()


OWN_OUTPUTS = torch.__version__ < (2, 13)     # a TorchVersion compares so
"""Whether a compiled autograd function's output is made a tensor of its own (:func:`_own`):
on torch 2.11 (and 2.12), Dynamo traces an ``autograd.Function``'s forward into a
higher-order op that also returns the forward's intermediates, and when the returned tensor
is one of them (``t.contiguous()`` of a contiguous ``t``, as :func:`_slice` does) autograd
sends the output's gradient to the intermediate's slot: the backward runs on zeros (the
tensor-parallel GPT's ``c_attn`` gradient; the mechanism of pytorch/pytorch#180642, not seen on
2.13 or 2.15)."""


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a forward's output: under compilation on torch < 2.13, a view of it (a tensor
    of its own, no copy: :data:`OWN_OUTPUTS`); else ``t`` itself."""
    if OWN_OUTPUTS and torch.compiler.is_compiling():
        return t.view_as(t)
    return t


def _gather(x, axis, dim, groups):
    comm = current_comm()
    return _group_major(comm.all_gather(x, axis, dim), dim, comm.size(axis), groups)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, grad_partial, regather=False, groups=1, dtype=None):
        ctx.axis, ctx.dim, ctx.grad_partial, ctx.groups = axis, dim, grad_partial, groups
        ctx.master = None
        if dtype is not None and x.dtype != dtype:   # mixed precision (passes/autocast.py)
            ctx.master, x = x.dtype, x.to(dtype)
        out = _gather(x, axis, dim, groups)
        if regather:
            regathered_weights().register(out, x, axis, dim, groups)
        return _own(out)

    @staticmethod
    def backward(ctx, g):
        return (_gather_grad(ctx, g), *(None,) * 6)


def _gather_grad(ctx, g):
    """The shard's gradient of a gather's whole gradient ``g`` (a reduce-scatter where
    partial), back in the shard's dtype (``ctx.master``) when it was gathered in another."""
    if ctx.master is not None:     # reduced in fp32 unless grad_reduce says otherwise
        g = g.to(current_comm().settings.grad_reduce_dtype or ctx.master)
    if ctx.grad_partial:
        comm = current_comm()
        g = _rank_major(g, ctx.dim, comm.size(ctx.axis), ctx.groups)
        g = comm.reduce_scatter(g, ctx.axis, ctx.dim)
    else:
        g = _slice(g, ctx.axis, ctx.dim, ctx.groups)
    return g if ctx.master is None else g.to(ctx.master)


def fp8_bytes(shard: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``shard`` cast to e4m3 with ``scale``, as bytes: gloo all-gathers no float8 dtype
    (torch 2.13: "Invalid scalar type", measured), so every fp8 gather moves uint8."""
    return scaled(shard.detach().to(HP), scale, E4M3).view(torch.uint8)


class _Fp8Shard:
    """What ``RegatheredWeights`` packs for an fp8-gathered weight: its shard and the scale
    forward cast it with, so backward gathers the same fp8 bytes again (the shard has not
    changed since: the optimizer steps after backward)."""

    __slots__ = ("shard", "scale", "axis", "dim", "groups")

    def __init__(self, shard, scale, axis, dim, groups):
        self.shard, self.scale, self.axis, self.dim, self.groups = shard, scale, axis, dim, groups

    def packed(self) -> None:
        pass

    def regather(self) -> torch.Tensor:
        return _gather(fp8_bytes(self.shard, self.scale), self.axis, self.dim, self.groups).view(E4M3)


class _Fp8AllGather(torch.autograd.Function):
    """ZeRO-3's gather of a tensorwise fp8 linear's weight in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``): the shard cast with the whole weight's scale (its
    amax max-reduced over the gather's axis and ``amax_axes``, the weight's other split
    axes), the fp8 bytes gathered (half of bf16's), returned as ``ops.fp8.fp8_weight``;
    backward is a bf16 gather's (:func:`_gather_grad`)."""

    @staticmethod
    def forward(ctx, x, axis, dim, grad_partial, groups, amax_axes):
        ctx.axis, ctx.dim, ctx.grad_partial, ctx.groups = axis, dim, grad_partial, groups
        ctx.master = x.dtype if x.dtype != HP else None
        scale = weight_scales([x.detach().to(HP)], (axis, *amax_axes))[0]
        source = _Fp8Shard(x.detach(), scale, axis, dim, groups)
        w8 = source.regather()
        regathered_weights().register(w8, source, axis, dim, groups)
        return fp8_weight(w8, scale.reciprocal())

    @staticmethod
    def backward(ctx, g):
        return (_gather_grad(ctx, g), *(None,) * 5)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, grad_partial):
        ctx.axis, ctx.grad_partial = axis, grad_partial
        return _own(current_comm().all_reduce(x, axis))

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_partial:
            return current_comm().all_reduce(g, ctx.axis), None, None
        return g, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return current_comm().all_reduce(g, ctx.axis), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, groups=1):
        ctx.axis, ctx.dim, ctx.groups = axis, dim, groups
        return _own(_slice(x, axis, dim, groups))

    @staticmethod
    def backward(ctx, g):
        return _gather(g.contiguous(), ctx.axis, ctx.dim, ctx.groups), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return _own(current_comm().reduce_scatter(x, axis, dim))

    @staticmethod
    def backward(ctx, g):
        return current_comm().all_gather(g.contiguous(), ctx.axis, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, split_dim, cat_dim):
        ctx.axis, ctx.split_dim, ctx.cat_dim = axis, split_dim, cat_dim
        return _own(current_comm().all_to_all(x, axis, split_dim, cat_dim))

    @staticmethod
    def backward(ctx, g):
        return current_comm().all_to_all(g, ctx.axis, ctx.cat_dim, ctx.split_dim), None, None, None


class _AllToAllV(torch.autograd.Function):
    # forward and setup_context apart: the experts op's backward differentiates it under
    # torch.func.vjp (ops/experts.py), which takes only this form
    @staticmethod
    def forward(x, axis, send, recv):
        return _own(current_comm().all_to_all_v(x, axis, send, recv))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.axis, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx, g):
        return current_comm().all_to_all_v(g, ctx.axis, ctx.recv, ctx.send), None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis):
        comm = current_comm()
        if torch.compiler.is_compiling():
            # the rank's choice read from a tensor at run time, not a Python branch: a branch
            # traces rank 0's graph reading x and the others' not (zeros_like), and Inductor
            # orders two different graphs' collectives differently (issue 43: a hang)
            return torch.where(comm.first_on_axis[axis], x, torch.zeros_like(x))
        return x.clone() if comm.coord[axis] == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class RegatheredWeights:
    """ZeRO-3's memory saving: a weight gathered from its shards for one use is not kept for
    backward. While a step runs under :meth:`hooks`, every tensor autograd would save that
    shares storage with such a gathered weight is packed as (shard, axis, dim, geometry)
    and gathered again when backward unpacks it; every rank unpacks in the same order."""

    def __init__(self):
        self.by_storage: dict[int, tuple] = {}

    def register(self, full, shard, axis, dim, groups=1):
        self.by_storage[full.untyped_storage().data_ptr()] = (weakref.ref(full), shard, axis, dim, groups)

    def _pack(self, t):
        entry = self.by_storage.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if entry is None:
            return t
        full = entry[0]()
        if full is None or not (t is full or t._base is full):
            return t   # the gathered weight is gone and its memory serves another tensor
        if not isinstance(entry[1], torch.Tensor):
            entry[1].packed()      # a bucket's weight (ops.param_buckets): gathered with its bucket
        return ("regather", *entry[1:], t.size(), t.stride(), t.storage_offset(), t.dtype)

    def _unpack(self, obj):
        if isinstance(obj, tuple) and obj and obj[0] == "regather":
            _, shard, axis, dim, groups, size, stride, offset, _dtype = obj
            with torch.no_grad():
                full = (_gather(shard.detach().to(_dtype), axis, dim, groups)
                        if isinstance(shard, torch.Tensor) else shard.regather())
            return full.as_strided(size, stride, offset)
        return obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def clear(self):
        self.by_storage.clear()


def regathered_weights() -> RegatheredWeights:
    comm = current_comm()
    reg = getattr(comm, "_regathered", None)
    if reg is None:
        reg = comm._regathered = RegatheredWeights()
    return reg


class _ShardToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim):
        comm = current_comm()
        ctx.axis, ctx.dim = axis, dim
        shape = list(x.shape)
        shape[dim] *= comm.size(axis)
        out = x.new_zeros(shape)
        out.narrow(dim, comm.coord[axis] * x.shape[dim], x.shape[dim]).copy_(x)
        return _own(out)

    @staticmethod
    def backward(ctx, g):
        return _slice(g, ctx.axis, ctx.dim), None, None


# The graph's call targets. Keyword names show up in the generated per-rank code.

def all_gather(x, axis: int, dim: int, grad_partial: bool = False, regather: bool = False,
               groups: int = 1, dtype: torch.dtype | None = None, bucket=None, index: int = 0,
               amax_axes: tuple[int, ...] = ()):
    """S(dim) (or strided S(dim/groups)) -> R on ``axis``. ``regather``: a ZeRO-3 weight,
    which autograd does not keep: backward gathers it again (:class:`RegatheredWeights`).
    ``dtype``: gather the shard cast to it (mixed precision); the gradient returns in the
    shard's dtype, reduced in it unless the communicator's ``settings.grad_reduce_dtype`` is set.
    ``bucket``: the ``ops.param_buckets.ParamBucket`` that gathered ``x`` with the rest of its
    block (``passes.prefetch``), ``x`` its weight ``index``: take it from there.
    ``dtype=float8_e4m3fn``: a ZeRO-3 weight of a tensorwise fp8 linear, gathered in fp8
    with the whole weight's scale (:class:`_Fp8AllGather`; ``amax_axes``: the other mesh
    axes the weight stays split on at the linear, whose amaxes join the scale's)."""
    if bucket is not None:
        return bucket.member(x, index, grad_partial)
    if dtype == E4M3:
        if not regather or torch.compiler.is_compiling():
            raise ValueError("all_gather(dtype=float8_e4m3fn) is ZeRO-3's eager fp8 gather of a "
                             "weight (regather=True, not compiled: passes/fp8_gathers.py)")
        return _Fp8AllGather.apply(x, axis, dim, grad_partial, groups, tuple(amax_axes))
    if regather and torch.compiler.is_compiling():
        # compiled (runtime.compiled): the gathered weight is recomputed, not saved, in the
        # compiled backward (storage-keyed saved-tensor hooks do not exist in a traced graph)
        return checkpoint(_AllGather.apply, x, axis, dim, grad_partial, False, groups, dtype,
                          use_reentrant=False, context_fn=_recompute_everything)
    return _AllGather.apply(x, axis, dim, grad_partial, regather, groups, dtype)


def all_reduce(x, axis: int, grad_partial: bool = False):
    """P -> R on ``axis``."""
    return _AllReduce.apply(x, axis, grad_partial)


def grad_all_reduce(x, axis: int):
    """R -> R on ``axis`` where the consumer's gradient is partial (Megatron's f)."""
    return _GradAllReduce.apply(x, axis)


def scatter(x, axis: int, dim: int, groups: int = 1):
    """R -> S(dim) (or strided S(dim/groups)) on ``axis``: keep this rank's block."""
    return _Scatter.apply(x, axis, dim, groups)


def reduce_scatter(x, axis: int, dim: int):
    """P -> S(dim) on ``axis``."""
    return _ReduceScatter.apply(x, axis, dim)


def all_to_all(x, axis: int, split_dim: int, cat_dim: int):
    """S(cat_dim) -> S(split_dim) on ``axis``."""
    return _AllToAll.apply(x, axis, split_dim, cat_dim)


def all_to_all_v(x, axis: int, send: tuple[int, ...], recv: tuple[int, ...]):
    """Rows to ranks of ``axis`` in blocks of ``send`` rows, ``recv`` rows back from each
    (sizes known at run time: a mixture of experts' dispatch); backward sends the
    gradients back the same way."""
    return _AllToAllV.apply(x, axis, tuple(send), tuple(recv))


def to_partial(x, axis: int):
    """R -> P on ``axis``: rank 0 keeps the value, the others hold zeros."""
    return _ToPartial.apply(x, axis)


def shard_to_partial(x, axis: int, dim: int):
    """S(dim) -> P on ``axis``: each rank's term is its block with zeros around it."""
    return _ShardToPartial.apply(x, axis, dim)


def _recompute_everything():
    """A selective-checkpoint context whose policy recomputes every op (a ZeRO-3 gather)."""
    return create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)


def apply_step(x, step):
    """Run one ``redistribute.Step`` (used by tests and the simulator)."""
    k = step.kind
    if k == "all_gather":
        return all_gather(x, step.axis, step.dim, step.grad_partial, groups=step.groups)
    if k == "all_reduce":
        return all_reduce(x, step.axis, step.grad_partial)
    if k == "grad_all_reduce":
        return grad_all_reduce(x, step.axis)
    if k == "scatter":
        return scatter(x, step.axis, step.dim, step.groups)
    if k == "reduce_scatter":
        return reduce_scatter(x, step.axis, step.dim)
    if k == "all_to_all":
        return all_to_all(x, step.axis, step.dim, step.dim2)
    if k == "to_partial":
        return to_partial(x, step.axis)
    if k == "shard_to_partial":
        return shard_to_partial(x, step.axis, step.dim)
    raise ValueError(f"unknown redistribution step {k!r}")
