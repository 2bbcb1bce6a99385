"""The module a user trains, for every plan: the per-rank programs, the local shards,
gradient sync, checkpoints.

``ParallelModule`` holds this rank's shard of every parameter its stages read (under
``module.<name>``, so ``pm.parameters()`` feeds any torch optimizer), the rewritten programs
(training: returns the global loss; forward: returns the model's outputs, replicated) and
the communicator. An unpipelined plan is one stage, run here directly
(:class:`OneStage`, micro-batch by micro-batch under gradient accumulation); a pipelined
plan's stages are run by
``autopar.runtime.pipeline_runner.PipelineRunner``. Parameter sharding, state dicts, the
once-per-step gradient sync (``autopar.runtime.grad_sync``) and input checks are the same
for both.
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import merge_chunks
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from autopar.analysis.microbatch_loss import denominator_inputs
from autopar.analysis.stages import assign_stages
from autopar.capture import Captured
from autopar.errors import ArgumentError
from autopar.ops.collectives import all_reduce, regathered_weights
from autopar.ops.comm import Comm, StepSettings, use_comm
from autopar.passes.shard_parameters import shard_tensor, unshard
from autopar.plan import Plan
from autopar.runtime.collective_order import check_eager_programs, order_check
from autopar.runtime.compiled import (
    CompiledProgram, cache_counts, check_compilable, compile_report, cuda_graphs_note, inductor_options,
)
from autopar.runtime.backward_loop import BackwardLoop, refusal
from autopar.runtime.branch_stage import BranchRanks
from autopar.runtime.data import RankData
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.nonfinite import finite_or_skip
from autopar.runtime.out_of_memory import reported_oom
from autopar.runtime.updates import UpdateRule, make_rule
from autopar.runtime.updates.workers import scaled_lr
from autopar.runtime.pipeline_runner import PipelineRunner, stage_plan
from autopar.runtime.plan_check import check_plan_fits
from autopar.runtime.program_passes import RankPrograms, rank_programs
from autopar.runtime.precision import LossScaler, autocast, compute_dtype, grad_reduce_dtype
from autopar.runtime.shards import Shards, get_tensor, set_tensor, shard_model
from autopar.runtime.timing import TimingReport, timing_report
from autopar.runtime.disk_offload import DiskOptimizer
from autopar.runtime.offload import HostOptimizer, offloaded
from autopar.runtime.weights import load_weights
from autopar.runtime.zero import (
    OptimizerShards, ZeroGradSync, optimizer_sharded, stored_shards, working_plan,
)


class OneStage:
    """An unpipelined plan: one stage running the whole per-rank program; under gradient
    accumulation (``plan.accumulate = k > 1``, the graph captured at micro-batch size) once
    per micro-batch, forward and backward, gradients accumulating.

    The step's gradient sync begins with the last micro-batch: the hooks of
    :meth:`GradSync.launch_on_accumulate` fire in every backward but launch reductions only
    in the last one, overlapped with it; so gradients are summed over ranks once per step.
    Each micro-batch's loss is its term of the global batch's (its means divide by the
    global denominator, fed by ``analysis.microbatch_loss.denominator_inputs``), so the
    step's loss is their sum and nothing is divided by ``k``."""

    pp_rank = 0
    device, dtype, loss_scale = None, None, None    # mixed precision (set by ParallelModule)
    idle_loss = None             # workers=: the zero loss term of a rank that skips a step

    def __init__(self, cap: Captured, programs: dict[str, GraphModule], loss_fn: Callable | None,
                 shards: Shards, n_microbatches: int = 1, branches: BranchRanks | None = None,
                 loss_sync: tuple[int, ...] = ()):
        self.programs = programs        # "train" (when the loss is captured), "forward"
        # "train" returns this rank's term of the loss, summed over these axes beside backward
        self.loss_sync = loss_sync
        self.branches = branches        # branch parallelism: this rank's group keeps its branches
        if branches is not None:
            self.pp_rank = branches.rank
        self._cap, self._loss_fn, self._shards = cap, loss_fn, shards
        self._out_spec = cap.model_output_spec
        self.n_microbatches = n_microbatches
        if n_microbatches > 1 and "train" not in programs:
            raise ArgumentError("gradient accumulation needs the loss in the graph: pass loss_fn and "
                                "target= (each micro-batch's loss is its term of the global batch's)")

    def owners(self) -> dict[str, list[int]]:
        if self.branches is not None:
            return self.branches.owners(self._shards.placements)
        return {attr: [0] for attr in self._shards.placements}

    def train(self, inputs: tuple, target, sync: GradSync, params, owners) -> torch.Tensor:
        """The step's forward, backward and gradient sync, as the plan's update rule runs
        them (``UpdateRule.train``: :meth:`run`, or ``workers=``' skipping of idle ranks)."""
        return sync.reducer.train(self, inputs, target, sync)

    def run(self, inputs: tuple, target, sync: GradSync, drop: bool = False,
               every_grad: bool = False) -> torch.Tensor:
        """Forward and backward of every micro-batch, the step's gradient sync, the loss's
        sum. ``drop``: this rank's loss term and gradients count as zeros; ``every_grad``:
        every synced parameter gets a gradient (zeros where backward made none), so the
        step reduces the same gradients on every rank (``workers=``)."""
        k = self.n_microbatches
        total, summing = None, None
        try:
            for i, (mb_inputs, mb_target, scales) in enumerate(self._microbatches(inputs, target)):
                if i == k - 1:
                    sync.begin()        # the step's reductions run in the last backward
                loss = self._loss(mb_inputs, mb_target, scales)
                total = loss.detach().clone() if total is None else total + loss.detach()
                if drop:
                    total = torch.zeros_like(total)
                if i == k - 1 and self.loss_sync:    # the loss's sum over ranks, beside backward
                    summing = sync.comm.all_reduce_coalesced([total], self.loss_sync[0])
                (loss if self.loss_scale is None else loss * self.loss_scale.scale).backward()
        except BaseException:
            sync.abort()
            raise
        with torch.no_grad():
            if every_grad:
                _every_grad(sync, zero=drop)
            return self._finish(sync, summing, total)

    def run_idle(self, sync: GradSync) -> torch.Tensor:
        """A data rank outside ``workers=``' set this step: no forward or backward; a zero
        term in the loss's sum and a zero gradient in the data axis's."""
        sync.begin()
        total = self.idle_loss.clone()
        summing = sync.comm.all_reduce_coalesced([total], self.loss_sync[0]) if self.loss_sync else None
        with torch.no_grad():
            _every_grad(sync, zero=True)
            return self._finish(sync, summing, total)

    def _finish(self, sync: GradSync, summing, total: torch.Tensor) -> torch.Tensor:
        """End a step's gradient sums (``sync``), and the loss's over the ranks (``summing``:
        its sum over the first axis of ``loss_sync``, started beside backward; the rest
        here)."""
        sync.finish()
        if summing is not None:
            summing.wait()
            for a in self.loss_sync[1:]:
                total = sync.comm.all_reduce(total, a)
        return total

    def _loss(self, inputs: tuple, target, scales: tuple) -> torch.Tensor:
        with autocast(self.device, self.dtype):     # forward only; backward outside autocast
            if "train" in self.programs:
                extra = (target,) if self._cap.takes_target else ()
                return self.programs["train"](*inputs, *extra, *scales)
            if self._loss_fn is not None:
                return _scalar(self._loss_fn(pytree.tree_unflatten(self.forward(inputs), self._out_spec),
                                             target), "loss_fn returned")
            return _scalar(self.forward(inputs)[0], "without loss_fn, the model's output is")

    def _microbatches(self, inputs: tuple, target):
        """(inputs, target, loss scale inputs) of each micro-batch of the global batch."""
        k = self.n_microbatches
        if k == 1:
            return [(inputs, target, ())]
        scales = tuple(t.to(self.device) for t in denominator_inputs(self._cap, inputs, target, k))
        n, has_t = len(inputs), target is not None
        given = tuple(inputs) + ((target,) if has_t else ()) + scales
        return [(mb[:n], mb[n] if has_t else None, mb[n + has_t:]) for mb in self._split(given)]

    def _split(self, tensors: tuple) -> list[tuple]:
        """The ``k`` micro-batches of ``tensors`` (along dim 0), each a tuple like it."""
        k = self.n_microbatches
        names = list(self._cap.inputs)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.shape[0] % k:
                name = names[i] if i < len(names) else f"input {i}"
                raise ArgumentError(f"the batch of input {name!r} ({tuple(getattr(t, 'shape', ()))}) "
                                    f"does not divide into {k} micro-batches (the plan accumulates "
                                    f"{k}); pass the global batch the plan was made for")
        parts = [t.tensor_split(k, dim=0) for t in tensors]
        return [tuple(p[j] for p in parts) for j in range(k)]

    def loss(self, inputs: tuple, target) -> torch.Tensor:
        """The global batch's loss, differentiable (``pm(x, target=y)``): this rank's term
        summed over the ranks by an all-reduce whose backward gives each rank its own
        term's gradient."""
        if self.n_microbatches > 1:
            raise ArgumentError(f"pm(x, target=y) on a plan that accumulates {self.n_microbatches} "
                                "micro-batches: call loss = pm.train_step(x, target=y)")
        total = self._loss(inputs, target, ())
        for a in self.loss_sync:
            total = all_reduce(total, a)
        return total

    def forward(self, inputs: tuple) -> list:
        with autocast(self.device, self.dtype):
            if self.n_microbatches == 1:
                return list(self.programs["forward"](*inputs))
            # the graph is one micro-batch's: run each, join the outputs along the batch
            outs = [list(self.programs["forward"](*mb)) for mb in self._split(tuple(inputs))]
        return list(merge_chunks(outs, None))

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        return t if self.branches is None else self.branches.broadcast(t, src)

    def code(self, which: str) -> str:
        return self.programs[which].code


