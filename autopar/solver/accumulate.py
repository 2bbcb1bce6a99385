"""Gradient accumulation without a pipeline: ``k`` micro-batches a step, each run forward
and backward, the gradients synchronised once per step.

Pinned by ``accumulate=k`` or ``micro_batch_size=`` without ``pipeline=`` (both given must
agree); chosen by the free search (:func:`search_accumulation`) when the full batch's
activations do not fit, or fit only recomputed (:func:`may_accumulate`).

The graph is captured at micro-batch size with its loss rewritten so that the micro-batch
losses sum to the global batch's (``analysis.microbatch_loss``, as for a pipeline), and the
one-stage solver plans it as it stands, so:

- memory: one micro-batch's activations (about 1/k of the full batch's); parameters,
  gradients and optimizer state as without accumulation;
- time: the solver's objective is one micro-batch (its compute, its tensor-parallel and
  ZeRO collectives) plus the bucketed gradient reductions weighted ``1 / k``
  (``grad_sync_scale``); the step is ``k`` times that, so the reductions count once and
  everything else ``k`` times. What a micro-batch costs beyond ``1 / k`` of the batch
  (every kernel's launch, less efficient small GEMMs) is in its roofline, ``k`` times.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

import torch

from autopar.analysis.batch_statistics import batch_statistics_nodes
from autopar.capture import Captured
from autopar.cost_models.memory import training_state_bytes
from autopar.cost_models.step import step_time
from autopar.errors import PinError
from autopar.options import Options, as_options
from autopar.plan import Plan
from autopar.solver.errors import InfeasibleError
from autopar.pricing.costing import StepView
from autopar.solver.flat import (ZERO_STAGES, BeyondCutoff, MeshAsk, Unsolved, mesh_floor,
                                 recompute_bound_s, solve_ask)
from autopar.solver.pipeline_search import capture_microbatch
from autopar.solver.spec import SearchSpec

MAX_TRIES = 4
"""Micro-batch counts the free search plans (the least first) before it stops."""


def _batch(example_inputs: Sequence) -> int:
    t = example_inputs[0] if example_inputs else None
    if not isinstance(t, torch.Tensor) or t.ndim == 0:
        raise PinError("gradient accumulation splits every input and the target along dim 0 "
                       f"into micro-batches; the first input is {type(t).__name__} "
                       f"{tuple(getattr(t, 'shape', ()))}")
    return int(t.shape[0])


def _splits(pins: Options, micro: int) -> bool:
    """Whether a micro-batch of ``micro`` rows splits over the pinned ``data=`` x
    ``expert=`` ranks (both axes split an input's dim 0: ``pricing.problem``; unpinned
    degrees ask nothing)."""
    ranks = (pins.data or 1) * (pins.expert or 1)
    return micro % ranks == 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulation_pin(pins: Options, example_inputs: Sequence) -> int | None:
    """Micro-batches per step the pins ask for without a pipeline (``accumulate=``, or the
    global batch over ``micro_batch_size=``); None when neither is pinned. Raises
    ValueError when they do not divide the batch or disagree."""
    pins = as_options(pins)
    k, mbs = pins.accumulate, pins.micro_batch_size
    if k is None and mbs is None:
        return None
    batch = _batch(example_inputs)
    if mbs is not None:
        if batch % mbs:
            raise PinError(f"micro_batch_size={mbs} does not divide the global batch {batch}: "
                           f"micro-batches must be equal; choose one of {_divisors(batch)}")
        if k is not None and k != batch // mbs:
            raise PinError(f"accumulate={k} and micro_batch_size={mbs} disagree: a global batch "
                           f"of {batch} in micro-batches of {mbs} is {batch // mbs} micro-batches; "
                           "pin one of them")
        k = batch // mbs
    if batch % k:
        raise PinError(f"accumulate={k} does not divide the global batch {batch}: micro-batches "
                       f"must be equal; choose one of {_divisors(batch)}")
    return k


def capture_accumulated(model, example_inputs, loss_fn, target, k: int) -> Captured:
    """The graph of one of ``k`` micro-batches, its loss a term of the global batch's.
    ``loss_fn`` is the in-graph loss (None: the model returns its own)."""
    cap = capture_microbatch(model, example_inputs, loss_fn, target, k)
    if not cap.has_loss:
        raise PinError("gradient accumulation needs the loss in the graph: pass loss_fn and "
                       "target= (or a model that returns its scalar loss), so that each "
                       "micro-batch's loss can be made its term of the global batch's")
    return cap


def accumulated_plan(plan: Plan, k: int) -> Plan:
    """``plan``, solved for one micro-batch, as a step of ``k`` micro-batches: every time
    ``k`` times (the gradient reductions were weighted ``1 / k``), memory as it is."""
    e = plan.estimate
    # the host's dispatches too run k times (the optimizer's few foreach calls once: within
    # a fraction of a percent, ``cost_models.host.OPTIMIZER_DISPATCHES``)
    est = replace(e, step_time_s=step_time((e.compute_s + e.comm_s) * k, e.host_s * k),
                  compute_s=e.compute_s * k, comm_s=e.comm_s * k,
                  comm={n: t * k for n, t in e.comm.items()}, host_s=e.host_s * k)
    return replace(plan, estimate=est, accumulate=k)


def plan_accumulated(spec: SearchSpec, k: int, explain=True, cap: Captured | None = None,
                     best_s: float = math.inf, pruned: list | None = None) -> tuple[Plan, Captured]:
    """The one-stage plan of ``spec`` at ``k`` micro-batches a step, and the graph it runs
    on. ``explain=False``: where nothing fits, without working out how far (the free
    search's tries, which only note that ``k`` does not fit). ``cap``: the micro-batch's
    graph, captured already (:func:`capture_accumulated`). ``best_s``: a step the caller
    has a plan for: programs that cannot give a step below it are not solved
    (``MeshAsk.cutoff_s`` at ``best_s / k``: a step is at least ``k`` times its program's
    objective, :func:`accumulated_plan`); ``flat.BeyondCutoff`` where none can. ``pruned``:
    a list the programs left unsolved so are added to (``MeshAsk.pruned``)."""
    t0 = time.perf_counter()
    if cap is None:
        cap = capture_accumulated(spec.model, spec.example_inputs, spec.loss_fn, spec.target, k)
    capture_s = time.perf_counter() - t0
    ask = MeshAsk(spec.cluster, spec.world, spec.options, spec.settings,
                  view=StepView(grad_sync_scale=1.0 / k), explain=explain, cutoff_s=best_s / k,
                  pruned=pruned if pruned is not None else [])
    plan, _ = solve_ask(cap, ask, capture_s)
    plan = accumulated_plan(plan, k)
    if spec.verbose:
        print(f"accumulate {k} micro-batches: step {plan.estimate.step_time_s * 1e3:.3f} ms, "
              f"{plan.estimate.memory_total / 2**30:.2f} GiB/device")
    return plan, cap


def may_accumulate(cap: Captured, example_inputs, pins: Options, flat: Plan | None, *,
                   world: int, budget: float, optimizer: str = "adamw") -> bool:
    """Whether the free search tries gradient accumulation: not pinned either way, the loss
    in the graph, every input split along dim 0, and the full batch's best plan ``flat``
    recomputes layers to fit, or no plan of the full batch fits (not even recomputed) while
    the training state could (``budget`` above its bytes sharded over all ``world``
    devices: micro-batches shrink activations only); never for a graph that normalizes by
    batch statistics (``analysis.batch_statistics``: its numbers would change). Micro-batches are the other way to
    shrink activations: each costs its kernels' launches and smaller GEMMs where
    recomputation costs a layer's forward again, and the least predicted step wins."""
    if pins.accumulate is not None or pins.micro_batch_size is not None:
        return False
    if not cap.has_loss or not example_inputs:
        return False
    if not all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in example_inputs):
        return False
    if int(example_inputs[0].shape[0]) < 2:
        return False
    if batch_statistics_nodes(cap):      # BatchNorm: micro-batches change its statistics
        return False
    if flat is not None:
        return bool(flat.recompute) and pins.recompute is None
    numel = sum(cap.node(ph).meta["val"].numel() for ph in cap.params)
    state = training_state_bytes(numel, optimizer, pins.precision or "fp32", zero=3, dp=world)
    return sum(state.values()) < budget


