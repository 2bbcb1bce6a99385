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
from typing import Any, Callable, Sequence

import torch

from autopar.capture import Captured, capture
from autopar.capture.cache import caching
from autopar.capture.export import check_loss_outside
from autopar.cost_models.hardware import devices_of, parse_cluster
from autopar.capture.sequence_layout import sequence_layout
from autopar.errors import PinError
from autopar.pricing.updates import reprice_updates
from autopar.options import Options, check_optimizer, refuse_hogwild_plan
from autopar.plan import Plan
from autopar.solver.accumulate import accumulation_pin, capture_accumulated, plan_accumulated
from autopar.solver.free_search import search_captured
from autopar.solver.pipeline_search import capture_pipelined, plan_pipelined
from autopar.solver.spec import Planned, SearchSpec, Settings

__all__ = ["AUTO_COMPRESS", "Planned", "SearchSpec", "Settings", "capture_for_plan", "plan_search", "solve",
           "search_captured"]

AUTO_COMPRESS = (None, "bf16", "int8", "topk:0.01", "powersgd:4")
"""What ``compress="auto"`` chooses from (``autopar.runtime.updates.compression``)."""


REUSE = {"captured": None, "capture_s": None, "cache": True}
"""``solve``'s keywords beside :class:`Settings`' fields, with their defaults: the full-batch
graph when the caller has it already (``captured``, ``capture_s`` the seconds it took), and
whether to use the capture cache (``cache``)."""


def solve(model: torch.nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
          target: Any = None, cluster="local", world_size: int | None = None,
          pins: "Options | dict | None" = None, **settings) -> Planned:
    """The best plan of ``model`` for ``world_size`` devices (default: all) of ``cluster``.

    ``loss_fn`` is captured in the graph when an example ``target`` is given (else the loss
    runs outside it, on the replicated output). ``pins`` fix choices (see
    ``autopar.options.Options``). ``settings``: :class:`Settings`' fields
    (``memory_budget``, ``mesh_shape``, ``optimizer``, ``time_limit_s``, ``verbose``,
    ``profiler``) and :data:`REUSE`'s: ``captured``, the full-batch graph when the caller
    has it already (``capture_s`` the seconds it took), so it is not captured again;
    ``cache``: read and write the captured graphs in the per-user capture cache
    (``autopar.capture.cache``; ``AUTOPAR_CACHE=0`` turns it off too); ``plan.solver.
    capture_cache`` says whether it gave them. An unknown keyword is a TypeError.
    """
    captured, capture_s, cache = (settings.pop(k, d) for k, d in REUSE.items())
    spec = _spec(model, example_inputs, loss_fn, target, cluster, world_size, pins,
                 Settings.of("solve", settings))
    with _collector_paused(), caching(cache) as use:
        planned = _solve(spec, captured, capture_s)
    if loss_fn is not None and target is None:      # the loss runs outside the graph
        check_loss_outside(planned.captured, loss_fn)
    plan = planned.plan
    return Planned(replace(plan, solver=replace(plan.solver, capture_cache=use.describe())),
                   *planned[1:])


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


def _spec(model, example_inputs, loss_fn, target, cluster, world_size, pins,
          settings: Settings) -> SearchSpec:
    """``solve``'s arguments as one :class:`SearchSpec`, checked (the options, the
    optimizer, the cluster); the loss is in the graph only with an example ``target``."""
    options = Options.from_pins(pins)
    if options.hogwild is not None:     # an entry point of its own (autopar.hogwild), no plan
        refuse_hogwild_plan(options)
    check_optimizer(settings.optimizer)
    cl = parse_cluster(cluster)
    if world_size:      # the first world_size devices of the cluster
        cl = devices_of(cl, world_size)
    return SearchSpec(model, example_inputs, loss_fn if target is not None else None, target, cl,
                      cl.world_size, options, settings.memory_budget,
                      settings.mesh_shape, settings.optimizer, settings.time_limit_s,
                      settings.verbose, settings.profiler)


