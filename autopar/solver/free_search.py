"""The free search: the plan of a full-batch graph when no pipeline and no gradient
accumulation is pinned (``driver`` calls it for ``autopar.plan`` / ``parallelize``).

Named stages, each a method of :class:`_FreeSearch` that reads the :class:`SearchSpec` and
offers its candidate to ``offer``, the one place plans are compared (the least predicted
step wins):

* ``unpipelined``: every mesh the options allow, recomputing when memory binds
  (``flat.plan_captured``);
* ``branches``: independent branches over groups of ranks (``branches``);
* ``context``: context parallelism, for self-attention over long sequences
  (``context_search``);
* ``experts``: expert parallelism, for graphs with mixture-of-experts layers
  (``expert_search``; the pipeline search weighs expert axes in its stage meshes too);
* ``pipelines``: on a cluster of several nodes, or when nothing unpipelined fits
  (:func:`may_pipeline`), every pipeline degree (``pipeline_free.search_pipelines``; its
  meshes and the unpipelined plan's programs solved ahead on the other cores,
  ``speculate``);
* ``probes``: the unpipelined plan with the fewest recomputed layers that fit, where it
  could still win;
* ``accumulation``: micro-batches of the full batch, where its activations do not fit or
  fit only recomputed (``accumulate``);
* ``offload``: ZeRO-Offload, when nothing else fits device memory (:func:`may_offload`);
  never its disk tier (``offload="disk"``, only on request: it frees no more device memory,
  and the search budgets device memory alone).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import replace
from typing import Callable

import torch

from autopar.analysis.batch_statistics import batch_statistics_nodes
from autopar.capture import Captured
from autopar.errors import PinError
from autopar.options import Options
from autopar.plan import Plan
from autopar.solver import progress
from autopar.solver.accumulate import accumulation_may_win, may_accumulate, search_accumulation
from autopar.solver.branches import plan_branched, search_branches
from autopar.solver.context_search import search_context
from autopar.solver.expert_search import search_experts
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import (MeshAsk, drop_deferred, mesh_jobs, recompute_bound_s, solve_ask,
                                 solve_mesh_job)
from autopar.solver.pipeline_free import degree_search, search_pipelines
from autopar.solver.spec import Planned, SearchSpec, Settings
from autopar.solver.speculate import Speculation, best_found_s, workers_for

PROGRESS_AFTER_S = 10.0
"""Planning seconds (capture included) after which each stage that ends prints one line
on stderr: its name, its seconds and the best step so far (``_FreeSearch._progress``)."""

PROBES = "the unpipelined plan's fewest recomputed layers"
"""The job of solving ``flat._fewest_layers``' probes ahead (``speculate``), after the
unpipelined plan's programs (``flat.mesh_jobs``, a job each) and the pipeline search's
meshes."""

PROBES_MARGIN = 1.25
"""A worker probes the unpipelined plan's fewest recomputed layers when that plan could beat
this multiple of the best step the pipeline search has predicted so far (``best_found_s``).
The search itself weighs the probes against the best plan it made (its real step), which
can lie above the prediction: GPT-175B on 1,024 A100s predicted 16.27 s, planned 17.61 s
(+8%), and the unpipelined plan, 16.70 s less its recomputation bound, fell between them.
A margin too wide costs a worker's CPU seconds on probes the search then skips (the
Llama 3 405B's are far outside it: 20.3 s against 8.6 s); it never changes the plan."""