def _first_compiled_step(runner, rank: int, first_step_s: float, cached: tuple[int, int]) -> dict:
    """``ParallelModule.compile_report``'s value after the first compiled step (printed on
    rank 0): its seconds, each program's compile seconds, the Inductor cache's hits."""
    if isinstance(runner, PipelineRunner):
        programs = [st.submod.program for stages in runner.stages.values() for _, st in stages]
    else:
        programs = list(runner.programs.values())
    report = {"first_step_s": first_step_s, **compile_report(programs, cached)}
    if rank == 0:
        print(f"autopar: compile=True: first step {first_step_s:.1f} s, compiling forward and "
              f"backward (Inductor cache: {report['cache_hits']} hits, {report['cache_misses']} "
              "misses)", file=sys.stderr, flush=True)
    return report


def refuse_frozen(model) -> None:
    """An ArgumentError for a parameter with ``requires_grad=False``: the per-rank module
    trains every parameter (its gradient synchronization registers a hook on each, and ZeRO
    and the optimizer keep state for each), so a frozen one would fail deep in torch
    ("cannot register a hook on a tensor that doesn't require gradient") or be stepped.
    Found on ERNIE 4.5's MoE gate, whose score-correction bias is such a parameter."""
    if not isinstance(model, nn.Module):
        return          # capture names it
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        named = ", ".join(map(repr, frozen[:3])) + (f" (and {len(frozen) - 3} more)"
                                                    if len(frozen) > 3 else "")
        which = f"parameters {named} have" if len(frozen) > 1 else f"parameter {named} has"
        raise ArgumentError(
            f"{which} requires_grad=False: autopar trains every parameter of the model and "
            "does not yet leave frozen ones out; register a constant as a buffer "
            "(module.register_buffer) instead, or unfreeze it (p.requires_grad_(True))")


