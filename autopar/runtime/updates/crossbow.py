"""Crossbow (Koliousis et al. 2019): the pin ``learners=m``, several learners per rank with
synchronous model averaging (SMA).

A plan with ``learners=m`` is data parallel (``tensor=``, ``pipeline=``, ZeRO are refused):
each rank holds m learners, whole model replicas, and the job has K = m x data learners.
``example_inputs`` is one learner batch's global shape (B rows); :meth:`Crossbow.train_step`
takes m such batches stacked along dim 0 (m x B rows, or this rank's slices of them under
``batch="per_rank"``) and learner j trains on the j-th, split over the data ranks as the plan
splits any batch. Gradients never leave the rank: each learner's is the mean over its own
rows. ``cb.parameters()`` are every learner's parameters (build the optimizer on them: each
learner gets its own optimizer state), and ``cb.step(opt)`` is Crossbow's SMA step
(Algorithm 1 of the paper), with the central average model z and its previous value z':

    c_j = alpha (w_j - z)                      for every learner, before its update
    w_j = optimizer_step(w_j, grad_j) - c_j
    z, z' = z + sum_j c_j + mu (z - z'), z     (the sum over all K learners: one all-reduce)

with ``alpha`` = 1 / K (:attr:`Crossbow.alpha`) and ``mu`` = :data:`SMA_MOMENTUM`. The
central model is the one the module answers for: ``cb(...)``, ``cb.full_state_dict()``.
Every learner starts from the model's weights, as z does.

The per-rank program is the plan's: each learner's tensors are swapped into the
ParallelModule's parameters (``p.data``) for its ``train_step``, whose gradient reduction over
the data axis is replaced by :class:`LocalGrads` (nothing sent). Memory: m copies of the
weights, gradients and optimizer state, plus z and z' (``autopar.pricing.costing`` counts
them); time: one all-reduce of the weights per step, after the optimizer step, not hidden.

Written here because no maintained library implements Crossbow's SMA for torch (the
paper's system is its own C++/CUDA runtime); torch's ``model_averaging`` averagers average
the replicas outright, without the central model's momentum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import ArgumentError
from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.updates.rule import Reducer, data_group

SMA_MOMENTUM = 0.9
"""``mu``, the central average model's momentum (a module constant: 0.9, SGD's usual)."""


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> "LocalGrads | None":
    """``learners=``' rule on the data axis ``axis``: :class:`LocalGrads` (None with one data
    rank or none: the learners' gradients are local anyway)."""
    if axis is None or comm.size(axis) == 1:
        return None
    return LocalGrads(data_group(comm, axis), axis)


class LocalGrads(Reducer):
    """Under ``learners=``: a bucket's gradients stay on the rank, scaled from the rank's term
    of the global loss to the mean over its own rows (times the data size), as Local SGD's
    local steps."""

    def reduce(self, index, flat, shapes):
        return flat.mul_(self.size)


