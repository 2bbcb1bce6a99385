"""A pipeline plan (placements carry the pipeline axis first, always ``R``): micro-batches, schedule, the intra-stage sharding plan, and the cuts.

``plan_pipeline`` (called by ``autopar.plan`` / ``autopar.parallelize`` when ``pipeline=p``
is pinned):

1. micro-batch count ``m`` (``micro_batch_size=`` pin, or the least divisor of the batch
   that gives every stage a micro-batch: m >= p * v) and schedule (``schedule=`` pin,
   default 1F1B; interleaved 1F1B gets v = 2 virtual stages per rank unless
   ``virtual_stages=`` says otherwise), checked against what torch's schedule can run;
2. capture with **micro-batch** inputs, so every shape in the graph is per micro-batch;
3. the core solver plans the whole graph on the intra-stage mesh (``data=``/``tensor=``/
   ``zero=`` pins apply there); every stage runs its part of that plan on its sub-mesh;
4. cuts by ``stage_dp`` over the graph's op nodes: per-node forward + backward time under
   the intra plan (the roofline cost model), the bytes live across each candidate cut as a
   tie-break (cuts land where little crosses);
5. ``simulate`` times the schedule over the stage times: ``estimate.bubble_fraction``.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from autopar.capture import Captured, capture
from autopar.placement import local_shape
from autopar.plan import Estimate, Plan, PlanError

DEFAULT_SCHEDULE = "1f1b"


def micro_batches(batch: int, p: int, v: int, micro_batch_size: int | None) -> int:
    if micro_batch_size is not None:
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or batch % micro_batch_size:
            divs = [d for d in range(1, batch + 1) if batch % d == 0]
            raise ValueError(f"micro_batch_size={micro_batch_size!r} does not divide the global batch "
                             f"{batch}: micro-batches must be equal; choose one of {divs}")
        return batch // micro_batch_size
    for m in range(p * v, batch + 1):
        if batch % m == 0:
            return m
    return batch


def split_batch(tensors: Sequence, m: int) -> tuple:
    """Micro-batch 0 of each tensor (dim 0), checking that m divides it."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            raise ValueError("pipeline parallelism splits every input and the target along dim 0 "
                             f"into micro-batches; got {type(t).__name__} {getattr(t, 'shape', '')}")
        if t.shape[0] % m:
            raise ValueError(f"{m} micro-batches do not divide a batch of {t.shape[0]} "
                             f"(input of shape {tuple(t.shape)}): pin micro_batch_size= to a "
                             f"divisor of {t.shape[0]}")
        out.append(t.tensor_split(m, dim=0)[0].clone())
    return tuple(out)


def pipeline_config(example_inputs: Sequence, pins: dict) -> tuple[int, int, int, str]:
    """(p, v, m, schedule) from the pins and the batch; raises on what torch cannot run."""
    from autopar.pipeline.schedule import SCHEDULES, check_schedule
    p = pins["pipeline"]
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"pin pipeline={p!r} must be a positive integer")
    schedule = pins.get("schedule") or DEFAULT_SCHEDULE
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    v = pins.get("virtual_stages") or (2 if schedule == "interleaved-1f1b" else 1)
    batch = example_inputs[0].shape[0]
    m = micro_batches(batch, p, v, pins.get("micro_batch_size"))
    try:
        check_schedule(schedule, p, m, v)
    except ValueError as e:
        raise ValueError(f"schedule {schedule!r} cannot run {p} pipeline stages with {m} "
                         f"micro-batches ({v} virtual stages per rank): {e}") from e
    return p, v, m, schedule


def capture_microbatch(model, example_inputs, loss_fn, target, m: int) -> Captured:
    inputs = split_batch(example_inputs, m)
    tgt = split_batch((target,), m)[0] if target is not None else None
    return capture(model, inputs, loss_fn, tgt)


