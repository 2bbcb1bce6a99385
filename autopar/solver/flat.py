"""The one-stage (unpipelined) plan of a captured graph: the sharding ILP over the meshes
the pins allow, with and without recomputation; also what the pipeline planner solves
inside each stage (``memory_weights``, ``grad_sync_scale``)."""
from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from autopar.analysis.layers import offload_nodes, recompute_nodes, repeated_layers, select_layers
from autopar.capture import Captured, fingerprint
from autopar.capture.graph import op_names
from autopar.errors import PinError
from autopar.mesh_roles import MeshRoles
from autopar.placement import local_shape, placements_str
from autopar.plan import Estimate, NodePlacement, Plan, SolverReport
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import OVERLAPPED, WHOLE_STEP, CostModel, Saves, StepView
from autopar.solver.errors import gib, one_screen
from autopar.solver.zero_whole import whole_note
from autopar.solver import speculate
from autopar.solver.ilp import (InfeasibleError, Solution, TimeLimitError, _gib, explain_infeasible,
                                time_limit_fix)
from autopar.solver.ilp import solve as solve_ilp
from autopar.solver.lp_bound import LP_FIRST_ABOVE, best_first, lp_bound, program_size
from autopar.solver.meshes import mesh_candidates
from autopar.solver.offload_choice import choose, layer_prices
from autopar.solver.spec import Settings
from autopar.pricing.activation_offload import frees_device_memory
from autopar.pricing.context import best_form, context_axis_of
from autopar.pricing.fp8 import chosen_fp8_layers
from autopar.cost_models.host import graphs_dispatches, host_time, step_dispatches
from autopar.cost_models.step import step_time
from autopar.options import CUDA_GRAPHS, Options, as_options, check_optimizer
from autopar.pricing.prices import compute_floor, memory_floor
from autopar.pricing.problem import _describe, _placeholder_choices, build_problem

RECOMPUTE_WHEN = 0.9
"""Recompute every repeated layer too when the best plan without it uses this share of memory."""
ZERO_STAGES = (3, 1, 2)
"""Without a ``zero=`` pin, the ZeRO stages weighed on the data axis when memory binds (nothing
fits without them, or the best plan uses more than ``RECOMPUTE_WHEN`` of the budget). Stage 3
first: it needs the least memory, so when it does not fit neither do the others."""


@dataclass(frozen=True)
class Solved:
    """What the solver decided, for callers that price the plan further (the pipeline
    planner): the problem, the cost model it was priced with and the option per node."""
    problem: Any
    cost: Any
    choice: dict


@dataclass(frozen=True)
class MeshAsk:
    """What one unpipelined search asks (:func:`solve_ask`): ``world`` devices of ``cl``,
    the options ``pins``, the search's :class:`Settings`, the share of a step the graph is
    (:class:`StepView`: a pipeline stage's or one micro-batch's view), whether to explain a
    search where nothing fits (``explain``: True, False or ``"later"``, see
    :func:`solve_captured`) and whether to probe the fewest recomputed layers that fit
    (``fewest_layers``)."""
    cl: Any
    world: int
    pins: Options
    settings: Settings = Settings()
    view: StepView = WHOLE_STEP
    explain: bool | str = True
    fewest_layers: bool = True
    timeouts: list = field(default_factory=list)
    """The programs this call's search skipped because they reached the time limit with no
    solution (their :class:`TimeLimitError` s), shared by the ``replace`` d asks of its ZeRO
    stages."""
    cutoff_s: float = math.inf
    """An objective the caller has a plan at least as good as (the free search's best step
    over the micro-batch count, ``accumulate``): a program whose bound (its compute floor,
    then its LP relaxation, ``solver.lp_bound``) is at least this is not solved, and a
    plan at or above it steers nothing (:func:`_search`). ``inf``: none."""
    pruned: list = field(default_factory=list)
    """The programs this call's search did not solve for :attr:`cutoff_s` (each an
    :class:`Unsolved`), shared like :attr:`timeouts`."""
    weigh_offload: bool = False
    """Whether a pipeline plan that frees layers to fit weighs offloading them against
    recomputing them (``solver.pipeline_offload``: the free pipeline search's asks)."""

    def __post_init__(self):
        object.__setattr__(self, "pins", as_options(self.pins))

    @property
    def budget(self) -> float:
        return self.settings.budget(self.cl)

    @property
    def mesh_shape(self):
        return self.settings.mesh_shape

    @property
    def optimizer(self) -> str:
        return self.settings.optimizer

    @property
    def time_limit_s(self) -> float:
        return self.settings.time_limit_s

    @property
    def verbose(self) -> bool:
        return self.settings.verbose

    @property
    def profiler(self):
        return self.settings.profiler

    @property
    def memory_weights(self) -> dict | None:
        return self.view.memory_weights

    @property
    def grad_sync_scale(self) -> float:
        return self.view.grad_sync_scale

    def cost_kw(self) -> dict:
        return dict(profiler=self.profiler, view=self.view)


class MeshJob(NamedTuple):
    """One program of the mesh search: the sharding ILP on mesh ``shape`` whose axes play
    ``roles``, under ``pins`` (the ZeRO stage among them), with ``n_states`` optimizer
    tensors per parameter, recomputing ``rec`` (None, ``"full"`` or layer names), within
    ``budget`` bytes per device and ``time_limit_s`` (which only the ILP reads, not the
    problem or its cost model). What :func:`mesh_jobs` hands a worker and ``_ilp_key``
    keys."""
    shape: tuple
    roles: MeshRoles
    rec: Any
    pins: Options
    n_states: int
    budget: float = float("inf")
    time_limit_s: float = 60.0


@dataclass
class _Best:
    sol: Any
    problem: Any
    shape: tuple
    axes: tuple
    recompute: tuple
    cost: Any
    pins: Options
    roles: MeshRoles       # the problem's axes' roles (``_problem``)
    n_states: int


def node_placements(problem, choice: dict[str, int]) -> dict[str, NodePlacement]:
    """Every graph node's placements, given one option per decision of ``problem``."""
    nodes = {}
    for name, v in problem.vars.items():
        combo = v.options[choice[name]]
        n_in = len(v.call.inputs) if v.call else 0
        entry = NodePlacement(
            tuple(placements_str(input_placements(combo, k)) for k in range(n_in)),
            tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs))))
        for member in v.members:
            nodes[member] = entry
    return nodes


def plan_captured(cap: Captured, cl, world: int, *, pins=None, capture_s=0.0, fewest_layers=True,
                  explain=True, **settings) -> Plan:
    """The best plan for the captured graph on ``world`` devices of ``cl`` (no pipeline).
    ``settings``: :class:`Settings`' fields (``memory_budget``, ``mesh_shape``,
    ``optimizer``, ``time_limit_s``, ``verbose``, ``profiler``).
    ``fewest_layers=False``: where memory binds, every repeated layer recomputed, without
    the probes for the fewest that fit (``_fewest_layers``; the free search defers them
    until the plan could win). ``explain``: as :func:`solve_captured`'s."""
    return solve_captured(cap, cl, world, pins=pins, capture_s=capture_s,
                          fewest_layers=fewest_layers, explain=explain, **settings)[0]


