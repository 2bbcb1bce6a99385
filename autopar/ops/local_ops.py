"""Local implementations that sharding localizers call in place of an ATen op.

Each runs the same code on every rank: it reads the rank's coordinate from
:func:`autopar.ops.comm.current_comm` at run time and crosses the shards with the
autograd-aware functions of :mod:`autopar.ops.collectives`. The ``axes`` arguments are
the mesh axes on which a tensor is sharded on the dim in question, in mesh order (the
earlier axis splits first, see :mod:`autopar.placement`).

Gradients follow the convention of :mod:`autopar.placement`: a replicated result's gradient
is whole on every rank, so a sum across shards (``collectives.all_reduce``) passes it
unchanged to each rank's term.
"""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.ops import collectives
from autopar.ops.comm import current_comm

aten = torch.ops.aten


def shard_offset(axes: Sequence[int], local_size: int) -> int:
    """Global index of this rank's first element on a dim sharded over ``axes``."""
    comm = current_comm()
    off = 0
    for k, a in enumerate(axes):
        block = local_size
        for b in axes[k + 1:]:
            block *= comm.size(b)
        off += comm.coord[a] * block
    return off


def _sum_over(t: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """Sum of ``t`` over the ranks of ``axes``; backward passes the (whole) gradient."""
    for a in axes:
        t = collectives.all_reduce(t, a)
    return t


def _sum_no_grad(t: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    comm = current_comm()
    t = t.detach()
    for a in axes:
        t = comm.all_reduce(t, a)
    return t


def _max_no_grad(t: torch.Tensor, axes: Sequence[int], dim: int) -> torch.Tensor:
    """Max over the ranks of ``axes`` of ``t`` (which has size 1 on ``dim``)."""
    comm = current_comm()
    t = t.detach()
    for a in axes:
        t = comm.all_gather(t, a, dim).amax(dim, keepdim=True)
    return t


# --- reductions ------------------------------------------------------------------------

def mean_over_shards(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None,
                     shards: int = 1) -> torch.Tensor:
    """The local term of a mean whose reduced dims are sharded over ``shards`` ranks:
    local sum / global count = local mean / shards (shards divide evenly)."""
    if dim is None:
        out = aten.mean.default(x, dtype=dtype)
    else:
        out = aten.mean.dim(x, dim, keepdim, dtype=dtype)
    return out / shards


def scaled(fn, *args, scale: float = 1.0, **kwargs):
    """``fn(*args, **kwargs) * scale``: a mean-reducing loss over sharded elements."""
    return fn(*args, **kwargs) * scale


# --- embedding -------------------------------------------------------------------------

def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor,
                             padding_idx: int = -1, scale_grad_by_freq: bool = False,
                             sparse: bool = False, *, axes: Sequence[int] = (0,)) -> torch.Tensor:
    """This rank's term of ``embedding(weight, indices)`` with the rows of ``weight``
    sharded over ``axes``: rows outside this rank's vocabulary range give zeros, so the
    sum over the ranks (a Partial output) is the lookup."""
    vocab = weight.shape[0]
    lo = shard_offset(axes, vocab)
    local = indices - lo
    inside = (local >= 0) & (local < vocab)
    local = torch.where(inside, local, torch.zeros_like(local))
    pad = -1
    if padding_idx is not None and padding_idx >= 0 and lo <= padding_idx < lo + vocab:
        pad = padding_idx - lo
    out = aten.embedding.default(weight, local, pad, scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)


# --- losses ----------------------------------------------------------------------------

def _target_logit(x: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, class_dim: int,
                  axes: Sequence[int]) -> torch.Tensor:
    """``x`` at the target class, summed over class shards (zero on ranks not holding it)."""
    c = x.shape[class_dim]
    lo = shard_offset(axes, c) if axes else 0
    local = target - lo
    inside = valid & (local >= 0) & (local < c)
    local = torch.where(inside, local, torch.zeros_like(local))
    picked = x.gather(class_dim, local.unsqueeze(class_dim)).squeeze(class_dim)
    picked = picked * inside.to(picked.dtype)
    return _sum_over(picked, axes)


def _reduce_loss(per: torch.Tensor, denom: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == 0:
        return per
    total = per.sum()
    return total if reduction == 2 else total / denom


def global_target_count(target: torch.Tensor, weight, ignore_index: int) -> torch.Tensor:
    """The denominator of a mean cross-entropy over the WHOLE ``target``: the count of its
    non-ignored entries, or the sum of their class weights (``passes.loss_count``)."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    w = weight[torch.where(valid, target, torch.zeros_like(target))]
    return (w * valid.to(w.dtype)).sum()


def sharded_cross_entropy(x: torch.Tensor, target: torch.Tensor, weight=None,
                          reduction: int = 1, ignore_index: int = -100,
                          label_smoothing: float = 0.0, *, class_axes: Sequence[int] = (),
                          batch_axes: Sequence[int] = (), log_probs: bool = False,
                          count: torch.Tensor | None = None):
    """``cross_entropy`` (or ``nll_loss`` on log-probabilities when ``log_probs``) with class
    indices as targets, the classes sharded over ``class_axes`` (vocabulary-parallel: the
    max and the sum of exponentials cross the shards) and the batch sharded over
    ``batch_axes`` (a mean divides by the GLOBAL count of non-ignored targets, and the
    result is this rank's Partial term). ``count``: that global count when known
    (:func:`global_target_count` of the whole target); else it is all-reduced.

    Class-sharded: ``weight`` must be None and ``label_smoothing`` 0 (the rule checks).
    Under autocast it computes in fp32, as autocast runs the losses it stands in for.
    """
    if x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
        x = x.float()
    class_dim = 1 if x.ndim >= 2 else 0
    valid = target != ignore_index
    if not class_axes:
        fn = aten.nll_loss_nd.default if log_probs else aten.cross_entropy_loss.default
        extra = () if log_probs else (label_smoothing,)
        per_sum = fn(x, target, weight, 2 if reduction != 0 else 0, ignore_index, *extra)
        if reduction != 1:
            return per_sum
        if count is not None:
            return per_sum / count.to(x.dtype)
        return per_sum / _sum_no_grad(global_target_count(target, weight, ignore_index).to(x.dtype),
                                      batch_axes)

    if log_probs:
        per = -_target_logit(x, target, valid, class_dim, class_axes)
    else:
        m = _max_no_grad(x.amax(class_dim, keepdim=True), class_axes, class_dim)
        sumexp = _sum_over((x - m).exp().sum(class_dim), class_axes)
        lse = sumexp.log() + m.squeeze(class_dim)
        per = lse - _target_logit(x, target, valid, class_dim, class_axes)
    per = per * valid.to(per.dtype)
    if count is None:
        count = _sum_no_grad(valid.sum().to(per.dtype), batch_axes)
    return _reduce_loss(per, count.to(per.dtype), reduction)
