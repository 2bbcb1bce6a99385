"""Predicted against measured: run a few training steps of a ParallelModule and set what
the plan predicted beside what each rank measured (issue 11, the closed loop).

Measured, per rank, on the steps after ``warmup``:

- **step**: wall time of ``zero_grad`` + ``train_step`` + ``pm.step(optimizer)``, the
  median over the steps; every other row is that median step's own breakdown, so its parts
  add up to it;
- **compute by op family** (``cost_models.families``): every ATen op the step runs,
  forward, backward and optimizer, timed one by one under a ``TorchDispatchMode``
  (:class:`OpTimer`). A backward op counts in its forward op's family
  (``native_layer_norm_backward`` is ``norm``: :func:`family_name`); the ops of
  ``pm.step(optimizer)`` form the row ``optimizer``;
- **communication by collective**: the time each rank waits in ``DistComm`` for its
  collective, by ``op@axis`` (``autopar.ops.comm.collective_timer``): the exposed part. A
  gradient all-reduce overlapped with backward counts only what is left when the step waits
  for it. Pipeline send / recv run inside ``torch.distributed.pipelining`` and are not
  measured;
- **other**: the rest of the step (Python, the autograd engine, hooks): step - compute -
  communication. Predicted: the estimate's host term (``Estimate.host_s``: every ATen call's
  dispatch on a GPU, ``cost_models.host``; ``-`` where it prices none). Under the op timer
  the measured figure also holds the timer's own per-op cost;
- **peak memory**: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the high-water mark
  of live tensor storage bytes seen by torch's ``MemTracker``
  (``torch.distributed._tools.mem_tracker``: parameters, gradients, optimizer state,
  activations and temporaries), the module and its optimizer tracked from the start.

Predicted: the plan's estimate (``Plan.estimate``: step, communication by collective, memory
per device) and, per family, the forward + backward seconds of each node's chosen option in
the price table the solver used (``pricing.prices``, the figures ``autopar explain``
shows), summed by the family of the node's op; the parameters' rows (optimizer step) form
``optimizer``. Pipeline plans predict no per-family rows (their per-stage prices are not
rebuilt). ZeRO-3's copy-out after each gather (the estimate's ``copy_out@<axis>``) is
predicted in the ``copy`` row, where the op timer finds it. Rank 0 gathers every rank's measurements (``all_gather_object``) into one
:class:`TimingReport`: columns predicted, each rank's measured, and the ratio of the slowest
rank to the prediction.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cost_models import families
from autopar.device import HOST, allocator_peak, synchronize
from autopar.errors import ArgumentError
from autopar.ops.comm import collective_timer
from autopar.placement import placements_str
from autopar.plan import Plan
from autopar.report import fmt_bytes, fmt_time
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import COPY_OUT
from autopar.pricing.prices import plan_prices

OPTIMIZER = "optimizer"
OTHER = "other"
TIMED_STEP = "step, ops timed"
_NAMES = ("VIEW", "MATMUL", "CONV", "ATTENTION", "NORM", "RMS_NORM", "SOFTMAX", "CE_LOSS",
          "NLL_LOSS", "MSE_LOSS", "ELEMENTWISE", "BINARY", "ADD", "DROPOUT", "REDUCTION",
          "EMBEDDING", "COPY", "FACTORY")
FAMILY_NAMES = {getattr(families, n): n.lower() for n in _NAMES}
"""Family constant -> the row name (``families.MATMUL`` -> ``"matmul"``)."""


def family_name(op_name: str) -> str:
    """The family row of an ATen op name (``"mm"``, ``"native_layer_norm_backward"``): a
    backward op counts in its forward op's family (the name before ``_backward``, then that
    without ``_dense``: ``embedding_dense_backward`` is ``embedding``); names no family
    lists are ``elementwise``."""
    candidates = [op_name]
    if "_backward" in op_name:
        base = op_name.split("_backward")[0]
        candidates += [base, base.removesuffix("_dense")]
    before = set(families.UNKNOWN_OPS)
    try:
        for name in candidates:
            fam = families.family(name)
            if fam != families.ELEMENTWISE:
                return FAMILY_NAMES[fam]
        return FAMILY_NAMES[families.ELEMENTWISE]
    finally:        # measured names are no graph ops: keep the coverage report's list clean
        families.UNKNOWN_OPS.difference_update(set(candidates) - before)


class OpTimer(TorchDispatchMode):
    """Seconds (and calls) of every ATen op run under it, by family row
    (:func:`family_name`); while ``optimizer`` is set, in the row ``optimizer``. Ops of
    other namespaces (``c10d``) are not compute and not counted."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        # an accelerator runs kernels asynchronously: synchronised around each op, the
        # timer reads the kernel's time, not its launch's (``synchronize``: a no-op on the CPU)
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.optimizer = False
        self._rows: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.device is not None:
            synchronize(self.device)
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if self.device is not None:
            synchronize(self.device)
        if func.namespace == "aten":
            self.record(func, args, time.perf_counter() - t0)
        return out

    def record(self, func, args, seconds: float) -> str:
        """Add one ATen op's ``seconds`` to its row; returns the row (a subclass may keep
        more, e.g. by input shapes)."""
        row = OPTIMIZER if self.optimizer else self._rows.get(func)
        if row is None:
            row = self._rows[func] = family_name(families.op_name(func))
        self.seconds[row] += seconds
        self.calls[row] += 1
        return row