def solve_captured(cap: Captured, cl, world: int, *, pins=None, capture_s=0.0, explain=True,
                   fewest_layers=True, **settings) -> tuple[Plan, Solved]:
    """``plan_captured``, and the solver's :class:`Solved` (:func:`solve_ask` of the
    keywords as one :class:`MeshAsk`). ``explain=False`` skips working out how far from
    fitting an infeasible mesh is; ``explain="later"`` raises, when nothing fits, an
    :class:`InfeasibleError` whose ``explain_later()`` returns the error ``explain=True``
    raises (the least-memory ILPs of ``infeasible``, one or more per mesh, solved only when
    called: the free search needs them only if no other stage finds a plan either)."""
    ask = MeshAsk(cl, world, pins, Settings.of("solve_captured", settings), explain=explain,
                  fewest_layers=fewest_layers)
    return solve_ask(cap, ask, capture_s)


def solve_ask(cap: Captured, ask: MeshAsk, capture_s: float = 0.0) -> tuple[Plan, Solved]:
    """(Plan, :class:`Solved`) of the best unpipelined plan ``ask`` allows: the sharding ILP
    on every mesh its pins allow, with recomputation and the ZeRO stages where memory
    binds. ``ask.view`` goes to the :class:`CostModel` (a pipeline's per-stage view, one of
    several micro-batches)."""
    told = ask.pruned                     # the caller's, told of this call's at the end
    ask = replace(ask, timeouts=[], pruned=[])  # this call's own (its ZeRO stages' asks share them)
    cl, world, pins, budget, mesh_shape = ask.cl, ask.world, ask.pins, ask.budget, ask.mesh_shape
    verbose, explain, memory_budget = ask.verbose, ask.explain, ask.settings.memory_budget
    phases: dict = {}
    best, errors = _search(cap, ask, phases)
    # a plan at or above the cutoff is as good as none: what it would stop is weighed
    binds = not _below(best, ask) or best.sol.memory_total > RECOMPUTE_WHEN * budget
    if pins.zero is None and (mesh_shape is None or len(mesh_shape) == 1):
        # memory binds: weigh sharding parameters, gradients and optimizer state over the
        # data axis (ZeRO 1, 2, 3); the least predicted step wins. Gradients reduced wider
        # than the compute dtype: ZeRO-2 also moves less (a reduce-scatter of the gradients
        # and a 16-bit gather of the weights against an fp32 all-reduce), so it is weighed
        # even when memory does not bind
        stages = _zero_stages(world, pins, mesh_shape, cl, binds)
    else:
        stages = ()
    for stage in stages:
        if verbose:
            print(f"trying zero={stage} on the data axis")
        pruned_before = len(ask.pruned)
        try:
            got, _ = _search(cap, replace(ask, pins=pins.replace(zero=stage), explain=False),
                             phases, tag=f" zero={stage}")
        except PinError:         # e.g. a batch the data axis cannot split, or a lossy pin
            break
        # nothing fits the stage that needs the least memory: nor do the others (a program
        # left unsolved for the cutoff may fit: the others are searched then)
        if got is None and stage == stages[0] and len(ask.pruned) == pruned_before:
            break
        if got is not None and (best is None or got.sol.objective_s < best.sol.objective_s):
            best = got
    told.extend(ask.pruned)
    if best is None and ask.pruned:
        raise BeyondCutoff(ask)
    if best is None and ask.timeouts:
        raise _timed_out(ask, errors)
    if best is None:
        def explained() -> InfeasibleError:
            errs = [_explained(e) for e in errors]
            if not explain or not any(e.explained for e in errs):
                return errs[0] if len(errs) == 1 else InfeasibleError("\n".join(str(e) for e in errs))
            return infeasible(cap, ask, errs)
        if explain == "later" and any(e.unexplained is not None for e in errors):
            later = InfeasibleError("\n".join(str(e) for e in errors) or
                                    "no unpipelined plan fits the memory budget")
            later.explain_later = explained
            raise later
        raise explained()
    plan = _to_plan(cap, best, cl, world, memory_budget, capture_s, phases,
                    time_limit=_time_limit_note(best.sol, ask.timeouts))
    return plan, Solved(best.problem, best.cost, dict(best.sol.choice))


def _timed_out(ask: MeshAsk, errors: list) -> TimeLimitError:
    """The error of a search that found no plan and skipped programs at the time limit: a
    longer limit might find one (the meshes that do not fit memory are only counted)."""
    meshes = sorted({str(e.mesh_shape) for e in ask.timeouts})
    rest = f"; {len(errors)} other programs do not fit the memory budget" if errors else ""
    return TimeLimitError(
        f"no plan found: the sharding ILP found no solution within its time limit of "
        f"{ask.time_limit_s:g} s on mesh{'es' if len(meshes) > 1 else ''} {', '.join(meshes)}"
        f"{rest}; " + time_limit_fix(ask.time_limit_s), time_limit_s=ask.time_limit_s)


def _time_limit_note(sol: Solution, timeouts: list) -> str:
    """``SolverReport.time_limit``: "" when no program of the search met its time limit;
    else the chosen program's (stopped with a solution) and the count of those skipped."""
    notes = [sol.time_limit] if sol.time_limit else []
    if timeouts:
        meshes = sorted({str(e.mesh_shape) for e in timeouts})
        notes.append(f"{len(timeouts)} sharding ILP(s) skipped: no solution within the time limit "
                     f"of {timeouts[0].time_limit_s:g} s (mesh {', '.join(meshes)})")
    return "; ".join(notes)


def _zero_stages(world: int, pins: Options, mesh_shape, cl, binds: bool) -> tuple[int, ...]:
    """The ZeRO stages to weigh (``solve_captured``): all where memory binds, else ZeRO-2
    where gradients are reduced wider than the compute dtype, on meshes with a data axis
    of more than one device. Without one, ZeRO-1 and 2 (which shard over the data axis
    only) would solve the plan's own program again; ZeRO-3 also shards weights over a
    context axis (``pricing.problem``), so a mesh with one weighs it where memory binds
    (e.g. ``context=4, tensor=8`` on 32 devices)."""
    try:       # the meshes a ZeRO pin allows (it makes a free mesh's axis the data axis)
        meshes = mesh_candidates(world, pins.replace(zero=3), mesh_shape, cl.devices_per_node)
    except (ValueError, PinError):
        return ()

    def has(role):
        return any(roles.degree(role, shape) > 1 for shape, _, roles in meshes)
    if has("data"):
        return ZERO_STAGES if binds else (2,) if wide_grads(pins) else ()
    return (3,) if binds and has("context") else ()


def wide_grads(pins: Options) -> bool:
    """Mixed precision whose gradients are reduced in fp32 (the ``grad_reduce`` default)."""
    return pins.precision in ("bf16", "fp16", "fp8") and pins.grad_reduce != "bf16"


def _explained(e: InfeasibleError) -> InfeasibleError:
    """``e``, or where ``_search`` left it unexplained, the error that says how far from
    fitting its mesh is (the least-memory plan's figures: ``ilp.explain_infeasible``)."""
    if e.unexplained is None:
        return e
    got = explain_infeasible(*e.unexplained)
    got.axes, got.roles, got.recompute = e.axes, e.roles, e.recompute
    return got


