"""BAGUA's model averaging over the data axis (Gan et al. 2021): the pin ``averaging=``.

Under both, the data axis reduces no gradient: each rank steps on its own gradient (its term
of the global loss times the data size: its local batch's mean; the other mesh axes are
still summed exactly), and ``ParallelModule.step`` (call ``pm.step(opt)``, not
``opt.step()``) calls :meth:`ModelAveraging.average` after the optimizer step, which every
``averaging_period`` steps (default 1) averages parameters:

- ``"decentralized"`` (:class:`Decentralized`): decentralized SGD on a ring (D-PSGD, Lian et
  al. 2017, BAGUA's ``DecentralizedAlgorithm``): each rank sends its parameters to its two
  ring neighbours (data ranks ``r - 1`` and ``r + 1``) and takes the mean of its own and
  theirs, ``x_r <- (x_{r-1} + x_r + x_{r+1}) / 3`` (the mixing matrix is doubly stochastic,
  so the ranks' mean is kept); with 2 data ranks the one neighbour, ``(x_0 + x_1) / 2``. A
  rank sends 2 parameter copies a period (1 with 2 ranks) by point-to-point
  (``batch_isend_irecv``) and never waits for the whole group. BAGUA overlaps this exchange
  with the next step's forward and backward; here it runs after the optimizer step.
- ``"async"`` (:class:`AsyncAveraging`): asynchronous model averaging (BAGUA's
  ``AsyncModelAverageAlgorithm``): at an averaging step a snapshot ``s`` of the parameters
  is all-reduced in the background (``async_op``: gloo's worker threads, NCCL's stream)
  while training goes on; at the next averaging step (``averaging_period`` steps later) it
  is folded in as ``x <- x + (mean(s) - s)``: the snapshot's part is replaced by the
  ranks' average, the local progress made since is kept. BAGUA's thread averages on a
  wall-clock interval; this one on a step count, so runs are reproducible.

torch's model averagers (``torch.distributed.algorithms.model_averaging``) average over a
whole group, synchronously (``PeriodicModelAverager``, which ``local_sgd=`` uses); BAGUA
itself is no longer maintained and needs its own backend, so both are written here on
torch.distributed's point-to-point ops and asynchronous all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.updates.rule import Reducer, data_group


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _write(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[off: off + p.numel()].view_as(p))
            off += p.numel()


def _by_dtype(params) -> list[list[torch.Tensor]]:
    """The parameters that train, grouped by dtype (one flat buffer each)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())


def ring_neighbours(rank: int, size: int) -> list[int]:
    """The distinct ring neighbours of data rank ``rank`` of ``size`` (1 with 2 ranks)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


class ModelAveraging(Reducer):
    """Gradients stay local on the data axis; :meth:`average` after each optimizer step."""

    def __init__(self, period: int, group, axis: int):
        super().__init__(group, axis)
        self.period = period
        self.steps = 0          # optimizer steps taken

    def reduce(self, index, flat, shapes):
        return flat.mul_(self.size)       # this rank's batch's mean

    def optimizer_step(self, step, params) -> bool:
        """The optimizer's step, then :meth:`average` (whether or not it stepped)."""
        params = list(params)
        stepped = step()
        self.average(params)
        return stepped

    def average(self, params) -> None:
        self.steps += 1
        if self.steps % self.period == 0:
            for group in _by_dtype(params):
                self._average(group)

    def _average(self, params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Finish any communication in flight (without changing the parameters)."""


class Decentralized(ModelAveraging):
    """``averaging="decentralized"``: each rank takes the mean of its and its ring
    neighbours' parameters."""

    def __init__(self, period: int, group, axis: int):
        super().__init__(period, group, axis)
        self.rank = dist.get_rank(group)
        self.neighbours = ring_neighbours(self.rank, self.size)

    def _average(self, params) -> None:
        mine = _flat(params)
        theirs = [torch.empty_like(mine) for _ in self.neighbours]
        ops = []
        for peer, buf in zip(self.neighbours, theirs):
            g = dist.get_global_rank(self.group, peer)
            ops += [dist.P2POp(dist.isend, mine, g, self.group),
                    dist.P2POp(dist.irecv, buf, g, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.wire_bytes += len(self.neighbours) * mine.numel() * mine.element_size()
        for buf in theirs:
            mine.add_(buf)
        _write(params, mine.div_(len(theirs) + 1))


class AsyncAveraging(ModelAveraging):
    """``averaging="async"``: the all-reduce of a snapshot runs behind the next
    ``period`` steps, then replaces the snapshot's part of the parameters."""

    def __init__(self, period: int, group, axis: int):
        super().__init__(period, group, axis)
        self._inflight: dict[torch.dtype, tuple] = {}     # by dtype: (snapshot, sum, work)

    def _average(self, params) -> None:
        key = params[0].dtype
        pending = self._inflight.pop(key, None)
        if pending is not None:         # last period's average: replace the snapshot's part
            snap, total, work = pending
            work.wait()
            _write(params, _flat(params) + (total / self.size - snap))
        snap = _flat(params)
        total = snap.clone()
        self.wire_bytes += snap.numel() * snap.element_size()
        self._inflight[key] = (snap, total, dist.all_reduce(total, group=self.group, async_op=True))

    def wait(self) -> None:
        for _, _, work in self._inflight.values():
            work.wait()

    @property
    def pending(self) -> bool:
        return bool(self._inflight)


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> "ModelAveraging | None":
    """``averaging=``' rule on the data axis ``axis`` (None with one data rank or none)."""
    if axis is None or comm.size(axis) == 1:
        return None
    return make_averaging(options.averaging, options.averaging_period or 1, data_group(comm, axis), axis)


def make_averaging(kind: str, period: int, group, axis: int) -> ModelAveraging:
    return (Decentralized if kind == "decentralized" else AsyncAveraging)(period, group, axis)
