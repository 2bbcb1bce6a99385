"""A pipeline plan (placements carry the pipeline axis first, always ``R``): micro-batches, schedule, the intra-stage sharding plan, and the cuts.

``plan_pipelined`` (``autopar.solver.driver.solve`` with ``pipeline=p`` pinned):

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

The free search over pipeline degrees (no ``pipeline=`` pin) is
``autopar.solver.pipeline_free.search_pipelines``; the prices and the estimate are
``autopar.solver.pipeline_price``'s; ``autopar.solver.driver.solve`` calls both planners.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from autopar.analysis.layers import most_blocks, repeated_layers, select_layers
from autopar.analysis.microbatch_loss import MicrobatchLossError
from autopar.analysis.microbatch_loss import rewrite as rewrite_microbatch_loss
from autopar.analysis.stages import chain, parameter_positions
from autopar.capture import Captured, capture
from autopar.errors import PinError
from autopar.mesh_roles import STAGE_AXES
from autopar.options import Options, as_options
from autopar.plan import NodePlacement, Pipeline, Plan
from autopar.schedule import SCHEDULES, check_schedule
from autopar.solver.errors import InfeasibleError, PipelineInfeasibleError, StageCutError, StagesDoNotFit
from autopar.solver.even_split import block_starts, even_cuts
from autopar.pricing.costing import StepView
from autopar.solver.flat import RECOMPUTE_WHEN, MeshAsk, Solved, recompute_rest, solve_ask
from autopar.solver.spec import SearchSpec
from autopar.solver.partial_recompute import fewest_step, partial_pipeline, without_recompute
from autopar.solver.pipeline_offload import may_offload, with_offload
from autopar.solver.pipeline_price import (
    Priced, batch_degree, memory_weights, pipeline_estimate, pipeline_host_bytes, price_plan,
    worst_rank_memory,
)
from autopar.solver.stage_dp import StagePins, _candidates, plan_stages, simulate_plan, DEFAULT_VIRTUAL
from autopar.solver.stage_tables import rank_times

DEFAULT_SCHEDULE = "1f1b"
INTRA_PINS = (*STAGE_AXES, "expert_dispatch", "expert_imbalance", "zero", "precision", "fp8_scaling",
              "dualpipev_overlap",
              "fp8_layers", "compile",
              "recompute", "offload_activations", "grad_reduce", "context_attention")


def micro_batches(batch: int, p: int, v: int, micro_batch_size: int | None) -> int:
    if micro_batch_size is not None:
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or batch % micro_batch_size:
            divs = [d for d in range(1, batch + 1) if batch % d == 0]
            raise PinError(f"micro_batch_size={micro_batch_size!r} does not divide the global batch "
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
            raise PinError("pipeline parallelism splits every input and the target along dim 0 "
                           f"into micro-batches; got {type(t).__name__} {getattr(t, 'shape', '')}")
        if t.shape[0] % m:
            raise PinError(f"{m} micro-batches do not divide a batch of {t.shape[0]} "
                           f"(input of shape {tuple(t.shape)}): pin micro_batch_size= to a "
                           f"divisor of {t.shape[0]}")
        out.append(t.tensor_split(m, dim=0)[0].clone())
    return tuple(out)


def pipeline_config(example_inputs: Sequence, pins: Options) -> tuple[int, int, int, str]:
    """(p, v, m, schedule) from the pins and the batch; raises on what torch cannot run."""
    pins = as_options(pins)
    p = pins.pipeline
    schedule = pins.schedule or DEFAULT_SCHEDULE
    v = pins.virtual_stages or (2 if schedule in ("interleaved-1f1b", "dualpipev") else 1)
    batch = example_inputs[0].shape[0]
    m = micro_batches(batch, p, v, pins.micro_batch_size)
    try:
        check_schedule(schedule, p, m, v)
    except ValueError as e:
        fix = ""
        if schedule == "dualpipev" and m < 2 * p:
            fix = (f"; pin micro_batch_size to at most {batch // (2 * p)} (a divisor of the batch "
                   f"{batch}) so the batch makes >= {2 * p} micro-batches" if batch >= 2 * p else
                   f"; the batch of {batch} cannot make {2 * p} micro-batches: use a batch of at "
                   f"least {2 * p}, fewer pipeline stages, or another schedule")
        raise PinError(f"schedule {schedule!r} cannot run {p} pipeline stages with {m} "
                       f"micro-batches ({v} virtual stages per rank): {e}{fix}") from e
    return p, v, m, schedule


def capture_pipelined(model, example_inputs, loss_fn, target, m: int) -> Captured:
    """The graph of one of a pipeline's ``m`` micro-batches, with its loss: the last stage
    computes each micro-batch's and back-propagates it."""
    cap = capture_microbatch(model, example_inputs, loss_fn, target, m)
    if not cap.has_loss:
        raise PinError("pipeline parallelism needs the loss in the graph: pass loss_fn and "
                       "target= (or a model that returns its scalar loss); the last stage "
                       "computes the loss of each micro-batch")
    return cap