def _search(cap: Captured, ask: MeshAsk, phases: dict, tag: str = ""):
    """(the best :class:`_Best` under ``ask.pins`` over the meshes they allow, or None; the
    reasons of the meshes that did not fit).

    Branch and bound over the programs: once a plan is found, a program whose objective
    cannot fall below the best so far is not solved (``prices.compute_floor``, a true lower
    bound of its objective; for a large program its LP relaxation, ``lp_bound``, worked out
    before any is solved and solved best-first: ``lp_bound.best_first``, which puts the
    small programs first and the large ones in the order of their bounds; a relaxation
    that does not fit the budget is the program's refusal, unsolved). The best is the
    least objective, the first of equals in that order, so such
    a program could not have replaced it: the best after each pass is the one the search
    finds unpruned, and so is every choice made on it (whether to recompute every layer,
    the fewest-layers probes on its mesh, the caller's ZeRO stages). A pruned program is
    no reason that nothing fits (there is a plan), so it adds none. The bound is this
    search's own best only: a caller's best elsewhere would prune programs whose outcome
    steers what comes next (the recomputation pass, the probes of fewer layers, which can
    fall below a full recomputation's floor), and the search would no longer be the one
    made unpruned."""
    cl, world, pins, budget, time_limit_s = ask.cl, ask.world, ask.pins, ask.budget, ask.time_limit_s
    memory_weights, grad_sync_scale = ask.memory_weights, ask.grad_sync_scale
    n_states = check_optimizer(ask.optimizer)
    # a search the free search deferred the probes of (``fewest_layers=False``) and now asks
    # again with them: its meshes are solved already, only the probes are left
    resumable = not memory_weights and ask.profiler is None and grad_sync_scale == 1.0
    if resumable:
        resume_key = repr((cl, world, sorted(pins.items()), budget, ask.mesh_shape, ask.optimizer,
                           time_limit_s, ask.explain, tag))
        deferred = _DEFERRED.setdefault(cap.gm, {})
    if resumable and ask.fewest_layers and resume_key in deferred:
        best, errors = deferred.pop(resume_key)
        return _with_fewest_layers(cap, best, ask), errors
    # Recomputation is pinned, or chosen here: plans without it first; with every repeated
    # layer recomputed too when memory binds (nothing fits, or the best uses > 90%), and
    # then the fewest layers that fit (``_fewest_layers``).
    choices = _recompute_choices(cap, pins)
    # the problem depends on the mesh only: built once, costed per recomputation choice
    t0 = time.perf_counter()
    problems, refused = [], []
    for shape, axes, roles in mesh_candidates(world, pins, ask.mesh_shape, cl.devices_per_node):
        try:
            problems.append((_problem(cap, shape, roles, pins.zero_stage, n_states), shape, axes, roles))
        except PinError as e:    # this mesh cannot take the pins (a micro-batch its data axis
            refused.append(e)    # cannot split): the others may; all refused, the first says why
    if not problems and refused:
        raise refused[0]
    phases[f"problems{tag}"] = phases.get(f"problems{tag}", 0.0) + time.perf_counter() - t0
    best, errors = None, []     # (a mesh's prices are shared by its cost models: costing._shared)
    for rec in choices:
        if rec is not choices[0] and _below(best, ask) and \
                best.sol.memory_total <= RECOMPUTE_WHEN * budget:
            break
        recompute = _recompute_of(cap, rec)[0]
        errors = []                    # report the last pass's reasons
        costed = [(problem, shape, axes, roles, _cost_model(cap, cl, job, **ask.cost_kw()), job)
                  for problem, shape, axes, roles in problems
                  for job in [MeshJob(shape, roles, rec, pins, n_states, budget, time_limit_s)]]
        # (``best`` as it stands when the small programs are solved: the closure reads it then)
        ordered = best_first(costed, lambda c: _timed_lp(c[0], c[4], budget, time_limit_s, phases, tag),
                             lambda c: _large(c[0], c[4], budget),
                             lambda c: (best is not None and _cannot_beat(c[0], c[4], best.sol.objective_s))
                             or compute_floor(c[0], c[4]) >= ask.cutoff_s)
        for (problem, shape, axes, roles, cost, job), lp in ordered:
            t0, key = time.perf_counter(), f"ilp {shape}{tag}"
            if best is not None and (_cannot_beat(problem, cost, best.sol.objective_s)
                                     if lp is None else best.sol.objective_s <= lp < math.inf):
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
                if ask.verbose:
                    print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}{tag}: cannot "
                          f"beat {best.sol.objective_s * 1e3:.3f} ms "
                          f"({'compute floor' if lp is None else 'LP relaxation'}), not solved")
                continue
            explain = (problem, cost, budget, time_limit_s) \
                if ask.explain and rec == choices[-1] else None
            if lp == math.inf:         # not even its relaxation fits: nor does any plan
                errors.append(_no_fit(InfeasibleError(f"no plan on mesh {problem.mesh_shape} fits "
                                                      "the memory budget"), axes, roles, rec, explain))
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
                continue
            if _beyond_cutoff(problem, cost, ask, lp):
                ask.pruned.append(Unsolved(shape, rec, tag, problem, cost, budget, time_limit_s))
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
                if ask.verbose:
                    print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}{tag}: bound at "
                          f"least the cutoff {ask.cutoff_s * 1e3:.3f} ms, not solved")
                continue
            try:
                sol = _solve_program(problem, cost, budget, time_limit_s, lambda: _ilp_key(
                    cap, cl, job, ask.view))
            except TimeLimitError as e:   # no plan on this mesh in the time: the others may have
                ask.timeouts.append(e)
                if ask.verbose:
                    print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}{tag}: {e}")
                continue
            except InfeasibleError as e:
                errors.append(_no_fit(e, axes, roles, rec, explain))
                continue
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
            if ask.verbose:
                print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}: "
                      f"{sol.objective_s * 1e3:.3f} ms ({sol.status}, {sol.solve_time_s:.2f}s)")
            if best is None or sol.objective_s < best.sol.objective_s:
                best = _Best(sol, problem, shape, axes, recompute, cost, pins, roles, n_states)
    if resumable and not ask.fewest_layers:
        deferred[resume_key] = (best, errors)
        while len(deferred) > DEFERRED_KEPT:
            deferred.pop(next(iter(deferred)))
    if not ask.fewest_layers:
        return best, errors
    return _with_fewest_layers(cap, best, ask), errors


def _timed_lp(problem, cost, budget: float, time_limit_s: float, phases: dict, tag: str) -> float:
    """``lp_bound`` of the program, its seconds added to ``phases["lp bounds"]``."""
    t0 = time.perf_counter()
    try:
        return lp_bound(problem, cost, budget if budget != float("inf") else None, time_limit_s)
    finally:
        phases[f"lp bounds{tag}"] = phases.get(f"lp bounds{tag}", 0.0) + time.perf_counter() - t0