@dataclass
class RankTiming:
    """One rank's measurements (the module docstring says how each is taken)."""
    rank: int
    step_s: float                                  # median plain step
    steps_s: list[float]                           # every plain step
    timed_step_s: float                            # median step under the op timer
    compute_s: dict[str, float]                    # by family row, in that step
    comm_s: dict[str, float]                       # by "op@axis", in that step
    peak_bytes: float
    memory_source: str

    @property
    def other_s(self) -> float:
        """The op-timed step's time outside every op and collective wait."""
        return self.timed_step_s - sum(self.compute_s.values()) - sum(self.comm_s.values())


@dataclass
class Row:
    name: str
    kind: str                        # "step", "compute", "comm", "other", "memory"
    predicted: float | None          # None: the cost model has no such term
    measured: list[float]            # by rank

    @property
    def ratio(self) -> float | None:
        """The slowest (largest) rank's measured over predicted."""
        if self.predicted is None or self.predicted <= 0 or not self.measured:
            return None
        return max(self.measured) / self.predicted


@dataclass
class TimingReport:
    """Predicted against measured, per rank (module docstring). ``print(report)``."""
    rows: list[Row]
    ranks: int
    steps: int
    warmup: int
    memory_source: str
    mesh: str = ""
    ranks_measured: list[RankTiming] = field(default_factory=list)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows: {[r.name for r in self.rows]}")

    def names(self, kind: str) -> list[str]:
        return [r.name for r in self.rows if r.kind == kind]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TimingReport":
        return cls([Row(**r) for r in d["rows"]], d["ranks"], d["steps"], d["warmup"],
                   d["memory_source"], d.get("mesh", ""),
                   [RankTiming(**r) for r in d.get("ranks_measured", [])])

    def __str__(self) -> str:
        head = ["row", "predicted", *(f"rank {r}" for r in range(self.ranks)), "ratio"]
        body = []
        for r in self.rows:
            fmt = fmt_bytes if r.kind == "memory" else fmt_time
            label = {"compute": "compute ", "comm": "comm ", "memory": ""}.get(r.kind, "") + r.name
            body.append([label, "-" if r.predicted is None else fmt(r.predicted),
                         *(fmt(v) for v in r.measured),
                         "-" if r.ratio is None else f"{r.ratio:.2f}x"])
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines = [f"predicted vs measured{(' on ' + self.mesh) if self.mesh else ''}: median of "
                 f"{self.steps} steps after {self.warmup} warm-up; ratio = slowest rank / predicted; "
                 f"communication = time waiting for each collective; peak memory: {self.memory_source}",
                 "  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in body]
        return "\n".join(lines)


# ---- predicted -----------------------------------------------------------------------------
def predicted_compute(cap, plan: Plan, optimizer: str = "adamw") -> dict[str, float] | None:
    """Forward + backward seconds per step by family row of every node's chosen option in
    the plan's price table, rebuilt as the solver built it (``pricing.prices.plan_prices``,
    as ``explain`` does); the parameters' own prices form ``optimizer``. None for
    pipeline plans."""
    if plan.pipeline_stages > 1:
        return None
    pt = plan_prices(cap, plan, optimizer)
    problem = pt.problem
    out: dict[str, float] = defaultdict(float)
    for name, v in problem.vars.items():
        chosen = plan.nodes.get(name)
        if chosen is None:
            continue
        for i, combo in enumerate(v.options):
            n_in = len(v.call.inputs) if v.call else 0
            ins = tuple(placements_str(input_placements(combo, k)) for k in range(n_in))
            outs = tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs)))
            if ins == chosen.inputs and outs == chosen.outputs:
                row = (OPTIMIZER if v.kind == "param" or v.call is None
                       else FAMILY_NAMES[families.family(v.call.op)])
                out[row] += pt.compute_s(name, i) * plan.accumulate
                break
    return {k: s for k, s in out.items() if s > 0}


# ---- measured ------------------------------------------------------------------------------
MEMORY_CUDA = "torch.cuda.max_memory_allocated"
MEMORY_CPU = "live tensor storage high-water (torch MemTracker)"


def _sync(pm) -> None:
    synchronize(pm.device)


def peak_memory(pm, opt, one_step) -> tuple[float, str]:
    """(bytes, how measured) of one step's peak: on CUDA the allocator's peak; on CPU the
    live tensor storage high-water mark of torch's ``MemTracker`` with the module and its
    optimizer tracked (a step of its own: its tracking would slow the timed steps)."""
    peak = allocator_peak(pm.device, one_step)
    if peak is not None:
        return peak, MEMORY_CUDA
    mt = MemTracker()
    mt.track_external(pm, opt)
    with mt:
        one_step()
    return float(sum(dev.get("Total", 0) for dev in mt.get_tracker_snapshot("peak").values())), MEMORY_CPU