def capture_microbatch(model, example_inputs, loss_fn, target, m: int) -> Captured:
    """The graph of one of ``m`` micro-batches, its loss rewritten into its term of the
    global batch's; ``MicrobatchLossError`` (when planning, before anything runs) where the
    loss is no sum of micro-batch terms (a mixture of experts' load-balancing loss, a
    product of batch means)."""
    inputs = split_batch(example_inputs, m)
    tgt = split_batch((target,), m)[0] if target is not None else None
    # each micro-batch's loss a partial term of the global batch's (summed, never averaged)
    cap = rewrite_microbatch_loss(capture(model, inputs, loss_fn, tgt), m, model)
    spec = cap.microbatch_loss
    if m > 1 and spec is not None and spec.error:
        raise MicrobatchLossError(f"{m} micro-batches (a pipeline or gradient accumulation) "
                                  f"would not train to the single-device numbers: {spec.error}")
    return cap


# ---- one intra-stage solution, priced per node ----------------------------------------------


def _choose(pr: Priced, p: int, batch: int, budget: float, pins: Options, allowed_m=None,
            bound: float = math.inf):
    """(StagePlan, predicted step) of least predicted step (:func:`_ranked`'s first), or
    None."""
    got = _ranked(pr, p, batch, budget, pins, allowed_m, bound)
    return got if got is None else got[0] if got else None


def _ranked(pr: Priced, p: int, batch: int, budget: float, pins: Options, allowed_m=None,
            bound: float = math.inf, partial=None):
    """Every simulated (StagePlan, predicted step), least step first, for pipeline degree p, over what
    the pins leave free (m among ``allowed_m``). ``plan_stages`` picks cuts and m per
    schedule by its closed form; the schedules are then ranked by simulating their
    timelines (the closed form takes transfers as overlapped, which 1F1B-like schedules
    on a slow link are not), plus the once-per-step gradient reduction.

    ``bound``: a search's best predicted step so far. A configuration whose busiest rank
    alone works that long (m micro-batches of its stages, one action at a time: a floor of
    the simulated step) cannot beat it: it is neither planned nor simulated, and None is
    returned when every configuration is such (an error when one that could beat it does
    not fit: recomputing, which only adds time, may then make it fit).

    ``partial`` = (Priced without recomputation, layers): ``pr`` recomputes every layer and
    the user left recompute= free, so a candidate at the captured micro-batch is ranked by
    its step with per rank only the fewest layers recomputed that fit under its cuts
    (``partial_recompute.fewest_layers``, as ``_Cutter.fitting`` will plan it), when that
    is faster: ranked with every layer recomputed, a schedule holding fewer micro-batches in
    flight, which needs fewer recomputed, lost to one that gains nothing from it."""
    mbs = pins.micro_batch_size
    costs = pr.layer_costs()
    limit = max(budget - pr.extra_memory(), 1.0)
    plans, error, beaten = [], None, False
    for kind, v in _kinds_and_virtual(pins, p, stage_limit(pr.cap)):
        try:
            sp = plan_stages(costs, n_devices=p, global_batch=batch, memory_limit=limit,
                             bandwidth=pr.bandwidth, n_stages=p,
                             micro_batches=batch // mbs if mbs else None, schedule=kind,
                             virtual_stages=v, micro_batch_options=allowed_m, explain=False,
                             above=bound, fixed_cuts=pr.fixed_cuts)
        except ValueError as e:
            error = error or e
            continue
        if sp is None:
            beaten = True
        else:
            plans.append(sp)
    if not plans:
        if beaten and error is None:
            return None
        raise error
    simulated = []
    # every schedule's (and virtual stage count's) best cut is simulated: the closed form is
    # no lower bound of the simulated step (unequal stages and transfers: 0.8-0.9x of it)
    for sp in sorted(plans, key=lambda sp: sp.predicted_step_time):
        sync = float(pr.rank_sync([int(pr.bounds[c]) for c in sp.cuts], p, sp.schedule).max())
        busiest = sp.micro_batches * float(rank_times(sp.schedule, p, sp.virtual_stages, sp.stage_times).max())
        if max(busiest + sync, sp.host_time) >= bound:
            continue                       # its busiest rank alone is too slow
        # the busiest rank's host dispatches where they take longer, and its optimizer's
        # after its last backward, beside the reduction (stage_dp's host rule)
        step = max(simulate_plan(sp, timeline=False) + max(sync, pr.optimizer_host_s), sp.host_time)
        if partial is not None:
            step = min(step, _partial_step(pr, partial, sp, p, batch, budget))
        simulated.append((sp, step))
    simulated.sort(key=lambda x: x[1])
    return simulated