def _large(problem, cost, budget: float) -> bool:
    """Whether ``_search`` bounds this program by its LP relaxation before solving any
    (``lp_bound.best_first``): it is large (``LP_FIRST_ABOVE``) and fits as far as its
    memory floor tells (else the ILP is not written at all, ``_solve_program``)."""
    return program_size(problem) >= LP_FIRST_ABOVE and (
        budget == float("inf") or memory_floor(problem, cost) <= budget)


def _no_fit(e: InfeasibleError, axes, roles, rec, unexplained: tuple | None) -> InfeasibleError:
    """``e``, the reason a program does not fit, with its mesh and recomputation;
    ``unexplained``: what works out how far from fitting it is (one more ILP, solved only if
    no mesh fits: ``_explained``), or None."""
    e.axes, e.roles, e.recompute = axes, roles, rec
    if unexplained is not None:
        e.unexplained = unexplained
    return e


def _below(best, ask: MeshAsk) -> bool:
    """Whether ``best`` (a :class:`_Best` or None) is a plan below ``ask``'s cutoff: only such
    a plan may stop the search weighing more (recomputation, ZeRO stages). One at or above
    it steers nothing, so a search with a cutoff explores at least what the search without
    one does wherever that one's outcome is below the cutoff (a program left unsolved for
    the cutoff has an objective at least the cutoff, above any plan below it)."""
    return best is not None and best.sol.objective_s < ask.cutoff_s


class Unsolved(NamedTuple):
    """A program a search with a cutoff left unsolved (``MeshAsk.pruned``): its mesh, its
    recomputation choice, its ZeRO tag, and what :meth:`fits` solves."""
    shape: tuple
    rec: Any
    tag: str
    problem: Any
    cost: Any
    budget: float
    time_limit_s: float

    def fits(self) -> bool:
        """Whether the program has a plan within its budget (its ILP, solved now)."""
        try:
            solve_ilp(self.problem, self.cost, self.budget if self.budget != float("inf") else None,
                      self.time_limit_s, explain=False)
        except InfeasibleError:        # a time limit with nothing in hand proves no fit either
            return False
        return True


class BeyondCutoff(InfeasibleError):
    """No plan of a search with a cutoff (``MeshAsk.cutoff_s``) is below it: every program
    either does not fit or has a bound at least the cutoff. Not "nothing fits": the caller
    has a plan at least as good."""

    def __init__(self, ask: "MeshAsk"):
        meshes = sorted({str(u.shape) for u in ask.pruned})
        super().__init__(f"no plan below {ask.cutoff_s:.6g} s: {len(ask.pruned)} program(s) on "
                         f"mesh {', '.join(meshes)} bounded at least that (compute floor or LP "
                         "relaxation), the rest do not fit")


def _beyond_cutoff(problem, cost, ask: MeshAsk, lp: float | None = None) -> bool:
    """Whether ``ask.cutoff_s`` leaves this program unsolved: it fits as far as its memory
    floor tells (else the ILP's own refusal says so, as without a cutoff) and its compute
    floor or, failing that, its LP relaxation (``solver.lp_bound``, true lower bounds of its
    objective; ``lp`` where worked out already) is at least the cutoff."""
    if not math.isfinite(ask.cutoff_s):
        return False
    budget = ask.budget
    if budget != float("inf") and memory_floor(problem, cost) > budget:
        return False
    if compute_floor(problem, cost) >= ask.cutoff_s:
        return True
    if lp is not None:
        return lp >= ask.cutoff_s
    return lp_bound(problem, cost, budget if budget != float("inf") else None,
                    ask.time_limit_s) >= ask.cutoff_s


def _cannot_beat(problem, cost, objective_s: float) -> bool:
    """Whether no solution of ``problem`` under ``cost`` has an objective below
    ``objective_s``: its compute floor (``prices.compute_floor``) is at least that. A floor
    that is infinite (a node with no option it can run) proves nothing here: the ILP says
    why."""
    floor = compute_floor(problem, cost)
    return math.isfinite(floor) and floor >= objective_s


def mesh_floor(cap: Captured, cl, world: int, pins, optimizer: str = "adamw") -> float:
    """The compute floor (``prices.compute_floor``) of the one mesh ``pins`` give, without
    recomputation (which only adds compute): no plan ``plan_captured`` makes under ``pins``
    predicts a step below it."""
    pins = as_options(pins)
    n_states = check_optimizer(optimizer)
    meshes = mesh_candidates(world, pins, None, cl.devices_per_node)
    return min(compute_floor(_problem(cap, shape, roles, pins.zero_stage, n_states),
                             _cost_model(cap, cl, MeshJob(shape, roles, None, pins, n_states)))
               for shape, _, roles in meshes)


def _cost_model(cap: Captured, cl, job: MeshJob, *, profiler=None,
                view: StepView = WHOLE_STEP) -> CostModel:
    """The cost model of ``_search``'s program ``job`` (its mesh, pins and recomputation)."""
    _, rec_nodes, rec_kept = _recompute_of(cap, job.rec)
    return CostModel.for_pins(cl, job.shape, job.pins, data_axis=job.roles.data,
                              recompute=_saves(cap, rec_nodes, rec_kept, job.pins), profiler=profiler,
                              view=view, native=cap.native_dtypes)


def _solve_program(problem, cost, budget: float, time_limit_s: float, key) -> Solution:
    """``_solve_or_read``, unless even each decision's least memory is over ``budget``: what
    the ILP would find infeasible, raised without pricing its edges."""
    if budget != float("inf") and memory_floor(problem, cost) > budget:
        raise InfeasibleError(f"no plan on mesh {problem.mesh_shape} fits the memory budget")
    return _solve_or_read(problem, cost, budget, time_limit_s, key)


def mesh_jobs(cap: Captured, cl, world: int, *, pins=None, memory_budget=None, mesh_shape=None,
              optimizer="adamw", time_limit_s=60.0) -> dict:
    """The programs ``plan_captured`` solves on each mesh (without recomputation, then with
    every repeated layer recomputed), keyed as ``_solve_or_read`` keys them, each with what
    :func:`solve_mesh_job` needs to solve it ahead (``autopar.solver.speculate``); {} when
    the pins allow no mesh."""
    pins = as_options(pins)
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    n_states = check_optimizer(optimizer)
    choices = _recompute_choices(cap, pins)
    try:
        meshes = mesh_candidates(world, pins, mesh_shape, cl.devices_per_node)
    except ValueError:
        return {}
    jobs = (MeshJob(shape, roles, rec, pins, n_states, budget, time_limit_s)
            for rec in choices for shape, _, roles in meshes)
    return {_ilp_key(cap, cl, job): job for job in jobs}


def solve_mesh_job(cap: Captured, cl, job: MeshJob) -> None:
    """Solve one of :func:`mesh_jobs`' programs as ``_search`` will (in a worker: its
    outcome recorded for the search)."""
    problem = _problem(cap, job.shape, job.roles, job.pins.zero_stage, job.n_states)
    cost = _cost_model(cap, cl, job)
    key = _ilp_key(cap, cl, job)
    try:
        _solve_program(problem, cost, job.budget, job.time_limit_s, lambda: key)
    except InfeasibleError:
        pass


