"""The two calls users make: ``plan`` (decide, no processes needed) and ``parallelize`` (run)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autopar.capture import Captured, capture, fingerprint
from autopar.placement import placements_str
from autopar.plan import Estimate, NodePlacement, Plan, PlanError, SolverReport
from autopar.sharding.registry import input_placements, output_placements

# Pins: keyword arguments that fix one choice each and leave the rest to the solver.
KNOWN_PINS = {"data", "tensor", "zero", "pipeline", "micro_batch_size", "schedule",
              "virtual_stages", "recompute", "precision"}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}


def _check_pins(pins: dict[str, Any]) -> dict[str, Any]:
    unknown = set(pins) - KNOWN_PINS
    if unknown:
        raise TypeError(f"unknown pin(s) {sorted(unknown)}; pins are {sorted(KNOWN_PINS)}")
    pipe = pins.get("pipeline")
    if pipe is not None and (not isinstance(pipe, int) or pipe < 1):
        raise ValueError(f"pin pipeline={pipe!r} must be a positive integer")
    rec = pins.get("recompute")
    if not (rec is None or isinstance(rec, bool) or rec in ("full", "none")
            or (isinstance(rec, (list, tuple)) and all(isinstance(r, str) for r in rec))):
        raise ValueError(f"recompute={rec!r}: use 'full' (every repeated layer), None, or a "
                         "list of layer names such as ['h.0', 'h.1']")
    for name in ("micro_batch_size", "schedule", "virtual_stages"):
        if pins.get(name) is not None and (pipe or 1) == 1:
            raise ValueError(f"the pin {name}= needs pipeline parallelism: pin pipeline= > 1 too")
    if pins.get("precision") not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"precision={pins['precision']!r}: use 'fp32', 'bf16' or 'fp16'")
    zero = pins.get("zero", 0) or 0
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r}: ZeRO stages are 0 (replicated), 1 and 2 (parameters, "
                         "gradients and optimizer state stored sharded over the data-parallel "
                         "axis, weights gathered once and kept for backward) and 3 (as 2, and "
                         "gathered weights freed after use and gathered again in backward)")
    for name in ("data", "tensor"):
        v = pins.get(name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"pin {name}={v!r} must be a positive integer")
    return pins


def _mesh_candidates(world: int, pins: dict, mesh_shape) -> list[tuple[tuple[int, ...], tuple[str, ...], dict]]:
    """(mesh shape, axis names, {"data_axis", "tensor_axis"}) to try."""
    data, tensor = pins.get("data"), pins.get("tensor")
    if mesh_shape is not None:
        mesh_shape = tuple(int(n) for n in mesh_shape)
        prod = 1
        for n in mesh_shape:
            prod *= n
        if prod != world:
            raise ValueError(f"mesh_shape {mesh_shape} has {prod} devices but the world has "
                             f"{world}; use a mesh whose product is {world}")
    if data is not None or tensor is not None:
        if data is None:
            data = world // tensor if world % tensor == 0 else None
        if tensor is None:
            tensor = world // data if world % data == 0 else None
        if data is None or tensor is None or data * tensor != world:
            raise ValueError(f"pins data={pins.get('data')} tensor={pins.get('tensor')} do not "
                             f"multiply to the world size {world}")
        axes, shape, roles = [], [], {}
        if data > 1 or tensor == 1:
            roles["data_axis"] = len(shape)
            axes.append("data"), shape.append(data)
        if tensor > 1:
            roles["tensor_axis"] = len(shape)
            axes.append("tensor"), shape.append(tensor)
        if mesh_shape is not None and tuple(shape) != mesh_shape:
            raise ValueError(f"mesh_shape {mesh_shape} disagrees with pins data={data} tensor={tensor}")
        return [(tuple(shape), tuple(axes), roles)]
    if pins.get("zero"):
        return [((world,), ("data",), {"data_axis": 0})]
    if mesh_shape is not None:
        return [(mesh_shape, tuple(f"axis{i}" for i in range(len(mesh_shape))), {})]
    out = [((world,), ("axis0",), {})]
    for a in range(2, world):
        if world % a == 0 and world // a >= 2:
            out.append(((a, world // a), ("axis0", "axis1"), {}))
    return out


def plan(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
         target: Any = None, cluster="local", memory_budget: float | None = None,
         mesh_shape: Sequence[int] | None = None, world_size: int | None = None,
         optimizer: str = "adamw", time_limit_s: float = 60.0, verbose: bool = False,
         profiler=None, **pins) -> Plan:
    """Decide how to parallelize ``model`` for ``cluster``; runs nothing distributed.

    >>> p = autopar.plan(model, (x,), F.cross_entropy, target=y, cluster="cpu:4", data=4)
    >>> print(p.summary())
    """
    from autopar.cost_models.hardware import parse_cluster
    pins = _check_pins(dict(pins))
    t0 = time.perf_counter()
    cl = parse_cluster(cluster)
    world = world_size or cl.world_size
    if _pipelined(pins):
        from autopar.solver.pipeline_search import plan_pipelined
        return plan_pipelined(model, example_inputs, loss_fn, target, cl, world, pins,
                              memory_budget=memory_budget, optimizer=optimizer,
                              time_limit_s=time_limit_s, verbose=verbose, profiler=profiler)[0]
    # without an example target the loss cannot be captured: plan the model alone (the
    # loss then runs outside the graph, on the replicated output)
    cap = capture(model, example_inputs, loss_fn if target is not None else None, target)
    capture_s = time.perf_counter() - t0
    return plan_search(cap, model, example_inputs, loss_fn, target, cl, world,
                       memory_budget=memory_budget, mesh_shape=mesh_shape, optimizer=optimizer,
                       time_limit_s=time_limit_s, capture_s=capture_s, verbose=verbose,
                       profiler=profiler, pins=pins)


def plan_search(cap: Captured, model, example_inputs, loss_fn, target, cl, world: int, *,
                pins: dict, memory_budget=None, mesh_shape=None, optimizer="adamw",
                time_limit_s=60.0, capture_s=0.0, verbose=False, profiler=None) -> Plan:
    """The best plan without a ``pipeline=`` pin: unpipelined (``plan_captured`` on the
    full-batch graph ``cap``) and, on a cluster of several nodes or when nothing
    unpipelined fits, pipelined (``autopar.solver.pipeline_search.search_pipelines``);
    the least predicted step wins."""
    from autopar.solver.ilp import InfeasibleError
    flat, error = None, None
    try:
        flat = plan_captured(cap, cl, world, memory_budget=memory_budget, mesh_shape=mesh_shape,
                             optimizer=optimizer, time_limit_s=time_limit_s, capture_s=capture_s,
                             verbose=verbose, pins=pins, profiler=profiler)
    except InfeasibleError as e:
        error = e
    if _may_pipeline(cap, example_inputs, cl, world, pins, mesh_shape, profiler, flat is None):
        from autopar.solver.pipeline_search import search_pipelines
        if verbose:
            print("searching pipelines" + (" (nothing unpipelined fits)" if flat is None else
                                            f" against {flat.estimate.step_time_s:.4g} s unpipelined"))
        piped = search_pipelines(cap, model, example_inputs, loss_fn, target, cl, world, pins,
                                 memory_budget=memory_budget, optimizer=optimizer,
                                 time_limit_s=time_limit_s, verbose=verbose)
        if piped is not None and (flat is None or piped.estimate.step_time_s < flat.estimate.step_time_s):
            return piped
    if flat is None:
        raise error
    return flat


def _may_pipeline(cap: Captured, example_inputs, cl, world, pins, mesh_shape, profiler,
                  nothing_fits: bool) -> bool:
    """Whether the free search considers pipelines: no pipeline pin (``pipeline=1`` means
    none), more than one node (or nothing unpipelined fits), the loss in the graph, every
    input split along dim 0, and room beside the data/tensor pins."""
    if pins.get("pipeline") is not None or mesh_shape is not None or profiler is not None:
        return False
    if not (cl.nodes > 1 or nothing_fits) or world != cl.world_size or world < 2:
        return False
    if not (cap.has_loss and cap.takes_target):
        return False
    if not all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in example_inputs):
        return False
    fixed = (pins.get("data") or 1) * (pins.get("tensor") or 1)
    return fixed < world


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


def plan_captured(cap: Captured, cl, world: int, *, memory_budget=None, mesh_shape=None,
                  optimizer="adamw", time_limit_s=60.0, capture_s=0.0, verbose=False,
                  pins=None, profiler=None) -> Plan:
    """The best plan for the captured graph on ``world`` devices of ``cl`` (no pipeline)."""
    return solve_captured(cap, cl, world, memory_budget=memory_budget, mesh_shape=mesh_shape,
                          optimizer=optimizer, time_limit_s=time_limit_s, capture_s=capture_s,
                          verbose=verbose, pins=pins, profiler=profiler)[0]


@dataclass(frozen=True)
class Solved:
    """What the solver decided, for callers that price the plan further (the pipeline
    planner): the problem, the cost model it was priced with and the option per node."""
    problem: Any
    cost: Any
    choice: dict


def solve_captured(cap: Captured, cl, world: int, *, memory_budget=None, mesh_shape=None,
                   optimizer="adamw", time_limit_s=60.0, capture_s=0.0, verbose=False,
                   pins=None, profiler=None, memory_weights=None,
                   grad_sync_scale=1.0, explain=True) -> tuple[Plan, Solved]:
    """``plan_captured``, and the solver's :class:`Solved`. ``memory_weights`` and
    ``grad_sync_scale`` go to the :class:`CostModel` (the pipeline's per-stage view);
    ``explain=False`` skips working out how far from fitting an infeasible mesh is."""
    from autopar.analysis.layers import recompute_nodes, select_layers
    from autopar.solver.costing import CostModel
    from autopar.solver.ilp import InfeasibleError, solve
    from autopar.solver.problem import build_problem
    pins = pins or {}
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    budget = memory_budget if memory_budget is not None else cl.device.memory_bytes
    # Recomputation is pinned, or chosen here: plans without it first; with every repeated
    # layer recomputed too when memory binds (nothing fits, or the best uses > 90%).
    choices = [pins.get("recompute")] if pins.get("recompute") is not None else [None]
    if choices == [None] and _has_repeated_layers(cap):
        choices.append("full")
    best, errors = None, []
    # the problem depends on the mesh only: built once, costed per recomputation choice
    meshes = _mesh_candidates(world, pins, mesh_shape)
    problems = [(build_problem(cap, shape, zero=pins.get("zero") or 0,
                               optimizer_states=OPTIMIZER_STATES[optimizer], **roles), shape, axes, roles)
                for shape, axes, roles in meshes]
    for rec in choices:
        if rec == "full" and best is not None and \
                sum(best[0].memory.values()) <= 0.9 * budget:
            break
        recompute = select_layers(cap.gm, rec)
        errors = []                    # report the last pass's reasons
        rec_nodes, rec_kept = recompute_nodes(cap.gm, recompute)
        for problem, shape, axes, roles in problems:
            cost = CostModel(cl, shape, dtype_key=pins.get("precision") or "fp32",
                             zero=pins.get("zero") or 0, data_axis=roles.get("data_axis"),
                             profiler=profiler, recompute=rec_nodes, recompute_kept=rec_kept,
                             memory_weights=memory_weights, grad_sync_scale=grad_sync_scale)
            try:
                sol = solve(problem, cost, budget if budget != float("inf") else None,
                            time_limit_s, explain=explain and rec == choices[-1])
            except InfeasibleError as e:
                errors.append(e)
                continue
            if verbose:
                print(f"mesh {shape}{' recompute ' + str(rec) if rec else ''}: "
                      f"{sol.objective_s * 1e3:.3f} ms ({sol.status}, {sol.solve_time_s:.2f}s)")
            if best is None or sol.objective_s < best[0].objective_s:
                best = (sol, problem, shape, axes, recompute, cost)
    if best is None:
        raise errors[0] if len(errors) == 1 else InfeasibleError("\n".join(str(e) for e in errors))
    sol, problem, shape, axes, recompute, cost = best
    nodes = node_placements(problem, sol.choice)
    comm = {f"{kind}@{axes[a]}": s for (kind, a), s in sorted(sol.comm_s.items())}
    comm_total = sum(sol.comm_s.values())
    est = Estimate(step_time_s=sol.compute_s + comm_total, compute_s=sol.compute_s,
                   comm_s=comm_total, memory_bytes=dict(sol.memory), comm=comm)
    n_graph = sum(1 for n in cap.gm.graph.nodes if n.op in ("placeholder", "call_function"))
    report = SolverReport(sol.status, sol.objective_s, sol.bound_s, sol.gap, sol.solve_time_s,
                          capture_s, sol.n_variables, sol.n_constraints, n_graph, len(problem.vars))
    params = {names[i]: ph for ph, names in cap.params.items() for i in range(len(names))}
    plan = Plan(world_size=world, mesh_shape=shape, mesh_axes=axes, cluster=cl.name,
                pins={k: v for k, v in pins.items() if v is not None}, nodes=nodes,
                params=params, fingerprint=fingerprint(cap), estimate=est, solver=report,
                memory_budget=memory_budget,
                param_shapes={n: list(cap.node(ph).meta["val"].shape) for n, ph in params.items()},
                node_ops={n.name: str(n.target) for n in cap.gm.graph.nodes
                          if n.op == "call_function" and n.name in nodes},
                inputs=tuple(cap.inputs), recompute=recompute)
    return plan, Solved(problem, cost, dict(sol.choice))


def _has_repeated_layers(cap: Captured) -> bool:
    from autopar.analysis.layers import select_layers
    try:
        return bool(select_layers(cap.gm, "full"))
    except ValueError:
        return False


def parallelize(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
                target: Any = None, plan: "Plan | str | None" = None, cluster=None,
                memory_budget: float | None = None, mesh_shape: Sequence[int] | None = None,
                optimizer: str = "adamw", comm=None, **pins):
    """Parallelize ``model`` over the ranks of this job (inside torchrun, or after
    ``torch.distributed.init_process_group``). Every rank passes the same global batch.

    >>> pm = autopar.parallelize(model, (x,), F.cross_entropy, target=y)
    >>> loss = pm.train_step(x, target=y)
    """
    from autopar.runtime.parallel_module import ParallelModule
    pins = _check_pins(dict(pins))
    if pins.get("precision") not in (None, "fp32"):
        raise NotImplementedError(
            f"precision={pins['precision']!r} is for planning (autopar.plan) only so far: the "
            "runtime trains in fp32; drop the pin to run")
    if comm is None:
        comm_world = _dist_world()
    else:
        comm_world = comm.world.world if hasattr(comm, "world") else int(torch.distributed.get_world_size())
    # loss_fn without a target: the loss runs outside the graph, on the replicated output.
    in_graph_loss = loss_fn if target is not None else None
    given = None
    if plan is not None:
        given = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if _pipelined(pins) or (given is not None and given.pipeline_stages > 1):
        return _parallelize_pipeline(model, example_inputs, in_graph_loss, target, given, cluster,
                                     memory_budget, optimizer, comm_world, pins)
    cap = capture(model, example_inputs, in_graph_loss, target)
    if plan is None:
        from autopar.cost_models.hardware import parse_cluster
        cl = parse_cluster(cluster if cluster is not None else _local_cluster(comm_world))
        # One rank solves and the others take its plan: solver runs may differ in time-limited
        # or tied cases, and every rank must run the same plan.
        the_plan, error = None, None
        if comm is not None or _rank() == 0:
            try:
                the_plan = plan_captured(cap, cl, comm_world, memory_budget=memory_budget,
                                         mesh_shape=mesh_shape, optimizer=optimizer, pins=pins)
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                error = e
        if comm is None:
            the_plan = _broadcast_plan(the_plan, error)
        elif error is not None:
            raise error
    else:
        the_plan = given
        if pins:
            raise ValueError("pass pins to autopar.plan, or pass plan= — not both")
    _validate(the_plan, cap, comm_world)
    if comm is None:
        comm = _dist_comm(the_plan)
    return ParallelModule(cap, the_plan, comm, model, loss_fn if in_graph_loss is None else None)


def _pipelined(pins: dict) -> bool:
    return (pins.get("pipeline") or 1) > 1


def _parallelize_pipeline(model, example_inputs, loss_fn, target, given, cluster, memory_budget,
                          optimizer, world, pins):
    """``parallelize`` with a pipeline axis: plan on rank 0 (or take ``given``), then run the
    stages with torch.distributed.pipelining (``autopar.runtime.pipeline_module``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.solver.pipeline_search import capture_microbatch, plan_pipelined
    from autopar.runtime.pipeline_module import PipelineModule
    if loss_fn is None:
        raise ValueError("pipeline parallelism needs the loss in the graph: pass loss_fn and "
                         "target= (the last stage computes the loss of each micro-batch)")
    if given is not None:
        if pins:
            raise ValueError("pass pins to autopar.plan, or pass plan= — not both")
        the_plan = given
        cap = capture_microbatch(model, example_inputs, loss_fn, target, given.n_microbatches)
    else:
        from autopar.cost_models.hardware import parse_cluster
        cl = parse_cluster(cluster if cluster is not None else _local_cluster(world))
        the_plan, error, cap = None, None, None
        if _rank() == 0:
            try:
                the_plan, cap = plan_pipelined(model, example_inputs, loss_fn, target, cl, world,
                                               pins, memory_budget=memory_budget, optimizer=optimizer)
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                error = e
        the_plan = _broadcast_plan(the_plan, error)
        if cap is None:     # the other ranks capture at the micro-batch rank 0 chose
            cap = capture_microbatch(model, example_inputs, loss_fn, target, the_plan.n_microbatches)
    _validate(the_plan, cap, world)
    mesh = init_device_mesh("cpu", tuple(the_plan.mesh_shape), mesh_dim_names=tuple(the_plan.mesh_axes))
    return PipelineModule(cap, the_plan, mesh, model)


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_plan(p: "Plan | None", error: Exception | None) -> Plan:
    """Rank 0's plan (or its error) on every rank."""
    import json

    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return p
    box = [p.to_json() if p is not None else None,
           None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise PlanError(f"planning failed on rank 0: {box[1]}")
    return Plan.from_dict(json.loads(box[0]))


def _validate(p: Plan, cap: Captured, world: int) -> None:
    if p.world_size != world:
        raise PlanError(f"the plan was made for {p.world_size} devices (mesh {p.mesh_shape}) "
                        f"but this job has {world}; plan again for {world} devices or launch "
                        f"with --nproc-per-node {p.world_size}")
    fp = fingerprint(cap)
    if p.fingerprint != fp:
        raise PlanError(f"the plan was made for another graph (fingerprint {p.fingerprint}, this "
                        f"model gives {fp}): same model, example input shapes and loss? "
                        "plan again with autopar.plan")


def _dist_world() -> int:
    import torch.distributed as dist
    if not dist.is_available():
        return 1
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend)
        else:
            raise RuntimeError("autopar.parallelize runs inside torchrun (or after "
                               "torch.distributed.init_process_group); to plan without "
                               "processes use autopar.plan")
    return dist.get_world_size()


def _local_cluster(world: int) -> str:
    if torch.cuda.is_available():
        return f"local-cuda:{world}"
    return f"cpu:{world}"


def _dist_comm(p: Plan):
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.ops.comm import DistComm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh(device, tuple(p.mesh_shape), mesh_dim_names=tuple(p.mesh_axes))
    return DistComm(mesh)