def _partial_step(pr: Priced, partial, sp, p: int, batch: int, budget: float) -> float:
    """The predicted step of ``sp``'s cuts with per rank the fewest layers recomputed that
    fit ``budget`` (inf when none fit, or ``sp`` is not at the captured micro-batch)."""
    bare, layers = partial
    if sp.micro_batches * pr.nc.batch != batch or len(bare.bounds) != len(pr.bounds) \
            or (bare.bounds != pr.bounds).any():
        return math.inf
    config = (p, sp.virtual_stages, sp.micro_batches, sp.schedule)
    cuts = tuple(int(bare.bounds[c]) for c in sp.cuts)
    got = fewest_step(pr.cap, bare, layers, config, cuts, budget)
    return math.inf if got is None else got[2]


def _kinds_and_virtual(pins: Options, p: int, limit: int | None = None) -> list[tuple[str, int | None]]:
    """(schedule, virtual stages) pairs ``_choose`` plans apart and then simulates: each
    interleaved virtual stage count on its own (``stage_dp.DEFAULT_VIRTUAL``) unless pinned,
    since the closed form that ``plan_stages`` ranks them by does not order their timelines.
    ``limit`` (:func:`stage_limit`): the most stages p x v the free counts may make. Beside
    them, where a graph's blocks split evenly over the p ranks, the count that gives each
    virtual stage one block (Megatron-LM's deep configurations) when it lies within the
    defaults' range: Mixtral 8x22B's 56 blocks over 8 ranks, v = 7 (its reference layout),
    plan 4.35 s a step on data 2 x expert 2 x tensor 4 against v = 4's 5.03 s (1.75 blocks a
    virtual stage: uneven stages, and four layers recomputed where v = 7 recomputes one)."""
    v = pins.virtual_stages
    free = [u for u in DEFAULT_VIRTUAL if limit is None or p * u <= limit]
    blocks = limit - END_STAGES if limit is not None else 0
    one_block = blocks // p if blocks % p == 0 else 0
    if min(DEFAULT_VIRTUAL) < one_block < max(DEFAULT_VIRTUAL) and one_block not in free:
        free = sorted(free + [one_block])
    return [(kind, u) for kind in _kinds(pins)
            for u in ([2] if kind == "dualpipev" and v is None     # its V: two stages a rank
                      else [v] if v is not None or kind != "interleaved-1f1b" or p < 2
                      else free)]


END_STAGES = 2
"""Stages :func:`stage_limit` allows beyond one a block: the layers before the blocks
(embedding) and after them (head)."""