def measure(pm, inputs: tuple, target, steps: int = 5, warmup: int = 1, optimizer=None) -> RankTiming:
    """This rank's :class:`RankTiming` (every rank must call it): ``warmup`` steps, one
    step for the peak memory, ``steps`` plain steps for the step time, then ``steps`` under
    the op timer for the breakdown. ``optimizer``: a function of the parameters (default
    AdamW). The module's parameters, buffers and gradients are restored afterwards (their
    copy kept in host memory meanwhile: one on the device was counted in the peak measured
    here, 4 GiB of the 8-billion-parameter rank of the GPU check's scale section)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ArgumentError(f"timing_report: steps={steps!r}: give a positive number of steps to measure")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ArgumentError(f"timing_report: warmup={warmup!r}: give 0 or more warm-up steps")
    saved = {k: t.detach().to(HOST, copy=True) for k, t in pm.module.state_dict().items()}
    grads = {n: p.grad for n, p in pm.module.named_parameters()}
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(list(pm.parameters()))
    timer = OpTimer(pm.device)
    waits: dict[str, float] = defaultdict(float)

    def on_wait(op: str, axis: str, seconds: float) -> None:
        waits[f"{op}@{axis}"] += seconds

    def one_step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pm.train_step(*inputs, target=target)
        timer.optimizer = True
        try:
            pm.step(opt)
        finally:
            timer.optimizer = False
        _sync(pm)
        return time.perf_counter() - t0

    try:
        for _ in range(warmup):
            one_step()
        peak, source = peak_memory(pm, opt, one_step)
        plain = [one_step() for _ in range(steps)]
        timed = []
        with collective_timer(on_wait):
            for _ in range(steps):
                timer.seconds.clear()
                timer.calls.clear()
                waits.clear()
                with timer:
                    wall = one_step()
                timed.append((wall, dict(timer.seconds), dict(waits)))
    finally:
        with torch.no_grad():
            pm.module.load_state_dict(saved)
        for n, p in pm.module.named_parameters():
            p.grad = grads.get(n)
    walls = [w for w, _, _ in timed]
    wall, compute, comm = timed[sorted(range(steps), key=walls.__getitem__)[(steps - 1) // 2]]
    return RankTiming(dist.get_rank() if dist.is_initialized() else 0, statistics.median(plain),
                      plain, wall, compute, comm, peak, source)


def report(plan: Plan, cap, measured: list[RankTiming], steps: int, warmup: int) -> TimingReport:
    """The table of ``plan``'s predictions against every rank's measurements."""
    est = plan.estimate
    fam_pred = predicted_compute(cap, plan) or {}
    # ZeRO-3's copy-out is listed with its gather in the estimate, but runs as a copy on the
    # compute stream (``split_with_sizes_copy``), which the op timer measures as ``copy``
    copy_out = {k for k in est.comm if k.startswith(COPY_OUT + "@")}
    if copy_out and plan.pipeline_stages == 1:
        fam_pred["copy"] = fam_pred.get("copy", 0.0) + sum(est.comm[k] for k in copy_out)
    rows = [Row("step", "step", est.step_time_s, [m.step_s for m in measured]),
            Row(TIMED_STEP, "step", None, [m.timed_step_s for m in measured])]
    fams = sorted(set(fam_pred) | {k for m in measured for k in m.compute_s})
    rows += [Row(f, "compute", fam_pred.get(f) if plan.pipeline_stages == 1 else None,
                 [m.compute_s.get(f, 0.0) for m in measured]) for f in fams]
    colls = sorted({k for k, s in est.comm.items() if s > 0 and k not in copy_out}
                   | {k for m in measured for k in m.comm_s})
    rows += [Row(c, "comm", est.comm.get(c, 0.0), [m.comm_s.get(c, 0.0) for m in measured])
             for c in colls]
    # the estimate's host term (eager dispatch, overlapped with the device: the step is
    # max(device, host)) against the measured time outside every op
    rows.append(Row(OTHER, "other", est.host_s or None, [m.other_s for m in measured]))
    rows.append(Row("peak memory", "memory", est.memory_total, [m.peak_bytes for m in measured]))
    mesh = f"mesh {tuple(plan.mesh_shape)} {tuple(plan.mesh_axes)}, cluster {plan.cluster}"
    return TimingReport(rows, len(measured), steps, warmup,
                        measured[0].memory_source if measured else "", mesh, list(measured))


def timing_report(pm, inputs: tuple, target=None, steps: int = 5, warmup: int = 1,
                  optimizer=None) -> TimingReport | None:
    """:func:`measure` on every rank, gathered: the :class:`TimingReport` on rank 0, None on
    the others (collective: every rank calls it)."""
    mine = measure(pm, inputs, target, steps, warmup, optimizer)
    if not dist.is_initialized():
        return report(pm.plan, pm._cap, [mine], steps, warmup)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    return report(pm.plan, pm._cap, everyone, steps, warmup)


__all__ = ["FAMILY_NAMES", "OpTimer", "RankTiming", "Row", "TimingReport", "family_name",
           "measure", "predicted_compute", "report", "timing_report"]
