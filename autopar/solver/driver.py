"""The one search: ``solve`` plans a model for a cluster over meshes x pipeline degree x
micro-batches x schedule x recomputation, and returns the Plan with the graph it runs on.

``autopar.plan``, ``autopar.parallelize`` (on rank 0) and the CLI's ``plan`` and ``demo``
all call it, so the same model, inputs, cluster and pins give the same plan everywhere.

* ``pipeline=p > 1`` pinned: ``pipeline_search.plan_pipelined`` (the graph is captured at
  the chosen micro-batch);
* ``accumulate=k`` (or ``micro_batch_size=`` without a pipeline) pinned:
  ``accumulate.plan_accumulated`` (one stage, the graph captured at the micro-batch);
* otherwise the full-batch graph is planned unpipelined (``flat.plan_captured``, every mesh
  the pins allow, recomputation when memory binds) and, on a cluster of several nodes or
  when nothing unpipelined fits, pipelines are searched too
  (``pipeline_free.search_pipelines``); when the full batch's activations do not fit, or
  fit only recomputed and micro-batches could beat the best plan found, gradient
  accumulation too (``accumulate.search_accumulation``); the least predicted step wins.
  When none of these fits device memory, ZeRO-Offload (``offload="optimizer"``,
  :func:`may_offload`): the optimizer state on the host.
* ``compress="auto"`` (the user allows lossy choices): each of ``AUTO_COMPRESS`` (no
  compression first) is planned as if pinned; the least predicted step wins, and its plan's
  pins say which (``compress=None`` when none pays).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Sequence

import torch

from autopar.capture import Captured, capture
from autopar.capture.export import check_loss_outside
from autopar.cost_models.hardware import parse_cluster
from autopar.errors import PinError
from autopar.plan import Plan
from autopar.solver.accumulate import (
    accumulation_may_win, accumulation_pin, capture_accumulated, may_accumulate, plan_accumulated,
    search_accumulation,
)
from autopar.solver.branches import plan_branched, search_branches
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import (drop_deferred, mesh_jobs, plan_captured, recompute_bound_s,
                                 solve_captured, solve_mesh_job)
from autopar.options import Options, as_options, check_optimizer
from autopar.solver.pipeline_free import degree_search, search_pipelines
from autopar.solver.pipeline_search import capture_pipelined, plan_pipelined
from autopar.solver.speculate import Speculation, best_found_s, workers_for

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

AUTO_COMPRESS = (None, "bf16", "int8", "topk:0.01", "powersgd:4")
"""What ``compress="auto"`` chooses from (``autopar.runtime.compression``)."""


class Planned(NamedTuple):
    """A plan and the graph it runs on: captured at the plan's micro-batch when pipelined
    or accumulating, at the full batch otherwise."""
    plan: Plan
    captured: Captured


def solve(model: torch.nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
          target: Any = None, cluster="local", world_size: int | None = None,
          pins: "Options | dict | None" = None, memory_budget: float | None = None,
          mesh_shape: Sequence[int] | None = None, optimizer: str = "adamw",
          time_limit_s: float = 60.0, verbose: bool = False, profiler=None,
          captured: Captured | None = None, capture_s: float | None = None) -> Planned:
    """The best plan of ``model`` for ``world_size`` devices (default: all) of ``cluster``.

    ``loss_fn`` is captured in the graph when an example ``target`` is given (else the loss
    runs outside it, on the replicated output). ``pins`` fix choices (see
    ``autopar.options.Options``). ``captured``: the full-batch graph when the caller has it
    already (``capture_s`` the seconds it took), so it is not captured again.
    """
    with _collector_paused():
        planned = _solve(model, example_inputs, loss_fn, target=target, cluster=cluster,
                         world_size=world_size, pins=pins, memory_budget=memory_budget,
                         mesh_shape=mesh_shape, optimizer=optimizer, time_limit_s=time_limit_s,
                         verbose=verbose, profiler=profiler, captured=captured,
                         capture_s=capture_s)
    if loss_fn is not None and target is None:      # the loss runs outside the graph
        check_loss_outside(planned.captured, loss_fn)
    return planned


PLANNING_GC_THRESHOLD = 50_000
"""The cyclic garbage collector's first threshold while planning (Python's default 700):
planning allocates millions of small objects (placements, prices, problems), and every
10 x 10 first-generation passes the collector may walk every live object, the captured
graph's included (11 s of 144 CPU-s planning GPT-175B). Off entirely, the cycles planning
drops pile up (peak memory 0.8 -> 2.1 GB on GPT-175B); a larger threshold runs it ~70x less
often and still collects them."""


_COLLECTOR = {"depth": 0, "before": None}
_COLLECTOR_LOCK = threading.Lock()


@contextlib.contextmanager
def _collector_paused():
    """:data:`PLANNING_GC_THRESHOLD` while planning, the caller's thresholds after; a
    collector the caller disabled stays disabled. Plans made at once in several threads
    (thread ranks that each solve) restore the thresholds from before the first of them,
    when the last one ends."""
    with _COLLECTOR_LOCK:
        if _COLLECTOR["depth"] == 0:
            before = _COLLECTOR["before"] = gc.get_threshold()
            gc.set_threshold(max(before[0], PLANNING_GC_THRESHOLD), *before[1:])
        _COLLECTOR["depth"] += 1
    try:
        yield
    finally:
        with _COLLECTOR_LOCK:
            _COLLECTOR["depth"] -= 1
            if _COLLECTOR["depth"] == 0:
                gc.set_threshold(*_COLLECTOR["before"])


def _solve(model, example_inputs, loss_fn=None, *, target=None, cluster="local", world_size=None,
           pins=None, memory_budget=None, mesh_shape=None, optimizer="adamw", time_limit_s=60.0,
           verbose=False, profiler=None, captured=None, capture_s=None) -> Planned:
    pins = Options.from_pins(pins)
    check_optimizer(optimizer)
    if pins.compress == "auto":
        best = None
        for scheme in AUTO_COMPRESS:
            got = solve(model, example_inputs, loss_fn, target=target, cluster=cluster,
                        world_size=world_size, pins=pins.replace(compress=scheme),
                        memory_budget=memory_budget, mesh_shape=mesh_shape, optimizer=optimizer,
                        time_limit_s=time_limit_s, verbose=verbose, profiler=profiler,
                        captured=captured, capture_s=capture_s)
            if verbose:
                print(f"compress={scheme!r}: {got.plan.estimate.step_time_s * 1e3:.3f} ms")
            if best is None or got.plan.estimate.step_time_s < best.plan.estimate.step_time_s:
                best = got
        return best
    cl = parse_cluster(cluster)
    world = world_size or cl.world_size
    in_graph_loss = loss_fn if target is not None else None
    if pins.pipelined:
        return Planned(*plan_pipelined(model, example_inputs, in_graph_loss, target, cl, world, pins,
                                       memory_budget=memory_budget, optimizer=optimizer,
                                       time_limit_s=time_limit_s, verbose=verbose,
                                       profiler=profiler))
    k = accumulation_pin(pins, example_inputs)
    if k is not None and k > 1:
        return Planned(*plan_accumulated(model, example_inputs, in_graph_loss, target, cl, world, k,
                                         pins, memory_budget=memory_budget, mesh_shape=mesh_shape,
                                         optimizer=optimizer, time_limit_s=time_limit_s,
                                         verbose=verbose, profiler=profiler))
    if captured is None:
        t0 = time.perf_counter()
        captured = capture(model, example_inputs, in_graph_loss, target)
        capture_s = time.perf_counter() - t0
    return search_captured(captured, model, example_inputs, in_graph_loss, target, cl, world,
                           pins=pins, memory_budget=memory_budget, mesh_shape=mesh_shape,
                           optimizer=optimizer, time_limit_s=time_limit_s,
                           capture_s=capture_s or 0.0, verbose=verbose, profiler=profiler)


def search_captured(cap: Captured, model, example_inputs, loss_fn, target, cl, world: int, *,
                    pins: Options, memory_budget=None, mesh_shape=None, optimizer="adamw",
                    time_limit_s=60.0, capture_s=0.0, verbose=False, profiler=None) -> Planned:
    """The best plan without a ``pipeline=`` pin > 1: unpipelined on the full-batch graph
    ``cap``; where ``may_pipeline`` says so, pipelined; with gradient accumulation where
    ``may_accumulate`` says so and, if the full batch fits recomputed,
    ``accumulation_may_win``; the least predicted step wins."""
    pins = as_options(pins)
    if (pins.branch or 1) > 1:      # branch parallelism pinned (autopar.solver.branches)
        return Planned(plan_branched(cap, cl, world, pins.branch, pins, memory_budget=memory_budget,
                                     optimizer=optimizer, time_limit_s=time_limit_s,
                                     capture_s=capture_s, verbose=verbose, profiler=profiler), cap)
    # when pipelines are searched too, the unpipelined plan's fewest recomputed layers are
    # probed only once it could win (its step less what its recomputation may cost,
    # ``flat.recompute_bound_s``, an estimate, below the best plan found)
    t_start = time.perf_counter()
    deferred = may_pipeline(cap, example_inputs, cl, world, pins, mesh_shape, profiler, False)
    kw = dict(t_start=t_start, pins=pins, memory_budget=memory_budget, mesh_shape=mesh_shape,
              optimizer=optimizer, time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
              profiler=profiler)
    if not deferred:
        return _search_captured(cap, model, example_inputs, loss_fn, target, cl, world, **kw)
    # the pipeline search's programs, then the unpipelined plan's, then its probes (which
    # the search may not need), solved ahead on the other cores (speculate.py)
    search = degree_search(cap, example_inputs, cl, world, pins, memory_budget=memory_budget,
                           optimizer=optimizer, time_limit_s=time_limit_s, verbose=verbose)
    workers = workers_for(len(cap.gm.graph.nodes), profiler)

    flat_args = dict(pins=pins, memory_budget=memory_budget, mesh_shape=mesh_shape,
                     optimizer=optimizer, time_limit_s=time_limit_s)
    # the unpipelined plan's programs, a job each: without recomputation first (the workers
    # take from the end), then every layer recomputed, which the search solves only if
    # memory binds
    flat_jobs = mesh_jobs(cap, cl, world, **flat_args)
    first = [k for k, job in flat_jobs.items() if job[2] is None]
    recomputed = [k for k, job in flat_jobs.items() if job[2] is not None]

    def solve_ahead(job) -> None:
        if job in flat_jobs:
            solve_mesh_job(cap, cl, flat_jobs[job])
        elif job == PROBES:
            # as the search will, only where the unpipelined plan could beat the best pipeline
            # (predicted so far, with a margin for the planned step: PROBES_MARGIN); its
            # programs are read where written, the probes resume its search
            flat = plan_captured(cap, cl, world, **flat_args, fewest_layers=False)
            if flat.recompute and pins.recompute is None and \
                    flat.estimate.step_time_s - recompute_bound_s(flat, cap) < \
                    PROBES_MARGIN * best_found_s():
                plan_captured(cap, cl, world, **flat_args)
        else:
            search.solve_ahead(job)
    ahead = Speculation([PROBES, *recomputed, *first, *search.meshes], solve_ahead, workers) \
        if workers and len(search.meshes) > 1 else None
    with ahead or contextlib.nullcontext():
        return _search_captured(cap, model, example_inputs, loss_fn, target, cl, world, **kw,
                                deferred=True, search=search, ahead=ahead)


def _search_captured(cap: Captured, model, example_inputs, loss_fn, target, cl, world: int, *,
                     t_start, pins: Options, memory_budget, mesh_shape, optimizer, time_limit_s,
                     capture_s, verbose, profiler, deferred=False, search=None,
                     ahead=None) -> Planned:
    """``search_captured``'s search from ``t_start``; ``deferred``: the unpipelined plan's
    probes wait for the pipelines', ``search``: the pipeline search made ahead, ``ahead``:
    its workers."""
    phases = {"capture": capture_s}
    flat_kw = dict(memory_budget=memory_budget, mesh_shape=mesh_shape, optimizer=optimizer,
                   time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose, pins=pins,
                   profiler=profiler)
    piped, searched = None, False

    def pipelines(against: str):
        if verbose:
            print(f"searching pipelines ({against})")
        t0 = time.perf_counter()
        got = search_pipelines(cap, model, example_inputs, loss_fn, target, cl, world, pins,
                               memory_budget=memory_budget, optimizer=optimizer,
                               time_limit_s=time_limit_s, verbose=verbose, search=search)
        phases["pipeline search"] = time.perf_counter() - t0
        return got, True
    if ahead is not None:
        # the workers take the unpipelined plan's programs after the pipelines' meshes:
        # pipelines first, then the plans compared in the order below (the unpipelined
        # search reads what the workers solved, or waits for what they are solving)
        piped, searched = pipelines("the unpipelined plan after them")
    t0 = time.perf_counter()
    flat, error = None, None
    try:
        flat = plan_captured(cap, cl, world, **flat_kw, fewest_layers=not deferred)
    except InfeasibleError as e:
        error = e
    phases.update(flat.solver.phases if flat is not None else {})
    phases["unpipelined"] = time.perf_counter() - t0
    best = Planned(flat, cap) if flat is not None else None
    t0 = time.perf_counter()
    branched = None if mesh_shape is not None else search_branches(
        cap, cl, world, pins, memory_budget=memory_budget, optimizer=optimizer,
        time_limit_s=time_limit_s, capture_s=capture_s, profiler=profiler)
    if branched is not None and (best is None or
                                 branched.estimate.step_time_s < best.plan.estimate.step_time_s):
        best = Planned(branched, cap)
    phases["branches"] = time.perf_counter() - t0
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    if not searched and may_pipeline(cap, example_inputs, cl, world, pins, mesh_shape, profiler,
                                     flat is None):
        piped, searched = pipelines("nothing fits unpipelined" if best is None else
                                    f"against {best.plan.estimate.step_time_s:.4g} s unpipelined")
    if piped is not None and (best is None or
                              piped[0].estimate.step_time_s < best.plan.estimate.step_time_s):
        best = Planned(*piped)
    if deferred and flat is not None and flat.recompute and pins.recompute is None and \
            flat.estimate.step_time_s - recompute_bound_s(flat, cap) < best.plan.estimate.step_time_s:
        t0 = time.perf_counter()
        if ahead is not None:
            ahead.take(PROBES)               # a worker's outcomes, if it took them
        fewer = plan_captured(cap, cl, world, **flat_kw)
        phases["unpipelined, fewest layers"] = time.perf_counter() - t0
        if fewer.estimate.step_time_s < best.plan.estimate.step_time_s:
            best = Planned(fewer, cap)
        if fewer.estimate.step_time_s < flat.estimate.step_time_s:
            flat = fewer
    drop_deferred(cap)
    if ahead is not None:
        ahead.close()                        # the workers' part is over
        if verbose:
            print(f"solved ahead: {len(ahead.read)} of {len(ahead.items)} jobs by "
                  f"{len(ahead.procs)} worker(s), {ahead.waited_s:.1f}s waited")
    if may_accumulate(cap, example_inputs, pins, flat, world=world, budget=budget, optimizer=optimizer) \
            and (flat is None or accumulation_may_win(flat, best.plan, cap)):
        if verbose:
            print("trying gradient accumulation (" + ("the full batch fits only recomputed"
                                                      if flat is not None else
                                                      "nothing fits the full batch") + ")")
        t0 = time.perf_counter()
        acc = search_accumulation(model, example_inputs, loss_fn, target, cl, world, pins,
                                  memory_budget=memory_budget, mesh_shape=mesh_shape,
                                  optimizer=optimizer, time_limit_s=time_limit_s, verbose=verbose,
                                  profiler=profiler)
        phases["accumulation"] = time.perf_counter() - t0
        if acc is not None and (best is None or
                                acc[0].estimate.step_time_s < best.plan.estimate.step_time_s):
            best = Planned(*acc)
    if best is None and may_offload(pins, mesh_shape):
        t0 = time.perf_counter()
        best = _offloaded(cap, cl, world, pins, verbose, memory_budget=memory_budget,
                          optimizer=optimizer, time_limit_s=time_limit_s, capture_s=capture_s,
                          profiler=profiler)
        phases["offload"] = time.perf_counter() - t0
    phases["total"] = capture_s + time.perf_counter() - t_start
    if verbose:
        print("planning time: " + ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
    if best is None:
        tried = [k for k in ("accumulation", "pipeline search", "offload") if k in phases]
        if tried and isinstance(error, InfeasibleError) and error.suggestions:
            error.args = (f"{error}\nalso tried, none fits: {', '.join(tried)}",)
        raise error
    return Planned(replace(best.plan, solver=replace(best.plan.solver, phases=phases)), best.captured)


def plan_search(cap: Captured, model, example_inputs, loss_fn, target, cl, world: int, *,
                pins: Options, **kw) -> Plan:
    """``search_captured``'s plan (for callers that hold the full-batch graph)."""
    return search_captured(cap, model, example_inputs, loss_fn, target, cl, world, pins=pins, **kw).plan


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
            and pins.compress in (None, "none") and not pins.local_sgd)


