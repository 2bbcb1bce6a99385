"""Prices of a pipeline: one intra-stage solution priced per node (``price_plan``), the cut
points a stage DP considers, the link between stages, the memory of a pipeline rank, and the
estimate of a pipeline plan (its simulated schedule).

Read by ``autopar.solver.pipeline_search``; the prices per node are
``autopar.solver.pipeline_costs``'.
"""
from __future__ import annotations

import math
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.analysis.stages import values_skip_stages
from autopar.capture import Captured
from autopar.cost_models.comm import collective_time
from autopar.cost_models.host import OPTIMIZER_DISPATCHES, host_time
from autopar.placement import Shard, local_shape, parse_placements
from autopar.plan import Estimate, Plan
from autopar.schedule import overlap_pairs, rank_stages, schedule_actions, stage_ranks
from autopar.pricing.costing import OVERLAPPED, exposed_sync
from autopar.options import OPTIMIZER_STATES
from autopar.solver.pipeline_costs import node_costs
from autopar.pricing.simulate import simulate
from autopar.solver.even_split import even_cuts
from autopar.solver.stage_dp import LayerCosts, in_flight, plan_stages
from autopar.solver.stage_tables import cut_latency

MAX_UNITS = 256
"""Cut points the stage DP considers at most (the cheapest crossings of a large graph), or
``UNITS_PER_STAGE`` per stage where that is more (:func:`max_units`)."""
UNITS_PER_STAGE = 8
"""Cut points kept per stage at least. A transformer chain offers 2-3 points a block at the
residual stream's crossing (the block boundary, mid-block, the add before it), all crossing
the same bytes; thinned evenly to a fixed 256 they lose block boundaries once there are more
(GPT 1T, 128 blocks: 323 such points thinned to 255 dropped the boundaries that 64 stages of
2 blocks need, so 10 stages held 2.5 blocks and paced the pipeline 11% slower than the
uniform split Megatron-LM ran, K22 Table 5; GPT 530B under 105 interleaved stages 10% slower).
Eight a stage keeps every such point of a chain of at least 2 blocks a stage with up to 4
points a block (the DP grows as points^2 x stages: 839 points x 105 stages plan in ~4 s)."""
FORWARD = 1 / 3      # forward's share of a stage's time (backward = 2 x forward)


def memory_weights(schedule: str, p: int, m: int, v: int) -> dict[str, float]:
    """Factors that turn the whole graph's memory (one micro-batch) into a pipeline rank's,
    for uniform stages: 1/p of the state; the activations of the micro-batches its stages
    hold at their peak (``stage_dp.in_flight``), each stage 1/(p v) of the graph."""
    n = in_flight(schedule, p, m, v)
    held = max(float(n[ks].sum()) for ks in rank_stages(schedule, p, v))
    state = 1.0 / p
    return {"params": state, "grads": state, "optimizer": state, "buffers": state,
            "activations": held / (p * v)}