def search_captured(spec: SearchSpec, cap: Captured, capture_s: float = 0.0) -> Planned:
    """The best plan without a ``pipeline=`` pin > 1, from the full-batch graph ``cap``: the
    stages of :class:`_FreeSearch` (unpipelined, branches, pipelines where
    ``may_pipeline`` says so, the unpipelined plan's fewest recomputed layers, gradient
    accumulation where ``may_accumulate`` says so, ZeRO-Offload when nothing else fits);
    the least predicted step wins. A ``branch=`` pin > 1 plans branch parallelism alone."""
    o = spec.options
    if (o.branch or 1) > 1:      # branch parallelism pinned (autopar.solver.branches)
        return Planned(plan_branched(cap, spec.cluster, spec.world, o.branch, o,
                                     **_branch_kw(spec, capture_s), verbose=spec.verbose), cap)
    run = _FreeSearch(spec, cap, capture_s)
    # when pipelines are searched too, the unpipelined plan's fewest recomputed layers are
    # probed only once it could win (its step less what its recomputation may cost,
    # ``flat.recompute_bound_s``, an estimate, below the best plan found)
    if not may_pipeline(spec, cap, False):
        return run.search()
    # the pipeline search's programs, then the unpipelined plan's, then its probes (which
    # the search may not need), solved ahead on the other cores (speculate.py)
    search = degree_search(spec, cap)
    workers = workers_for(len(cap.gm.graph.nodes), spec.profiler)
    # (a worker's asks: the spec's settings, quiet and without the profiler, which
    # ``may_pipeline`` rules out here)
    quiet = Settings(spec.memory_budget, spec.mesh_shape, spec.optimizer, spec.time_limit_s)
    # the unpipelined plan's programs, a job each: without recomputation first (the workers
    # take from the end), then every layer recomputed, which the search solves only if
    # memory binds
    flat_jobs = mesh_jobs(cap, spec.cluster, spec.world, pins=o, memory_budget=quiet.memory_budget,
                          mesh_shape=quiet.mesh_shape, optimizer=quiet.optimizer,
                          time_limit_s=quiet.time_limit_s)
    first = [k for k, job in flat_jobs.items() if job[2] is None]
    recomputed = [k for k, job in flat_jobs.items() if job[2] is not None]

    def solve_ahead(job) -> None:
        if job in flat_jobs:
            solve_mesh_job(cap, spec.cluster, flat_jobs[job])
        elif job == PROBES:
            # as the search will, only where the unpipelined plan could beat the best pipeline
            # (predicted so far, with a margin for the planned step: PROBES_MARGIN); its
            # programs are read where written, the probes resume its search
            ask = MeshAsk(spec.cluster, spec.world, o, quiet, explain="later")
            flat = solve_ask(cap, replace(ask, fewest_layers=False))[0]
            if flat.recompute and o.recompute is None and \
                    flat.estimate.step_time_s - recompute_bound_s(flat, cap) < \
                    PROBES_MARGIN * best_found_s():
                solve_ask(cap, ask)
        else:
            search.solve_ahead(job)
    ahead = Speculation([PROBES, *recomputed, *first, *search.meshes], solve_ahead, workers) \
        if workers and len(search.meshes) > 1 else None
    with ahead or contextlib.nullcontext():
        return run.search(deferred=True, pipelines=search, ahead=ahead)


