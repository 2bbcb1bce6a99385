"""The free pipeline search (``autopar.plan`` without a ``pipeline=`` pin, on a cluster of
more than one node or when nothing unpipelined fits): every pipeline degree p that divides
the node count (each stage whole nodes, so tensor parallelism stays inside a node's NVLink,
as Megatron-LM does; 315 nodes give 3, 5, 7, 9, 15, 21, 35, ...) and is at most the number
of layers; each planned on the full-batch graph (no capture per p) on meshes ``(d,)`` and
``(d / t, t)`` for t dividing a node's devices (1, 2, 4, 8 on a DGX), with prices scaled per
sample to choose m and the schedule; the best is captured at its micro-batch and planned as
``pipeline_search.plan_pipeline`` does.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from autopar.analysis.layers import repeated_layers, select_layers
from autopar.analysis.stages import chain
from autopar.capture import Captured
from autopar.options import Options, as_options
from autopar.plan import Plan
from autopar.solver import speculate
from autopar.solver.errors import InfeasibleError, TimeLimitError
from autopar.solver.expert_search import (expert_degrees, expert_free, least_state_bytes,
                                          moe_experts, split_state_bytes)
from autopar.pricing.costing import StepView
from autopar.solver.flat import MeshAsk, mesh_floor, recompute_rest, wide_grads
from autopar.solver.spec import SearchSpec, Settings
from autopar.solver.pipeline_price import (batch_degree, memory_weights, price_plan, state_bytes,
                                           state_per_param)
from autopar.solver.pipeline_search import (
    INTRA_PINS, _allowed_micro_batches, _choose, _has_layers, _sub_cluster, capture_microbatch,
    most_stages, plan_pipeline, plan_pipelined, solve_intra, stage_limit, step_floor,
)


def stage_meshes(cl, d: int, pins: Options) -> list[tuple[int, int]]:
    """(data, tensor) degrees the free search tries on a stage of ``d`` devices: tensor
    parallelism t dividing a node's devices (1, 2, 4, 8 on a DGX), data parallelism over
    the rest (as pinned)."""
    dpn, pins = cl.devices_per_node, as_options(pins)
    ts = [pins.tensor] if pins.tensor else [t for t in range(1, dpn + 1) if dpn % t == 0]
    e = (pins.expert or 1) * (pins.context or 1)   # the expert and context axes take their share
    out = []
    for t in ts:
        if d % (t * e) or (pins.data and pins.data != d // (t * e)):
            continue
        out.append((d // (t * e), t))
    return out


def stage_meshes_experts(cl, d: int, pins: Options, n_experts: int | None
                         ) -> list[tuple[int, int, int]]:
    """(data, tensor, expert) degrees of a stage of ``d`` devices: :func:`stage_meshes`'
    (expert 1, or as pinned), then, for a graph with mixture-of-experts layers of
    ``n_experts`` experts whose expert degree the pins leave free, each expert degree
    ``expert_search.expert_degrees`` allows beside each tensor degree (the batch over the
    data x expert ranks), least expert degree first."""
    pins = as_options(pins)
    out = [(data, tensor, pins.expert or 1) for data, tensor in stage_meshes(cl, d, pins)]
    if n_experts is None or not expert_free(pins):
        return out
    for _, tensor in stage_meshes(cl, d, pins):
        for e in expert_degrees(n_experts, d // tensor):
            data = d // (tensor * e)
            if pins.data is None or pins.data == data:
                out.append((data, tensor, e))
    return out


def pipeline_degrees(cap: Captured, cl, world: int) -> list[int]:
    """Pipeline degrees the free search tries: every p >= 2 dividing the node count (whole
    nodes per stage; the devices on one node), at most one stage per layer. Not only powers
    of two: 315 DGX nodes of a 105-layer model give 3, 5, 7, 9, 15, 21, 35, 45, 63, 105."""
    span = cl.nodes if cl.nodes > 1 else world
    limit = len(repeated_layers(cap.gm)) or len(chain(cap))
    return [p for p in range(2, min(span, limit) + 1) if span % p == 0 and world % p == 0]


def degree_search(spec: SearchSpec, cap: Captured) -> "_DegreeSearch":
    """The search ``search_pipelines`` runs over ``pipeline_degrees``, made before it runs
    (the driver starts workers on its meshes' programs: ``_DegreeSearch.solve_ahead``)."""
    return _DegreeSearch(spec, cap, pipeline_degrees(cap, spec.cluster, spec.world))


def search_pipelines(spec: SearchSpec, cap: Captured, search: "_DegreeSearch | None" = None,
                     report=None, notes: list | None = None) -> tuple[Plan, Captured] | None:
    """The best pipeline plan of ``spec`` over ``pipeline_degrees`` and the graph captured at
    its micro-batch (None when none fits). ``cap`` is the full-batch graph: each degree's
    intra-stage plans are made on it (data x tensor meshes, memory left to the pipeline
    model), priced per sample, with and without every layer recomputed; only the winner is
    captured at its micro-batch and planned for real. ``search``: ``degree_search``'s, made
    ahead; ``report(name, seconds)``: told as each degree's search begins (``seconds``
    None) and ends (the free search's progress line: a long search says which degree it is
    at); ``notes``: told of the stage meshes skipped at the ILP's time limit (what
    ``plan.solver.skipped`` says). (The free search runs it without a ``mesh_shape`` or a profiler:
    ``free_search.may_pipeline``; neither is read here.)"""
    model, example_inputs, loss_fn, target = spec.model, spec.example_inputs, spec.loss_fn, spec.target
    cl, world, pins, verbose = spec.cluster, spec.world, as_options(spec.options), spec.verbose
    spec = replace(spec, options=pins, mesh_shape=None, profiler=None)
    # (a configuration that frees layers weighs offloading them: ``pipeline_offload``)
    ask = MeshAsk(cl, world, pins, spec.settings, weigh_offload=True)
    search = search or degree_search(spec, cap)
    found = []
    for p in pipeline_degrees(cap, cl, world):
        t0 = time.perf_counter()
        if report is not None:
            report(f"pipeline search p={p}", None)
        figures = search.figures(p)
        best = figures[0] if figures else None
        if verbose:
            msg = (f"m={best[2].micro_batches} {best[2].schedule} v={best[2].virtual_stages}, "
                   f"{best[3]}, predicted {best[0]:.4g} s") if best else "nothing fits"
            print(f"pipeline search p={p}: {msg} ({time.perf_counter() - t0:.1f}s)")
        if report is not None:
            report(f"pipeline search p={p}", time.perf_counter() - t0)
        found.extend(figures)
    # planned for real in predicted order, every stage mesh's best configuration (not one per
    # degree: Mixtral 8x22B's p = 8, data 4 x tensor 4 predicted 4.08 s planned 4.48, data 2 x
    # expert 2 x tensor 4 predicted 4.13 planned 4.30); a plan whose real step exceeds the next
    # configuration's prediction does not end the search (the per-sample prices can miss
    # per-micro-batch costs: BLOOM's ZeRO-3 on Omni-Path was predicted 82 s, planned 167 s)
    pending, first, planned = sorted(found, key=lambda x: x[0]), True, None
    captured = {}       # m -> the graph at that micro-batch: configurations of one m share it
    missed = 1.0        # the most a real plan has exceeded its prediction (REALIZE_MARGIN)
    while pending:
        predicted, p, sp, extra = pending.pop(0)
        if planned is not None and \
                predicted >= min(REALIZE_MARGIN, missed) * planned[0].estimate.step_time_s:
            break
        config = (p, sp.virtual_stages, sp.micro_batches, sp.schedule)
        try:
            t0 = time.perf_counter()
            mcap = captured.get(config[2])
            if mcap is None:
                mcap = captured[config[2]] = capture_microbatch(model, example_inputs, loss_fn,
                                                                target, config[2])
            real = plan_pipeline(mcap, ask, config, extra_pins=extra,
                                 capture_s=time.perf_counter() - t0)
            if _frees_layers(real, pins) and _may_choose_again(pins):
                real = _replan_recomputing(real, mcap, spec, config, extra)
            if planned is None or real.estimate.step_time_s < planned[0].estimate.step_time_s:
                planned = (real, mcap)
            missed = max(missed, real.estimate.step_time_s / predicted)
            if real.estimate.step_time_s <= predicted * (1 + 1e-6):
                continue
            if verbose:
                print(f"pipeline p={p} m={config[2]} {config[3]}: planned "
                      f"{real.estimate.step_time_s:.4g} s, predicted {predicted:.4g} s")
        except ValueError as e:     # InfeasibleError, PlanError, a schedule that cannot run
            if verbose:
                print(f"pipeline p={p} m={config[2]} {config[3]}: {str(e).splitlines()[0][:120]}")
        if first:   # the best failed or fell short: the meshes the bound skipped join, priced in full
            first = False
            pending = sorted(pending + search.unpruned(), key=lambda x: x[0])
    if planned is not None:
        planned = _second_look(found, planned, spec, verbose)
    timed_out = getattr(search, "timed_out", ())     # (a stand-in search may keep none)
    if timed_out and notes is not None:
        notes.append(f"{len(timed_out)} pipeline stage mesh(es) skipped: no solution within "
                     f"the ILP's time limit of {search.time_limit_s:g} s ((p, data, tensor, expert): "
                     + ", ".join(map(str, timed_out)) + ")")
    return planned


REALIZE_MARGIN = 1.25
"""The degree search's configurations are planned for real in predicted order until one is
predicted this multiple of the best real plan or more, or, where less, the most a real plan
of this search exceeded its prediction (predictions that held stop the search at the best
real plan, as before). The per-sample predictions are not lower bounds: DeepSeek-V3 on 2,048
H800s (``benchmarks/frontier.py``), pipeline 8 x expert 256 was predicted 29.0 s and planned
23.7 s, while pipeline 32 x data 4 x expert 16, predicted below it, planned 27.3 s; stopping
at the first prediction above 27.3 s kept the slower. Errors seen there run from 0.82x to
1.68x; each configuration admitted costs its real planning (and a capture at a new
micro-batch count: Llama 3 405B's row took 42 s at a fixed 1.25 against 24 s)."""

SECOND_LOOK_MARGIN = 1.05
"""A pipeline degree whose best configuration the degree search predicted within this
multiple of the best plan made for real is searched again as if ``pipeline=p`` were pinned
(:func:`_second_look`). The degree search prices every stage mesh per sample on the
full-batch graph, recomputing every layer or none, and its prediction can sit above the
degree's best real plan: Mixtral 8x7B on 64 H100s (``benchmarks/frontier.py``), p = 4 data 16
was predicted 2.884 s (1F1B, its interleaved schedule not fitting at that view of memory)
and p = 4's best 2.630 s (expert 8), so the search stopped at p = 8's real 2.568 s; pinned
``pipeline=4`` plans data 16 interleaved (v = 4) at 2.527 s, on the micro-batch's own prices
with the fewest layers recomputed per rank. A wider margin costs a pinned search per degree
it admits (``pipeline=4`` on Mixtral 8x7B: 5 CPU s, its captures included)."""

SECOND_LOOKS = 2
"""Degrees :func:`_second_look` searches again at most (the best predicted first)."""


def _second_look(found: list, planned: tuple, spec: SearchSpec, verbose: bool) -> tuple:
    """``planned`` = (plan, graph), or the plan of a degree in ``found`` (the degree search's
    best per p: (predicted, p, StagePlan, intra pins)) predicted within
    :data:`SECOND_LOOK_MARGIN` of it, made by ``pipeline_search.plan_pipelined`` with
    ``pipeline=p`` (its stage mesh, micro-batch count, schedule and virtual stages chosen on
    the micro-batch's own prices; with the expert degree the degree search chose too, where
    it chose one), if its step is lower. Its pins stay the user's (:func:`_with_users_pins`)."""
    pins = spec.options
    best = planned
    per_degree = {}         # each degree's best prediction (``found`` has every stage mesh's)
    for x in sorted(found, key=lambda x: x[0]):
        per_degree.setdefault(x[1], x)
    near = [x for x in per_degree.values()
            if x[0] < SECOND_LOOK_MARGIN * planned[0].estimate.step_time_s][:SECOND_LOOKS]
    for predicted, p, _, extra in near:
        tries = [{}] + ([{"expert": extra["expert"]}] if extra.get("expert", 1) > 1 else [])
        for extra_pins in tries:
            try:
                again, mcap = plan_pipelined(replace(spec, options=pins.replace(pipeline=p)),
                                             extra_pins=extra_pins or None, weigh_offload=True)
            except ValueError as e:
                if verbose:
                    print(f"pipeline p={p} {extra_pins or ''} searched again: "
                          f"{str(e).splitlines()[0][:120]}")
                continue
            step = again.estimate.step_time_s
            if verbose:
                print(f"pipeline p={p} {extra_pins or ''} searched again (predicted "
                      f"{predicted:.4g} s): planned {step:.4g} s")
            if step < best[0].estimate.step_time_s:
                best = (_with_users_pins(again, pins), mcap)
    return best


def _with_users_pins(plan: Plan, pins: Options) -> Plan:
    """``plan`` (made with a pipeline degree, micro-batch and schedule pinned in the search's
    stead) with the user's ``pins`` as its options, and what the search chose that a plan's
    options carry (ZeRO stage, expert degree, fp8 layers, offloaded layers)."""
    return replace(plan, options=Options.from_pins(
        {k: v for k, v in plan.options.items()
         if k in pins or k in ("zero", "expert", "fp8_layers", "offload_activations")}))


def _frees_layers(plan: Plan, pins: Options) -> bool:
    """Whether ``plan`` recomputes layers or offloads layers the search chose to
    (``pipeline_offload``): it fits by freeing them."""
    return bool(plan.recompute) or (pins.offload_activations is None
                                    and plan.options.offload_activations is not None)


def _may_choose_again(pins: Options) -> bool:
    """Whether the user left recompute= free and a schedule or a virtual-stage count to
    choose (``_replan_recomputing``)."""
    fixed = pins.schedule and (pins.schedule != "interleaved-1f1b" or pins.virtual_stages)
    return pins.recompute is None and not fixed


def _replan_recomputing(real: Plan, mcap, spec: SearchSpec, config, extra) -> Plan:
    """``real``, a plan that recomputes layers (or offloads those the search chose to:
    ``pipeline_offload``, weighed again here), or, if predicted faster, the plan of the same
    pipeline degree p, micro-batch count m and stage mesh with schedule and virtual stages
    chosen again on the micro-batch's own prices (``pipeline_search.plan_pipelined``, which
    ranks them with per rank the fewest layers recomputed that fit). The search ranked them
    recomputing every layer or none, where a schedule that holds fewer micro-batches in
    flight, and so needs fewer layers recomputed, loses what it gains (Llama 3 405B on
    8,192 H100s: zero bubble chosen, 14.4 s; interleaved 12.3 s). Recomputing, the stage
    mesh is also tried with ZeRO-2 over its data axis when the search's intra-stage plan left
    it out (it fitted by recomputing every layer; sharding gradients and optimizer state
    leaves room to recompute fewer). Its pins stay the user's."""
    p, _, m, _ = config
    pins = spec.options
    batch = int(spec.example_inputs[0].shape[0])
    mesh = {k: v for k, v in extra.items() if k != "recompute"}
    tries = [mesh]
    if pins.zero is None and not mesh.get("zero") and mesh.get("data", 1) > 1 \
            and (mesh.get("expert") or pins.expert or 1) == 1:
        tries.append({**mesh, "zero": 2})
    # (accumulate=1, "no accumulation", may be pinned beside a pipeline the search chose)
    at = pins.replace(pipeline=p, micro_batch_size=batch // m, accumulate=None)
    best = real
    for extra_pins in tries:
        try:
            again, _ = plan_pipelined(replace(spec, options=at), cap0=mcap, extra_pins=extra_pins,
                                      weigh_offload=True)
        except ValueError:
            continue
        if again.estimate.step_time_s < best.estimate.step_time_s:
            best = _with_users_pins(again, pins)
    return best


class _DegreeSearch:
    """The free search's best configuration for one pipeline degree, priced on the
    full-batch graph."""

    def __init__(self, spec: SearchSpec, cap, degrees=()):
        pins = as_options(spec.options)
        self.cap, self.cl, self.world, self.pins = cap, spec.cluster, spec.world, pins
        self.batch = int(spec.example_inputs[0].shape[0])
        self.budget, self.optimizer, self.verbose = spec.budget, spec.optimizer, spec.verbose
        self.time_limit_s = spec.time_limit_s
        optimizer = spec.optimizer
        self.degrees = degrees
        self.n_experts = moe_experts(cap)
        # every (p, data, tensor, expert) ``best`` may solve, in its order: what workers
        # solve ahead
        self.meshes = [(p, *mesh) for p in degrees for mesh in self._stage_meshes(p)]
        # every repeated layer, or those a pinned offload_activations= leaves (not both)
        self.rest = recompute_rest(cap, pins) if pins.recompute is None and _has_layers(cap) else None
        self.layers = select_layers(cap.gm, self.rest) if self.rest else ()
        self.state = state_bytes(cap, optimizer, pins.precision)
        # the state of the experts' weight stacks apart (an expert axis splits them)
        self.state_split = split_state_bytes(cap, state_per_param(optimizer, pins.precision)) \
            if self.n_experts is not None else None
        # branch and bound: the least predicted step found so far; a mesh whose step floor
        # (pipeline_search.step_floor: its busiest rank's work) cannot beat it is skipped
        self.bound, self.pruned = math.inf, []
        # a pruned mesh's intra-stage solution and prices, kept for ``unpruned`` (which
        # would otherwise solve the same ILP again)
        self.priced: dict[tuple[int, int, int, int], tuple] = {}
        self._floors: dict[tuple[int, int, int, int], float] = {}   # ``compute_floor``'s
        # (p, data, tensor, expert) of the stage meshes whose ILP reached its time limit
        # with no solution (``plan.solver.skipped`` names them)
        self.timed_out: list[tuple[int, int, int, int]] = []

    def unpruned(self) -> list:
        """The best of each stage mesh the bound skipped, priced in full: every one, not the
        best predicted per degree (the predictions can misorder two meshes of a degree:
        Qwen3-235B's p = 16, expert 16 predicted above data 4 x tensor 2 x expert 2, planned
        16.6 s against 19.2 s)."""
        out, pruned = [], self.pruned
        self.pruned = []
        for p, data, tensor, expert in pruned:
            self.bound = math.inf       # none prunes another: the predictions are in doubt
            got = self._on_mesh(p, data, tensor, expert,
                                self.priced.pop((p, data, tensor, expert), None))
            if got is not None:
                out.append(got)
        return out

    def figures(self, p: int) -> list:
        """Every stage mesh's (predicted step, p, StagePlan, intra pins), least predicted
        first (none where nothing fits). Per expert degree, the most tensor-parallel stage
        mesh first: of one expert degree it holds the least per device, so when no plan on
        it fits the memory budget, none of the others of that degree does and they are
        skipped. (A mesh whose floor cannot beat the best found is pruned, not listed:
        ``unpruned`` lists it once the best falls short.)"""
        out, skip = [], set()
        meshes = self._stage_meshes(p)
        for k, (data, tensor, expert) in enumerate(meshes):
            if expert in skip:
                continue
            self.out_of_memory = False
            got = self._on_mesh(p, data, tensor, expert)
            if self.out_of_memory and (k == 0 or meshes[k - 1][2] != expert):
                skip.add(expert)
            if got is not None:
                out.append(got)
        return sorted(out, key=lambda x: x[0])

    def _stage_meshes(self, p: int) -> list[tuple[int, int, int]]:
        """(data, tensor, expert) of ``p``'s stage meshes in ``best``'s order: by expert
        degree as ``stage_meshes_experts`` gives them (no expert axis first), most tensor
        parallel first within one. An expert mesh whose data x expert ranks do not divide
        the batch is left out: the batch is split over both, so no plan on it exists (the
        problem it would build, 30 s of CPU on DeepSeek-V3, ends in that error)."""
        meshes = [m for m in stage_meshes_experts(self.cl, self.world // p, self.pins,
                                                  self.n_experts)
                  if m[2] == 1 or self.batch % (m[0] * m[2]) == 0]
        order = list(dict.fromkeys(e for _, _, e in meshes))
        return sorted(meshes, key=lambda m: (order.index(m[2]), -m[1]))

    def _least_state(self, p: int, data: int, tensor: int, expert: int = 1) -> float:
        """Parameter and optimizer bytes the fullest rank holds at least (without a zero=
        pin the intra-stage search weighs ZeRO over the data axis: flat.py; an expert axis
        splits the experts' stacks and is not combined with ZeRO:
        ``expert_search.least_state_bytes``)."""
        if expert > 1 and self.state_split is not None:
            return least_state_bytes(*self.state_split, p, tensor, expert)
        return self.state / (p * tensor * (1 if self.pins.zero == 0 else data))

    def _mesh(self, data: int, tensor: int, expert: int) -> dict:
        """The intra-stage pins of a stage mesh (the expert degree where the search chose it)."""
        mesh = {"data": data, "tensor": tensor}
        if expert > 1 and not self.pins.expert:
            mesh["expert"] = expert
        return mesh

    def _solve(self, p: int, data: int, tensor: int, expert: int = 1):
        """The intra-stage (Plan, Solved) of one stage mesh, memory seen as one rank of a
        1F1B pipeline with the smallest micro-batch (one sample per data-parallel rank)
        sees it: 1/p of the state, the activations of one micro-batch of the whole graph
        (p micro-batches of 1/p of it); per micro-batch too its inputs and the transient of
        rebuilding one recomputed layer in backward (priced on the full batch, it alone can
        exceed the budget)."""
        weights = memory_weights("1f1b", p, p, 1)
        weights["activations"] *= data / self.batch
        # (a rank of the expert axis holds its own samples as a data-parallel rank does)
        weights["activations"] *= expert
        weights["inputs"] = weights["recompute"] = data * expert / self.batch
        mesh = self._mesh(data, tensor, expert)
        # (the stage plans are solved quietly, without a mesh shape or a profiler)
        ask = MeshAsk(self.cl, self.world, self.pins,
                      Settings(self.budget, optimizer=self.optimizer, time_limit_s=self.time_limit_s),
                      view=StepView(weights), explain=False)
        if self.pins.zero is None and data > 1 and wide_grads(self.pins) and \
                (self.pins.expert or expert) == 1:
            # gradients reduced in fp32 once a step: ZeRO-2's reduce-scatter and 16-bit
            # gather move less than an fp32 all-reduce, and hold less, so it is the stage
            # mesh's ZeRO stage (the flat search would weigh it against the all-reduce
            # hidden behind the whole backward, where a pipeline hides it behind the last
            # micro-batch's only); the free stage when ZeRO-2 does not fit
            try:
                return solve_intra(self.cap, replace(ask, pins=self.pins.replace(**mesh, zero=2)), p)
            except InfeasibleError:
                pass
        return solve_intra(self.cap, replace(ask, pins=self.pins.replace(**mesh)), p)

    def solve_ahead(self, mesh: tuple[int, int, int]) -> None:
        """A worker's part (``speculate.Speculation``): solve ``mesh`` = (p, data, tensor,
        expert) as ``_on_mesh`` will, its programs' outcomes recorded for the search; not
        where the search will skip it (its memory bound, or its compute floor against the
        best step the search has predicted so far, ``speculate.best_found_s``)."""
        if self._least_state(*mesh) <= self.budget and \
                self.compute_floor(*mesh) < speculate.best_found_s():
            self._solve(*mesh)

    def compute_floor(self, p: int, data: int, tensor: int, expert: int = 1) -> float:
        """Seconds no pipeline plan of degree ``p`` on this stage mesh predicts less than,
        worked out before its intra-stage ILP is built and solved (kept per mesh).

        It is ``flat.mesh_floor`` of the stage mesh (``prices.compute_floor``: every node
        of the whole graph at its least compute over its options on the ``world / p``
        devices of one stage, recomputing nothing) over ``p``. Why it holds: the stage's
        intra plan chooses one option per node, so the graph's compute under it (what
        ``pipeline_costs.node_costs`` reads from the same price table, per chain node) is
        at least that floor F, recomputation only adding to it; the search prices the
        plan per sample and ``pipeline_search.step_floor`` (<= the predicted step of every
        m, schedule and cut ``_choose`` weighs) is at least m x (the per-sample layer times
        summed, times the micro-batch, plus the fixed costs) / p >= F / p: the busiest
        of the p ranks runs at least 1/p of the graph's work, and the schedule's bubbles,
        the crossings and the gradient sync only add. The floor reads node prices only
        (no edge), so it costs about a thousandth of the ILP on large graphs; ZeRO stages
        change parameters' options only, which carry no compute (outside offload, which
        the pipeline search does not weigh)."""
        key = (p, data, tensor, expert)
        got = self._floors.get(key)
        if got is None:
            d = self.world // p
            pins = Options.from_pins({k: v for k, v in self.pins.replace(
                **self._mesh(data, tensor, expert)).items() if k in INTRA_PINS})
            try:
                got = mesh_floor(self.cap, _sub_cluster(self.cl, d), d, pins, self.optimizer) / p
            except ValueError:          # no mesh or no option: the ILP says why
                got = -math.inf
            self._floors[key] = got
        return got

    def _on_mesh(self, p: int, data: int, tensor: int, expert: int = 1,
                 priced: tuple | None = None):
        """``best``'s figure for one stage mesh; ``priced``: its (intra plan, Solved,
        Priced, allowed micro-batch counts) from when the bound pruned it."""
        cap, pins, batch = self.cap, self.pins, self.batch
        mesh = self._mesh(data, tensor, expert)
        key = (p, data, tensor, expert)
        least = self._least_state(p, data, tensor, expert)
        if least > self.budget:          # the fullest rank holds at least this much state
            self._say(p, mesh, f"at least {least / 2**30:.1f} GiB of parameters and optimizer "
                               "state per device")
            return None
        if priced is None and self.bound < math.inf and \
                self.compute_floor(p, data, tensor, expert) >= self.bound:
            # no plan on it can beat the best found: not built, not solved (``unpruned``
            # solves it if the best falls short when planned for real)
            self.pruned.append(key)
            self._say(p, mesh, f"cannot beat {self.bound:.4g} s (compute floor "
                               f"{self.compute_floor(p, data, tensor, expert):.4g} s, not solved)")
            return None
        if priced is None:
            ahead = speculate.active()
            if ahead is not None:
                ahead.take(key)     # a worker's outcomes, if it took the mesh
            try:
                intra, sol = self._solve(p, data, tensor, expert)
                pr = price_plan(cap, intra, sol, self.cl, self.world, p,
                                most_stages(pins, p, stage_limit(cap)))
                priced = (intra, sol, pr, _allowed_micro_batches(batch, batch_degree(cap, intra)))
            except ValueError as e:          # InfeasibleError, PinError, ...
                # (a program stopped by the ILP's time limit says nothing of memory)
                self.out_of_memory = isinstance(e, InfeasibleError) and \
                    not isinstance(e, TimeLimitError)
                if isinstance(e, TimeLimitError):
                    self.timed_out.append(key)
                self._say(p, mesh, str(e).splitlines()[0][:100])
                return None
        intra, sol, pr, allowed = priced
        if step_floor(pr, p, batch, pins, allowed) >= self.bound:
            # its busiest rank alone takes longer than the best found (recomputing only adds)
            self.pruned.append(key)
            self.priced[key] = priced
            self._say(p, mesh, f"cannot beat {self.bound:.4g} s")
            return None
        for rec in ((), self.layers) if self.layers else ((),):
            if rec:
                pr = replace(pr, nc=pr.nc.with_recompute(cap, rec))
            try:
                got = _choose(_per_micro_batch(pr, data * expert / batch), p, batch, self.budget, pins,
                              allowed, bound=self.bound * (1 + 1e-6))
            except ValueError:
                continue
            if got is None:     # nothing on this mesh can beat the best found (nor recomputing)
                self.pruned.append(key)
                self.priced[key] = priced
                self._say(p, mesh, f"cannot beat {self.bound:.4g} s")
                return None
            sp, predicted = got
            self.bound = min(self.bound, predicted)
            if (ahead := speculate.active()) is not None:
                ahead.found(self.bound)       # the workers weigh their jobs against it
            # recomputing only when nothing fits without it
            chosen = {"zero": intra.options.zero} if intra.options.zero and not pins.zero else {}
            return predicted, p, sp, {**mesh, **chosen,
                                      **({"recompute": self.rest or "full"} if rec or intra.recompute
                                         else {})}
        return None

    def _say(self, p, mesh, why):
        if self.verbose:
            e = f" expert={mesh['expert']}" if "expert" in mesh else ""
            print(f"pipeline search p={p} data={mesh['data']} tensor={mesh['tensor']}{e}: {why}")


def _per_micro_batch(pr, share: float):
    """``pr`` (priced on the full batch) with what a rank holds once besides its stages'
    activations (the inputs, one recomputed layer rebuilt in backward, the offloaded layers
    in flight) at the smallest micro-batch, ``share`` of the batch: the stage DP adds the
    activations per sample."""
    nc = pr.nc
    held = [(name, {k: b * share if k == "inputs" else b for k, b in terms.items()}, users)
            for name, terms, users in nc.placeholders]
    return replace(pr, nc=replace(nc, placeholders=held, recompute_bytes=nc.recompute_bytes * share,
                                  offload_bytes=nc.offload_bytes * share))