def _solve(spec: SearchSpec, captured: Captured | None, capture_s: float | None) -> Planned:
    options, cl = spec.options, spec.cluster
    if spec.mesh_shape is None:
        _check_filled(options, spec.world)
    if (options.context or 1) > 1 and captured is not None and \
            getattr(captured, "sequence_balanced", None) != options.context:
        captured = None        # captured for another layout: capture again, balanced
    with sequence_layout(options.context):
        planned = _solve_spec(spec, captured, capture_s)
    if options.update.repriced:     # autopar.update_schemes: priced again under the scheme
        planned = Planned(reprice_updates(planned.plan, cl, spec.budget), *planned[1:])
    return planned


def _check_filled(o: Options, world: int) -> None:
    """Pins ``data=`` and ``tensor=`` both given, no pipeline pinned: with ``expert=`` and
    ``context=`` they must fill the world, before the search begins (it raised this at its
    first unpipelined mesh, after capture and, on a cluster of nodes, the pipeline search's
    work)."""
    if o.data is None or o.tensor is None or o.pipelined or (o.branch or 1) > 1:
        return
    used = o.data * o.tensor * (o.expert or 1) * (o.context or 1)
    if used == world:
        return
    named = " ".join(f"{k}={v}" for k, v in (("data", o.data), ("tensor", o.tensor),
                                            ("expert", o.expert), ("context", o.context))
                     if v is not None and (k in ("data", "tensor") or v > 1))
    fix = (f"pin pipeline={world // used} too (stages of {used} devices), or " if world % used == 0
           and world > used else "")
    raise PinError(f"pins {named} use {used} devices of the world size {world}: {fix}pin "
                   f"degrees whose product is {world}, or plan for {used} devices (world_size=)")


def _solve_spec(spec: SearchSpec, captured: Captured | None, capture_s: float | None) -> Planned:
    """The plan of ``spec``: what its options pin (``compress="auto"``, a pipeline, gradient
    accumulation), else the free search of the full-batch graph (``search_captured``)."""
    o = spec.options
    if o.compress == "auto":
        return _auto_compress(spec, captured, capture_s)
    if o.pipelined:
        return Planned(*plan_pipelined(spec))
    k = accumulation_pin(o, spec.example_inputs)
    if k is not None and k > 1:
        return Planned(*plan_accumulated(spec, k))
    if captured is None:
        t0 = time.perf_counter()
        captured = capture(spec.model, spec.example_inputs, spec.loss_fn, spec.target)
        capture_s = time.perf_counter() - t0
    return search_captured(spec, captured, capture_s or 0.0)


def _auto_compress(spec: SearchSpec, captured, capture_s) -> Planned:
    """``compress="auto"``: each of AUTO_COMPRESS planned as if pinned; the least step."""
    best = None
    for scheme in AUTO_COMPRESS:
        got = _solve_spec(spec.with_options(compress=scheme), captured, capture_s)
        if spec.verbose:
            print(f"compress={scheme!r}: {got.plan.estimate.step_time_s * 1e3:.3f} ms")
        if best is None or got.plan.estimate.step_time_s < best.plan.estimate.step_time_s:
            best = got
    return best


def plan_search(spec: SearchSpec, cap: Captured, capture_s: float = 0.0) -> Plan:
    """``search_captured``'s plan (for callers that hold the full-batch graph)."""
    return search_captured(spec, cap, capture_s).plan


def capture_for_plan(model, example_inputs, loss_fn, target, plan: Plan) -> Captured:
    """The graph ``plan`` runs on (the loss in it when ``target`` is given): captured at the
    plan's micro-batch when it is pipelined or accumulates, at the full batch otherwise."""
    with sequence_layout(plan.options.context):
        return _capture_for_plan(model, example_inputs, loss_fn, target, plan)


def _capture_for_plan(model, example_inputs, loss_fn, target, plan: Plan) -> Captured:
    in_graph_loss = loss_fn if target is not None else None
    if plan.pipeline_stages > 1:
        return capture_pipelined(model, example_inputs, in_graph_loss, target, plan.n_microbatches)
    if plan.accumulate > 1:
        return capture_accumulated(model, example_inputs, in_graph_loss, target, plan.accumulate)
    cap = capture(model, example_inputs, in_graph_loss, target)
    if loss_fn is not None and target is None:      # the loss runs outside the graph
        check_loss_outside(cap, loss_fn)
    return cap