def stage_limit(cap: Captured) -> int | None:
    """The most stages (ranks x virtual stages) the free search cuts a graph of repeated
    blocks into: one a block, and one more at each end for the layers around the blocks
    (embedding, head), None for a graph without repeated blocks. Megatron-LM's interleaved
    schedule gives each virtual stage at least one layer (``num_layers_per_virtual_pipeline
    _stage`` >= 1); Llama 3 405B ran its 126 layers as 16 x 8 = 128 stages, the first and
    last a layer short (Llama 3 paper, section 3.3.2). More stages than that cut blocks
    apart, and price the chain at 8 points a stage (``pipeline_price.max_units``): Llama 3
    405B at p = 64, v = 8 asked for 3,691 cut points and a 6.5 GiB table of 64 in-flight
    counts (``stage_tables.Tables.arrays``), which killed planning on this 24 GiB machine.
    A ``virtual_stages`` pin is not limited by it."""
    blocks = most_blocks(cap.gm)
    return blocks + END_STAGES if blocks else None


def most_stages(pins: Options, p: int, limit: int | None = None) -> int:
    """The most stages (ranks x virtual stages) ``_choose`` may cut under ``pins``: what the
    chain's cut points (``pipeline_price.cut_points``) are priced for. Fewer would leave a
    count of one layer or so per virtual stage only the layer boundaries to cut at (Llama 3
    405B on 16 stages: v=8 simulated 16.1 s on 4p's cut points, 14.3 s on 8p's)."""
    pins = as_options(pins)
    return p * max(v or 1 for _, v in _kinds_and_virtual(pins, p, limit))


def _kinds(pins: Options) -> list[str]:
    """The schedules ``_choose`` weighs under ``pins``."""
    return [pins.schedule] if pins.schedule else \
        ["interleaved-1f1b"] if pins.virtual_stages else list(SCHEDULES)