class ParallelModule(nn.Module):
    """A model parallelized by a Plan. Build it with ``autopar.parallelize`` (or
    ``autopar.runtime.build``). ``comm`` is this rank's communicator on the plan's whole
    mesh; under a pipeline, axis 0 is the pipeline axis. ``weights``: a weights source
    (``autopar.runtime.weights``) the local shards are read from; ``model`` may then be on
    the meta device."""

    first_step_check = None
    """Under ``check=``: ``autopar.first_step.FirstStepCheck``, run after the first ``train_step``."""
    elastic = None
    """Under ``elastic=True``: what the re-plan chose (``autopar.elastic.ElasticInfo``)."""

    def __init__(self, cap: Captured, plan: Plan, comm: Comm, model: nn.Module,
                 loss_fn: Callable | None = None, batch: str = "global", weights=None):
        super().__init__()
        check_plan_fits(plan, cap)       # a plan file edited by hand: a PlanError naming the node
        refuse_frozen(model)
        self.plan, self.comm, self._cap = plan, comm, cap
        self.device = comm.device
        # batch="per_rank": each data rank passes its slice (autopar.runtime.data)
        self.rank_data = RankData(plan, cap, comm, batch)
        pipelined = plan.pipeline_stages > 1
        if pipelined and not cap.has_loss:
            raise ArgumentError("pipeline parallelism needs the loss in the graph: pass loss_fn "
                                "and target= (or a model that returns its scalar loss); the last "
                                "stage computes each micro-batch's loss")
        # inside a stage every collective runs on the stage's own mesh (without the pipeline axis)
        self._stage_comm = comm.inner() if pipelined else comm
        splan = stage_plan(plan) if pipelined else plan
        if optimizer_sharded(plan):
            # ZeRO-1/2 (autopar.runtime.zero): the programs run on working parameters,
            # replicated over the data axis; the module keeps the plan's shards of them
            plan = working_plan(plan)
        run_splan = stage_plan(plan) if pipelined else plan
        root, shards = shard_model(cap, run_splan, self._stage_comm.coord, model, self.device,
                                   meta_ok=weights is not None)
        shards = stored_shards(shards, splan)
        self._shards, self._stage_mesh = shards, tuple(splan.mesh_shape)
        # the rewrite of this rank's programs: the declared passes (runtime.program_passes)
        built = rank_programs(cap, run_splan, pipelined, self._stage_comm.coord, self.device, root,
                              shards.attr_of, assign_stages(cap, plan.stage_cuts, plan.pipeline_stages
                                                            * plan.virtual_stages) if pipelined else None)
        self.program_passes = built.passes       # the passes each program went through
        self.runner = _runner(cap, plan, comm, root, shards, built, loss_fn)
        # this rank keeps what its stages read
        self.owners = self.runner.owners()
        self.module = nn.Module()
        for attr in shards.placements:
            if self.runner.pp_rank in self.owners[attr]:
                t = get_tensor(root, attr)
                set_tensor(self.module, attr, t, buffer=not isinstance(t, nn.Parameter))
        working = dict(self.module.named_parameters())
        self._zero = None
        if optimizer_sharded(self.plan):
            self._zero = OptimizerShards(self.plan.options.zero, working, shards.placements,
                                         splan.mesh_axes.index("data"), self._stage_comm)
            for attr, p in self._zero.params.items():
                set_tensor(self.module, attr, p)
            self._grad_sync = ZeroGradSync(working, built.grad_sync, self._stage_comm, self._zero,
                                           reduce_dtype=grad_reduce_dtype(plan.options))
        else:
            data_axis = splan.mesh_axes.index("data") if "data" in splan.mesh_axes else None
            self._grad_sync = GradSync(working, built.grad_sync, self._stage_comm,
                                       reduce_dtype=grad_reduce_dtype(plan.options),
                                       reducer=make_rule(plan.options, self._stage_comm, data_axis, working))
        self.scaler = self._mixed_precision(plan, pipelined)
        # loss_fn(pm(x), y).backward(): the ordinary loop (autopar.runtime.backward_loop)
        self._loop = BackwardLoop(self._grad_sync, self._zero, lambda: self._offload, refusal(
            plan.options, pipelined, plan.accumulate, bool(plan.branches), compute_dtype(plan.options)))
        if not pipelined:
            self._grad_sync.launch_on_accumulate()
        self._out_spec = cap.model_output_spec
        self.steps_started = 0
        """``train_step`` and differentiable forward calls so far: the step an error names."""
        if weights is not None:
            load_weights(self, weights, model)
        self._offload = None
        self._compile_report: dict | None = None
        if offloaded(self.plan):
            # ZeRO-Offload (autopar.runtime.offload): pm.parameters() are host master copies,
            # in files on disk between steps under offload="disk" (runtime.disk_offload)
            if self.plan.offload == "disk":
                self._offload = DiskOptimizer(dict(self.module.named_parameters()), self.device,
                                              self.plan.options.offload_dir)
            else:
                self._offload = HostOptimizer(dict(self.module.named_parameters()), self.device)
            self._stage_comm.settings.bucket_listener = self._offload  # copies by bucket, overlapped
            for attr, p in self._offload.masters.items():
                set_tensor(self.module, attr, p)

    def _mixed_precision(self, plan: Plan, pipelined: bool) -> LossScaler | None:
        """Set up the plan's precision (``autopar.runtime.precision``); the loss scaler under fp16."""
        dtype = compute_dtype(plan.options)
        self._stage_comm.configure(StepSettings(
            grad_reduce_dtype=grad_reduce_dtype(plan.options),
            context_attention=plan.options.context_attention or "ring",
            context_layout="balanced" if (plan.options.context or 1) > 1 else "contiguous"))
        if not pipelined:
            self.runner.device, self.runner.dtype = self.device, dtype
        if dtype != torch.float16:
            return None
        self.runner.loss_scale = LossScaler()     # a pipeline scales each micro-batch's loss
        return self.runner.loss_scale

    def step(self, optimizer, skip_nonfinite: bool = False) -> bool:
        """``optimizer.step()`` as the plan's update scheme makes it (``runtime.updates``:
        local SGD's averaging, staleness's skipped first steps, a parameter server's pulls,
        workers' learning rate); under fp16 with dynamic loss scaling. ``skip_nonfinite``:
        also without fp16, skip the step on every rank when any rank's gradients hold NaN or
        Inf (``runtime.nonfinite``: one small all-reduce; ``pm.nonfinite_skips`` lists them).
        Returns whether the optimizer stepped."""
        if self._offload is not None:      # offload="disk": steps by buckets, streamed from disk
            optimizer = self._offload.stepping(optimizer)

        def optimizer_step() -> bool:
            if self.scaler is None:
                if skip_nonfinite and not finite_or_skip(self, list(self.module.parameters())):
                    return False
                optimizer.step()
                return True
            return self.scaler.step(optimizer, list(self.module.parameters()), self.comm)
        rule = self.update_rule        # runtime.updates: the plan's scheme
        with reported_oom(self.comm, self.steps_started, "the optimizer step"):
            with scaled_lr(optimizer, rule.lr_scale):
                stepped = rule.optimizer_step(optimizer_step, self.module.parameters())
            self._gather_params()
        return stepped

    @property
    def update_rule(self) -> UpdateRule:
        """The rule of the plan's data-parallel update scheme (``autopar.runtime.updates``:
        ``ExactAllReduce`` when none is pinned)."""
        return self._grad_sync.reducer

    def _gather_params(self) -> None:
        """ZeRO-1/2: all-gather the optimizer shards into the working parameters when a
        shard changed (an optimizer step, a load) since the last gather; under offload,
        the host masters are copied into the device shards first."""
        if self._offload is not None and self._offload.dirty():
            if self._zero is None:
                self._offload.params_up()
            else:    # the shards' masters go up bucket by bucket, each just before its gather
                sharded = {id(self._zero.params[a]) for a in self._zero.dims}
                self._offload.up(p for p in self._offload.device_params.values() if id(p) not in sharded)
                self._zero.gather()
        if self._zero is not None and self._zero.dirty():
            self._zero.gather()

    @property
    def data_rank(self) -> int:
        """This rank's index among the data ranks (``DistributedSampler(rank=...)``); 0
        unless built with ``batch="per_rank"`` on a plan with a data axis."""
        return self.rank_data.rank

    @property
    def data_world(self) -> int:
        """How many slices make the global batch (``DistributedSampler(num_replicas=...)``):
        the size of the plan's data axes under ``batch="per_rank"``, else 1."""
        return self.rank_data.world

    # ---- running ------------------------------------------------------------------------
    def forward(self, *inputs, target=None):
        """The model's outputs (whole, on every rank) for the global batch ``inputs`` (under
        ``batch="per_rank"``, for this data rank's slice: its rows of the outputs, DDP's
        form); with ``target=``, the global batch's loss instead (``loss_fn`` on it, in the
        plan's graph or after it). Differentiable: ``loss.backward()`` on a loss of them trains the plan
        (``autopar.runtime.backward_loop``: the data-parallel gradient sums run in buckets
        as backward makes them; plans that cannot run that loop raise at backward, naming
        ``train_step``)."""
        inputs = self._check_inputs(inputs, target, "forward")
        if target is not None:
            return self._loss(inputs, target)
        inputs, _ = self.rank_data.global_batch(inputs, None)
        self._gather_params()
        flat = self._differentiable(lambda: self.runner.forward(inputs))
        # batch="per_rank": this rank's rows, as DDP returns them (gradients averaged)
        return pytree.tree_unflatten(self.rank_data.local_rows(flat), self._out_spec)

    def _loss(self, inputs: tuple, target) -> torch.Tensor:
        """``pm(x, target=y)``: the global batch's loss, differentiable."""
        if isinstance(self.runner, PipelineRunner):
            raise ArgumentError("pm(x, target=y) on a pipelined plan: its schedule runs forward "
                                "and backward together; call loss = pm.train_step(x, target=y)")
        if not self._cap.has_loss and self.runner._loss_fn is None:
            raise ArgumentError("pm(x, target=y): there is no loss to compute: pass loss_fn (and "
                                "target=) to autopar.parallelize, or call pm(x) and compute it")
        inputs, target = self.rank_data.global_batch(inputs, self._to_device(target))
        self._gather_params()
        return self._differentiable(lambda: [self.runner.loss(inputs, target)])[0]

    def _differentiable(self, run) -> list:
        """``run()``'s outputs; with grad enabled, a backward through them trains the plan:
        the step's gradient sync is armed first and the outputs pass the loop's entry node
        (``runtime.backward_loop``)."""
        grad = torch.is_grad_enabled()
        if grad:
            self._loop.arm()        # a backward may follow: its gradient sync listens
            self.steps_started += 1
        with reported_oom(self.comm, self.steps_started, "forward"), use_comm(self._stage_comm), \
                self._saved_tensor_policy():
            outs = run()
        return self._loop.attach(outs) if grad else outs

    def no_sync(self):
        """``with pm.no_sync():`` the backward passes of forwards run inside keep their
        gradients local, adding up in ``.grad``; the first backward after it sums them over
        the data-parallel ranks once (DDP's ``no_sync``)."""
        return self._loop.no_sync()

    def train_step(self, *inputs, target=None) -> torch.Tensor:
        """Forward and backward on the global batch; returns the global mean loss. Gradients
        are added to the local shards' ``.grad`` (call the optimizer's ``zero_grad`` between
        steps as usual)."""
        given = (inputs, target)
        inputs = self._check_inputs(inputs, target, "train_step")
        if target is None and self._cap.has_loss and self._cap.takes_target:
            raise ArgumentError("train_step needs target=: the loss is part of the plan's graph")
        target = self._to_device(target)
        inputs, target = self.rank_data.global_batch(inputs, target)
        params = self._local_params()
        self._gather_params()
        self._loop.disarm()       # a forward's armed sync, never followed by its backward
        if self._zero is not None:
            self._zero.drop_working_grads()
        first_compiled = self.plan.options.compile and self._compile_report is None
        t0, cached = time.perf_counter(), cache_counts() if first_compiled else None
        self.steps_started += 1
        with reported_oom(self.comm, self.steps_started, "forward and backward"), \
                use_comm(self._stage_comm), self._saved_tensor_policy(), _fresh_grads(params):
            loss = self.runner.train(inputs, target, self._grad_sync, params, self.owners)
            if self._offload is not None:
                self._offload.grads_down()      # the synced gradient shards to the host masters
        if first_compiled:
            self._compile_report = _first_compiled_step(self.runner, self.comm.rank,
                                                        time.perf_counter() - t0, cached)
        check, self.first_step_check = self.first_step_check, None
        if check is not None:       # check=: this first step against one device's, once
            check(*given, loss)
        return loss

    def compile_report(self) -> dict | None:
        """Under ``compile=True``, after the first ``train_step``: its seconds (compiling
        forward and backward), each program's compile seconds, and Inductor's on-disk cache
        hits and misses during it (``autopar.runtime.compiled``); None before, or when eager."""
        return self._compile_report

    def _local_params(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by attribute path, built once (every parameter is set by
        the end of ``__init__``; loads copy into them)."""
        if self.__dict__.get("_params_cache") is None:
            self.__dict__["_params_cache"] = dict(self.module.named_parameters())
        return self.__dict__["_params_cache"]

    @contextlib.contextmanager
    def _saved_tensor_policy(self):
        """Under zero=3, gathered weights are not saved for backward but gathered again
        (compiled: by the compiled backward itself, ``ops.collectives.all_gather``)."""
        if self.plan.options.zero_stage < 3 or self.plan.options.compile:
            yield
            return
        reg = regathered_weights()
        try:
            with reg.hooks():
                yield
        finally:
            reg.clear()

    def _check_inputs(self, inputs, target, call: str) -> tuple:
        """The inputs on this rank's device, after checking them (and the target) against
        what the plan was made for: their number, shapes and dtypes (``RankData.check``)."""
        if len(inputs) != self._cap.n_model_inputs:
            hint = (" (the target goes in target=)" if self._cap.takes_target
                    and len(inputs) == self._cap.n_model_inputs + 1 else "")
            raise ArgumentError(f"{call}: expected {self._cap.n_model_inputs} inputs (the global "
                                f"batch, as in example_inputs), got {len(inputs)}{hint}")
        self.rank_data.check(inputs, target, call)
        return tuple(self._to_device(x) for x in inputs)

    def _to_device(self, x):
        return pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, x)

    # ---- state --------------------------------------------------------------------------
    def _whole(self, attr: str, local: torch.Tensor | None) -> torch.Tensor:
        """The whole tensor of ``attr`` on every rank, from the first pipeline rank holding
        it (collective)."""
        src = self.owners[attr][0]
        if self.runner.pp_rank == src:
            with use_comm(self._stage_comm):
                whole = unshard(local.detach().to(self.device), self._shards.placements[attr]).contiguous()
        else:
            whole = torch.empty(self._shards.shapes[attr], dtype=self._shards.dtypes[attr],
                                device=self.device)
        return self.runner.broadcast(whole, src)

    def _by_name(self, whole_of) -> dict[str, torch.Tensor]:
        out = {}
        for attr, whole in whole_of:
            for name in self._shards.aliases[attr]:
                out[name] = whole
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers by their names in the original model, on every rank
        (collective: every rank must call it)."""
        mine = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        return self._by_name((attr, self._whole(attr, mine.get(attr))) for attr in self._shards.placements)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole gradients by original parameter name, on every rank (collective); a
        parameter without a gradient counts as a zero one."""
        mine = dict(self.module.named_parameters())

        def local(attr):
            p = mine.get(attr)
            return None if p is None else (p.grad if p.grad is not None else torch.zeros_like(p))
        grads = {attr: local(attr) for attr in self._shards.params}
        # a parameter server holds the global gradient (UpdateRule.global_grads)
        grads = self.update_rule.global_grads({a: g for a, g in grads.items() if g is not None}) | \
            {a: g for a, g in grads.items() if g is None}
        return self._by_name((attr, self._whole(attr, grads[attr])) for attr in self._shards.params)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (as from ``model.state_dict()``); each rank keeps its blocks of
        the tensors its stages read."""
        placements = self._shards.placements
        check_state_dict(state_dict, placements, self._shards.aliases, self._shards.shapes)
        coord = self._stage_comm.coord
        with torch.no_grad():
            for attr, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
                t.copy_(shard_tensor(state_dict[attr], placements[attr], coord, self._stage_mesh))

    def received_skips(self) -> list[tuple[int, int]]:
        """Pipelines: (skip edge, micro-batch) pairs this rank received in the last train step."""
        return self.runner.received_skips()

    def code(self, which: str = "train") -> str:
        """The rewritten per-rank program as Python (a pipeline rank's: its stage programs)."""
        return self.runner.code(which)

    def timing_report(self, *inputs, target=None, steps: int = 5, warmup: int = 1,
                      optimizer=None) -> TimingReport | None:
        """Run ``warmup`` + 1 + 2 x ``steps`` training steps (AdamW, or ``optimizer(params)``)
        and return what the plan predicted against what each rank measured: step time,
        compute by op family, communication by collective, peak memory
        (``autopar.runtime.timing``). Collective: rank 0 gets the report (print it), the
        others None. Parameters and gradients are left as they were."""
        return timing_report(self, tuple(inputs), target, steps, warmup, optimizer)


def _runner(cap: Captured, plan: Plan, comm: Comm, root: nn.Module, shards: Shards,
            built: RankPrograms, loss_fn: Callable | None) -> "OneStage | PipelineRunner":
    """What runs this rank's programs (``built``): one stage, or a pipeline's stages. Every
    rank of each group issues the same collectives in the same order, or the program is
    refused before it runs (``runtime.collective_order``): eager programs now, compiled ones
    as Inductor generates them."""
    programs, pipelined, compiled = built.programs, plan.pipeline_stages > 1, bool(plan.options.compile)
    if compiled:
        check_compilable(comm)
    order = order_check(comm, pipelined) if compiled or not pipelined else None
    if not compiled and not pipelined:
        check_eager_programs(order, comm, programs)
    if compiled and (note := cuda_graphs_note(plan.options.compile, comm.device)) and comm.rank == 0:
        warnings.warn(note, stacklevel=3)
    if compiled and not pipelined:   # a pipeline compiles each of its stages
        options = inductor_options(plan.options.compile, comm.device)
        programs = {w: CompiledProgram(gm, w, order, options) for w, gm in programs.items()}
    if pipelined:
        return PipelineRunner(cap, plan, comm, root, shards, programs, built.grad_sync,
                              order if compiled else None)
    return OneStage(cap, programs, loss_fn, shards, plan.accumulate,
                    BranchRanks(plan, comm, shards.attr_of) if plan.branches else None, built.loss_sync)


def _every_grad(sync: GradSync, zero: bool) -> None:
    """Every parameter ``sync`` reduces gets a gradient: zeros where it has none (and, with
    ``zero``, everywhere)."""
    for p in sync.params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif zero:
            p.grad.zero_()


@contextlib.contextmanager
def _fresh_grads(params: dict[str, nn.Parameter]):
    """The step starts without gradients (so it syncs and scales only its own); those of
    earlier steps are added back after it."""
    stash = {a: p.grad for a, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    try:
        yield
    finally:
        for a, p in params.items():
            old = stash.get(a)
            if old is not None:
                p.grad = old if p.grad is None else old + p.grad


def _scalar(loss, what: str) -> torch.Tensor:
    """``loss`` when it is a scalar tensor that can be trained; else an ArgumentError."""
    if isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point():
        return loss
    got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else \
        f"a {type(loss).__name__}"
    raise ArgumentError(f"train_step: {what} {got}, not a scalar loss: return one number of "
                        "floating dtype (reduce with .mean() or .sum()), or pass loss_fn and "
                        "target= for a model that returns outputs")


def check_state_dict(state_dict, placements: dict, aliases: dict, shapes: dict) -> None:
    """An ArgumentError naming the missing and unexpected keys, or a tensor of another shape,
    of a whole-model state dict (tied weights may appear under any of their names)."""
    if not isinstance(state_dict, dict):
        raise ArgumentError(f"load_full_state_dict takes a dict of tensors (model.state_dict()), "
                            f"got {type(state_dict).__name__}")
    known = {a for attr in placements for a in aliases.get(attr, [attr])} | set(placements)
    missing = [n for n in placements if n not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if missing or unexpected:
        def some(names):
            return f"{names[:5]}{' ...' if len(names) > 5 else ''}"
        raise ArgumentError(
            "load_full_state_dict: the state dict does not fit the model: "
            + "; ".join(([f"{len(missing)} missing keys {some(missing)}"] if missing else [])
                        + ([f"{len(unexpected)} unexpected keys {some(unexpected)}"] if unexpected else []))
            + ". Pass the state_dict() of the model given to autopar.parallelize (same names)")
    for attr in placements:
        t = state_dict[attr]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shapes[attr]):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ArgumentError(f"load_full_state_dict: {attr!r} is {got}, the model's is "
                                f"{list(shapes[attr])}: pass the state dict of this model's "
                                "configuration")


