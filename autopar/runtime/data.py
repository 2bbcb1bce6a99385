"""Where a rank's inputs come from: the global batch on every rank, or a slice per data rank.

``autopar.parallelize(..., batch="global")`` (the default): every rank passes the whole
global batch and the plan takes its own part. ``batch="per_rank"``: the torchrun way. Each
rank passes its own slice along dim 0 of every tensor input and of the target; ranks with
the same *data rank* pass the same slice, and the slices of data ranks ``0 .. data_world-1``
in that order make the global batch. ``pm.data_rank`` / ``pm.data_world`` are what a
``DistributedSampler(dataset, num_replicas=pm.data_world, rank=pm.data_rank)`` takes.

The data axes of a plan: the mesh axes named ``"data"`` (``data=`` pins, ZeRO) and
``"expert"`` (``expert=``, whose ranks split the batch for every op but the experts); in a plan
without one (a free plan's ``axis0`` / ``axis1``), every axis on which each batched model
input and the target are split along dim 0 (``S(0)``). A plan with no data axis has
``data_world == 1``: every rank passes the whole batch, as with ``"global"``. Several data
axes are flattened row-major (as ``S(0)S(0)`` splits a tensor).

The slices are all-gathered over the data axes into the global batch, which then runs as
under ``"global"`` (the plan slices it again): correct for every plan, at the cost of one
all-gather of the inputs per step.
"""
from __future__ import annotations

import math

import torch

from autopar.capture import Captured
from autopar.errors import ArgumentError
from autopar.placement import Shard
from autopar.plan import Plan

BATCH_MODES = ("global", "per_rank")


def data_axes(plan: Plan, cap: Captured) -> tuple[int, ...]:
    """The axes of ``plan``'s whole mesh the batch is split over (see module doc)."""
    names = tuple(plan.mesh_axes)
    named = tuple(names.index(n) for n in ("data", "expert") if n in names)
    if named:                  # the expert axis splits the batch too (dp2ep)
        return named
    first = 1 if plan.pipeline_stages > 1 else 0      # a pipeline's axis 0 cuts layers
    batched = [n for n in cap.inputs if len(_shape(cap, n)) >= 1]
    if not batched:
        return ()
    out = []
    for a in range(first, len(names)):
        if plan.mesh_shape[a] > 1 and all(_split_on(plan, n, a) for n in batched):
            out.append(a)
    return tuple(out)


def _shape(cap: Captured, name: str) -> tuple[int, ...]:
    val = cap.node(name).meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _split_on(plan: Plan, name: str, axis: int) -> bool:
    node = plan.nodes.get(name)
    if node is None or not node.outputs:
        return False
    pl = node.output(0)
    return (axis < len(pl) and isinstance(pl[axis], Shard) and pl[axis].dim == 0
            and pl[axis].groups == 1)