class _FreeSearch:
    """The free search of one spec's full-batch graph, as named stages. Each stage offers
    its candidate to :meth:`offer`, the one place plans are compared (least predicted
    step); :meth:`search` runs them in order, each stage's seconds in ``phases``."""

    def __init__(self, spec: SearchSpec, cap: Captured, capture_s: float):
        self.spec, self.cap, self.capture_s = spec, cap, capture_s
        self.t_start = time.perf_counter()
        self.phases: dict[str, float] = {"capture": capture_s}
        self.best: Planned | None = None
        self.flat: Plan | None = None               # the unpipelined plan
        self.error: InfeasibleError | None = None   # why nothing unpipelined fits
        self.searched = False                       # pipelines searched
        self.best_plain: float | None = None        # the best step without a context axis
        self.skipped: list[str] = []                # what stages did not try (plan.solver.skipped)

    # ---- the one comparison ------------------------------------------------------------
    def offer(self, got: "Planned | None") -> None:
        if got is not None and (got.plan.options.context or 1) == 1 and (
                self.best_plain is None or got.plan.estimate.step_time_s < self.best_plain):
            self.best_plain = got.plan.estimate.step_time_s
        if got is not None and (self.best is None or
                                got.plan.estimate.step_time_s < self.best.plan.estimate.step_time_s):
            self.best = got

    def _timed(self, name: str, stage: Callable):
        self._started(name)
        t0 = time.perf_counter()
        try:
            return stage()
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
            self._progress(name, time.perf_counter() - t0)

    def _best_s(self) -> float | None:
        return self.best.plan.estimate.step_time_s if self.best is not None else None

    def _started(self, name: str) -> None:
        """Tell the open reporter (``solver.progress``), if any, that stage ``name`` begins."""
        report = progress.reporter()
        if report is not None:
            report(name, None, self._best_s())

    def _progress(self, name: str, seconds: float) -> None:
        """Stage ``name`` ended: to the open reporter (``solver.progress``: the CLI's
        progress line); with none, one line on stderr per stage that ends once planning has
        run :data:`PROGRESS_AFTER_S` (a long search says where it is; a quick one stays
        quiet)."""
        report = progress.reporter()
        if report is not None:
            report(name, seconds, self._best_s())
            return
        if self.capture_s + time.perf_counter() - self.t_start >= PROGRESS_AFTER_S:
            best = (f", best so far {self.best.plan.estimate.step_time_s:.4g} s"
                    if self.best is not None else "")
            print(f"autopar: {name} {seconds:.1f}s{best}", file=sys.stderr, flush=True)

    def _ask(self) -> MeshAsk:
        # where nothing fits unpipelined, how far from fitting each mesh is (least-memory
        # ILPs, 130 of 180 s on DeepSeek-V3's first 4 layers) is worked out only if no other
        # stage finds a plan either (``result``)
        return MeshAsk(self.spec.cluster, self.spec.world, self.spec.options, self.spec.settings,
                       explain="later")

    def _plan_with(self, cap: Captured, pins: Options, cutoff_s: float = math.inf,
                   pruned: list | None = None) -> Plan:
        """The unpipelined plan of ``cap`` under ``pins`` (the context and expert stages');
        ``cutoff_s``: a step the search has a plan for (``MeshAsk.cutoff_s``: programs whose
        compute floor or LP relaxation is at least it are not solved, added to ``pruned``;
        ``flat.BeyondCutoff`` where none is left)."""
        ask = replace(self._ask(), pins=pins, cutoff_s=cutoff_s,
                      pruned=pruned if pruned is not None else [])
        return solve_ask(cap, ask, self.capture_s)[0]

    # ---- the stages ----------------------------------------------------------------------
    def search(self, deferred: bool = False, pipelines=None, ahead=None) -> Planned:
        """``deferred``: the unpipelined plan's probes wait for the pipelines'; ``pipelines``:
        the pipeline search made ahead, ``ahead``: its workers."""
        spec, cap = self.spec, self.cap
        if pipelines is not None:
            # pipelines first, then the plans compared in the order below, with workers or
            # without (the same order, so the same plan): the workers take the unpipelined
            # plan's programs after the pipelines' meshes (the unpipelined search reads what
            # they solved, or waits for what they are solving), and the expert stage's
            # programs are bounded by the best step found (Mixtral 8x7B: the pipelines'
            # 2.57 s leaves its 6 expert programs unsolved, ``expert_search``)
            self.pipelines("the unpipelined plan after them", pipelines)
        self.unpipelined(deferred)
        self._timed("branches", self.branches)
        self._timed("context", self.context)
        self._timed("experts", self.experts)
        if not self.searched and may_pipeline(spec, cap, self.flat is None):
            self.pipelines("nothing fits unpipelined" if self.best is None else
                           f"against {self.best.plan.estimate.step_time_s:.4g} s unpipelined",
                           pipelines)
        if deferred:
            self.probes(ahead)
        drop_deferred(cap)
        if ahead is not None:
            ahead.close()                        # the workers' part is over
            if spec.verbose:
                print(f"solved ahead: {len(ahead.read)} of {len(ahead.items)} jobs by "
                      f"{len(ahead.procs)} worker(s), {ahead.waited_s:.1f}s waited")
        self.accumulation()
        if self.best is None and may_offload(spec.options, spec.mesh_shape):
            self.offer(self._timed("offload", lambda: _offloaded(spec, cap, self.capture_s)))
        return self.result()

    def unpipelined(self, deferred: bool) -> None:
        """Every mesh the options allow, recomputing when memory binds (``flat``)."""
        self._started("unpipelined")
        t0 = time.perf_counter()
        try:
            self.flat = solve_ask(self.cap, replace(self._ask(), fewest_layers=not deferred),
                                  self.capture_s)[0]
        except InfeasibleError as e:
            self.error = e
        self.phases.update(self.flat.solver.phases if self.flat is not None else {})
        self.phases["unpipelined"] = time.perf_counter() - t0
        self.offer(Planned(self.flat, self.cap) if self.flat is not None else None)
        self._progress("unpipelined" + ("" if self.flat is not None else " (nothing fits)"),
                       self.phases["unpipelined"])

    def context(self) -> None:
        """Context parallelism over long sequences (``context_search``), each degree and
        program pruned by its compute floor or LP relaxation against the best step found."""
        best = self.best.plan.estimate.step_time_s if self.best is not None else None
        if self.spec.profiler is not None:
            best = None          # the floor is priced without the profiler's times
        notes: list[str] = []
        for plan, cap in search_context(self.spec, self.cap, self._plan_with, best, notes):
            self.offer(Planned(plan, cap))
        self.skipped += notes

    def experts(self) -> None:
        """Expert parallelism for mixture-of-experts layers (``expert_search``), each mesh
        pruned by its memory and compute bounds against the best plan found so far."""
        best = self.best.plan.estimate.step_time_s if self.best is not None else None
        if self.spec.profiler is not None:
            best = None          # the floor is priced without the profiler's times
        notes: list[str] = []
        for plan in search_experts(self.spec, self.cap, self._plan_with, best, notes):
            self.offer(Planned(plan, self.cap))
        self.skipped += notes

    def branches(self) -> None:
        """Independent branches over groups of ranks (``branches.search_branches``)."""
        if self.spec.mesh_shape is not None:
            return
        got = search_branches(self.cap, self.spec.cluster, self.spec.world, self.spec.options,
                              **_branch_kw(self.spec, self.capture_s))
        self.offer(Planned(got, self.cap) if got is not None else None)

    def pipelines(self, against: str, search) -> None:
        """Pipelines of every degree ``pipeline_free.pipeline_degrees`` allows."""
        spec = self.spec
        if spec.verbose:
            print(f"searching pipelines ({against})")
        notes: list[str] = []
        got = self._timed("pipeline search", lambda: search_pipelines(
            spec, self.cap, search, report=lambda name, seconds: self._started(name)
            if seconds is None else self._progress(name, seconds), notes=notes))
        self.skipped += notes
        self.searched = True
        self.offer(Planned(*got) if got is not None else None)

    def probes(self, ahead) -> None:
        """The unpipelined plan with the fewest layers recomputed that fit, where it could
        still win (its step less what recomputing may cost below the best plan)."""
        flat, cap = self.flat, self.cap
        if not (flat is not None and flat.recompute and self.spec.options.recompute is None
                and flat.estimate.step_time_s - recompute_bound_s(flat, cap)
                < self.best.plan.estimate.step_time_s):
            return
        self._started("unpipelined, fewest layers")
        t0 = time.perf_counter()
        if ahead is not None:
            ahead.take(PROBES)               # a worker's outcomes, if it took them
        fewer = solve_ask(cap, self._ask(), self.capture_s)[0]
        self.phases["unpipelined, fewest layers"] = time.perf_counter() - t0
        self.offer(Planned(fewer, cap))
        self._progress("unpipelined, fewest layers", self.phases["unpipelined, fewest layers"])
        if fewer.estimate.step_time_s < flat.estimate.step_time_s:
            self.flat = fewer

    def accumulation(self) -> None:
        """Micro-batches of the full batch, where the full batch's activations do not fit, or
        fit only recomputed and micro-batches could beat the best plan
        (``accumulate.may_accumulate``, ``accumulation_may_win``)."""
        spec, cap, flat = self.spec, self.cap, self.flat
        if not (may_accumulate(cap, spec.example_inputs, spec.options, flat, world=spec.world,
                               budget=spec.budget, optimizer=spec.optimizer)
                and (flat is None or accumulation_may_win(flat, self.best.plan, cap))):
            return
        if spec.verbose:
            print("trying gradient accumulation (" + ("the full batch fits only recomputed"
                                                      if flat is not None else
                                                      "nothing fits the full batch") + ")")
        # each count's compute floor against the best step found: counts that cannot beat it
        # are not planned (``accumulate.search_accumulation``, exact)
        best = self._best_s()
        notes: list[str] = []
        got = self._timed("accumulation", lambda: search_accumulation(
            spec, best if best is not None else math.inf, notes))
        self.skipped += notes
        self.offer(Planned(*got) if got is not None else None)

    def result(self) -> Planned:
        self.phases["total"] = self.capture_s + time.perf_counter() - self.t_start
        if self.spec.verbose:
            print("planning time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items()))
        if self.best is None:
            error = self.error
            if isinstance(error, InfeasibleError) and error.explain_later is not None:
                error = error.explain_later()
            tried = [k for k in ("accumulation", "pipeline search", "offload") if k in self.phases]
            if tried and isinstance(error, InfeasibleError) and error.suggestions:
                error.args = (f"{error}\nalso tried, none fits: {', '.join(tried)}",)
            raise error
        plan = self.best.plan
        if (plan.options.context or 1) > 1 and self.best_plain is not None:
            plan = replace(plan, alternatives_s={"without a context axis": self.best_plain})
        skipped = "; ".join(n for n in [plan.solver.skipped, *self.skipped] if n)
        return Planned(replace(plan, solver=replace(plan.solver, phases=self.phases,
                                                    skipped=skipped)),
                       self.best.captured)


def _branch_kw(spec: SearchSpec, capture_s: float) -> dict:
    return dict(memory_budget=spec.memory_budget, optimizer=spec.optimizer,
                time_limit_s=spec.time_limit_s, capture_s=capture_s, profiler=spec.profiler)


OFFLOAD_STAGES = (2, 3)
"""The ZeRO stages the free search tries with ``offload="optimizer"`` when nothing else fits
device memory (ZeRO-Offload costs time: host-link copies and a host step): stage 2 first
(DeepSpeed's pairing), then 3 (parameters sharded too); a pinned ``zero=`` stage alone."""


def may_offload(pins: Options, mesh_shape) -> bool:
    """Whether the free search tries ZeRO-Offload: not pinned either way, no ``zero=0`` pin,
    and nothing it is not offered with (pipelines, branches, lossy reduction)."""
    if pins.offload is not None or pins.zero == 0 or mesh_shape is not None:
        return False
    return (not pins.pipelined and (pins.branch or 1) == 1
            and pins.compress in (None, "none") and not pins.local_sgd
            and not getattr(pins, "averaging", None))


def _offloaded(spec: SearchSpec, cap: Captured, capture_s: float) -> Planned | None:
    """The first of :data:`OFFLOAD_STAGES` (or the pinned stage) whose plan with
    ``offload="optimizer"`` fits, or None."""
    pins = spec.options
    for stage in ([pins.zero] if pins.zero else OFFLOAD_STAGES):
        if spec.verbose:
            print(f"trying offload='optimizer', zero={stage} (nothing else fits device memory)")
        try:
            plan, _ = solve_ask(cap, MeshAsk(spec.cluster, spec.world,
                                             pins.replace(zero=stage, offload="optimizer"),
                                             spec.settings, explain=False), capture_s)
        except (InfeasibleError, PinError):
            continue
        return Planned(plan, cap)
    return None


def may_pipeline(spec: SearchSpec, cap: Captured, nothing_fits: bool) -> bool:
    """Whether the free search considers pipelines: no pipeline pin (``pipeline=1`` means
    none), more than one node (or nothing unpipelined fits), the loss in the graph, every
    input split along dim 0, room beside the data/tensor pins, and no op that normalizes by
    batch statistics (``analysis.batch_statistics``: micro-batches would change them)."""
    pins, cl, world = spec.options, spec.cluster, spec.world
    if pins.pipeline is not None or spec.mesh_shape is not None or spec.profiler is not None:
        return False
    if not (cl.nodes > 1 or nothing_fits) or world != cl.world_size or world < 2:
        return False
    if not (cap.has_loss and cap.takes_target):
        return False
    if not all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in spec.example_inputs):
        return False
    fixed = (pins.data or 1) * (pins.tensor or 1)
    return fixed < world and not batch_statistics_nodes(cap)