def _solve_or_read(problem, cost, budget: float, time_limit_s: float, key) -> Solution:
    """The sharding ILP's solution, or where a worker solved the same program ahead
    (``autopar.solver.speculate``), its outcome; in a worker, the outcome is recorded for
    the search. ``key``: the program's inputs (``_ilp_key``), worked out only then."""
    if speculate.active() is None and not speculate.recording():
        return solve_ilp(problem, cost, budget if budget != float("inf") else None, time_limit_s,
                         explain=False)
    k = key()
    got = speculate.read(k)
    if isinstance(got, tuple):
        if got[0] == "time limit":
            raise TimeLimitError(got[1], mesh_shape=tuple(problem.mesh_shape),
                                 time_limit_s=time_limit_s)
        raise InfeasibleError(got[1])
    if got is not None:
        return got
    try:
        sol = solve_ilp(problem, cost, budget if budget != float("inf") else None, time_limit_s,
                        explain=False)
    except InfeasibleError as e:
        speculate.record(k, ("time limit" if isinstance(e, TimeLimitError) else "infeasible", str(e)))
        raise
    speculate.record(k, sol)
    return sol


def _ilp_key(cap, cl, job: MeshJob, view: StepView = WHOLE_STEP) -> tuple:
    """What ``_search``'s program on one mesh is made of: the graph, the job (the mesh and
    its axes' roles, the pins (ZeRO stage among them), the optimizer's states, the
    recomputed layers, the budget and time limit), the cluster and the pipeline's view of
    memory and gradient sync."""
    layers = job.rec if job.rec is None or isinstance(job.rec, str) else tuple(job.rec)
    return (id(cap.gm), tuple(job.shape), job.roles, repr(sorted(job.pins.items())),
            job.n_states, layers, repr(cl), repr(sorted((view.memory_weights or {}).items())),
            view.grad_sync_scale, job.budget, job.time_limit_s)


DEFERRED_KEPT = 4
"""Searches kept per graph whose probes were deferred (``_search``'s ``fewest_layers=False``):
one per ZeRO stage of the free search's unpipelined plan."""
_DEFERRED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def drop_deferred(cap: Captured) -> None:
    """Forget the searches of ``cap`` kept for their deferred probes (the free search did
    not need them)."""
    _DEFERRED.pop(cap.gm, None)


def _with_fewest_layers(cap: Captured, best, ask: MeshAsk):
    """``best``, or where it recomputes every layer of a free choice, ``_fewest_layers``'
    plan (a pipeline's stage view, ``memory_weights``, leaves which layers to the per-rank
    choice after the cuts: ``partial_recompute``)."""
    if ask.pins.recompute is None and best is not None and best.recompute \
            and not ask.memory_weights:
        best = _fewest_layers(cap, best, ask)
        if ask.pins.offload_activations is None and best.recompute and not ask.pins.compile \
                and not ask.pins.pipelined and (ask.pins.branch or 1) == 1 \
                and frees_device_memory(ask.cl.device):
            return _with_offload(cap, best, ask)
    return best


OFFLOAD_RETRIES = 1
"""Kept layers ``_with_offload`` frees in addition when its split does not fit (an offloaded
layer holds up to one layer more in flight than a recomputed one)."""


def _with_offload(cap: Captured, best: _Best, ask: MeshAsk) -> _Best:
    """``best`` (recomputing the fewest layers that fit), or the plan on its mesh where each
    of those layers is recomputed or has its saved activations offloaded to host memory,
    whichever its prices say is cheaper (``solver.offload_choice``), if that plan fits and
    its objective is lower."""
    cl = ask.cl
    every = select_layers(cap.gm, "full")
    prices = layer_prices(best.problem, best.cost, best.sol.choice,
                          {lay: recompute_nodes(cap.gm, [lay]) for lay in every}, cl.device)
    freed = list(best.recompute)
    kept = [lay for lay in every if lay not in freed]
    for _ in range(1 + OFFLOAD_RETRIES):
        rec, off = choose(prices, freed)
        if not off:
            return best
        pins = best.pins.replace(offload_activations=off)
        layers, rec_nodes, rec_kept = _recompute_of(cap, rec)
        cost = CostModel.for_pins(cl, best.shape, pins, data_axis=best.cost.data_axis,
                                  recompute=_saves(cap, rec_nodes, rec_kept, pins),
                                  native=best.cost.native, **ask.cost_kw())
        job = MeshJob(best.shape, best.roles, rec, pins, best.n_states, ask.budget, ask.time_limit_s)
        try:
            sol = _solve_or_read(best.problem, cost, ask.budget, ask.time_limit_s,
                                 lambda: _ilp_key(cap, cl, job, ask.view))
        except TimeLimitError:
            return best
        except InfeasibleError:
            if not kept:
                return best
            freed.append(kept.pop(0))
            continue
        if ask.verbose:
            print(f"mesh {best.shape} recompute {len(rec)}, offload {len(off)} layers: "
                  f"{sol.objective_s * 1e3:.3f} ms")
        if sol.objective_s < best.sol.objective_s:
            return _Best(sol, best.problem, best.shape, best.axes, layers, cost, pins,
                         best.roles, best.n_states)
        return best
    return best


def recompute_bound_s(plan: Plan, cap: Captured) -> float:
    """What ``plan``'s layer recomputation may cost its step, for the free search's choice
    of what else to plan: the forward of the layers it recomputes again, out of forward,
    backward and forward again (a quarter of their compute), doubled for the placements a
    plan recomputing less may also change. An estimate, not a bound: on the Llama 3 405B's
    unpipelined mesh (2048 x 8) recomputing 33 layers instead of 126 saved 5.25 s where it
    says 2.61 (the placements changed); there the pipelines found were faster still. A
    bound that holds (the mesh without a budget, one ILP) was tried and prunes nothing: it
    is below the best pipeline on both large models, and the 405B's free search then took
    341 CPU s instead of 110."""
    layers = max(len(repeated_layers(cap.gm)), 1)
    return 0.5 * plan.estimate.compute_s * len(plan.recompute) / layers


PARTIAL_PROBES = 2
"""ILPs ``_fewest_layers`` solves at most. Two: the first probe starts where ``full``'s own
placements fit (``activation_room``), and the probes below it bind memory, where SCIP
branches: ``autopar plan hf:llama3-70b --cluster 8x8xH100 --batch 16 --seq 8192`` probed
64, 63, 61, 57 of 80 layers in 2.4-8.7 s each (20.4 s, 24.369 s a step after offloading),
64 and 63 in 8.6 s (24.378 s); from the old first probe, 79-72 layers, 1.3-2.1 s each
(24.588 s). Measured 2026-12-02, ``docs/measured.md``."""


def _fewest_layers(cap: Captured, full: _Best, ask: MeshAsk) -> _Best:
    """``full`` (every one of the L repeated layers recomputed) or, if predicted faster, the
    plan on its mesh recomputing only the first k layers, k the fewest that fit ``budget``
    (Megatron-LM's ``--recompute-num-layers``). Layers alike, recomputing one saves at most
    what its rebuild holds, R (``full``'s "recompute" term: one layer's activations rebuilt
    in backward): on ``full``'s placements, recomputing L - k layers fewer adds at most
    (L - k) R to the "activations" term and nothing to the others, so the first probe is
    the least k whose peak so grown fits (:func:`activation_room`: only the phases that
    hold activations grow; where the peak is another phase's, the gradients' with their
    buffers, the room is that of the activations' phase, not the budget less the peak).
    The ILP (which may choose other placements) says: while every probe fits, k steps down
    1, 2, 4, ... layers; from the first that does not, the least k that fits is bisected;
    within ``PARTIAL_PROBES`` solves. The least objective of them and ``full`` wins."""
    cl, budget, time_limit_s = ask.cl, ask.budget, ask.time_limit_s
    layers, per = full.recompute, full.sol.memory.get("recompute", 0.0)
    n = len(layers)
    if n < 2 or per <= 0 or budget == float("inf"):
        return full
    room = activation_room(full.sol.memory, full.sol.memory_phases, budget)
    k = min(n - 1, max(1, math.ceil(n - room / per - 1e-9)))
    best, fits, fails, step = full, n, 0, 1
    for _ in range(PARTIAL_PROBES):
        if not fails < k < fits:
            break
        _, rec_nodes, rec_kept = _recompute_of(cap, layers[:k])
        cost = CostModel.for_pins(cl, full.shape, full.pins, data_axis=full.cost.data_axis,
                                  recompute=_saves(cap, rec_nodes, rec_kept, full.pins),
                                  native=full.cost.native, **ask.cost_kw())
        try:
            job = MeshJob(full.shape, full.roles, layers[:k], full.pins, full.n_states, budget,
                          time_limit_s)
            sol = _solve_or_read(full.problem, cost, budget, time_limit_s, lambda: _ilp_key(
                cap, cl, job, ask.view))
        except InfeasibleError:
            fails, step = k, 0
            k = (fails + fits + 1) // 2
            continue
        if ask.verbose:
            print(f"mesh {full.shape} recompute {k} of {n} layers: {sol.objective_s * 1e3:.3f} ms")
        if sol.objective_s < best.sol.objective_s:
            best = _Best(sol, full.problem, full.shape, full.axes, layers[:k], cost, full.pins,
                         full.roles, full.n_states)
        fits = k
        if step:                       # every probe so far fits: further down
            k, step = max(fails + 1, k - step), 2 * step
        else:                          # between a probe that fails and one that fits
            k = (fails + fits) // 2
    return best


def activation_room(terms: dict[str, float], phases: tuple, budget: float) -> float:
    """Bytes the "activations" term of memory ``terms`` may grow by before their peak
    (``cost_models.memory.peak_bytes`` over ``phases``) passes ``budget``, the other terms
    as they are: the budget less the terms always live and the fullest phase that holds
    activations (every term, without phases). Where another phase is the peak, more than
    the budget less the peak; negative where the terms do not fit.

    >>> from cost_models.memory import step_phases
    >>> activation_room({"activations": 2, "grads": 5, "grad_buffers": 1, "optimizer": 1},
    ...                 step_phases(), 10)
    7.0
    >>> activation_room({"activations": 2, "grads": 5}, (), 10)
    3.0
    """
    grouped = {k for g in phases for k in g}
    always = sum(b for k, b in terms.items() if k not in grouped)
    holding = [g for g in phases if "activations" in g]
    if not holding:                     # no phases: every term is live at once
        return float(budget - always)
    return float(budget - always - max(sum(terms.get(k, 0.0) for k in g) for g in holding))


def _family(shape: tuple, axes: tuple) -> str:
    if len(shape) == 1:
        return {"data": "data only", "tensor": "tensor only"}.get(axes[0], "1-D (data/tensor per op)")
    return "data x tensor" if axes == ("data", "tensor") else "2-D"


def _row(family, shape, variant, need, terms) -> dict:
    binding = max(terms.items(), key=lambda kv: kv[1])[0] if terms else "?"
    return dict(family=family, mesh=tuple(shape), variant=variant, need=need,
                terms=dict(terms), binding=binding)


def _least_memory(cap, ask: MeshAsk, cl, shape, roles, pins, rec):
    """The least memory per device of any plan of ``cap`` on ``shape`` of ``cl`` under
    ``pins`` (``rec``: the recomputation choice): (bytes, {term: bytes})."""
    _, rec_nodes, rec_kept = _recompute_of(cap, rec)
    problem = _problem(cap, shape, roles, pins.zero_stage, check_optimizer(ask.optimizer))
    cost = CostModel.for_pins(cl, shape, pins, data_axis=roles.data,
                              recompute=_saves(cap, rec_nodes, rec_kept, pins),
                              native=cap.native_dtypes, **ask.cost_kw())
    sol = solve_ilp(problem, cost, None, ask.time_limit_s, minimize_memory=True)
    return sol.memory_total, dict(sol.memory)


def infeasible(cap: Captured, ask: MeshAsk, errors: list) -> InfeasibleError:
    """One screen for a search where nothing fits: the closest plan per mesh family, what
    binds, and the smallest changes that fit (a budget, a ZeRO stage, more devices,
    gradient accumulation), each worked out from the least-memory plans. The error carries
    ``meshes`` (every mesh's figures), ``closest`` and ``suggestions``."""
    rows = [_row(_family(e.mesh_shape, e.axes), e.mesh_shape,
                 f"recompute={e.recompute!r}" if e.recompute else "", e.need_bytes, e.terms)
            for e in errors if e.explained]
    cl, world, pins, budget = ask.cl, ask.world, ask.pins, ask.budget
    rec = errors[-1].recompute if errors else None
    zero_free = pins.zero is None and pins.tensor in (None, 1)
    if zero_free:       # the ZeRO stage that shards the most, on the data axis
        try:
            z3 = pins.replace(zero=3)
            need, terms = _least_memory(cap, ask, cl, (world,), MeshRoles(data=0), z3, rec)
            rows.append(_row("data only", (world,), "zero=3" + (f", recompute={rec!r}" if rec else ""),
                             need, terms))
        except (InfeasibleError, PinError):
            pass
    closest: dict = {}
    for r in rows:
        if r["family"] not in closest or r["need"] < closest[r["family"]]["need"]:
            closest[r["family"]] = r
    best = min(closest.values(), key=lambda r: r["need"])
    fix_pins = {"zero": 3} if "zero=3" in best["variant"] else {}
    if rec:
        fix_pins["recompute"] = rec
    sugg = [dict(change=f"memory_budget={_up(best['need'])}" + _pin_text(fix_pins),
                 why=f"the smallest plan needs {_gib(best['need'])} ({best['family']}, mesh "
                     f"{best['mesh']}): raise memory_budget to at least {_gib(best['need'])}",
                 memory_budget=_up(best["need"]), pins=fix_pins)]
    if zero_free:
        more = _more_devices(cap, ask, rec)
        if more is not None:
            n, need, bigger = more
            more_pins = {"data": n, "zero": 3, **({"recompute": rec} if rec else {})}
            sugg.append(dict(change=f"{n} devices" + _pin_text(more_pins),
                             why=f"ZeRO-3 over {n} devices needs {gib(need)} per device",
                             world_size=n, cluster=bigger, pins=more_pins))
    k = _accumulation(cap, best, budget, pins)
    if k is not None:
        sugg.append(dict(change=f"accumulate={k}" + _pin_text(fix_pins),
                         why=f"{best['binding']} bind; one of {k} micro-batches holds about 1/{k} of the "
                             "activations (estimated)", pins={**fix_pins, "accumulate": k}))
    if ask.verbose:
        for r in rows:
            print(f"  {r['family']:<22} mesh {str(r['mesh']):<10} {r['variant']:<22} needs {gib(r['need'])}")
    notes = _zero_notes(cap, ask, errors, zero_free)
    return InfeasibleError(one_screen(budget, world, list(closest.values()), sugg, len(rows), notes),
                           meshes=rows, closest=list(closest.values()), suggestions=sugg)