def _offloaded(cap: Captured, cl, world: int, pins: Options, verbose: bool, **kw) -> Planned | None:
    """The first of :data:`OFFLOAD_STAGES` (or the pinned stage) whose plan with
    ``offload="optimizer"`` fits, or None."""
    for stage in ([pins.zero] if pins.zero else OFFLOAD_STAGES):
        if verbose:
            print(f"trying offload='optimizer', zero={stage} (nothing else fits device memory)")
        try:
            plan, _ = solve_captured(cap, cl, world, pins=pins.replace(zero=stage, offload="optimizer"),
                                     verbose=verbose, explain=False, **kw)
        except (InfeasibleError, PinError):
            continue
        return Planned(plan, cap)
    return None


def may_pipeline(cap: Captured, example_inputs, cl, world, pins, mesh_shape, profiler,
                 nothing_fits: bool) -> bool:
    """Whether the free search considers pipelines: no pipeline pin (``pipeline=1`` means
    none), more than one node (or nothing unpipelined fits), the loss in the graph, every
    input split along dim 0, and room beside the data/tensor pins."""
    if pins.pipeline is not None or mesh_shape is not None or profiler is not None:
        return False
    if not (cl.nodes > 1 or nothing_fits) or world != cl.world_size or world < 2:
        return False
    if not (cap.has_loss and cap.takes_target):
        return False
    if not all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in example_inputs):
        return False
    fixed = (pins.data or 1) * (pins.tensor or 1)
    return fixed < world


def capture_for_plan(model, example_inputs, loss_fn, target, plan: Plan) -> Captured:
    """The graph ``plan`` runs on (the loss in it when ``target`` is given): captured at the
    plan's micro-batch when it is pipelined or accumulates, at the full batch otherwise."""
    in_graph_loss = loss_fn if target is not None else None
    if plan.pipeline_stages > 1:
        return capture_pipelined(model, example_inputs, in_graph_loss, target, plan.n_microbatches)
    if plan.accumulate > 1:
        return capture_accumulated(model, example_inputs, in_graph_loss, target, plan.accumulate)
    cap = capture(model, example_inputs, in_graph_loss, target)
    if loss_fn is not None and target is None:      # the loss runs outside the graph
        check_loss_outside(cap, loss_fn)
    return cap
