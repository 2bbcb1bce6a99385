"""The prices of the update-scheme pins ``staleness=``, ``param_server=``, ``learners=``
(issue 31) and ``workers=``: :func:`reprice_updates` turns the estimate of the exact data-parallel plan the
solver found into the pinned scheme's (as ``solver.accumulate.accumulated_plan`` turns one
micro-batch's into a step's). The solver never chooses these schemes (only a pin sets one),
so the layout is the one the exact reduction prices best, and only the data axis's
gradient reduction, the optimizer state and the extra copies change:

- ``staleness=s``: the data axis's gradient all-reduce (``all_reduce@data``, as priced)
  runs behind the next s steps: hidden up to s steps of compute (instead of behind the
  last bucket's backward); memory holds s more copies of the gradients (``stale_grads``).
- ``param_server=k``: the all-reduce becomes a push of the gradients to the k servers and a
  pull of the parameters from them (``cost_models.comm.param_server_time``: the servers'
  links carry every other rank's bytes). The push hides as the all-reduce did (or, with
  ``staleness=``, behind the next s steps); the pull follows the optimizer step and is never
  hidden. A server keeps 1/k of the optimizer state (the busiest device's memory), plus the
  other ranks' pushed shards it sums (``server_buffers``, s + 1 steps of them with ``staleness=``).
- ``learners=m``: m learner batches a step (m x the compute), no gradient reduction, one
  all-reduce of the parameters after the optimizer step (``sma_all_reduce@data``, never
  hidden); m copies of the parameters, gradients and optimizer state, plus the central
  model and its previous value (``central_model``).

- ``workers="accordion:W1:W2"`` (Accordion's batch-size form, ``autopar.runtime.updates.workers``):
  priced at W2 workers, an upper bound: a rank that trains computes its whole per-rank
  batch in either regime and the idle ones wait at the collective, so the step time is the
  exact plan's compute (the worker-steps, not the step, shrink in critical regimes); the
  data axis's all-reduce is the same bytes but no longer hidden behind backward (idle ranks
  have no backward to order buckets by: it runs after it, whole), and memory holds two
  more gradient-sized buffers (the flat sum and the detector's accumulated gradient,
  ``workers_buffers``). The regime check (one number all-reduced every 10 steps) is left out.

A plan whose memory then exceeds the budget is refused (PinError naming the fix).
"""
from __future__ import annotations

from dataclasses import replace

from autopar.cost_models import comm as comm_model
from autopar.cost_models.hardware import axis_link
from autopar.cost_models.step import step_time
from autopar.errors import PinError
from autopar.pricing.costing import OVERLAPPED


def reprice_updates(plan, cluster, budget: float):
    """``plan`` with its estimate priced for its options' update scheme (module docstring);
    ``plan`` itself when none is pinned or it has no data axis of more than one rank."""
    o = plan.options
    s, k, m = o.staleness or 0, o.param_server, o.learners
    if o.workers is not None:
        return _reprice_workers(plan, budget)
    if not (s or k or m):
        return plan
    axes, shape = tuple(plan.mesh_axes), tuple(plan.mesh_shape)
    n = shape[axes.index("data")] if "data" in axes else 1
    e = plan.estimate
    mem = dict(e.memory_bytes)
    comm = dict(e.comm)
    compute = e.compute_s
    grads, params, opt = mem.get("grads", 0.0), mem.get("params", 0.0), mem.get("optimizer", 0.0)
    exact = comm.pop("all_reduce@data", 0.0)
    hidden = -comm.pop(OVERLAPPED, 0.0)
    link = axis_link(cluster, shape, axes.index("data")) if n > 1 else None
    if m:       # no gradient reduction (nor its overlap): one parameter all-reduce a step
        if n > 1:
            comm["sma_all_reduce@data"] = comm_model.collective_time("all_reduce", params, n, link)
        compute *= m
        for term in ("params", "grads", "optimizer"):
            mem[term] = mem.get(term, 0.0) * m
        mem["central_model"] = 2 * params
    else:
        share = hidden / exact if exact > 0 else 0.0     # what backward hid of the reduction
        if k:
            push = comm_model.param_server_time(grads, n, k, link) if n > 1 else 0.0
            pull = comm_model.param_server_time(params, n, k, link) if n > 1 else 0.0
            comm["push@data"], comm["pull@data"] = push, pull
            reduced = push
            mem["optimizer"] = opt / k
            mem["server_buffers"] = (n - 1) * grads / k * (s + 1)
        else:
            comm["all_reduce@data"] = exact
            reduced = exact
        hide = min(reduced, s * compute) if s else reduced * share
        if hide > 0:
            comm[OVERLAPPED] = -hide
        if s:
            mem["stale_grads"] = s * grads
    comm_s = sum(comm.values())
    # m learners: each replica's forward and backward dispatched by the host too
    host_s = e.host_s * m if m else e.host_s
    est = replace(e, step_time_s=step_time(compute + comm_s, host_s), compute_s=compute, comm_s=comm_s,
                  memory_bytes=mem, comm=comm, host_s=host_s)
    if est.memory_total > budget:
        what = (f"learners={m} keeps {m} replicas" if m else
                f"staleness={s} keeps {s} gradient copies" if s and not k else
                f"param_server={k} sums the other ranks' pushes on each server")
        raise PinError(f"{what}: {est.memory_total / 2**30:.2f} GiB a device, over the budget of "
                       f"{budget / 2**30:.2f} GiB; pin fewer (or drop the pin), or a larger "
                       "memory_budget=")
    return replace(plan, estimate=est)


def _reprice_workers(plan, budget: float):
    """``workers=``' price (module docstring): the exact plan's compute, its data-axis
    all-reduce exposed, two more gradient-sized buffers."""
    e = plan.estimate
    mem, comm = dict(e.memory_bytes), dict(e.comm)
    if "all_reduce@data" in comm:
        comm.pop(OVERLAPPED, None)        # after backward, not beside it
    mem["workers_buffers"] = 2 * mem.get("grads", 0.0)
    comm_s = sum(comm.values())
    est = replace(e, step_time_s=step_time(e.compute_s + comm_s, e.host_s), comm_s=comm_s, memory_bytes=mem, comm=comm)
    if est.memory_total > budget:
        raise PinError(f"workers={plan.options.workers!r} keeps two more gradient-sized buffers: "
                       f"{est.memory_total / 2**30:.2f} GiB a device, over the budget of "
                       f"{budget / 2**30:.2f} GiB; drop workers=, or pin a larger memory_budget=")
    return replace(plan, estimate=est)