def _zero_notes(cap, ask: MeshAsk, errors: list, zero_free: bool) -> tuple:
    """The lines (one per distinct note) naming the parameters a ZeRO stage leaves whole on
    the data axis of the meshes tried (``solver.zero_whole``); with no ``zero=`` pin, the
    ZeRO-3 row's mesh (``(world,)``) is asked."""
    n_states = check_optimizer(ask.optimizer)
    asks = [(e.mesh_shape, e.roles, ask.pins.zero_stage) for e in errors
            if e.roles is not None and e.roles.data is not None]
    if zero_free:
        asks.append(((ask.world,), MeshRoles(data=0), 3))
    notes: list = []
    for shape, roles, zero in asks:
        if zero < 1:
            continue
        try:
            note = whole_note(_problem(cap, shape, roles, zero, n_states), roles.data, zero)
        except PinError:
            continue
        if note and note not in notes:
            notes.append(note)
    return tuple(notes)


def _up(b: float) -> int:
    """A budget just above ``b`` bytes (whole 4 KiB)."""
    return int(-(-b * 1.001 // 4096)) * 4096


def _pin_text(pins: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in pins.items())


def _more_devices(cap, ask: MeshAsk, rec):
    """The fewest devices (a multiple of ``world``, batch permitting) on which ZeRO-3 over
    the data axis fits: (devices, bytes per device), or None within 64x."""
    cl, world, pins = ask.cl, ask.world, ask.pins
    for n in (world * 2 ** j for j in range(1, 7)):
        dpn = cl.devices_per_node
        bigger = replace(cl, name=f"{cl.name} ({n} devices)", nodes=n // dpn if n % dpn == 0 else 1,
                         devices_per_node=dpn if n % dpn == 0 else n)
        try:
            need, _ = _least_memory(cap, ask, bigger, (n,), MeshRoles(data=0),
                                    pins.replace(data=n, zero=3), rec)
        except (InfeasibleError, PinError, ValueError):
            return None
        if need <= ask.budget:
            return n, need, bigger
    return None


def _accumulation(cap, best: dict, budget: float, pins: Options):
    """The fewest micro-batches whose activations (about 1/k of the batch's) bring the
    closest plan within ``budget``; None when activations do not bind or no k does it."""
    # (the loss's gradients are one micro-batch's too)
    act = best["terms"].get("activations", 0.0) + best["terms"].get("loss_grads", 0.0)
    if pins.pipelined or pins.accumulate or act <= 0:
        return None
    try:
        batch = int(cap.node(cap.inputs[0]).meta["val"].shape[0])
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    # k micro-batches keep the gradients beside the next one's activations: every term adds
    # (no flat buffers of a single step's gradient sync)
    every = sum(b for t, b in best["terms"].items() if t != "grad_buffers")
    for k in range(2, batch + 1):
        if batch % k == 0 and every - act * (1 - 1 / k) <= 0.9 * budget:
            return k
    return None


def _to_plan(cap: Captured, best: _Best, cl, world: int, memory_budget, capture_s: float,
             phases: dict | None = None, time_limit: str = "") -> Plan:
    """The Plan of the solver's best solution (under its pins, ``best.pins``)."""
    sol, problem, axes, pins = best.sol, best.problem, best.axes, best.pins
    nodes = node_placements(problem, sol.choice)
    comm = {f"{kind}@{axes[a]}": s for (kind, a), s in sorted(sol.comm_s.items())}
    if sol.overlapped_s > 0:   # gradient sync hidden behind compute (cost_models/step.py)
        comm[OVERLAPPED] = -sol.overlapped_s
    comm_total = sum(comm.values())
    host_s = plan_host_s(cap, cl.device, _recompute_of(cap, best.recompute or None)[1]
                         if best.recompute else (), best.n_states, pins)
    est = Estimate(step_time_s=step_time(sol.compute_s + comm_total, host_s), compute_s=sol.compute_s,
                   comm_s=comm_total, memory_bytes=dict(sol.memory), comm=comm,
                   memory_phases=sol.memory_phases, host_s=host_s)
    n_graph = sum(1 for n in cap.gm.graph.nodes if n.op in ("placeholder", "call_function"))
    report = SolverReport(sol.status, sol.objective_s, sol.bound_s, sol.gap, sol.solve_time_s,
                          capture_s, sol.n_variables, sol.n_constraints, n_graph, len(problem.vars),
                          phases=dict(phases or {}), time_limit=time_limit)
    params = {names[i]: ph for ph, names in cap.params.items() for i in range(len(names))}
    if pins.context_attention is None and any(
            context_axis_of(v.call, v.options[sol.choice[n]], best.shape) is not None
            for n, v in problem.vars.items() if v.kind == "op"):
        pins = pins.replace(context_attention=best_form(problem, sol.choice, best.cost))
    if pins.precision == "fp8" and pins.fp8_layers is None:    # the linears fp8 by price
        pins = pins.replace(fp8_layers=chosen_fp8_layers(problem, sol.choice, best.cost))
    return Plan(world_size=world, mesh_shape=best.shape, mesh_axes=axes, cluster=cl.name,
                options=pins, nodes=nodes,
                params=params, fingerprint=fingerprint(cap), estimate=est, solver=report,
                memory_budget=memory_budget,
                param_shapes={n: list(cap.node(ph).meta["val"].shape) for n, ph in params.items()},
                node_ops={n: op for n, op in op_names(cap.gm).items() if n in nodes},
                inputs=tuple(cap.inputs), recompute=best.recompute,
                offload=pins.offload, host_memory_bytes=_host_bytes(best),
                disk_bytes=_disk_bytes(best))


def plan_host_s(cap: Captured, device, recomputed, optimizer_states: int, pins: Options) -> float:
    """Host seconds of one step of a flat plan's eager program on ``device``
    (``cost_models.host``; 0 where the device prices none: CPU ranks)."""
    if not device.host_op_s:
        return 0.0
    if pins.compile == CUDA_GRAPHS:        # replayed: the host launches graphs, not ops
        calls = graphs_dispatches(len(cap.inputs), len(cap.params), optimizer_states=optimizer_states)
        return calls * device.host_op_s
    ops = op_names(cap.gm)
    targets = list(ops.values())
    again = [ops[n] for n in recomputed if n in ops]
    calls = step_dispatches(targets, again, optimizer_states=optimizer_states)
    return host_time(calls, device.host_op_s, compiled=bool(pins.compile))


def _host_bytes(best: _Best) -> dict[str, float]:
    """Host bytes per rank under ``offload="optimizer"``: each parameter's optimizer shard
    (its fp32 master copy and moments) and the gradient shard copied down; {} without.
    Under ``offload="disk"`` the gradient shard alone (the optimizer shard is on disk).
    Under ``offload_activations=`` also the offloaded activations ("activations")."""
    acts = _offloaded_activations(best)
    out = {"activations": acts} if acts else {}
    if best.pins.offload not in ("optimizer", "disk"):
        return out
    if best.pins.offload == "disk":
        return {**out, "grads": _offload_shard(best)}
    shard = _offload_shard(best)
    return {**out, "optimizer": shard * (1 + best.problem.optimizer_states), "grads": shard}


def _offloaded_activations(best: _Best) -> float:
    """Bytes per rank the offloaded layers (``offload_activations=``) keep in host memory at
    the end of forward: what each of their nodes saves, under the solution's placements, and
    under mixed precision the 16-bit copies of the weights only they read."""
    cost, total = best.cost, 0.0
    if not cost.act_offload:
        return 0.0
    for name, v in best.problem.vars.items():
        combo = v.options[best.sol.choice[name]]
        off = cost._offloaded(v)
        if off:
            total += off * cost.saved_bytes(v, combo)
        off = cost._offloaded_params(v) if cost.mixed else 0
        if off:
            total += off * cost.base_memory(v, combo, 0)["params"]
    return total


def _disk_bytes(best: _Best) -> dict[str, float]:
    """Disk bytes per rank under ``offload="disk"``: the optimizer shard's files (fp32
    master copy and moments); {} otherwise."""
    if best.pins.offload != "disk":
        return {}
    return {"optimizer": _offload_shard(best) * (1 + best.problem.optimizer_states)}


def _offload_shard(best: _Best) -> float:
    """fp32 bytes of this rank's parameter shards (what offload steps off the device)."""
    shard = 0.0
    for name, v in best.problem.vars.items():
        if v.kind == "param":
            placements = output_placements(v.options[best.sol.choice[name]], 0)
            shard += len(v.members) * _numel(v.meta.shape, placements, best.shape) * 4
    return shard


def _numel(shape, placements, mesh_shape) -> int:
    n = 1
    for s in local_shape(shape, placements, mesh_shape):
        n *= s
    return n


def _recompute_choices(cap: Captured, pins: Options) -> list:
    """The recomputation choices ``_search`` weighs, in order: the pinned one, or none and
    then (when memory binds) every repeated layer (every one not offloaded, under a pinned
    ``offload_activations=``)."""
    if pins.recompute is not None:
        return [pins.recompute]
    if not _has_repeated_layers(cap):
        return [None]
    rest = recompute_rest(cap, pins)
    return [None, rest] if rest else [None]


def recompute_rest(cap: Captured, pins: Options):
    """What recomputing every repeated layer means under ``pins``: ``"full"``, or under a
    pinned ``offload_activations=`` the names of the layers it does not offload (a layer is
    one or the other), None when it offloads them all."""
    if offload_of(cap, pins) is None:
        return "full"
    offloaded = set(select_layers(cap.gm, pins.offload_activations, "offload_activations"))
    rest = tuple(lay for lay in select_layers(cap.gm, "full") if lay not in offloaded)
    return rest or None


def _has_repeated_layers(cap: Captured) -> bool:
    try:
        return bool(_recompute_of(cap, "full")[0])
    except ValueError:
        return False


PROBLEMS_KEPT = 8
"""Problems ``_problem`` keeps per graph (the most recent): a mesh's ZeRO stages and retries."""
_PROBLEMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _problem(cap: Captured, shape, roles: MeshRoles, zero: int, n_states: int):
    """``build_problem(cap, shape, roles, zero=zero, optimizer_states=n_states)``, kept for
    the graph's next asks (the ZeRO stages of a mesh, a pipeline's retries); a ZeRO stage's
    problem is the stage-0 one's with its parameters' options re-chosen (nothing else
    reads the stage)."""
    memo = _PROBLEMS.setdefault(cap.gm, OrderedDict())
    key = (tuple(shape), roles, zero, n_states)
    got = memo.get(key)
    if got is None:
        base = memo.get((tuple(shape), roles, 0, n_states))
        got = build_problem(cap, shape, roles, zero=zero, optimizer_states=n_states) \
            if base is None or zero == 0 else _with_zero(base, zero, roles)
        memo[key] = got
        while len(memo) > PROBLEMS_KEPT:
            memo.popitem(last=False)
    memo.move_to_end(key)
    return got


def _with_zero(base, zero: int, roles: MeshRoles):
    """``base`` (built with ZeRO stage 0) with its parameters' options under ``zero``."""
    vars_ = dict(base.vars)
    for name, v in base.vars.items():
        if v.kind == "param":
            opts = _placeholder_choices(name, v.kind, v.meta, base.mesh_shape, roles, zero)
            if not opts:
                raise PinError(f"node {v.name} has no placement that satisfies the pins on mesh "
                               f"{base.mesh_shape}: {_describe(v)}")
            vars_[name] = replace(v, options=opts)
    return replace(base, vars=vars_)


_RECOMPUTE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per captured graph alive: recomputation choice -> what ``_recompute_of`` worked out."""


def offload_of(cap: Captured, pins: Options) -> tuple | None:
    """(offloaded nodes with the parameters only they read, those read outside every
    offloaded layer) of ``pins.offload_activations`` (``analysis.layers.offload_nodes``;
    layers named as ``recompute=``), None when none; worked out once per graph."""
    spec = pins.offload_activations
    if spec in (None, "none", ()):
        return None
    memo = _RECOMPUTE.setdefault(cap.gm, {})
    key = ("offload", spec if isinstance(spec, (str, bool)) else tuple(spec))
    if key not in memo:
        memo[key] = offload_nodes(cap.gm, _recompute_of(cap, spec, "offload_activations")[0], cap.params)
    return memo[key]


def _saves(cap: Captured, rec_nodes, rec_kept, pins: Options) -> Saves:
    """The layers' :class:`~autopar.pricing.costing.Saves`: ``rec_nodes`` recomputed (those
    of ``rec_kept`` read outside their layers), and ``pins.offload_activations``' nodes."""
    return Saves(rec_nodes, rec_kept, *(offload_of(cap, pins) or ()))


def _recompute_of(cap: Captured, rec, pin: str = "recompute") -> tuple:
    """(layers, recomputed nodes, kept nodes) of the recomputation choice ``rec`` (None,
    ``"full"`` or layer names; ``analysis.layers``), worked out once per graph: the search
    weighs the same choices on every mesh, ZeRO stage and pipeline degree. ``pin``: the pin
    ``rec`` comes from, named in a refusal."""
    memo = _RECOMPUTE.setdefault(cap.gm, {})
    key = rec if rec is None or isinstance(rec, (str, bool)) else tuple(rec)
    if key not in memo:
        layers = select_layers(cap.gm, rec, pin)
        memo[key] = (layers, *recompute_nodes(cap.gm, layers))
    return memo[key]