@dataclass
class Priced:
    cap: Captured
    intra: Plan
    solved: object
    nc: object                   # autopar.solver.pipeline_costs.NodeCosts
    bounds: np.ndarray           # chain index where each DP unit starts, then L
    bandwidth: float             # bytes/s per rank between neighbouring stages
    latency: float
    action: float = 0.0          # the runtime's seconds per scheduled action of a stage
    message: float = 0.0         # seconds of latency per tensor sent between stages
    near_bandwidth: float = 0.0  # bytes/s per rank of a cut inside a node (0: ``bandwidth``)
    ranks_apart: int = 0         # ranks between neighbouring stages (world // p)
    devices_per_node: int = 0    # 0: one node (every cut inside it)
    starts: tuple | None = None  # stage_split="even-layers": each repeated layer's chain start
    host_op_s: float = 0.0       # host seconds per ATen call (``Device.host_op_s``; 0: CPU ranks)
    optimizer_calls: float = 0.0  # a rank's optimizer foreach calls a step (cost_models.host)
    p2p_by_tag: bool = True      # the backend matches messages by tag (``Device.p2p_by_tag``)

    def host_calls(self) -> np.ndarray:
        """ATen calls per chain node of one micro-batch (``NodeCosts.host_calls``; zeros
        where the device prices no host time)."""
        nc = self.nc
        if not self.host_op_s or len(nc.host_calls) != len(nc.units):
            return np.zeros(len(nc.units))
        return nc.host_calls

    @property
    def optimizer_host_s(self) -> float:
        """Host seconds of a rank's optimizer step (its foreach calls), dispatched after
        its last backward (``stage_dp``'s host rule; 0 on CPU ranks)."""
        return self.optimizer_calls * self.host_op_s

    def rank_host_s(self, cuts: Sequence[int], p: int, m: int, schedule: str = "1f1b") -> np.ndarray:
        """Host seconds a step per pipeline rank for chain cuts ``cuts`` (stages placed as
        ``schedule`` places them): its stages' calls once per micro-batch, forward and
        backward, and its optimizer's once (``stage_dp``'s host rule; zeros on CPU ranks)."""
        if not self.host_op_s:
            return np.zeros(p)
        calls = self.host_calls()
        bounds = (0, *cuts, len(calls))
        rank = stage_ranks(schedule, p, (len(bounds) - 1) // p)
        out = np.zeros(p)
        for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:])):
            out[rank[k]] += m * float(calls[j:i].sum())
        return (out + self.optimizer_calls) * self.host_op_s

    @property
    def fixed_cuts(self):
        """None (the stage DP cuts), or under ``stage_split="even-layers"`` S -> the DP-unit
        indices of the even cuts into S stages (``even_split.even_cuts``) for
        ``plan_stages(fixed_cuts=)``."""
        if self.starts is None:
            return None
        unit = {int(x): k for k, x in enumerate(self.bounds)}
        return lambda S: tuple(unit[c] for c in even_cuts(list(self.starts), S))

    def cut_bandwidths(self, p: int, n_stages: int, schedule: str = "1f1b") -> list[float]:
        """Bytes/s per rank of each of the ``n_stages - 1`` stage boundaries, on the link
        that boundary crosses (:func:`cut_crosses_nodes`): a rank's own NIC share
        (``bandwidth``) where the two stages sit on different nodes, NVLink
        (``near_bandwidth``) where they share one."""
        near = self.near_bandwidth or self.bandwidth
        rank = stage_ranks(schedule, p, n_stages // p)
        return [self.bandwidth if cut_crosses_nodes(rank[k], rank[k + 1], self.ranks_apart,
                                                    self.devices_per_node) else near
                for k in range(n_stages - 1)]

    @property
    def positions(self) -> np.ndarray:
        return self.bounds[1:-1]

    def layer_costs(self):
        """Per-sample costs of the DP units (``stage_dp.LayerCosts``)."""
        nc, starts = self.nc, self.bounds[:-1]
        b = nc.batch
        fixed = nc.fixed()

        def seg(a):
            return np.add.reduceat(np.asarray(a, float), starts)
        t = np.maximum(seg(nc.time) - seg(fixed), 0.0) / b
        return LayerCosts(time=t, state_bytes=nc.state(starts), activation_bytes=seg(nc.activations) / b,
                          boundary_bytes=nc.cross[self.positions - 1] / b, fixed_time=seg(fixed),
                          action_time=self.action, boundary_tensors=nc.cross_tensors[self.positions - 1],
                          message_time=self.message,
                          parameters=seg(nc.params) if len(nc.params) else None,
                          host_time=seg(self.host_calls()) * self.host_op_s,
                          host_step_time=self.optimizer_calls * self.host_op_s,
                          grad_boundary_bytes=nc.cross_grad[self.positions - 1] / b
                          if len(nc.cross_grad) else None,
                          time_floors=self._unit_floors())

    def _unit_floors(self):
        """``NodeCosts.time_floors`` with each chain node's DP unit in place of its index."""
        got = self.nc.time_floors()
        if got is None:
            return None
        nodes, per, floor = got
        return np.searchsorted(self.bounds[:-1], nodes, side="right") - 1, per, floor

    def extra_memory(self) -> float:
        """Bytes every rank may hold besides state and activations: the recompute transient,
        the offloaded layers in flight in backward and the micro-batch's inputs."""
        inputs = sum(t.get("inputs", 0.0) for _, t, _ in self.nc.placeholders)
        return self.nc.recompute_bytes + self.nc.offload_bytes + inputs

    def rank_sync(self, cuts: Sequence[int], p: int, schedule: str = "1f1b") -> np.ndarray:
        """Gradient reduction seconds per rank for chain cuts ``cuts`` (stages placed as
        ``schedule`` places them: ``schedule.stage_ranks``)."""
        bounds = (0, *cuts, len(self.nc.units))
        rank = stage_ranks(schedule, p, (len(bounds) - 1) // p)
        sync = np.zeros(p)
        for k, (j, i) in enumerate(zip(bounds[:-1], bounds[1:])):
            sync[rank[k]] += self.nc.sync[j:i].sum()
        return sync


def price_plan(cap: Captured, intra: Plan, solved, cl, world: int, p: int, n_stages: int,
               starts: Sequence[int] | None = None) -> Priced:
    """``starts``: under ``stage_split="even-layers"``, each repeated layer's chain start
    (``even_split.block_starts``), kept among the cut points (the even cuts are of them)."""
    nc = _node_costs(cap, intra, solved)
    # a cut no parameter's value crosses leaves the stages before it without a backward
    # (nothing, free nodes, buffer slices): no stage
    positions = [i for i in cut_points(nc.cross, n_stages) if nc.cross_learned[i - 1] > 0]
    if starts is not None:
        positions = sorted(set(positions) | {int(i) for i in starts if i > 0})
    bw, lat = pipeline_link(cl, world // p, world)
    near, _ = pipeline_link(cl, world // p, 1)
    # host time of the ranks' eager programs (GPU devices only: ``Device.host_op_s``); a
    # compiled intra plan pays ``COMPILED_HOST_FRACTION`` of it, as a flat plan does
    host_op_s = float(getattr(cl.device, "host_op_s", 0.0) or 0.0)
    if host_op_s and intra.options.compile:
        host_op_s = host_time(1.0, host_op_s, compiled=True)
    opt_calls = OPTIMIZER_DISPATCHES.get(getattr(solved.problem, "optimizer_states", 2), 10)
    return Priced(cap, intra, solved, nc, np.array([0, *positions, len(nc.units)], dtype=int), bw, lat,
                  float(getattr(cl.device, "pipeline_action", 0.0)), message_latency(cl, world),
                  near_bandwidth=near, ranks_apart=world // p,
                  devices_per_node=cl.devices_per_node if cl.nodes > 1 else 0,
                  starts=None if starts is None else tuple(int(i) for i in starts),
                  host_op_s=host_op_s, optimizer_calls=float(opt_calls) if host_op_s else 0.0,
                  p2p_by_tag=bool(getattr(cl.device, "p2p_by_tag", True)))


PRICED_KEPT = 4
"""Intra-stage solutions whose per-node prices ``price_plan`` keeps (the last ones priced)."""
_PRICED: OrderedDict = OrderedDict()


def _node_costs(cap: Captured, intra: Plan, solved):
    """``node_costs`` of ``solved`` (its crossings through ``intra``'s placements), kept for
    the last ``PRICED_KEPT`` (graph, intra plan, Solved): a pipeline plan prices one
    solution for its cuts, for every stage count weighed and without its recomputation
    (``partial_recompute``) several times over (nothing mutates a NodeCosts; variants are
    ``dataclasses.replace`` copies)."""
    key = (id(cap.gm), id(intra), id(solved))
    hit = _PRICED.get(key)
    if hit is not None and hit[0] is cap.gm and hit[1] is intra and hit[2] is solved:
        _PRICED.move_to_end(key)
        return hit[3]
    held: dict = {}       # (shape, placements, dtype) -> bytes: layers repeat the same values
    nc = node_costs(cap, solved, lambda n: local_bytes(cap, intra, n, held), axes=intra.mesh_axes)
    _PRICED[key] = (cap.gm, intra, solved, nc)      # (held alive: their ids stay theirs)
    while len(_PRICED) > PRICED_KEPT:
        _PRICED.popitem(last=False)
    return nc


def max_units(n_stages: int) -> int:
    """Cut points the stage DP considers for ``n_stages`` stages: ``MAX_UNITS``, or
    ``UNITS_PER_STAGE`` a stage where that is more."""
    return max(MAX_UNITS, UNITS_PER_STAGE * int(n_stages))


def cut_points(cross: np.ndarray, n_stages: int) -> list[int]:
    """Chain positions a cut may fall before: all of them in a small graph; in a large one
    the ``max_units(n_stages)`` where the fewest bytes cross (the boundaries between layers),
    at least four per stage."""
    L = len(cross) + 1
    cap = max_units(n_stages)
    if L - 1 <= cap:
        return list(range(1, L))
    # the least crossing level that offers enough cut points (four per stage, and at least
    # 64), every point at or under it (all layer boundaries alike), thinned evenly if many
    want = min(L - 1, max(4 * n_stages, 64))
    level = float(np.sort(cross)[want - 1]) * (1 + 1e-6)
    chosen = [int(i) for i in np.flatnonzero(cross <= level)]
    # every stretch of the chain offers a cut: a window of it (``want`` equal ones) with
    # none gets its cheapest crossing (a graph whose prologue - token ids, rotary tables -
    # crosses fewer bytes than any layer boundary had every point there, so the last stage
    # held every layer)
    edges = np.linspace(0, L - 1, want + 1).round().astype(int)
    marks = np.zeros(L - 1, bool)
    marks[chosen] = True
    spread = [int(a + np.argmin(cross[a:b])) for a, b in zip(edges[:-1], edges[1:])
              if b > a and not marks[a:b].any()]
    if len(chosen) > cap - len(spread):
        keep = np.linspace(0, len(chosen) - 1, max(cap - len(spread), 1)).round().astype(int)
        chosen = [chosen[k] for k in sorted(set(keep.tolist()))]
    return [i + 1 for i in sorted(set(chosen) | set(spread))]


def pipeline_link(cl, d: int, world: int) -> tuple[float, float]:
    """(bytes/s per rank, seconds of latency and wait) between neighbouring stages, ``d``
    ranks apart, where their boundary crosses nodes (``world`` beyond one node).
    Across nodes each rank gets its share of the node's NICs (one per GPU on a DGX: a
    send and its receive are point to point, rank to rank, over the sender's and the
    receiver's own NICs, rail-optimized, not a ring over the node's eight); inside a node,
    NVLink (``world`` <= devices_per_node; :meth:`Priced.cut_bandwidths` picks, per
    boundary, the one it crosses). Both at the link's NCCL bus bandwidth, which for a
    send/recv is its bandwidth (nccl-tests PERFORMANCE.md: busbw = algbw for sendrecv)."""
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


def cut_crosses_nodes(a: int, b: int, d: int, devices_per_node: int) -> bool:
    """Whether the boundary between pipeline ranks ``a`` and ``b`` crosses nodes: the
    pipeline axis is the mesh's outermost (``hardware``'s row-major layout), so pipeline
    rank ``r``'s ``d`` ranks are ``r d .. r d + d - 1`` and each sends to the one at the same
    offset in its neighbour; the boundary crosses if any such pair sits on two nodes (all
    pairs send at once, the slowest sets the pace). ``devices_per_node`` 0: one node.
    With ``d >= devices_per_node`` every boundary crosses; with ``d`` = 2 on 8-GPU nodes
    (tensor 2, no data parallelism) three boundaries in four stay inside a node."""
    if devices_per_node <= 0 or a == b:
        return False
    return any((a * d + j) // devices_per_node != (b * d + j) // devices_per_node
               for j in range(d))


def message_latency(cl, world: int) -> float:
    """Seconds of latency of one tensor sent between neighbouring stages: a send of next to
    no bytes on their link (``pipeline_link``'s), without the wait for the peer (that is in
    ``pipeline_link``'s latency, once per cut)."""
    link = cl.inter if cl.nodes > 1 and world > cl.devices_per_node else cl.intra
    return collective_time("send", 1.0, 2, link, skew=False)


def batch_degree(cap: Captured, intra: Plan) -> int:
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


def worst_rank_memory(cap, solved, cl, world, config, starts=None) -> float:
    """Bytes per device of the fullest rank under the fastest cuts (the even ones under
    ``starts``: ``price_plan``), memory aside."""
    p, v, m, schedule = config
    pr = price_plan(cap, solved[0], solved[1], cl, world, p, p * v, starts)
    sp = plan_stages(pr.layer_costs(), n_devices=p, global_batch=pr.nc.batch * m,
                     memory_limit=math.inf, bandwidth=pr.bandwidth, n_stages=p, micro_batches=m,
                     schedule=schedule, virtual_stages=v, fixed_cuts=pr.fixed_cuts)
    cuts = [int(pr.bounds[c]) for c in sp.cuts]
    bounds = (0, *cuts, len(pr.nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    return max(sum(mem.values()) for mem in pr.nc.rank_memories(stages, schedule, p, m, v))


def pipeline_estimate(pr: Priced, config, cuts: tuple[int, ...]) -> Estimate:
    """Step time (simulated schedule + once-per-step gradient reduction, or the busiest
    rank's host seconds where that is more: ``stage_dp``'s host rule), per-device compute
    and communication of the busiest rank, memory of the fullest rank."""
    p, v, m, schedule = config
    nc = pr.nc
    S = p * v
    bounds = (0, *cuts, len(nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    times = nc.time
    # every tensor crossing a stage's cuts is a message each way per micro-batch (stage_dp)
    at = cut_latency(np.concatenate([[0.0], nc.cross_tensors, [0.0]]), pr.message)
    # a stage's micro-batch: its device time or its host's dispatch, whichever is longer
    # (stage_dp's host rule; zeros on CPU ranks)
    calls = pr.host_calls()
    stage_times = np.array([max(times[j:i].sum() + at[j] + at[i], calls[j:i].sum() * pr.host_op_s)
                            for j, i in stages])
    # each boundary at the link it crosses (NVLink inside a node, the rank's NIC across);
    # the stage DP chose the cuts at the slower, ``pr.bandwidth`` (a bound for every cut)
    # a boundary between two stages of one rank (DualPipeV's middle one) sends nothing
    rank = stage_ranks(schedule, p, v)
    p2p = [0.0 if rank[k] == rank[k + 1] else float(nc.cross[c - 1] / bw + pr.latency)
           for k, (c, bw) in enumerate(zip(cuts, pr.cut_bandwidths(p, S, schedule)))]
    # the runtime's cost per action: F and B, or F, I and W (the backward pays two)
    a = pr.action
    split = schedule == "zero-bubble"
    # DualPipeV splits only its last backwards (``schedule._dual_pipe_v`` steps 3, 6-8):
    # priced as its full backwards, one action each; its I and W share the backward's time
    halves = split or schedule == "dualpipev"
    weight = stage_times * (1 - FORWARD) / 2 + a
    if halves and pr.intra.options.compile:
        # compiled stages run their whole backward at I, nothing at W (runtime/pipeline_runner)
        weight = np.full_like(stage_times, a)
    elif halves and len(nc.recomputed):
        # a later stage holding recomputed (or offloaded) layers runs its whole backward at
        # I, nothing at W (runtime/pipeline_runner.split_backward_safe: its wrapped regions
        # hide the weights' path from torch's split)
        wrapped = nc.recomputed | nc.offloaded if len(nc.offloaded) == len(nc.recomputed) else nc.recomputed
        whole = np.array([k > 0 and bool(wrapped[j:i].any()) for k, (j, i) in enumerate(stages)])
        weight = np.where(whole, a, weight)
    forward, backward = stage_times * FORWARD + a, stage_times * (1 - FORWARD) + (2 if split else 1) * a
    a2a = np.array([nc.expert_a2a[j:i].sum(axis=0) if len(nc.expert_a2a) else (0.0, 0.0)
                    for j, i in stages]).reshape(S, 2)
    hidden = None
    # where values skip stages, the runtime overlaps the pairs only on a backend matching
    # messages by tag (``runtime.overlap``: NCCL's by issue order would differ by rank)
    if overlap_priced(pr.intra, schedule) and a2a.any() and (
            pr.p2p_by_tag or not values_skip_stages(pr.cap, cuts)):
        # each half's compute: the stage's time less its all-to-alls, split as every stage's
        # (FORWARD), with the runtime's cost of the action; the all-to-alls half each way
        rest = np.maximum(stage_times - a2a.sum(axis=1), 0.0)
        hidden = pair_hidden(overlap_pairs(schedule, p, m), rest * FORWARD + a,
                             rest * (1 - FORWARD) + a, a2a)
    sim = simulate(schedule_actions(schedule, p, m, v), forward=forward, backward=backward,
                   weight=weight, p2p=p2p if p2p else 0.0, hidden=hidden)
    end = np.zeros(p)
    for ev in sim.timeline:
        end[ev["rank"]] = max(end[ev["rank"]], ev["end"])
    # a rank's gradient reduction, once per step, overlaps its stages' backward of the last
    # micro-batch only, except the last bucket (cost_models/step.py); ZeRO-3's per-micro-
    # batch gathers are priced in full with the stage's time
    sync = pr.rank_sync(cuts, p, schedule)
    last = float(pr.solved.cost.last_bucket_s) if pr.solved.cost.zero < 3 else 0.0
    rank_stages_ = rank_stages(schedule, p, v)
    hide = [float(sum(stage_times[k] for k in ks)) * (1 - FORWARD) for ks in rank_stages_]
    exposed = np.array([exposed_sync(float(sync[r]), hide[r], last) for r in range(p)])
    # the host's dispatches (stage_dp's host rule): the busiest rank's calls, its stages'
    # once per micro-batch and its optimizer's once, against the simulated device step; the
    # optimizer's calls come after the rank's last backward, beside its exposed reduction
    host = float(pr.rank_host_s(cuts, p, m, schedule).max())
    step = max(float((end + np.maximum(exposed, pr.optimizer_host_s)).max()), host)
    mems = nc.rank_memories(stages, schedule, p, m, v)
    worst = max(range(p), key=lambda r: sum(mems[r].values()))
    busiest = max(range(p), key=lambda r: sim.busy[r] + exposed[r])
    comm: dict[str, float] = {}
    compute = 0.0
    for k in rank_stages_[busiest]:
        j, i = stages[k]
        # an experts op's own all-to-alls: in its time, shown as communication
        compute += m * float(nc.compute[j:i].sum() - a2a[k].sum())
        for c in range(j, i):
            for key, sec in nc.expert_a2a_by.get(c, {}).items():
                comm[key] = comm.get(key, 0.0) + m * sec
        for idx in range(j, i):
            for key, s in nc.comm_by[idx].items():
                comm[key] = comm.get(key, 0.0) + m * s
            for key, s in nc.sync_by[idx].items():
                comm[key] = comm.get(key, 0.0) + s
        sends = (p2p[k - 1] if k > 0 else 0.0) + (p2p[k] if k < S - 1 else 0.0)
        if sends:
            comm["send_recv@pipeline"] = comm.get("send_recv@pipeline", 0.0) + m * sends
    overlapped = float(sync[busiest] - exposed[busiest]) if sync[busiest] > exposed[busiest] else 0.0
    if hidden:      # the busiest rank's pairs' all-to-alls hidden behind the other half
        mine = set(rank_stages_[busiest])
        overlapped += sum(t for act, t in hidden.items() if act.stage in mine)
    if overlapped:
        comm[OVERLAPPED] = -overlapped
    return Estimate(step_time_s=step, host_s=host, compute_s=float(compute),
                    comm_s=float(sum(comm.values())),
                    memory_bytes={k: float(b) for k, b in mems[worst].items()},
                    rank_memory_bytes=tuple(mems),
                    comm={k: float(s) for k, s in comm.items()},
                    bubble_fraction=float(sim.bubble_fraction),
                    stage_times_s=tuple(float(t) for t in stage_times + (3 if split else 2) * a))


def overlap_priced(intra: Plan, schedule: str) -> bool:
    """Whether DualPipeV's pairs are priced as run at once: where the runtime runs them so
    (``runtime.overlap.overlap_applies``; the experts' all-to-all is the caller's test, a
    stage's ``expert_a2a``): ``dualpipev``, options that allow it
    (``Options.dualpipev_overlaps``), no context axis."""
    return (schedule == "dualpipev" and intra.options.dualpipev_overlaps
            and "context" not in intra.mesh_axes)


def pair_hidden(pairs, compute_f: np.ndarray, compute_b: np.ndarray, a2a: np.ndarray) -> dict:
    """Seconds off each pair's backward (its second half) when the pair runs at once
    (``runtime.overlap``). Stage ``k``'s forward of one micro-batch is ``compute_f[k]`` of
    compute (every collective but the experts' all-to-alls waits in line with it) and
    ``a2a[k, 0]`` of all-to-all, its backward ``compute_b[k]`` and ``a2a[k, 1]``. The
    forward's all-to-all hides behind the backward's compute and the backward's behind the
    forward's, each up to that compute:

        hidden = min(Fa, Bc) + min(Ba, Fc),

    so the pair takes ``Fc + Fa + Bc + Ba - hidden = max(Fc + Bc, Fa + Ba, Fc + Fa, Bc + Ba)``:
    never less than the two computes (one device), nor than the two all-to-alls (one link),
    nor than either half alone. ``pairs``: per rank, (F, B) actions
    (``schedule.overlap_pairs``). A pair without an all-to-all hides nothing (no entry)."""
    out = {}
    for rank_pairs in pairs:
        for f, b in rank_pairs:
            fc, fa = float(compute_f[f.stage]), float(a2a[f.stage, 0])
            bc, ba = float(compute_b[b.stage]), float(a2a[b.stage, 1])
            t = min(fa, bc) + min(ba, fc)
            if t > 0:
                out[b] = t
    return out


def pipeline_host_bytes(pr: Priced, config, cuts: tuple[int, ...]) -> dict[str, float]:
    """``Plan.host_memory_bytes`` of a pipeline plan: the offloaded layers' saved bytes
    (``offload_activations=``) of the micro-batches in flight on the rank holding the most,
    as ``activations``; {} without offload."""
    p, v, m, schedule = config
    bounds = (0, *cuts, len(pr.nc.units))
    stages = list(zip(bounds[:-1], bounds[1:]))
    held = in_flight(schedule, p, m, v)
    most = max(pr.nc.rank_host_memory([stages[k] for k in ks], held[ks])
               for ks in rank_stages(schedule, p, v))
    return {"activations": most} if most else {}


def state_bytes(cap: Captured, optimizer: str, precision: str | None) -> float:
    """Bytes of parameters, gradients and optimizer state of the whole model, unsharded:
    4 (2 + k) per parameter in fp32, 2 + 4 + 4 (1 + k) in mixed precision (16-bit weight
    copies, fp32 grads, fp32 master and moments), for k optimizer tensors per parameter
    (AdamW: 2)."""
    n = sum(cap.node(ph).meta["val"].numel() for ph in cap.params)
    return float(n * state_per_param(optimizer, precision))


def state_per_param(optimizer: str, precision: str | None) -> float:
    """:func:`state_bytes`' bytes per parameter element."""
    k = OPTIMIZER_STATES.get(optimizer, 2)
    return 2 + 4 + 4 * (1 + k) if precision in ("bf16", "fp16", "fp8") else 4 * (2 + k)


def local_bytes(cap: Captured, intra: Plan, node, memo: dict | None = None) -> float:
    """Bytes per device of ``node``'s value under ``intra``; ``memo``: a dict the caller
    keeps for one plan (the same global shape and placements give the same bytes)."""
    if node.target is operator.getitem:
        base, k = node.args
        val, name = base.meta["val"][k], base.name
    else:
        val, name, k = node.meta["val"], node.name, 0
    np_ = intra.nodes.get(name)
    shape = tuple(val.shape)
    placed = np_.outputs[k] if np_ is not None and k < len(np_.outputs) else None
    key = (shape, placed, val.dtype)
    got = memo.get(key) if memo is not None else None
    if got is None:
        if placed is not None:
            shape = local_shape(shape, parse_placements(placed), intra.mesh_shape) or shape
        n = 1
        for d in shape:
            n *= int(d)
        got = float(n * val.element_size())
        if memo is not None:
            memo[key] = got
    return got