def accumulation_may_win(flat: Plan, best: Plan, cap: Captured) -> bool:
    """Whether micro-batches without recomputation could beat ``best``, where the full
    batch's plan ``flat`` recomputes: they save about its recomputation (the estimate
    ``flat.recompute_bound_s``), and each micro-batch's launches and smaller GEMMs cost
    more, so a step above ``best``'s by more than that is not worth capturing and planning
    again."""
    return flat.estimate.step_time_s - recompute_bound_s(flat, cap) < best.estimate.step_time_s


def accumulation_floor(spec: SearchSpec, cap: Captured, k: int) -> float:
    """Seconds no plan :func:`plan_accumulated` makes at ``k`` micro-batches predicts a
    step below, from the micro-batch's graph ``cap``: ``k`` times the least compute floor
    (``flat.mesh_floor``: every node at its least compute over its options, recomputing
    nothing) over the meshes the pins allow, and those of each ZeRO stage the search may
    weigh (a ZeRO pin makes the 1-D mesh's axis the data axis: other options).

    Why it holds: that plan's step is ``max(k (compute_s + comm_s), k host_s)``
    (:func:`accumulated_plan`, ``step_time``), where ``compute_s + comm_s`` is the
    objective of the program it was solved as (``flat._to_plan``), which is at least its
    mesh's compute floor (``prices.compute_floor``) whatever it recomputes (recomputation
    only adds compute); the program's mesh, roles and ZeRO stage are among those minimised
    over (a ``mesh_shape`` setting only narrows the meshes). Reads node prices only (no
    edge, no ILP). ``-inf`` where it proves nothing (no mesh, a node with no option)."""
    pins = spec.options
    variants = [pins] + ([pins.replace(zero=z) for z in ZERO_STAGES] if pins.zero is None else [])
    floors = []
    for variant in variants:
        try:
            floors.append(mesh_floor(cap, spec.cluster, spec.world, variant, spec.optimizer))
        except ValueError:       # no mesh for these pins, no option for a node
            if variant is pins:
                return -math.inf     # the ILP says why
    return k * min(floors)