class Crossbow(nn.Module):
    """m learners over a ParallelModule ``pm`` (built with a :class:`LocalGrads` reducer)."""

    def __init__(self, pm, learners: int, group=None):
        super().__init__()
        if pm.plan.pipeline_stages > 1 or any(a != "data" for a in pm.plan.mesh_axes if
                                              pm.plan.mesh_shape[pm.plan.mesh_axes.index(a)] > 1):
            raise ArgumentError(f"learners={learners} (Crossbow) needs a data-parallel plan; this "
                                f"plan's mesh is {dict(zip(pm.plan.mesh_axes, pm.plan.mesh_shape))}: "
                                "pin data=<world size>")
        self.pm = pm
        self.m = learners
        self.group = group
        self.ranks = 1 if group is None else dist.get_world_size(group)
        self.alpha = 1.0 / (learners * self.ranks)
        self.momentum = SMA_MOMENTUM
        self._vessels = dict(pm.module.named_parameters())    # the program's parameters
        self.attrs = list(self._vessels)
        start = {a: p.detach().clone() for a, p in self._vessels.items()}
        self.learner = nn.ModuleList()
        for _ in range(learners):
            mod = nn.Module()
            for i, a in enumerate(self.attrs):
                mod.register_parameter(f"p{i}", nn.Parameter(start[a].clone()))
            self.learner.append(mod)
        self.z = [start[a].clone() for a in self.attrs]
        self.z_prev = [t.clone() for t in self.z]
        self.wire_bytes = 0
        self._corrections = None

    def _weights(self, j: int) -> list[nn.Parameter]:
        return [getattr(self.learner[j], f"p{i}") for i in range(len(self.attrs))]

    def parameters(self, recurse: bool = True):
        """Every learner's parameters (learner 0's first)."""
        for j in range(self.m):
            yield from self._weights(j)

    def _swap_in(self, tensors, grads=None) -> None:
        for i, a in enumerate(self.attrs):
            v = self._vessels[a]
            v.data = tensors[i].data if isinstance(tensors[i], nn.Parameter) else tensors[i]
            v.grad = None if grads is None else grads[i]

    # ---- running ------------------------------------------------------------------------
    def train_step(self, *inputs, target=None) -> torch.Tensor:
        """Each learner's forward and backward on its batch (the j-th of m stacked along dim
        0); returns the mean of the learners' losses (each the mean over its global batch)."""
        def split(t):
            if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] % self.m:
                raise ArgumentError(f"learners={self.m}: train_step takes {self.m} batches stacked "
                                    f"along dim 0; got shape {tuple(getattr(t, 'shape', ()))}, "
                                    f"not a multiple of {self.m} rows")
            return t.tensor_split(self.m)
        xs = [split(x) for x in inputs]
        ys = split(target) if target is not None else [None] * self.m
        total = 0.0
        try:
            for j in range(self.m):
                w = self._weights(j)
                self._swap_in(w, [p.grad for p in w])
                loss = self.pm.train_step(*(x[j] for x in xs), target=ys[j])
                for p, i in zip(w, range(len(self.attrs))):
                    p.grad = self._vessels[self.attrs[i]].grad
                total = total + loss.detach()
        finally:
            self._swap_in(self.z)
        return total / self.m

    def forward(self, *inputs):
        """The central average model's outputs."""
        self._swap_in(self.z)
        return self.pm(*inputs)

    @torch.no_grad()
    def step(self, optimizer) -> bool:
        """The SMA step (module docstring): the optimizer steps every learner, each is pulled
        toward z, and z moves by the learners' corrections and its momentum."""
        corr = [[self.alpha * (w - z) for w, z in zip(self._weights(j), self.z)] for j in range(self.m)]
        optimizer.step()
        for j in range(self.m):
            for w, c in zip(self._weights(j), corr[j]):
                w.sub_(c)
        summed = [sum(corr[j][i] for j in range(self.m)) for i in range(len(self.attrs))]
        if self.group is not None and self.ranks > 1:
            flat = torch.cat([s.reshape(-1) for s in summed])
            dist.all_reduce(flat, group=self.group)
            self.wire_bytes = flat.numel() * flat.element_size()
            off = 0
            for s in summed:
                s.copy_(flat[off: off + s.numel()].view_as(s))
                off += s.numel()
        new = [z + s + self.momentum * (z - zp) for z, s, zp in zip(self.z, summed, self.z_prev)]
        self.z_prev, self.z = self.z, new
        self._swap_in(self.z)
        return True

    # ---- state: the central model -------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self._swap_in(self.z)
        return self.pm.full_state_dict()

    def load_full_state_dict(self, state_dict) -> None:
        """Load into the central model and every learner."""
        self._swap_in(self.z)
        self.pm.load_full_state_dict(state_dict)
        with torch.no_grad():
            for i, a in enumerate(self.attrs):
                v = self._vessels[a].detach()
                self.z[i].copy_(v)
                self.z_prev[i].copy_(v)
                for j in range(self.m):
                    self._weights(j)[i].copy_(v)

    @property
    def plan(self):
        return self.pm.plan

    @property
    def data_rank(self) -> int:
        return self.pm.data_rank

    @property
    def data_world(self) -> int:
        return self.pm.data_world
