"""Accordion's batch-size form as a number of data-parallel workers: the pin
``workers="accordion:W1:W2"`` (Agarwal et al. 2021), with ``workers_lr=``.

Accordion trains with a small batch in critical learning regimes and a large one
otherwise. With a fixed batch per rank the global batch is the number of data ranks that
train, so here data ranks ``0 .. W1-1`` train in a critical regime and ``0 .. W2-1`` otherwise
(:class:`ActiveWorkers`, the data axis's reducer in ``GradSync``):

- The regime is Accordion's (``autopar.runtime.regime``, the detector ``compress="accordion:..."``
  uses per bucket) on the whole model's gradient: every 10 steps the norm of the averaged
  gradient summed since the last check (its sum of squares all-reduced over every rank of
  the job, so every rank, of every data group, decides alike) is compared with the last
  check's; a relative change of 0.5 or more, and the start, is critical.
- A rank outside the step's set skips forward and backward (``OneStage.train``): its batch
  is not used, and it saves that compute. It still joins the data axis's collectives: the
  loss's sum (its term zero) and the gradient's (a zero gradient), so it waits there.
- The gradient is averaged over the ranks that trained: the data axis's sum times
  ``data / workers`` (each rank's gradient is its term of the global batch's mean, whose
  denominator counts every rank's rows: exact when every rank's batch counts the same rows,
  e.g. no ``ignore_index`` targets). The loss ``train_step`` returns is scaled alike: the
  mean over the batches that trained.
- ``workers_lr="linear"`` (the default, Accordion's linear scaling rule, Goyal et al. 2017):
  ``pm.step(opt)`` steps with each param group's learning rate times ``workers / W2`` (the
  optimizer's rate is the large batch's) and puts it back; ``"constant"`` leaves it.
- Idle ranks have no backward to order gradient buckets by, so the data axis's sum is not
  overlapped with backward: when the step's first bucket is waited for, every gradient
  reduced over the data axis is summed at once, in parameter-name order, one flat buffer
  per dtype (one gradient-sized copy).
- The first step runs every rank's forward and backward (the idle ranks' results dropped),
  under a communicator that records any collective crossing the data axis inside them
  (BatchNorm's batch statistics, a loss computed outside the graph on gathered outputs): a
  rank that skips could not join those, so that is an ``ArgumentError`` on every rank.
- The schedule's state (regimes, last norm, steps) is saved with ``save_checkpoint`` (the
  checkpoint ``autopar.elastic`` resumes from) and restored by ``load_checkpoint``; the
  gradient accumulated since the last check is not, so after a resume the next check comes
  a full interval later.

The world does not shrink: torchrun cannot hand ranks back from inside a job, so idle ranks
hold their devices and wait at the collectives; what is saved is their compute (and the
energy of it), not the step time, which the ranks that train set.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from autopar.errors import ArgumentError
from autopar.ops.comm import Comm, current_comm, use_comm
from autopar.options import Options
from autopar.runtime.updates.rule import Reducer, data_group
from autopar.runtime.regime import ACCORDION_ETA, ACCORDION_INTERVAL, RegimeDetector

MODEL = "model"
"""The detector's one key: the whole model's gradient."""
COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v",
                         "shift", "shift_start", "all_reduce_coalesced", "reduce_scatter_start",
                         "all_gather_start"})
"""The methods of ``autopar.ops.comm.Comm`` that cross a mesh axis."""


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> "ActiveWorkers | None":
    """The reducer of ``workers=`` on the data axis ``axis`` (None when W2 is 1: one rank
    trains, the plan has nothing to skip); ArgumentError when the plan's data axis is
    smaller than W2."""
    low, high = options.worker_counts
    size = comm.size(axis) if axis is not None else 1
    if size < high:
        raise ArgumentError(f"workers={options.workers!r} trains W2={high} data-parallel workers outside "
                            f"critical regimes, but this plan's data axis has {size} rank(s): pin "
                            f"data={high} (or more), or a smaller W2")
    if high == 1 and size == 1:
        return None
    return ActiveWorkers(data_group(comm, axis), axis, low, high,
                         scale_lr=(options.workers_lr or "linear") == "linear", pin=options.workers)


class ActiveWorkers(Reducer):
    """``workers="accordion:W1:W2"`` on the data axis (module docstring): which data ranks
    train this step, the sum of the gradient over the data axis averaged over them, the
    regime, and the learning rate's factor."""

    def __init__(self, group, axis: int, low: int, high: int, scale_lr: bool = True,
                 interval: int = ACCORDION_INTERVAL, eta: float = ACCORDION_ETA, pin: str | None = None):
        super().__init__(group, axis)
        self.low, self.high, self.scale_lr = low, high, scale_lr
        self.pin = pin if pin is not None else f"accordion:{low}:{high}"   # for errors
        self.rank = dist.get_rank(group)          # this rank's place on the data axis
        self.detector = RegimeDetector(interval, eta)
        self.last = low                           # the workers that trained the last step
        self.history: list[float] = []            # per step: 1.0 critical, 0.0 not
        self.counts: list[int] = []               # per step: the workers that trained
        self.watched = False                      # the first step ran every rank, watched
        self._buckets: list[tuple[tuple[str, ...], list[torch.Tensor]]] = []
        self._summed = False

    # ---- which ranks train ---------------------------------------------------------------
    @property
    def critical(self) -> bool:
        return self.detector.is_critical(MODEL)

    @property
    def workers(self) -> int:
        """The data ranks that train the coming step: W1 in a critical regime, else W2."""
        return self.low if self.critical else self.high

    @property
    def trains(self) -> bool:
        """Whether this rank trains the coming step (its data coordinate < :attr:`workers`)."""
        return self.rank < self.workers

    @property
    def loss_scale(self) -> float:
        """The last step's factor from the data axis's sum to the mean over the ranks that
        trained."""
        return self.size / self.last

    @property
    def lr_scale(self) -> float | None:
        """The learning rate's factor for the last step (``workers_lr="linear"``), or None."""
        return self.last / self.high if self.scale_lr else None

    # ---- a step -----------------------------------------------------------------------------
    def train(self, stage, inputs: tuple, target, sync) -> torch.Tensor:
        """Only the step's data ranks train (``stage.run``); the others add a zero term
        (``stage.run_idle``). The first step runs every rank (the idle ones' results
        dropped), watching for collectives on the data axis inside forward and backward,
        which a rank that skips could not join."""
        if "train" not in stage.programs:
            raise ArgumentError(f"workers={self.pin!r} needs the loss in the graph: pass loss_fn and "
                                "target= (ranks that skip a step add a zero term to the loss's sum)")
        if not self.watched:
            with use_comm(self.watch(current_comm())):
                total = stage.run(inputs, target, sync, drop=not self.trains, every_grad=True)
            stage.idle_loss = torch.zeros_like(total)
            self.check_watch(self.pin)
        elif self.trains:
            total = stage.run(inputs, target, sync, every_grad=True)
        else:
            total = stage.run_idle(sync)
        return total * self.loss_scale      # the mean over the batches that trained

    # ---- the data axis's sum -------------------------------------------------------------
    def start(self, names: tuple[str, ...], grads: list[torch.Tensor]):
        self._buckets.append((tuple(names), list(grads)))
        return _Summed(self)

    def sum_all(self) -> None:
        """Sum every gradient handed in this step over the data axis (once), in parameter
        name order, and scale it to the mean over the ranks that trained."""
        if self._summed:
            return
        self._summed = True
        by_name = {n: g for names, grads in self._buckets for n, g in zip(names, grads)}
        groups: dict[tuple, list[torch.Tensor]] = {}
        for name in sorted(by_name):
            g = by_name[name]
            groups.setdefault((g.dtype, g.device), []).append(g)
        scale = self.size / self.workers
        for (dtype, _), grads in groups.items():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._step_bytes += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=self.group)
            flat.mul_(scale)
            off = 0
            for g in grads:
                g.copy_(flat[off: off + g.numel()].view_as(g))
                off += g.numel()
            self.detector.add(str(dtype), flat)

    def end_step(self) -> None:
        self.sum_all()          # nothing waited (no bucket): nothing to do but agree
        self.last = self.workers
        self.counts.append(self.last)
        self.history.append(1.0 if self.critical else 0.0)
        self._buckets, self._summed = [], False
        if self.detector.end_step():
            self._detect()
        super().end_step()

    def _detect(self) -> None:
        """The regime from the whole model's accumulated gradient: its squared norm summed
        over every rank of the job (a tensor-parallel rank holds a shard; replicas count
        alike at every check), so every rank decides alike."""
        _, norms = self.detector.local_norms()
        total = norms.double().square().sum().reshape(1)
        dist.all_reduce(total)
        self._step_bytes += total.numel() * total.element_size()
        self.detector.judge({MODEL: math.sqrt(float(total))})

    # ---- the first step's check ----------------------------------------------------------
    def watch(self, comm: Comm) -> "CollectiveWatch":
        """A communicator over ``comm`` recording the collectives issued on the data axis."""
        self._watch = CollectiveWatch(comm, self.axis)   # kept: use_comm holds it weakly
        return self._watch

    def check_watch(self, workers_pin: str) -> None:
        """After the watched first step: an ArgumentError (on every rank alike) when the
        program crossed the data axis inside forward or backward."""
        self.watched = True
        crossed = sorted(set(self._watch.crossed))
        if crossed:
            raise ArgumentError(
                f"workers={workers_pin!r}: this model's forward or backward crosses the data axis "
                f"({', '.join(crossed)}; e.g. BatchNorm's batch statistics, or a loss run outside "
                "the graph on the gathered output), which ranks that skip the step cannot join: "
                "pass the loss in the graph (loss_fn with target=) and keep each rank's step local "
                "to its batch (e.g. eval-mode or group/layer norms), or drop workers=")

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The schedule's state a checkpoint keeps (``runtime.dcp_state``)."""
        return {"workers": (self.low, self.high), "last": self.last,
                "detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.last = min(int(state["last"]), self.high)


class _Summed:
    """A bucket's sum in flight: waiting for it sums every bucket of the step at once."""

    def __init__(self, reducer: ActiveWorkers):
        self.reducer = reducer

    def wait(self) -> None:
        self.reducer.sum_all()


class CollectiveWatch:
    """A communicator that passes everything on to ``comm`` and records the collectives
    issued on mesh axis ``axis`` (``crossed``: their method names)."""

    def __init__(self, comm: Comm, axis: int):
        self._comm, self._axis = comm, axis
        self.crossed: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in COLLECTIVES:
            return attr

        def watched(t, axis, *args, **kw):
            if axis == self._axis:
                self.crossed.append(name)
            return attr(t, axis, *args, **kw)
        return watched


@contextlib.contextmanager
def scaled_lr(optimizer, factor: float | None):
    """``optimizer``'s param groups' learning rates times ``factor`` inside the block, put
    back after (None or 1: unchanged)."""
    if factor is None or factor == 1 or not hasattr(optimizer, "param_groups"):
        yield
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = g["lr"] * factor
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr
