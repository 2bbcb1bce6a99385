"""A pipeline plan (placements carry the pipeline axis first, always ``R``): micro-batches, schedule, the intra-stage sharding plan, and the cuts.

``plan_pipelined`` (``autopar.plan`` / ``autopar.parallelize`` with ``pipeline=p`` pinned):

1. a reference configuration: micro-batch count ``m0`` (``micro_batch_size=`` pin, or the
   least divisor of the batch that gives every stage a micro-batch: m >= p * v) and
   schedule (``schedule=`` pin, else 1F1B; interleaved 1F1B gets v = 2 virtual stages per
   rank unless ``virtual_stages=`` says otherwise), checked against what torch's schedule
   can run;
2. capture with **micro-batch** inputs, so every shape in the graph is per micro-batch;
3. the core solver plans the whole graph on the intra-stage mesh (``data=``/``tensor=``/
   ``zero=``/``precision=``/``recompute=`` pins apply there), its memory seen per stage
   (``memory_weights``: a rank holds 1/p of the state and the activations of the
   micro-batches in flight under the schedule) and its gradient reduction once per step;
   every stage runs its part of that plan on its sub-mesh;
4. every op node priced under that plan (``autopar.solver.pipeline_costs``); what is not pinned
   among m, schedule and virtual stages is chosen by ``stage_dp.plan_stages`` on those
   prices scaled per sample (plus a fixed launch cost per micro-batch), the micro-batch
   counts limited to those whose micro-batch the plan's data-parallel degree divides;
   if the chosen m differs from m0 the model is captured again at the chosen micro-batch
   and the intra plan solved again on the same mesh (the runtime needs the shapes of its
   micro-batch); the better of the reference and the chosen plan is kept;
5. cuts by ``plan_stages`` pinned to the configuration (least bottleneck stage whose
   memory fits, then least bytes crossing the cuts) over the chain's op nodes, or over the
   ``MAX_UNITS`` cheapest cut points of a large graph (between transformer layers);
6. ``simulate`` times the schedule: ``estimate.step_time_s`` is the last rank's end plus
   its once-per-step gradient reduction — a whole training step over the global batch,
   comparable with an unpipelined plan's; ``estimate.memory_bytes`` is the worst rank's,
   by the intra plan's terms (its own parameters, activations x micro-batches in flight).

``search_pipelines`` (``autopar.plan`` without a ``pipeline=`` pin, on a cluster of more
than one node or when nothing unpipelined fits): pipeline degrees p in {2, 4, 8, 16}
dividing the node count (each stage whole nodes, so tensor parallelism stays inside a
node's NVLink, as Megatron-LM does) and at most the number of layers; each planned on the
full-batch graph (no capture per p) on meshes ``(d,)`` and ``(d / t, t)`` for t in 2, 4, 8
(t within a node), with prices scaled per sample to choose m and the schedule; the best
is captured at its micro-batch and planned as above.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from autopar.capture import Captured, capture
from autopar.placement import Shard, local_shape, parse_placements
from autopar.plan import Estimate, Plan, PlanError

DEFAULT_SCHEDULE = "1f1b"
MAX_UNITS = 256
"""Cut points the stage DP considers at most (the cheapest crossings of a large graph)."""
PIPELINE_DEGREES = (2, 4, 8, 16)
"""Pipeline degrees the free search tries (``search_pipelines``)."""
INTRA_PINS = ("data", "tensor", "zero", "precision", "recompute")
FORWARD = 1 / 3      # forward's share of a stage's time (backward = 2 x forward)


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
    from autopar.schedule import SCHEDULES, check_schedule
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
    # each micro-batch's loss a partial term of the global batch's (summed, never averaged)
    from autopar.analysis.microbatch_loss import rewrite
    return rewrite(capture(model, inputs, loss_fn, tgt), m, model)


def memory_weights(schedule: str, p: int, m: int, v: int) -> dict[str, float]:
    """Factors that turn the whole graph's memory (one micro-batch) into a pipeline rank's,
    for uniform stages: 1/p of the state; the activations of the micro-batches its stages
    hold at their peak (``stage_dp.in_flight``), each stage 1/(p v) of the graph."""
    from autopar.solver.stage_dp import in_flight
    n = in_flight(schedule, p, m, v)
    held = max(float(n[r::p].sum()) for r in range(p))
    state = 1.0 / p
    return {"params": state, "grads": state, "optimizer": state, "buffers": state,
            "activations": held / (p * v)}


# ---- one intra-stage solution, priced per node ----------------------------------------------


@dataclass
class _Priced:
    cap: Captured
    intra: Plan
    solved: object
    nc: object                   # autopar.solver.pipeline_costs.NodeCosts
    bounds: np.ndarray           # chain index where each DP unit starts, then L
    bandwidth: float             # bytes/s per rank between neighbouring stages
    latency: float
    action: float = 0.0          # the runtime's seconds per scheduled action of a stage

    @property
    def positions(self) -> np.ndarray:
        return self.bounds[1:-1]

    def layer_costs(self):
        """Per-sample costs of the DP units (``stage_dp.LayerCosts``)."""
        from autopar.solver.stage_dp import LayerCosts
        nc, starts = self.nc, self.bounds[:-1]
        b = nc.batch
        fixed = nc.fixed()

        def seg(a):
            return np.add.reduceat(np.asarray(a, float), starts)
        t = np.maximum(seg(nc.time) - seg(fixed), 0.0) / b
        return LayerCosts(time=t, state_bytes=nc.state(starts), activation_bytes=seg(nc.activations) / b,
                          boundary_bytes=nc.cross[self.positions - 1] / b, fixed_time=seg(fixed),
                          action_time=self.action)

    def extra_memory(self) -> float:
        """Bytes every rank may hold besides state and activations: the recompute transient
        and the micro-batch's inputs."""
        inputs = sum(t.get("inputs", 0.0) for _, t, _ in self.nc.placeholders)
        return self.nc.recompute_bytes + inputs

    def rank_sync(self, cuts: Sequence[int], p: int) -> np.ndarray:
        """Gradient reduction seconds per rank for chain cuts ``cuts``."""
        bounds = (0, *cuts, len(self.nc.units))
        sync = np.zeros(p)
        for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:])):
            sync[k % p] += self.nc.sync[j:i].sum()
        return sync


def _price(cap: Captured, intra: Plan, solved, cl, world: int, p: int, n_stages: int) -> _Priced:
    from autopar.solver.pipeline_costs import node_costs
    nc = node_costs(cap, solved, lambda n: _local_bytes(cap, intra, n), axes=intra.mesh_axes)
    positions = _cut_points(nc.cross, n_stages)
    bw, lat = _pipeline_link(cl, world // p, world)
    return _Priced(cap, intra, solved, nc, np.array([0, *positions, len(nc.units)], dtype=int), bw, lat,
                   float(getattr(cl.device, "pipeline_action", 0.0)))


def _cut_points(cross: np.ndarray, n_stages: int) -> list[int]:
    """Chain positions a cut may fall before: all of them in a small graph; in a large one
    the ``MAX_UNITS`` where the fewest bytes cross (the boundaries between layers), at least
    four per stage."""
    L = len(cross) + 1
    if L - 1 <= MAX_UNITS:
        return list(range(1, L))
    # the least crossing level that offers enough cut points (four per stage, and at least
    # 64), every point at or under it (all layer boundaries alike), thinned evenly if many
    want = min(L - 1, max(4 * n_stages, 64))
    level = float(np.sort(cross)[want - 1]) * (1 + 1e-6)
    chosen = [int(i) for i in np.flatnonzero(cross <= level)]
    if len(chosen) > MAX_UNITS:
        keep = np.linspace(0, len(chosen) - 1, MAX_UNITS).round().astype(int)
        chosen = [chosen[k] for k in sorted(set(keep.tolist()))]
    return [i + 1 for i in chosen]


def _pipeline_link(cl, d: int, world: int) -> tuple[float, float]:
    """(bytes/s per rank, seconds of latency and wait) between neighbouring stages, ``d``
    ranks apart.
    Across nodes each rank gets its share of the node's NICs (one per GPU on a DGX)."""
    dpn = cl.devices_per_node
    if cl.nodes > 1 and world > dpn:
        link = cl.inter
        bw = min(float(link.bandwidth) / dpn, float(getattr(cl.intra, "bandwidth", math.inf)))
    else:
        link = cl.intra
        bw = float(link.bandwidth)
    if not math.isfinite(bw) or bw <= 0:
        bw = 1e30
    # a receive between computations waits for its peer as a collective does (Link.skew)
    return bw, float(getattr(link, "latency", 0.0) or 0.0) + float(getattr(link, "skew", 0.0))


def _batch_degree(cap: Captured, intra: Plan) -> int:
    """Devices the intra plan splits the batch over (dim 0 of the user inputs)."""
    degree = 1
    for name in cap.inputs:
        np_ = intra.nodes.get(name)
        if np_ is None or not np_.outputs:
            continue
        k = 1
        for a, pl in enumerate(parse_placements(np_.outputs[0])):
            if isinstance(pl, Shard) and pl.dim == 0:
                k *= intra.mesh_shape[a]
        degree = degree * k // math.gcd(degree, k)
    return degree


def _choose(pr: _Priced, p: int, batch: int, budget: float, pins: dict, allowed_m=None):
    """(StagePlan, predicted step) of least predicted step for pipeline degree p, over what
    the pins leave free (m among ``allowed_m``). ``plan_stages`` picks cuts and m per
    schedule by its closed form; the schedules are then ranked by simulating their
    timelines (the closed form takes transfers as overlapped, which 1F1B-like schedules
    on a slow link are not), plus the once-per-step gradient reduction."""
    from autopar.schedule import SCHEDULES
    from autopar.solver.stage_dp import plan_stages, simulate_plan
    mbs = pins.get("micro_batch_size")
    costs = pr.layer_costs()
    limit = max(budget - pr.extra_memory(), 1.0)
    kinds = [pins["schedule"]] if pins.get("schedule") else \
        ["interleaved-1f1b"] if pins.get("virtual_stages") else list(SCHEDULES)
    plans, error = [], None
    for kind in kinds:
        try:
            plans.append(plan_stages(costs, n_devices=p, global_batch=batch, memory_limit=limit,
                                     bandwidth=pr.bandwidth, n_stages=p,
                                     micro_batches=batch // mbs if mbs else None, schedule=kind,
                                     virtual_stages=pins.get("virtual_stages"),
                                     micro_batch_options=allowed_m, explain=False))
        except ValueError as e:
            error = error or e
    if not plans:
        raise error
    best = None
    # the closed form is a lower bound of the simulated step: simulate in its order, stop
    # once it cannot beat the best simulated
    for sp in sorted(plans, key=lambda sp: sp.predicted_step_time):
        sync = float(pr.rank_sync([int(pr.bounds[c]) for c in sp.cuts], p).max())
        if best is not None and sp.predicted_step_time - sp.sync_time + sync >= best[1]:
            break
        step = simulate_plan(sp).makespan + sync
        if best is None or step < best[1]:
            best = (sp, step)
    return best


def _allowed_micro_batches(batch: int, degree: int) -> list[int]:
    return [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % degree == 0]


def solve_intra(cap: Captured, cl, world: int, p: int, pins: dict, *, weights=None,
                grad_sync_scale=1.0, memory_budget=None, optimizer="adamw", time_limit_s=60.0,
                capture_s=0.0, verbose=False, mesh_shape=None, explain=True, profiler=None):
    """(Plan, Solved) of the whole graph on one stage's ``world // p`` devices."""
    from autopar.api import solve_captured
    d = world // p
    intra_pins = {k: pins[k] for k in INTRA_PINS if pins.get(k) is not None}
    if intra_pins.get("data") or intra_pins.get("tensor") or intra_pins.get("zero"):
        mesh_shape = None                       # the pins say which mesh
    return solve_captured(cap, _sub_cluster(cl, d), d, memory_budget=memory_budget,
                          mesh_shape=mesh_shape, optimizer=optimizer,
                          time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
                          pins=intra_pins, memory_weights=weights, grad_sync_scale=grad_sync_scale,
                          explain=explain, profiler=profiler)


# ---- the plan for one configuration ---------------------------------------------------------


def plan_pipeline(cap: Captured, cl, world: int, pins: dict, config: tuple[int, int, int, str], *,
                  memory_budget=None, optimizer="adamw", time_limit_s=60.0, capture_s=0.0,
                  verbose=False, mesh_shape=None, extra_pins=None, solved=None,
                  profiler=None) -> Plan:
    """The Plan for ``cap`` (captured with micro-batch inputs) on ``world`` devices, for
    ``config`` = (p, v, m, schedule). ``solved`` = (intra Plan, Solved) reuses an intra
    solution of this graph; ``mesh_shape`` fixes the intra-stage mesh, ``extra_pins``
    (data, tensor, recompute) pin the intra plan without being the user's pins."""
    from autopar.analysis.stages import chain
    from autopar.solver.stage_dp import plan_stages
    from autopar.solver.ilp import InfeasibleError

    p, v, m, schedule = config
    if world % p:
        raise ValueError(f"pipeline={p} does not divide the world of {world} devices; every stage "
                         f"needs an equal sub-mesh: use a divisor of {world}")
    S = p * v
    units = chain(cap)
    if S > len(units):
        raise ValueError(f"{S} pipeline stages ({p} ranks x {v} virtual) are more than this graph "
                         f"can be cut into: it has {len(units)} op nodes ({len(units) - 1} cut "
                         "points); use fewer stages")
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    intra_pins = {**pins, **(extra_pins or {})}

    def solve(pins_, limit=budget):
        return solve_intra(cap, cl, world, p, pins_, weights=memory_weights(schedule, p, m, v),
                           grad_sync_scale=1.0 / m, memory_budget=limit, optimizer=optimizer,
                           time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
                           mesh_shape=mesh_shape, profiler=profiler)

    def cut(solved_, limit=budget, explain=True):
        pr_ = _price(cap, solved_[0], solved_[1], cl, world, p, S)
        sp_ = plan_stages(pr_.layer_costs(), n_devices=p, global_batch=pr_.nc.batch * m,
                          memory_limit=max(limit - pr_.extra_memory(), 1.0),
                          bandwidth=pr_.bandwidth, n_stages=p, micro_batches=m,
                          schedule=schedule, virtual_stages=v, explain=explain)
        return pr_, sp_

    def fits_not(e: Exception) -> bool:
        return str(e).startswith("no pipeline plan fits")

    solved = solved or solve(intra_pins)
    t0 = time.perf_counter()
    try:
        try:
            pr, sp = cut(solved, explain=False)
        except ValueError as e:
            # The solver saw uniform stages; the real ones (embedding, head, whole layers)
            # hold more. Solve again with the budget short by the real overflow, then with
            # every layer recomputed.
            if not fits_not(e):
                raise
            retries = []
            worst = _worst_rank_memory(cap, solved, cl, world, config)
            seen = sum(solved[0].estimate.memory_bytes.values())
            if worst > budget and seen > 0:
                retries.append((intra_pins, budget * seen / worst * 0.98))
            if not solved[0].recompute and intra_pins.get("recompute") is None and _has_layers(cap):
                retries.append(({**intra_pins, "recompute": "full"}, budget))
            for k, (pins_, limit) in enumerate(retries):
                try:
                    solved_ = solve(pins_, limit)
                    pr, sp = cut(solved_, explain=k == len(retries) - 1)
                    solved = solved_
                    break
                except ValueError as e2:
                    if k == len(retries) - 1 or not fits_not(e2):
                        raise
            else:
                cut(solved)         # raises, saying which stage overflows
    except ValueError as e:
        if str(e).startswith("no pipeline plan fits"):
            raise InfeasibleError(f"pipeline={p}, {m} micro-batches, schedule {schedule!r}: {e}") from e
        raise PlanError(f"no cut of {len(units)} op nodes into {S} stages: {e}") from e
    intra = solved[0]
    cuts = tuple(int(pr.bounds[c]) for c in sp.cuts)
    estimate = _estimate(pr, config, cuts)
    dp_s = time.perf_counter() - t0
    if verbose:
        print(f"pipeline p={p} v={v} m={m} {schedule}: cuts {[units[c] for c in cuts]}, step "
              f"{estimate.step_time_s * 1e3:.3f} ms, bubble {estimate.bubble_fraction:.3f}, "
              f"{estimate.memory_total / 2**30:.2f} GiB/device ({dp_s:.2f}s)")
    from autopar.plan import NodePlacement
    # the pipeline axis is replicated for every node (a stage holds its nodes whole on it)
    nodes = {k: NodePlacement(tuple("R" + x for x in v_.inputs), tuple("R" + x for x in v_.outputs))
             for k, v_ in intra.nodes.items()}
    return replace(intra, nodes=nodes, world_size=world, mesh_shape=(p, *intra.mesh_shape),
                   mesh_axes=("pipeline", *intra.mesh_axes), memory_budget=memory_budget,
                   pins={k: v_ for k, v_ in pins.items() if v_ is not None}, estimate=estimate,
                   pipeline_stages=p, virtual_stages=v, n_microbatches=m, schedule=schedule,
                   stage_cuts=tuple(units[c] for c in cuts))


def _worst_rank_memory(cap, solved, cl, world, config) -> float:
    """Bytes per device of the fullest rank under the fastest cuts, memory aside."""
    from autopar.solver.stage_dp import in_flight, plan_stages
    p, v, m, schedule = config
    pr = _price(cap, solved[0], solved[1], cl, world, p, p * v)
    sp = plan_stages(pr.layer_costs(), n_devices=p, global_batch=pr.nc.batch * m,
                     memory_limit=math.inf, bandwidth=pr.bandwidth, n_stages=p, micro_batches=m,
                     schedule=schedule, virtual_stages=v)
    cuts = [int(pr.bounds[c]) for c in sp.cuts]
    bounds = (0, *cuts, len(pr.nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    held = in_flight(schedule, p, m, v)
    return max(sum(pr.nc.rank_memory([stages[k] for k in range(r, p * v, p)],
                                     held[list(range(r, p * v, p))]).values()) for r in range(p))


def _estimate(pr: _Priced, config, cuts: tuple[int, ...]) -> Estimate:
    """Step time (simulated schedule + once-per-step gradient reduction), per-device compute
    and communication of the busiest rank, memory of the fullest rank."""
    from autopar.schedule import schedule_actions
    from autopar.solver.simulate import simulate
    from autopar.solver.stage_dp import in_flight
    p, v, m, schedule = config
    nc = pr.nc
    S = p * v
    bounds = (0, *cuts, len(nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    times = nc.time
    stage_times = np.array([times[j:i].sum() for j, i in stages])
    p2p = [float(nc.cross[c - 1] / pr.bandwidth + pr.latency) for c in cuts]
    # the runtime's cost per action: F and B, or F, I and W (the backward pays two)
    a = pr.action
    split = schedule == "zero-bubble"
    sim = simulate(schedule_actions(schedule, p, m, v), forward=stage_times * FORWARD + a,
                   backward=stage_times * (1 - FORWARD) + (2 if split else 1) * a,
                   weight=stage_times * (1 - FORWARD) / 2 + a, p2p=p2p if p2p else 0.0)
    end = np.zeros(p)
    for ev in sim.timeline:
        end[ev["rank"]] = max(end[ev["rank"]], ev["end"])
    sync = pr.rank_sync(cuts, p)
    step = float((end + sync).max())
    held = in_flight(schedule, p, m, v)
    rank_stages = [[k for k in range(r, S, p)] for r in range(p)]
    mems = [nc.rank_memory([stages[k] for k in ks], held[ks]) for ks in rank_stages]
    worst = max(range(p), key=lambda r: sum(mems[r].values()))
    busiest = max(range(p), key=lambda r: sim.busy[r] + sync[r])
    comm: dict[str, float] = {}
    compute = 0.0
    for k in rank_stages[busiest]:
        j, i = stages[k]
        compute += m * float(nc.compute[j:i].sum())
        for idx in range(j, i):
            for key, s in nc.comm_by[idx].items():
                comm[key] = comm.get(key, 0.0) + m * s
            for key, s in nc.sync_by[idx].items():
                comm[key] = comm.get(key, 0.0) + s
        sends = (p2p[k - 1] if k > 0 else 0.0) + (p2p[k] if k < S - 1 else 0.0)
        if sends:
            comm["send_recv@pipeline"] = comm.get("send_recv@pipeline", 0.0) + m * sends
    return Estimate(step_time_s=step, compute_s=float(compute), comm_s=float(sum(comm.values())),
                    memory_bytes={k: float(b) for k, b in mems[worst].items()},
                    comm={k: float(s) for k, s in comm.items()},
                    bubble_fraction=float(sim.bubble_fraction),
                    stage_times_s=tuple(float(t) for t in stage_times + (3 if split else 2) * a))


# ---- choosing what the pins leave free ------------------------------------------------------


def plan_pipelined(model, example_inputs, loss_fn, target, cl, world: int, pins: dict, *,
                   memory_budget=None, optimizer="adamw", time_limit_s=60.0, verbose=False,
                   profiler=None) -> tuple[Plan, Captured]:
    """The pipeline plan for ``pipeline=p`` pinned (m, schedule and virtual stages chosen
    where not pinned), and the graph captured at its micro-batch. ``profiler``: measured
    op times where it has them (as for ``autopar.plan``)."""
    t0 = time.perf_counter()
    config0 = pipeline_config(example_inputs, pins)
    p, v0, m0, schedule0 = config0
    cap0 = capture_microbatch(model, example_inputs, loss_fn, target, m0)
    capture_s = time.perf_counter() - t0
    kw = {"memory_budget": memory_budget, "optimizer": optimizer, "time_limit_s": time_limit_s,
          "verbose": verbose, "profiler": profiler}
    if pins.get("micro_batch_size") is not None and pins.get("schedule") is not None \
            and (pins["schedule"] != "interleaved-1f1b" or pins.get("virtual_stages") is not None):
        return plan_pipeline(cap0, cl, world, pins, config0, capture_s=capture_s, **kw), cap0
    if world % p:
        plan_pipeline(cap0, cl, world, pins, config0, **kw)          # raises the error
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    solved = solve_intra(cap0, cl, world, p, pins, weights=memory_weights(schedule0, p, m0, v0),
                         grad_sync_scale=1.0 / m0, memory_budget=budget, optimizer=optimizer,
                         time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
                         profiler=profiler)
    # the reference configuration's plan; a chosen one replaces it when predicted faster
    try:
        base, base_error = plan_pipeline(cap0, cl, world, pins, config0, solved=solved, **kw), None
    except ValueError as e:
        base, base_error = None, e
    intra = solved[0]
    batch = int(example_inputs[0].shape[0])
    try:
        pr = _price(cap0, intra, solved[1], cl, world, p, p * max(v0, 4))
        sp, predicted = _choose(pr, p, batch, budget, pins,
                                _allowed_micro_batches(batch, _batch_degree(cap0, intra)))
    except ValueError as e:
        if verbose:
            print(f"pipeline p={p}: keeping m={m0} {schedule0} ({e})")
        if base is None:
            raise base_error from None
        return base, cap0
    config = (p, sp.virtual_stages, sp.micro_batches, sp.schedule)
    if verbose:
        print(f"pipeline p={p}: chose m={config[2]} {config[3]} v={config[1]} "
              f"(predicted {predicted * 1e3:.3f} ms)")
    best, cap = None, cap0
    if config != config0:
        try:
            if config[2] == m0:
                best = plan_pipeline(cap0, cl, world, pins, config, solved=solved, **kw)
            else:
                cap = capture_microbatch(model, example_inputs, loss_fn, target, config[2])
                best = plan_pipeline(cap, cl, world, pins, config, mesh_shape=intra.mesh_shape, **kw)
        except ValueError as e:      # e.g. infeasible at the new micro-batch
            if verbose:
                print(f"pipeline p={p} m={config[2]} {config[3]}: {e}")
            if base is None:
                raise
    if best is not None and (base is None or best.estimate.step_time_s <= base.estimate.step_time_s):
        return best, cap
    if base is None:
        raise base_error
    return base, cap0


def stage_meshes(cl, d: int, pins: dict) -> list[tuple[int, int]]:
    """(data, tensor) degrees the free search tries on a stage of ``d`` devices: tensor
    parallelism t in 1, 2, 4, 8 inside a node, data parallelism over the rest (as pinned)."""
    ts = [pins["tensor"]] if pins.get("tensor") else \
        [t for t in (1, 2, 4, 8) if t <= cl.devices_per_node]
    out = []
    for t in ts:
        if d % t or (pins.get("data") and pins["data"] != d // t):
            continue
        out.append((d // t, t))
    return out


def pipeline_degrees(cap: Captured, cl, world: int) -> list[int]:
    """Pipeline degrees the free search tries: whole nodes per stage (devices per stage on
    one node), at most one stage per layer."""
    from autopar.analysis.layers import repeated_layers
    from autopar.analysis.stages import chain
    span = cl.nodes if cl.nodes > 1 else world
    limit = len(repeated_layers(cap.gm)) or len(chain(cap))
    return [p for p in PIPELINE_DEGREES if span % p == 0 and world % p == 0 and p <= limit]


def _has_layers(cap: Captured) -> bool:
    from autopar.analysis.layers import repeated_layers
    return bool(repeated_layers(cap.gm))


def search_pipelines(cap: Captured, model, example_inputs, loss_fn, target, cl, world: int,
                     pins: dict, *, memory_budget=None, optimizer="adamw", time_limit_s=60.0,
                     verbose=False) -> Plan | None:
    """The best pipeline plan over ``pipeline_degrees`` (None when none fits). ``cap`` is
    the full-batch graph: each degree's intra-stage plans are made on it (data x tensor
    meshes, memory left to the pipeline model), priced per sample, with and without every
    layer recomputed; only the winner is captured at its micro-batch and planned for real."""
    from autopar.analysis.layers import select_layers
    from autopar.solver.ilp import InfeasibleError
    batch = int(example_inputs[0].shape[0])
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    layers = select_layers(cap.gm, "full") if pins.get("recompute") is None and _has_layers(cap) else ()
    state = state_bytes(cap, optimizer, pins.get("precision"))
    found = []
    for p in pipeline_degrees(cap, cl, world):
        t0 = time.perf_counter()
        best = None
        for data, tensor in stage_meshes(cl, world // p, pins):
            mesh = {"data": data, "tensor": tensor}
            least = state / (p * tensor * (data if pins.get("zero") else 1))
            if least > budget:          # the fullest rank holds at least this much state
                if verbose:
                    print(f"pipeline search p={p} data={data} tensor={tensor}: at least "
                          f"{least / 2**30:.1f} GiB of parameters and optimizer state per device")
                continue
            # memory as one rank of a 1F1B pipeline with the smallest micro-batch (one
            # sample per data-parallel rank) sees it: 1/p of the state, the activations of
            # one micro-batch of the whole graph (p micro-batches of 1/p of it)
            weights = memory_weights("1f1b", p, p, 1)
            weights["activations"] *= data / batch
            try:
                intra, sol = solve_intra(cap, cl, world, p, {**pins, **mesh}, weights=weights,
                                         memory_budget=budget, optimizer=optimizer,
                                         time_limit_s=time_limit_s, explain=False)
                pr = _price(cap, intra, sol, cl, world, p, 4 * p)
                allowed = _allowed_micro_batches(batch, _batch_degree(cap, intra))
            except (InfeasibleError, ValueError) as e:
                if verbose:
                    print(f"pipeline search p={p} data={data} tensor={tensor}: "
                          f"{str(e).splitlines()[0][:100]}")
                continue
            for rec in ((), layers) if layers else ((),):
                if rec:
                    pr = replace(pr, nc=pr.nc.with_recompute(cap, rec))
                try:
                    sp, predicted = _choose(pr, p, batch, budget, pins, allowed)
                except ValueError:
                    continue
                extra = {**mesh, **({"recompute": "full"} if rec or intra.recompute else {})}
                if best is None or predicted < best[0]:
                    best = (predicted, p, sp, extra)
                break               # recomputing only when nothing fits without it
        if verbose:
            msg = (f"m={best[2].micro_batches} {best[2].schedule} v={best[2].virtual_stages}, "
                   f"{best[3]}, predicted {best[0]:.4g} s") if best else "nothing fits"
            print(f"pipeline search p={p}: {msg} ({time.perf_counter() - t0:.1f}s)")
        if best is not None:
            found.append(best)
    for predicted, p, sp, extra in sorted(found, key=lambda x: x[0]):
        config = (p, sp.virtual_stages, sp.micro_batches, sp.schedule)
        try:
            t0 = time.perf_counter()
            mcap = capture_microbatch(model, example_inputs, loss_fn, target, config[2])
            return plan_pipeline(mcap, cl, world, pins, config, extra_pins=extra,
                                 memory_budget=memory_budget, optimizer=optimizer,
                                 time_limit_s=time_limit_s, capture_s=time.perf_counter() - t0,
                                 verbose=verbose)
        except (InfeasibleError, ValueError) as e:
            if verbose:
                print(f"pipeline p={p} m={config[2]} {config[3]}: {str(e).splitlines()[0][:120]}")
    return None


def state_bytes(cap: Captured, optimizer: str, precision: str | None) -> float:
    """Bytes of parameters, gradients and optimizer state of the whole model, unsharded:
    4 (2 + k) per parameter in fp32, 2 + 2 + 4 (1 + k) in mixed precision, for k
    optimizer tensors per parameter (AdamW: 2)."""
    from autopar.api import OPTIMIZER_STATES
    k = OPTIMIZER_STATES.get(optimizer, 2)
    per = 4 + 4 * (1 + k) if precision in ("bf16", "fp16") else 4 * (2 + k)
    n = sum(cap.node(ph).meta["val"].numel() for ph in cap.params)
    return float(n * per)


def _sub_cluster(cl, d: int):
    """The devices of one stage: the ``d`` consecutive ranks of the intra-stage mesh."""
    dpn = cl.devices_per_node
    nodes, per = (1, d) if d <= dpn else (d // dpn, dpn)
    return replace(cl, name=f"{cl.name}[stage of {d}]", nodes=nodes, devices_per_node=per)


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