def step_floor(pr: Priced, p: int, batch: int, pins: Options, allowed_m=None) -> float:
    """A lower bound of ``_choose``'s predicted step, without planning any cut: whatever
    the cuts and schedule, the busiest of the p ranks runs each of the m micro-batches
    through its stages, at least 1/p of every layer's time and at least the longest layer
    (per micro-batch: its share of the batch, plus its fixed time), and the simulated
    timeline cannot be shorter than that (each layer's floors at that micro-batch included:
    ``LayerCosts.micro_batch_time``); the gradient sync only adds. The least over the
    micro-batch counts the pins and ``allowed_m`` leave; -inf when they leave none. The
    busiest rank's host dispatches (``LayerCosts.host_floor``) are such a floor too."""
    costs = pr.layer_costs()
    mbs = pins.micro_batch_size
    floor = math.inf
    for kind in _kinds(pins):
        try:
            candidates = _candidates(costs.n_layers, p, batch, StagePins(
                p, batch // mbs if mbs else None, kind, pins.virtual_stages, allowed_m),
                learned=costs.n_learned)
        except ValueError:
            return -math.inf      # let ``_choose`` raise what the pins cannot run
        for c in candidates:
            layer = costs.micro_batch_time(batch / c.m)
            floor = min(floor, max(c.m * max(float(layer.sum()) / c.p, float(layer.max())),
                                   costs.host_floor(c.p, c.m)))
    return floor


def _allowed_micro_batches(batch: int, degree: int) -> list[int]:
    return [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % degree == 0]


def _too_few_parameters(p: int, v: int, learned: int, world: int) -> str:
    """Why ``p`` ranks x ``v`` virtual stages cannot each hold a parameter, and what fits."""
    stages = f"{p * v} stages ({p} ranks x {v} virtual)" if v > 1 else f"{p} stages"
    fits = [q for q in range(2, world + 1) if world % q == 0 and q * v <= learned]
    fix = " or ".join([f"pipeline={q}" for q in fits] + (["fewer virtual stages"] if v > 1 else [])
                      + ["no pipeline"])
    return (f"pipeline={p} cuts the model into {stages}, each of which must hold a parameter (a "
            f"stage without one trains nothing: its rank's optimizer would get an empty "
            f"parameter list), but only {learned} op node(s) of this graph read a parameter, "
            f"so at most {learned} stages can each hold one: use {fix}")


def solve_intra(cap: Captured, ask: MeshAsk, p: int, capture_s: float = 0.0):
    """(Plan, Solved) of the whole graph on one stage's ``ask.world // p`` devices of
    ``ask.cl``, under ``ask``'s pins that concern one stage (``INTRA_PINS``), its settings
    and its view (a pipeline rank's: ``memory_weights``, ``1 / m`` of the gradient sync)."""
    d = ask.world // p
    intra_pins = Options.from_pins({k: v for k, v in ask.pins.items() if k in INTRA_PINS})
    settings = ask.settings
    if intra_pins.data or intra_pins.tensor or intra_pins.zero or intra_pins.expert \
            or intra_pins.context:
        settings = settings.replace(mesh_shape=None)        # the pins say which mesh
    return solve_ask(cap, replace(ask, cl=_sub_cluster(ask.cl, d), world=d, pins=intra_pins,
                                  settings=settings), capture_s)


# ---- the plan for one configuration ---------------------------------------------------------


def plan_pipeline(cap: Captured, ask: MeshAsk, config: tuple[int, int, int, str], *,
                  capture_s=0.0, extra_pins=None, solved=None) -> Plan:
    """The Plan for ``cap`` (captured with micro-batch inputs) on ``ask.world`` devices of
    ``ask.cl`` under ``ask.pins``, for ``config`` = (p, v, m, schedule). ``solved`` = (intra
    Plan, Solved) reuses an intra solution of this graph; ``ask.settings.mesh_shape`` fixes
    the intra-stage mesh, ``extra_pins`` (data, tensor, recompute) pin the intra plan
    without being the user's pins.

    Raises :class:`PipelineInfeasibleError` when no cut fits the memory budget and
    :class:`StageCutError` when the graph cannot be cut into the stages at all."""
    cl, world, pins, verbose = ask.cl, ask.world, ask.pins, ask.verbose
    memory_budget = ask.settings.memory_budget
    p, v, m, schedule = config
    if world % p:
        raise PinError(f"pipeline={p} does not divide the world of {world} devices; every stage "
                       f"needs an equal sub-mesh: use a divisor of {world}")
    units = chain(cap)
    if p * v > len(units):
        raise PinError(f"{p * v} pipeline stages ({p} ranks x {v} virtual) are more than this graph "
                       f"can be cut into: it has {len(units)} op nodes ({len(units) - 1} cut "
                       "points); use fewer stages")
    learned = len(parameter_positions(cap))
    if p * v > learned:
        raise PinError(_too_few_parameters(p, v, learned, world))
    if pins.stage_split == "even-layers":
        even_cuts(block_starts(cap), p, v)          # a PinError naming the counts
    cutter = _Cutter(cap, replace(ask, pins=pins.replace(**(extra_pins or {})),
                                  settings=ask.settings.replace(memory_budget=ask.budget)),
                     config, capture_s, free_recompute=pins.recompute is None,
                     free_offload=ask.weigh_offload and may_offload(pins, cl))
    t0 = time.perf_counter()
    try:
        solved, pr, sp = cutter.fitting(solved or cutter.solve(cutter.pins))
    except (StagesDoNotFit, InfeasibleError) as e:
        raise PipelineInfeasibleError(f"pipeline={p}, {m} micro-batches, schedule {schedule!r}: {e}") from e
    except ValueError as e:
        raise StageCutError(f"no cut of {len(units)} op nodes into {p * v} stages: {e}") from e
    cuts = tuple(int(pr.bounds[c]) for c in sp.cuts)
    estimate = pipeline_estimate(pr, config, cuts)
    if verbose:
        print(f"pipeline p={p} v={v} m={m} {schedule}: cuts {[units[c] for c in cuts]}, step "
              f"{estimate.step_time_s * 1e3:.3f} ms, bubble {estimate.bubble_fraction:.3f}, "
              f"{estimate.memory_total / 2**30:.2f} GiB/device ({time.perf_counter() - t0:.2f}s)")
    intra = solved[0]
    # the pipeline axis is replicated for every node (a stage holds its nodes whole on it)
    nodes = {k: NodePlacement(tuple("R" + x for x in v_.inputs), tuple("R" + x for x in v_.outputs))
             for k, v_ in intra.nodes.items()}
    # host memory: the offloaded activations of the micro-batches in flight (not the intra
    # solution's, which priced one micro-batch of the whole graph)
    host = {**{k: b for k, b in intra.host_memory_bytes.items() if k != "activations"},
            **pipeline_host_bytes(pr, config, cuts)}
    return replace(intra, nodes=nodes, world_size=world, mesh_shape=(p, *intra.mesh_shape),
                   mesh_axes=("pipeline", *intra.mesh_axes), memory_budget=memory_budget,
                   host_memory_bytes=host,
                   options=Options.from_pins(pins).replace(
                       **({"zero": intra.options.zero} if intra.options.zero else {}),
                       # an expert axis the search chose is a choice the runtime reads
                       **({"expert": intra.options.expert} if (intra.options.expert or 1) > 1
                          else {}),
                       # the linears fp8 by price (pricing.fp8), as the stage's solution runs them
                       **({"fp8_layers": intra.options.fp8_layers}
                          if intra.options.fp8_layers is not None else {}),
                       # the layers the search offloads (pipeline_offload), which the runtime reads
                       **({"offload_activations": intra.options.offload_activations}
                          if intra.options.offload_activations is not None else {})),
                   estimate=estimate,
                   pipeline=Pipeline(p, v, m, schedule, tuple(units[c] for c in cuts)))


class _Cutter:
    """Intra-stage solutions of one graph for one pipeline configuration, and their cuts."""

    def __init__(self, cap, ask: MeshAsk, config, capture_s: float, free_recompute=False,
                 free_offload=False):
        """``ask``: the pipeline's devices, the intra-stage pins and the settings, its
        memory budget resolved."""
        self.cap, self.ask, self.config, self.capture_s = cap, ask, config, capture_s
        self.cl, self.world, self.pins, self.budget = ask.cl, ask.world, ask.pins, ask.budget
        self.free_recompute = free_recompute    # the user left recompute= to the solver
        # and offload_activations= too, in the free search (``pipeline_offload.may_offload``)
        self.free_offload = free_offload

    def solve(self, pins: Options, limit: float | None = None, explain: bool | None = None,
              ) -> tuple[Plan, Solved]:
        """``explain=False``: an infeasible stage mesh is not worked out how far from fitting
        (the least-memory ILP), where the caller has the plan it had (``with_offload``)."""
        p, v, m, schedule = self.config
        settings = self.ask.settings.replace(memory_budget=self.budget if limit is None else limit)
        ask = replace(self.ask, pins=pins, settings=settings,
                      view=StepView(memory_weights(schedule, p, m, v), 1.0 / m))
        if explain is not None:
            ask = replace(ask, explain=explain)
        return solve_intra(self.cap, ask, p, self.capture_s)

    def cut(self, solved, limit: float | None = None, explain: bool = True):
        """(Priced, StagePlan) of ``solved``; raises StagesDoNotFit when no cut fits."""
        p, v, m, schedule = self.config
        limit = self.budget if limit is None else limit
        pr = price_plan(self.cap, solved[0], solved[1], self.cl, self.world, p, p * v,
                        stage_starts(self.cap, self.pins))
        sp = plan_stages(pr.layer_costs(), n_devices=p, global_batch=pr.nc.batch * m,
                         memory_limit=max(limit - pr.extra_memory(), 1.0),
                         bandwidth=pr.bandwidth, n_stages=p, micro_batches=m,
                         schedule=schedule, virtual_stages=v, explain=explain,
                         fixed_cuts=pr.fixed_cuts)
        return pr, sp

    def fitting(self, solved):
        """(solved, Priced, StagePlan) whose cut fits (``_fitting``); when that recomputes
        and the user left recompute= free, per rank only the fewest layers that fit
        (``partial_recompute.partial_pipeline``) if predicted faster; when it recomputes
        nothing but its intra-stage plan fills memory, the plan recomputing layers so
        chosen, if predicted faster (``_recomputing_too``); in the free search, each layer
        recomputed then recomputed or offloaded, whichever is cheaper
        (``pipeline_offload.with_offload``)."""
        got = self._fitting(solved)
        if self.free_recompute and not got[0][0].recompute:
            got = self._recomputing_too(got)
        elif self.free_recompute:
            got = partial_pipeline(self.cap, got, self.cl, self.world, self.config, self.budget)
        if self.free_offload and self.free_recompute and got[0][0].recompute:
            got = with_offload(self, got)
        return got

    def _recomputing_too(self, got):
        """``got`` = (solved, Priced, StagePlan), which recomputes nothing, or, where its
        intra-stage plan uses :data:`flat.RECOMPUTE_WHEN` of the budget or more, the plan
        solved with every layer recomputed, then per rank only the fewest layers
        (``partial_pipeline``), when its simulated step is less. The intra-stage solver
        weighs recomputing every layer, which its memory may not need: Mixtral 8x22B on
        128 H100s, TP 4 x EP 2 x PP 8 x VP 7, recomputing nothing is 542 ms of compute a
        micro-batch and 4.64 s a step, its placements chosen to fit; every layer 678 ms,
        and a few layers per rank 4.35 s."""
        solved = got[0]
        rest = recompute_rest(self.cap, self.pins)
        if not rest or not _has_layers(self.cap) or \
                sum(solved[0].estimate.memory_bytes.values()) < RECOMPUTE_WHEN * self.budget:
            return got
        try:
            again = self.solve(self.pins.replace(recompute=rest), explain=False)
            other = partial_pipeline(self.cap, (again, *self.cut(again, explain=False)), self.cl,
                                     self.world, self.config, self.budget)
        except (StagesDoNotFit, InfeasibleError):
            return got
        return other if self._step(other) < self._step(got) else got

    def _step(self, got) -> float:
        """The simulated step of (solved, Priced, StagePlan)."""
        _, pr, sp = got
        return pipeline_estimate(pr, self.config, tuple(int(pr.bounds[c]) for c in sp.cuts)).step_time_s

    def _fitting(self, solved):
        """(solved, Priced, StagePlan) whose cut fits. The solver saw uniform stages; the
        real ones (embedding, head, whole layers) hold more: when no cut of ``solved`` fits,
        solve again with the budget short by the real overflow, then with every layer
        recomputed; the last failure explains which stage overflows."""
        try:
            return (solved, *self.cut(solved, explain=False))
        except StagesDoNotFit:
            pass
        retries = []
        worst = worst_rank_memory(self.cap, solved, self.cl, self.world, self.config,
                                  stage_starts(self.cap, self.pins))
        seen = sum(solved[0].estimate.memory_bytes.values())
        if worst > self.budget and seen > 0:
            retries.append((self.pins, self.budget * seen / worst * 0.98))
        rest = recompute_rest(self.cap, self.pins)      # (offloaded layers: not recomputed too)
        if not solved[0].recompute and self.pins.recompute is None and _has_layers(self.cap) and rest:
            retries.append((self.pins.replace(recompute=rest), self.budget))
        explained = solved
        for k, (pins, limit) in enumerate(retries):
            last = k == len(retries) - 1
            try:
                again = self.solve(pins, limit)
            except InfeasibleError:
                # no intra-stage plan within the shortened limit (the solver's view, not the
                # user's budget): the stages of the last plan made say what overflows
                continue
            explained = again
            try:
                return (again, *self.cut(again, explain=last))
            except StagesDoNotFit:
                if last:
                    raise
        return (explained, *self.cut(explained))      # raises, saying which stage overflows


# ---- choosing what the pins leave free ------------------------------------------------------


def plan_pipelined(spec: SearchSpec, *, cap0: Captured | None = None,
                   extra_pins: dict | None = None, weigh_offload: bool = False
                   ) -> tuple[Plan, Captured]:
    """The pipeline plan of ``spec`` for ``pipeline=p`` pinned (m, schedule and virtual
    stages chosen where not pinned), and the graph captured at its micro-batch (the
    spec's ``mesh_shape`` is not read: the stage mesh is the pins' or chosen). ``cap0``:
    the graph already captured at the pins' micro-batch; ``extra_pins``: the intra-stage
    mesh a search chose (data, tensor, zero), applied as pins but not the user's
    (``plan_pipeline``); ``weigh_offload``: the free search's (``MeshAsk.weigh_offload``)."""
    t0 = time.perf_counter()
    model, example_inputs, loss_fn, target = spec.model, spec.example_inputs, spec.loss_fn, spec.target
    cl, world, pins, verbose = spec.cluster, spec.world, spec.options, spec.verbose
    ask = MeshAsk(cl, world, pins, spec.settings.replace(mesh_shape=None),
                  weigh_offload=weigh_offload)
    config0 = pipeline_config(example_inputs, pins)
    p, v0, m0, schedule0 = config0
    if cap0 is None:
        cap0 = capture_pipelined(model, example_inputs, loss_fn, target, m0)
    capture_s = time.perf_counter() - t0
    kw = {"extra_pins": extra_pins}
    if pins.micro_batch_size is not None and pins.schedule is not None \
            and (pins.schedule != "interleaved-1f1b" or pins.virtual_stages is not None):
        return plan_pipeline(cap0, ask, config0, capture_s=capture_s, **kw), cap0
    if world % p:
        plan_pipeline(cap0, ask, config0, **kw)          # raises the error
    budget = ask.budget
    solved = solve_intra(cap0, replace(ask, pins=pins.replace(**(extra_pins or {})),
                                       settings=ask.settings.replace(memory_budget=budget),
                                       view=StepView(memory_weights(schedule0, p, m0, v0), 1.0 / m0)),
                         p, capture_s)
    # the reference configuration's plan; a chosen one replaces it when predicted faster
    try:
        base, base_error = plan_pipeline(cap0, ask, config0, solved=solved, **kw), None
    except ValueError as e:
        base, base_error = None, e
    intra = solved[0]
    batch = int(example_inputs[0].shape[0])
    try:
        starts = stage_starts(cap0, pins)
        most = most_stages(pins, p, stage_limit(cap0))
        pr = price_plan(cap0, intra, solved[1], cl, world, p, most, starts)
        partial = None
        if intra.recompute and pins.recompute is None:
            partial = (price_plan(cap0, intra, without_recompute(solved[1]), cl, world, p,
                                  most, starts), select_layers(cap0.gm, recompute_rest(cap0, pins) or ()))
        ranked = _ranked(pr, p, batch, budget, pins,
                         _allowed_micro_batches(batch, batch_degree(cap0, intra)),
                         partial=partial)
        if not ranked:
            raise ValueError("no configuration could be simulated")
    except ValueError as e:
        if verbose:
            print(f"pipeline p={p}: keeping m={m0} {schedule0} ({e})")
        if base is None:
            raise base_error from None
        return base, cap0
    # planned for real: the best; with recomputation also the runner-up, since the layers
    # each rank recomputes under its real cuts can reorder two close candidates
    best, cap, error = None, cap0, None
    for sp, predicted in ranked[:2 if partial is not None else 1]:
        config = (p, sp.virtual_stages, sp.micro_batches, sp.schedule)
        if verbose:
            print(f"pipeline p={p}: chose m={config[2]} {config[3]} v={config[1]} "
                  f"(predicted {predicted * 1e3:.3f} ms)")
        if config == config0:
            continue
        try:
            if config[2] == m0:
                got, at = plan_pipeline(cap0, ask, config, solved=solved, **kw), cap0
            else:
                at = capture_microbatch(model, example_inputs, loss_fn, target, config[2])
                got = plan_pipeline(at, replace(ask, settings=ask.settings.replace(
                    mesh_shape=intra.mesh_shape)), config, **kw)
        except ValueError as e:      # e.g. infeasible at the new micro-batch
            if verbose:
                print(f"pipeline p={p} m={config[2]} {config[3]}: {e}")
            error = error or e
            continue
        if best is None or got.estimate.step_time_s < best.estimate.step_time_s:
            best, cap = got, at
    if best is not None and (base is None or best.estimate.step_time_s <= base.estimate.step_time_s):
        return best, cap
    if base is None:
        raise error or base_error
    return base, cap0


def stage_starts(cap: Captured, pins: Options) -> list[int] | None:
    """Each repeated layer's chain start under ``stage_split="even-layers"``
    (``even_split.block_starts``), None otherwise (the stage DP cuts)."""
    return block_starts(cap) if pins.stage_split == "even-layers" else None


_LAYERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _has_layers(cap: Captured) -> bool:
    """Whether the graph has repeated layers (worked out once per graph)."""
    got = _LAYERED.get(cap.gm)
    if got is None:
        got = _LAYERED[cap.gm] = bool(repeated_layers(cap.gm))
    return got


def _sub_cluster(cl, d: int):
    """The devices of one stage: the ``d`` consecutive ranks of the intra-stage mesh."""
    dpn = cl.devices_per_node
    nodes, per = (1, d) if d <= dpn else (d // dpn, dpn)
    return replace(cl, name=f"{cl.name}[stage of {d}]", nodes=nodes, devices_per_node=per)


