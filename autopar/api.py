"""The two calls users make: ``plan`` (decide, no processes needed) and ``parallelize`` (run).

Both plan with ``autopar.solver.driver.solve``, the one search (as the CLI does)."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import numbers
import os
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch import nn

from autopar import first_step
from autopar.capture import Captured, fingerprint
from autopar.capture.align import same_graph_on_every_rank
from autopar.capture.cache import caching
from autopar.cost_models.local_devices import local_cluster
from autopar.device import SHARE_GPUS_ENV, backend_for, gpus_shared, rank_device
from autopar import elastic as _elastic
from autopar.errors import ArgumentError
from autopar.ops.comm import collective_timeout
from autopar.plan import Plan, PlanError
from autopar.runtime import build
from autopar.runtime.data import BATCH_MODES
from autopar.runtime.parallel_module import refuse_frozen
from autopar.runtime.weights import capture_view, has_meta, weights_kind
from autopar.solver.driver import Planned, capture_for_plan, plan_search, solve
from autopar.solver.flat import Solved, node_placements, plan_captured, solve_captured
from autopar.options import KNOWN_PINS, OPTIMIZER_STATES, Options, refuse_hogwild_plan

# names that moved to autopar.solver, still importable from here
__all__ = ["plan", "parallelize", "KNOWN_PINS", "OPTIMIZER_STATES", "Planned", "Solved",
           "node_placements", "plan_captured", "plan_search", "solve", "solve_captured"]


def plan(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
         target: Any = None, cluster="local", memory_budget: float | None = None,
         mesh_shape: Sequence[int] | None = None, world_size: int | None = None,
         optimizer: str = "adamw", time_limit_s: float = 60.0, verbose: bool = False,
         profiler=None, cache: bool = True, **pins) -> Plan:
    """Decide how to parallelize ``model`` for ``cluster``; runs nothing distributed.

    ``cache``: read the captured graph from the per-user capture cache when this model was
    planned before with the same shapes, and store it there otherwise
    (``autopar.capture.cache``: under ``$AUTOPAR_CACHE_DIR`` or ``~/.cache/autopar``;
    ``AUTOPAR_CACHE=0`` turns it off); ``plan.solver.capture_cache`` says which.

    >>> p = autopar.plan(model, (x,), F.cross_entropy, target=y, cluster="cpu:4", data=4)
    >>> print(p.summary())
    """
    _check_budget(memory_budget)
    _check_mesh_shape(mesh_shape)
    _refuse_hogwild(Options.from_pins(pins))
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
        raise ArgumentError(f"time_limit_s={time_limit_s!r}: pass the solver's time limit in "
                            "seconds, a number > 0 (e.g. 60)")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ArgumentError(f"world_size={world_size!r}: pass a number of devices >= 1, or None "
                            "for all the cluster's")
    return solve(model, example_inputs, loss_fn, target=target, cluster=cluster,
                 world_size=world_size, pins=pins, memory_budget=memory_budget,
                 mesh_shape=mesh_shape, optimizer=optimizer, time_limit_s=time_limit_s,
                 verbose=verbose, profiler=profiler, cache=_check_cache(cache)).plan


def _check_cache(cache) -> bool:
    if not isinstance(cache, bool):
        raise ArgumentError(f"cache={cache!r}: pass True (read and write the capture cache) "
                            "or False")
    return cache


def parallelize(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None, *,
                target: Any = None, plan: "Plan | str | None" = None, cluster=None,
                memory_budget: float | None = None, mesh_shape: Sequence[int] | None = None,
                optimizer: str = "adamw", comm=None, batch: str = "global",
                timeout: float | None = None, weights: "str | os.PathLike | None" = None,
                check: bool | None = None, elastic: bool = False, **pins):
    """Parallelize ``model`` over the ranks of this job (inside torchrun, or after
    ``torch.distributed.init_process_group``).

    ``batch``: what each rank passes to ``pm(...)`` / ``pm.train_step(...)``.

    - ``"global"`` (default): every rank passes the same global batch; the plan takes its
      part.
    - ``"per_rank"``: the torchrun way. Each rank passes its own slice (dim 0 of every
      tensor input and of the target); ranks with the same ``pm.data_rank`` pass the same
      slice, and the slices of data ranks ``0 .. pm.data_world - 1`` make the global batch.
      Feed it from ``DistributedSampler(ds, num_replicas=pm.data_world, rank=pm.data_rank)``
      and ``DataLoader(ds, batch_size=<global batch> // pm.data_world, sampler=...,
      drop_last=True)``. The data ranks are the coordinates on the plan's ``data`` axis (or,
      in a free plan, the axes the batch is split on); a plan without one has
      ``data_world == 1``. The slices are all-gathered into the global batch each step
      (``autopar.runtime.data``).

    ``example_inputs`` / ``target`` describe the *global* batch in both modes (the plan is
    made for its shapes; only shapes and dtypes matter to it).

    ``timeout``: seconds a collective may wait for its peers before it raises
    ``autopar.ops.comm.CollectiveError`` naming the op, the mesh axis and the group's ranks
    (a peer died or hangs). Default: the environment variable ``AUTOPAR_COLLECTIVE_TIMEOUT``,
    else the process group's own timeout. When ``parallelize`` creates the process group
    (inside torchrun), it gets this timeout too.

    ``weights``: pretrained weights each rank reads only its shards of, for a model built
    on the meta device (``with torch.device("meta"): model = GPT(cfg)``, or under
    ``autopar.meta_parameters()`` to keep the buffers its init computes): a ``torch.save``
    state-dict file (``.pt``, ``.pth``, ``.bin``; memory-mapped), a ``.safetensors`` file or
    directory (Hugging Face), or a ``torch.distributed.checkpoint`` directory
    (``autopar.save_checkpoint``'s, or ``dcp.save(model.state_dict())``'s). See
    ``autopar.runtime.weights``.

    ``check``: compute the first ``train_step`` on one device too (a copy of ``model`` taken
    now, the same global batch) and compare the loss and every gradient; a difference raises
    ``autopar.first_step.FirstStepMismatch`` naming the worst parameter and the plan. Default:
    the environment variable ``AUTOPAR_CHECK=1``. For models that fit one device.

    ``elastic``: this job's number of ranks may change between restarts (``torchrun --nnodes
    MIN:MAX``); plan for the world it has now. The ``data`` axis takes the ranks the other
    mesh pins leave, and ``accumulate`` grows so that each rank's micro-batch is no larger
    than under the pins while the global batch (``example_inputs``' rows) stays the same
    (``autopar.elastic.elastic_pins``; an error naming the world sizes that work when it
    cannot). ``pm.elastic`` says what was chosen and how long planning took; resume with
    ``autopar.elastic.resume`` and read data with ``autopar.elastic.GlobalBatchSampler``.

    Without ``plan=``, rank 0 solves (``autopar.solver.driver.solve``, as ``autopar.plan``
    does) and the other ranks take its plan and capture the graph it runs on. ``comm``: a
    communicator of thread ranks (tests); then every rank solves.

    >>> pm = autopar.parallelize(model, (x,), F.cross_entropy, target=y)
    >>> loss = pm.train_step(x, target=y)
    """
    started = time.perf_counter()
    pins = Options.from_pins(dict(pins))
    _refuse_hogwild(pins)
    _check_run_arguments(model, plan, pins, batch, memory_budget, mesh_shape)
    _check_elastic(elastic, plan, mesh_shape)
    if weights is None:
        _check_not_meta(model)      # a meta model runs with weights= to load
    refuse_frozen(model)          # before planning: ParallelModule refuses it too
    timeout = collective_timeout(timeout)
    scheme = pins.update        # autopar.update_schemes: what check= cannot compare under it
    if scheme.check_refusal is not None and first_step.wanted(check):
        raise ArgumentError(f"check= compares the first step's gradients with one device's; under "
                            f"{scheme.written()} {scheme.check_refusal}")
    reference = first_step.reference_copy(model) if first_step.wanted(check) else None
    world = _dist_world(timeout) if comm is None else (
        comm.world.world if hasattr(comm, "world") else int(dist.get_world_size()))
    if elastic:     # this world's data degree and accumulation, the global batch kept
        pins, info = _elastic.elastic_pins(pins, world, _elastic.global_batch_rows(example_inputs, target))
    if (pins.learners or pins.workers) and pins.data is None and pins.tensor is None:
        # Crossbow's learners are whole replicas per rank; workers= needs the data axis
        pins = pins.replace(data=world)
    if weights is not None:
        weights_kind(weights)       # a path that is no weights source fails before planning
    # a meta model is captured as the model on the CPU (autopar.runtime.weights.capture_view)
    with (capture_view(model, example_inputs, target) if weights is not None and has_meta(model)
          else contextlib.nullcontext((example_inputs, target))) as (example_inputs, target):
        if plan is not None:
            the_plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
            cap = _capture_the_plans_graph(model, example_inputs, loss_fn, target, the_plan)
        else:
            the_plan, cap = _solve_once(model, example_inputs, loss_fn, target, world, every_rank=comm is not None,
                                        cluster=cluster if cluster is not None else _local_cluster(world),
                                        pins=pins, memory_budget=memory_budget, mesh_shape=mesh_shape,
                                        optimizer=optimizer)
    if comm is None:        # the plan names nodes: every rank's in rank 0's order and names
        same_graph_on_every_rank(cap)
    _validate(the_plan, cap, world)
    if comm is None:
        _check_shared_gpus(the_plan)
    if plan is not None and comm is None:
        _same_plan_on_every_rank(the_plan)
    # loss_fn without a target runs outside the graph, on the replicated output; comm None:
    # this job's torch.distributed ranks, on a mesh on the rank's device
    return build(cap, the_plan, model, loss_fn if target is None else None, comm, batch=batch,
                 timeout=timeout, weights=weights,
                 check=None if reference is None else functools.partial(  # the first step, checked
                     first_step.FirstStepCheck, reference=reference, loss_fn=loss_fn,
                     precision=the_plan.options.precision),
                 elastic=None if not elastic else _elastic.ElasticInfo(
                     info.world, info.data, the_plan.n_microbatches, info.global_batch,
                     time.perf_counter() - started, info.split))


def _capture_the_plans_graph(model, example_inputs, loss_fn, target, the_plan: Plan) -> Captured:
    """The graph ``the_plan`` was made on, captured here. A plan made from the capture
    cache's graph (``autopar.capture.cache``, written by another process) can name the nodes
    of another order than this process captures: code that iterates a set of strings
    (transformers' masks per layer kind) follows the process's hash seed. Where the fresh
    capture's fingerprint is not the plan's, the cached graph is read and taken if it is."""
    cap = capture_for_plan(model, example_inputs, loss_fn, target, the_plan)
    if fingerprint(cap) != the_plan.fingerprint:
        with caching(True):
            cached = capture_for_plan(model, example_inputs, loss_fn, target, the_plan)
        if fingerprint(cached) == the_plan.fingerprint:
            return cached
    return cap


def _refuse_hogwild(pins: Options) -> None:
    refuse_hogwild_plan(pins)


def _check_budget(memory_budget) -> None:
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(
            memory_budget, (int, float)) or not memory_budget > 0):
        raise ArgumentError(f"memory_budget={memory_budget!r}: pass bytes per device as a number "
                            "> 0 (e.g. 40e9 or 40 * 2**30), or None for the device's memory")


def _check_mesh_shape(mesh_shape) -> None:
    if mesh_shape is not None and not (isinstance(mesh_shape, (tuple, list)) and mesh_shape and all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 for n in mesh_shape)):
        raise ArgumentError(f"mesh_shape={mesh_shape!r}: pass a tuple of positive ints, e.g. (2, 4), "
                            "or None to let the solver choose")


def _check_run_arguments(model, plan, pins: Options, batch: str, memory_budget,
                         mesh_shape=None) -> None:
    """ArgumentErrors for what ``parallelize`` cannot run, before any process group or
    capture: a plan that is no Plan or path, pins beside a plan, an unknown batch mode, a
    memory budget that is no number of bytes."""
    _check_budget(memory_budget)
    _check_mesh_shape(mesh_shape)
    if batch not in BATCH_MODES:
        raise ArgumentError(f"batch={batch!r}: use 'global' (every rank passes the global batch) "
                            "or 'per_rank' (each data rank passes its own slice)")
    if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
        raise ArgumentError(f"plan= is a {type(plan).__name__}: pass a Plan (autopar.plan's) or "
                            "the path of a plan file (plan.save's)")
    if plan is not None and pins:
        raise ArgumentError("pass pins to autopar.plan, or pass plan= — not both")


def _check_elastic(elastic, plan, mesh_shape) -> None:
    if not isinstance(elastic, bool):
        raise ArgumentError(f"elastic={elastic!r}: pass True (re-plan for the world this job has "
                            "now, keeping the global batch) or False")
    if elastic and plan is not None:
        raise ArgumentError("elastic=True plans for each world size the job runs on; plan= fixes "
                            "one: pass pins instead of plan=, or drop elastic=True")
    if elastic and mesh_shape is not None:
        raise ArgumentError(f"elastic=True with mesh_shape={tuple(mesh_shape)!r} fixes the world "
                            "size: pin the model-parallel degrees (tensor=, pipeline=) instead and "
                            "let the data axis take the rest")


def _check_not_meta(model) -> None:
    """An ArgumentError for a model left on the meta device (nothing to run it with)."""
    if not isinstance(model, nn.Module):
        return          # capture names it
    meta = next((n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
                 if t.is_meta), None)
    if meta is not None:
        raise ArgumentError(f"the model is on the meta device ({meta!r} has no data): to run "
                            "it, build it on a real device, load its weights "
                            "(model.to_empty(device='cpu'); model.load_state_dict(sd)), or "
                            "pass weights= (a state-dict file, safetensors or a DCP "
                            "checkpoint); autopar.plan is what plans a meta model")


def _solve_once(model, example_inputs, loss_fn, target, world: int, *, every_rank: bool,
                **kw) -> Planned:
    """``solve`` on rank 0 (on every rank with ``every_rank``), its plan on every rank, and
    the graph that plan runs on. One rank solves: solver runs may differ in time-limited or
    tied cases, and every rank must run the same plan."""
    if every_rank:
        return solve(model, example_inputs, loss_fn, target=target, world_size=world, **kw)
    planned, error = None, None
    if _rank() == 0:
        try:
            planned = solve(model, example_inputs, loss_fn, target=target, world_size=world, **kw)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = e
    the_plan = _broadcast_plan(planned.plan if planned is not None else None, error)
    if planned is not None:
        return planned
    return Planned(the_plan, capture_for_plan(model, example_inputs, loss_fn, target, the_plan))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_plan(p: "Plan | None", error: Exception | None) -> Plan:
    """Rank 0's plan (or its error) on every rank."""
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
                        "plan again with autopar.plan (a model whose code iterates a set, as "
                        "transformers' masks per layer kind do, is captured in an order that "
                        "follows PYTHONHASHSEED: set it alike where the plan is made and where "
                        "it runs)")


def _check_shared_gpus(p: Plan) -> None:
    """Ranks sharing a GPU (``AUTOPAR_SHARE_GPUS=1``: gloo over CUDA tensors) run every
    collective but send / recv: gloo's point-to-point of a CUDA tensor fails ("writev: Bad
    address", seen on an H200, 2026-11-29) and closes the pair. A plan that sends (a
    pipeline's stages, ring attention) is refused before it runs."""
    if not gpus_shared() or rank_device().type != "cuda":
        return
    sends = [what for what, yes in (("pipeline stages", p.pipeline_stages > 1),
                                    ("ring attention", p.options.context_attention == "ring")) if yes]
    if sends:
        raise PlanError(f"this plan's {' and '.join(sends)} send tensors rank to rank, which gloo "
                        f"cannot do with CUDA tensors ({SHARE_GPUS_ENV}=1 runs ranks on a shared GPU "
                        "over gloo): pin pipeline=1 and context_attention='all-gather', or give each "
                        "rank a GPU of its own (unset the variable)")


def _same_plan_on_every_rank(p: Plan) -> None:
    """A ``plan=`` each rank passed itself: the same on every rank, or a PlanError naming
    the ranks that differ (two plans run as one program exchange tensors that do not match:
    wrong numbers or a hang). Plans solved on each rank can differ where the solver breaks
    a tie by measured op times."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, p.digest())
    if len(set(every)) > 1:
        groups: dict = {}
        for rank, d in enumerate(every):
            groups.setdefault(d, []).append(rank)
        raise PlanError(
            "the ranks were given different plans (" + "; ".join(
                f"ranks {ranks}: digest {d}" for d, ranks in groups.items()) + "): make the "
            "plan once and give every rank the same one (autopar.plan on rank 0, then "
            "plan.save / Plan.load, or dist.broadcast_object_list of plan.to_json()), or "
            "leave plan= out and parallelize plans on rank 0 for every rank")


def _dist_world(timeout: float | None = None) -> int:
    """This job's world size; inside torchrun, the process group is created here if it is
    not yet: after ``rank_device()`` has made ``LOCAL_RANK`` the current CUDA device, with
    the backend of that device (NCCL on CUDA, gloo on CPU) and ``timeout`` seconds (None:
    torch's default)."""
    if not dist.is_available():
        return 1
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend_for(rank_device()), timeout=None if timeout is None
                                    else timedelta(seconds=timeout))
        else:
            raise RuntimeError("autopar.parallelize runs inside torchrun (or after "
                               "torch.distributed.init_process_group); to plan without "
                               "processes use autopar.plan")
    else:
        rank_device()       # the current CUDA device is LOCAL_RANK's before the mesh is made
    return dist.get_world_size()


def _local_cluster(world: int):
    """The cluster of this job's devices (``cost_models.local_devices.local_cluster``): a
    preset string or a Cluster, never a spec ``parse_cluster`` rejects."""
    return local_cluster(world)