def plan_pipeline(cap: Captured, cl, world: int, pins: dict, config: tuple[int, int, int, str], *,
                  memory_budget=None, optimizer="adamw", time_limit_s=60.0, capture_s=0.0,
                  verbose=False) -> Plan:
    """The Plan for ``cap`` (captured with micro-batch inputs) on ``world`` devices."""
    from autopar.api import plan_captured
    from autopar.pipeline.schedule import schedule_actions
    from autopar.pipeline.simulate import simulate
    from autopar.pipeline.split import chain, crossing_bytes
    from autopar.pipeline.stage_dp import stage_dp

    p, v, m, schedule = config
    if schedule == "interleaved-1f1b" and (p > 2 or world // p > 1):
        # seen to deadlock at pipeline 4 and at pipeline 2 x data 2; refuse rather than hang
        raise NotImplementedError(
            f"schedule 'interleaved-1f1b' runs with pipeline=2 on 2 devices only for now (asked: "
            f"pipeline={p} on {world} devices); use schedule='1f1b' or 'zero-bubble'")
    if world % p:
        raise ValueError(f"pipeline={p} does not divide the world of {world} devices; every stage "
                         f"needs an equal sub-mesh: use a divisor of {world}")
    S = p * v
    units = chain(cap)
    if S > len(units):
        raise ValueError(f"{S} pipeline stages ({p} ranks x {v} virtual) are more than this graph "
                         f"can be cut into: it has {len(units)} op nodes ({len(units) - 1} cut "
                         "points); use fewer stages")
    intra_pins = {k: pins[k] for k in ("data", "tensor", "zero") if pins.get(k) is not None}
    intra = plan_captured(cap, _sub_cluster(cl, world // p), world // p, memory_budget=memory_budget, optimizer=optimizer,
                          time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
                          pins=intra_pins)
    t0 = time.perf_counter()
    times = np.array([_node_time(cap, intra, cl, name) for name in units])
    bandwidth = _pipeline_bandwidth(cl, world // p)
    cross = np.array(crossing_bytes(cap, lambda n: _local_bytes(cap, intra, n)))
    L = len(units)
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    span = prefix[None, :] - prefix[:, None]                     # span[j, i]: layers j .. i-1
    j, i = np.indices((L + 1, L + 1))
    cost = np.where(j < i, span, np.inf)[None].repeat(S, axis=0)  # cost[k, j, i]
    boundary = np.concatenate([[0.0], cross, [0.0]]) / bandwidth  # boundary[j]: cut before j
    tiebreak = cost + 2 * boundary[None, :, None]
    bottleneck, cuts = stage_dp(cost, tiebreak)
    if not cuts and S > 1:
        raise PlanError(f"no cut of {L} op nodes into {S} stages was found")
    bounds = (0, *cuts, L)
    stage_times = np.array([span[a, b] for a, b in zip(bounds[:-1], bounds[1:])])
    f = 1 / 3
    sim = simulate(schedule_actions(schedule, p, m, v), forward=stage_times * f,
                   backward=stage_times * (1 - f), weight=stage_times * (1 - f) / 2,
                   p2p=[boundary[c] for c in cuts] if cuts else 0.0)
    dp_s = time.perf_counter() - t0
    est = intra.estimate
    estimate = Estimate(step_time_s=sim.makespan + est.comm_s * m / p, compute_s=est.compute_s * m / p,
                        comm_s=est.comm_s * m / p, memory_bytes=dict(est.memory_bytes),
                        comm=dict(est.comm), bubble_fraction=sim.bubble_fraction)
    if verbose:
        print(f"pipeline: {S} stages, cuts {[units[c] for c in cuts]}, bottleneck "
              f"{bottleneck * 1e3:.3f} ms, bubble {sim.bubble_fraction:.3f} ({dp_s:.3f}s)")
    from autopar.plan import NodePlacement
    # the pipeline axis is replicated for every node (a stage holds its nodes whole on it)
    nodes = {k: NodePlacement(tuple("R" + x for x in v_.inputs), tuple("R" + x for x in v_.outputs))
             for k, v_ in intra.nodes.items()}
    return replace(intra, nodes=nodes, world_size=world, mesh_shape=(p, *intra.mesh_shape),
                   mesh_axes=("pipeline", *intra.mesh_axes),
                   pins={k: v_ for k, v_ in pins.items() if v_ is not None}, estimate=estimate,
                   pipeline_stages=p, virtual_stages=v, n_microbatches=m, schedule=schedule,
                   stage_cuts=tuple(units[c] for c in cuts))


def _sub_cluster(cl, d: int):
    """The devices of one stage: the ``d`` consecutive ranks of the intra-stage mesh."""
    dpn = cl.devices_per_node
    nodes, per = (1, d) if d <= dpn else (d // dpn, dpn)
    return replace(cl, name=f"{cl.name}[stage of {d}]", nodes=nodes, devices_per_node=per)


def _pipeline_bandwidth(cl, d: int) -> float:
    """Bytes/s between neighbouring stages (d ranks apart): within a node or across nodes."""
    link = cl.inter if cl.nodes > 1 and d >= cl.devices_per_node else cl.intra
    return float(getattr(link, "bandwidth", 0.0) or 10e9)


def _node_time(cap: Captured, intra: Plan, cl, name: str) -> float:
    """Forward + backward seconds of one op node under the intra plan (roofline)."""
    from autopar.cost_models import compute
    from autopar.sharding.registry import TensorMeta, make_call
    node = cap.node(name)
    call = make_call(node)
    np_ = intra.nodes.get(name)
    mesh = intra.mesh_shape

    def loc(meta, placements):
        shape = local_shape(meta.shape, placements, mesh) if placements is not None else None
        return TensorMeta(shape if shape is not None else meta.shape, meta.dtype)
    ins = [loc(mt, np_.input(k) if np_ and k < len(np_.inputs) else None) for k, mt in enumerate(call.inputs)]
    outs = [loc(mt, np_.output(k) if np_ and k < len(np_.outputs) else None) for k, mt in enumerate(call.outputs)]
    try:
        fwd, bwd = compute.node_time(call.op, ins, outs, call.args, call.kwargs, cl.device, "fp32")
    except (KeyError, ValueError, TypeError, NotImplementedError):
        # no roofline rule: count the bytes it touches at the device's memory rate
        nbytes = sum(t.nbytes for t in ins + outs)
        fwd = bwd = nbytes / max(getattr(cl.device, "memory_bandwidth", 1e11) or 1e11, 1.0)
    return float(fwd + bwd)


def _local_bytes(cap: Captured, intra: Plan, node) -> float:
    import operator
    if node.target is operator.getitem:
        base, k = node.args
        val, name = base.meta["val"][k], base.name
    else:
        val, name, k = node.meta["val"], node.name, 0
    np_ = intra.nodes.get(name)
    shape = tuple(val.shape)
    if np_ is not None and k < len(np_.outputs):
        shape = local_shape(shape, np_.output(k), intra.mesh_shape) or shape
    n = 1
    for d in shape:
        n *= int(d)
    return float(n * val.element_size())