class RankData:
    """This rank's part in building the global batch (see module doc)."""

    def __init__(self, plan: Plan, cap: Captured, comm, batch: str = "global"):
        if batch not in BATCH_MODES:
            raise ArgumentError(f"batch={batch!r}: use 'global' (every rank passes the global "
                                "batch) or 'per_rank' (each data rank passes its slice)")
        self.mode, self._comm, self._cap = batch, comm, cap
        # a pipeline's graph (or an accumulating plan's) is captured for one micro-batch
        self._micro = plan.n_microbatches
        self.axes = data_axes(plan, cap) if batch == "per_rank" else ()
        sizes = [plan.mesh_shape[a] for a in self.axes]
        self.world = math.prod(sizes)
        rank = 0
        for a, n in zip(self.axes, sizes):
            rank = rank * n + comm.coord[a]
        self.rank = rank

    def expected_shape(self, captured: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a rank passes for an input captured as ``captured`` (the micro-batch's
        under a pipeline or accumulation; this data rank's slice under ``"per_rank"``)."""
        if not captured:
            return captured
        rows = captured[0] * self._micro
        if self.world > 1 and rows % self.world == 0:
            rows //= self.world
        return (rows, *captured[1:])

    def check(self, inputs: tuple, target, call: str) -> None:
        """An ArgumentError before anything runs when an input or the target is no tensor,
        or has another shape or kind of dtype than the plan was made for; it names the input,
        the shape given and the shape expected."""
        names, n = list(self._cap.inputs), self._cap.n_model_inputs
        scales = self._cap.microbatch_loss.scale_inputs if self._cap.microbatch_loss else []
        if len(names) != n + self._cap.takes_target + len(scales):
            return          # the target was a tuple or dict: no placeholder per argument
        takes_target = self._cap.takes_target and target is not None
        given = [(x, names[i], f"input {i}") for i, x in enumerate(inputs)]
        if takes_target:
            given.append((target, names[n], "target"))
        per_rank = (f"this data rank's slice of the global batch ({self.world} data ranks, "
                    "batch='per_rank')" if self.world > 1 else "the global batch")
        for x, name, what in given:
            val = self._cap.node(name).meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            want = self.expected_shape(tuple(val.shape))
            if not isinstance(x, torch.Tensor):
                hint = (f"; pass the inputs as separate arguments: pm.{call}(*inputs)"
                        if isinstance(x, (tuple, list)) else "")
                raise ArgumentError(f"{call}: {what} is a {type(x).__name__}, but the plan was made "
                                    f"for a tensor of shape {list(want)}{hint}")
            if tuple(x.shape) != want:
                raise ArgumentError(
                    f"{call}: {what} has shape {list(x.shape)}, but the plan was made for "
                    f"{list(want)} ({per_rank}, as example_inputs and target= described it); "
                    "pass batches of that shape (a DataLoader with drop_last=True drops a short "
                    "last batch), or plan again for the new shape")
            if x.is_floating_point() != val.is_floating_point() or (
                    x.is_floating_point() and x.dtype != val.dtype):
                raise ArgumentError(f"{call}: {what} has dtype {x.dtype}, but the plan was made for "
                                    f"{val.dtype}: convert it (x.to({val.dtype})) or plan again "
                                    "with example inputs of this dtype")

    def slice(self, t):
        """This data rank's slice of a global-batch tensor (dim 0); other values unchanged."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or self.world == 1:
            return t
        return t.tensor_split(self.world, dim=0)[self.rank]

    def global_batch(self, inputs: tuple, target):
        """(inputs, target) of the global batch from this rank's slices (collective over the
        data axes under ``"per_rank"``; unchanged under ``"global"``)."""
        if self.world == 1:
            return inputs, target
        names = list(self._cap.inputs)
        given = list(inputs) + ([target] if target is not None else [])
        with torch.no_grad():
            out = [self._gather(t, names[i] if i < len(names) else f"input {i}")
                   for i, t in enumerate(given)]
        return tuple(out[:len(inputs)]), (out[len(inputs)] if target is not None else None)

    def _gather(self, t, name: str):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        shape = _shape(self._cap, name) if name in self._cap.inputs else ()
        rows = shape[0] * self._micro if shape else 0
        if rows and rows % self.world == 0 and t.shape[0] != rows // self.world:
            raise ArgumentError(
                f"batch='per_rank': input {name!r} has {t.shape[0]} rows on this rank; the "
                f"plan's global batch of {rows} over data world {self.world} needs "
                f"{rows // self.world} per data rank (build the DataLoader with "
                f"batch_size={rows // self.world} and drop_last=True)")
        x = t.to(torch.uint8) if t.dtype == torch.bool else t     # gloo gathers no bool
        for a in reversed(self.axes):      # innermost first: row-major over the data axes
            x = self._comm.all_gather(x, a, 0)
        return x.to(torch.bool) if t.dtype == torch.bool else x

    def local_rows(self, outs: list) -> list:
        """``pm(x)`` under ``"per_rank"``: this data rank's rows of every output whose dim 0
        is the global batch, as DDP returns a rank's outputs; their gradient is divided by
        ``world``, so that the data-parallel sum of the ranks' gradients is their mean, as
        DDP's (a mean loss over equal slices then trains as on one device). Unchanged
        under ``"global"`` or without a data axis."""
        if self.world == 1:
            return outs
        first = _shape(self._cap, self._cap.inputs[0])
        rows = first[0] * self._micro if first else 0
        return [_LocalRows.apply(t, self.world, self.rank)
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == rows else t
                for t in outs]


class _LocalRows(torch.autograd.Function):
    """Rank ``rank``'s block of ``world`` along dim 0; backward: the gradient there over
    ``world``, zeros elsewhere."""

    @staticmethod
    def forward(ctx, t, world: int, rank: int):
        ctx.shape, ctx.world, ctx.rank = t.shape, world, rank
        return t.tensor_split(world, dim=0)[rank].clone()

    @staticmethod
    def backward(ctx, g):
        full = g.new_zeros(ctx.shape)
        full.tensor_split(ctx.world, dim=0)[ctx.rank].copy_(g / ctx.world)
        return full, None, None