def search_accumulation(spec: SearchSpec, best_s: float = math.inf,
                        notes: list | None = None) -> tuple[Plan, Captured] | None:
    """The fastest plan over micro-batch counts ``k`` (divisors of the batch, the least
    first, at most :data:`MAX_TRIES`), or None when none fits or none beats ``best_s``. It
    stops at the first ``k`` that fits without recomputation (more micro-batches only add
    per-micro-batch costs); when the least ``k`` does not fit, it gives up unless the most
    (one sample each) does. With ``data=`` pinned, only counts whose micro-batch that
    degree splits (a micro-batch of fewer rows than data ranks has no plan:
    ``build_problem`` refuses it with a ``PinError`` about the input, which would hide why
    the full batch did not fit).

    ``best_s``: the best step the caller has found (the free search's). Two exact bounds
    against it (the caller keeps the least step, the first of equals, so a plan at or
    above it is not taken):

    - before it plans a count, the search stops where every count it could still plan (the
      rest of the tries, and the one-sample count while the first has not been planned)
      has a compute floor (:func:`accumulation_floor`, the counts' graphs captured in
      order, as far as needed to find one below ``best_s``) of at least ``best_s``
      (without a profiler: the floor prices ops by the cost model);
    - each count's search (:func:`plan_accumulated`) leaves unsolved every program whose
      LP relaxation (``solver.lp_bound``: it counts the communication the memory budget
      forces, which the compute floor does not) gives no step below the least of
      ``best_s`` and the steps found so far (``MeshAsk.cutoff_s``); a count none of whose
      programs can is "beyond" (``flat.BeyondCutoff``): it may fit, so the search goes on
      to the next count as it would after a count planned with recomputation, unless one
      of its unsolved programs without recomputation is known to fit
      (:func:`fits_unrecomputed`): there the search without the bounds stops too, or, where
      its plan of that count recomputes, goes on to counts the stage's rule says cannot beat
      a plan the count has, at least the cutoff.

    What it returns: the plan the search without the bounds returns wherever that plan is
    below ``best_s``, except that a program left unsolved is not the base of the
    fewest-layers probes or the activation offload (``flat._with_fewest_layers``) the
    search without the bounds would run on it where it were the best of its count; where
    a count's decisions (recompute every layer, weigh the ZeRO stages, the next count)
    hinge on a program left unsolved, the search weighs more, not less, so its plan is
    never slower. ``notes``: a list the stage's unsolved programs are said in (the free
    search puts them in ``plan.solver.skipped``)."""
    batch, pins = _batch(spec.example_inputs), spec.options
    counts = [d for d in _divisors(batch) if d > 1 and _splits(pins, batch // d)]
    planned: dict[int, tuple[Plan, Captured] | None] = {}
    captured: dict[int, Captured] = {}
    floors: dict[int, float] = {}
    bounded = best_s < math.inf and spec.profiler is None
    pruned: dict[int, list] = {}
    cutoffs: dict[int, float] = {}
    best = None

    def floor(k: int) -> float:
        if k not in floors:
            if k in planned:             # planned already: its step is known
                got = planned[k]
                # beyond: no step below the cutoff it was searched with
                floors[k] = got[0].estimate.step_time_s if isinstance(got, tuple) else \
                    cutoffs[k] if got is BEYOND else math.inf
            else:
                captured[k] = capture_accumulated(spec.model, spec.example_inputs, spec.loss_fn,
                                                  spec.target, k)
                floors[k] = accumulation_floor(spec, captured[k], k)
            if spec.verbose:
                print(f"accumulate {k}: floor {floors[k]:.4g} s against {best_s:.4g} s")
        return floors[k]

    def hopeless(rest) -> bool:
        return bounded and all(floor(k) >= best_s for k in rest)

    def attempt(k: int):
        if k not in planned:
            cutoff = min(best_s, best[0].estimate.step_time_s if best is not None else math.inf)
            cutoffs[k], pruned[k] = cutoff, []
            try:
                planned[k] = plan_accumulated(spec, k, explain=False, cap=captured.pop(k, None),
                                              best_s=cutoff, pruned=pruned[k])
            except BeyondCutoff as e:
                planned[k] = BEYOND
                if spec.verbose:
                    print(f"accumulate {k}: {e}")
            except (InfeasibleError, PinError) as e:   # PinError: no mesh splits its micro-batch
                planned[k] = None
                if spec.verbose:
                    print(f"accumulate {k}: nothing fits ({str(e).splitlines()[0]})")
        return planned[k]

    tries = counts[:MAX_TRIES]
    for i, k in enumerate(tries):
        if hopeless(tries[i:] + (counts[-1:] if i == 0 else [])):
            if spec.verbose:
                print(f"accumulation: no count from {k} on can beat {best_s:.4g} s (floors)")
            break
        got = attempt(k)
        # may fit, cannot win: the next count may, unless the rule's premise holds here
        settled = got is BEYOND and fits_unrecomputed(pruned[k])
        pruned[k] = [tuple(u[:3]) for u in pruned[k]]   # what the note says (prices freed)
        if got is BEYOND:
            if settled:
                break
            continue
        if got is None:
            # not even micro-batches of one sample fit; or neither they nor the tries left
            # could win, whatever they give
            if i == 0 and (hopeless(counts[-1:] + tries[1:]) or attempt(counts[-1]) is None):
                break
            continue
        if best is None or got[0].estimate.step_time_s < best[0].estimate.step_time_s:
            best = got
        if not got[0].recompute:
            break
    if notes is not None:
        notes.extend(pruned_note(pruned))
    return best


WITNESS_MESH_DIMS = 1
"""Unsolved programs :func:`fits_unrecomputed` solves to learn whether a count fits without
recomputation: those on meshes of at most this many dimensions (a 1-D mesh's program is
priced and solved in about a second on Llama 3 70B at 4 micro-batches, a 2-D one's in
25-80 s at load 4-7)."""


def fits_unrecomputed(unsolved: list) -> bool:
    """Whether one of a count's programs left unsolved for the cutoff (``flat.Unsolved``),
    without recomputation and on a mesh of at most :data:`WITNESS_MESH_DIMS` dimensions, has
    a plan within the budget: then the count fits without recomputation, and by the stage's
    rule (:func:`search_accumulation`: from the first such count, more micro-batches only
    add per-micro-batch costs) no later count beats its plan, which is at least the cutoff.
    False where none is known to fit (the search goes on: it weighs more, not less)."""
    return any(u.fits() for u in unsolved      # (a count settled before: its prices freed)
               if isinstance(u, Unsolved) and u.rec is None and len(u.shape) <= WITNESS_MESH_DIMS)


BEYOND = "beyond the cutoff"
"""``search_accumulation``'s outcome of a count none of whose programs can beat the best."""


def pruned_note(pruned: dict[int, list]) -> list[str]:
    """One line for the programs :func:`search_accumulation` left unsolved (by count), or
    none: what ``plan.solver.skipped`` says of the stage."""
    counts = {k: len(p) for k, p in pruned.items() if p}
    if not counts:
        return []
    each = ", ".join(f"{n} at {k} micro-batches" for k, n in counts.items())
    return [f"gradient accumulation: {sum(counts.values())} sharding programs not solved ({each}): "
            "their LP relaxation gives no step below the best plan found (exact); the "
            "fewest-layers probes and activation offload of those programs not tried"]
