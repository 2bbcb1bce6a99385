"""How a pipelined plan runs a step: stage programs run by torch.distributed.pipelining.

The mesh is ``(p, *intra)`` with the leading axis ``"pipeline"``. Pipeline rank ``r`` runs
stages ``r, r + p, ...`` (``v`` of them under an interleaved schedule; under DualPipeV the
V's ``r`` and ``2p - 1 - r``, ``schedule.stage_ranks``) as ``PipelineStage``s
on the pipeline-axis process group; inside a stage every collective runs on the intra mesh
(``comm.inner()``). autopar chooses the cuts, micro-batches and schedule; torch's schedule
classes run them. ``autopar.runtime.parallel_module.ParallelModule`` owns the shards, the
checks and the gradient sync; this runner owns what is particular to a pipeline.

One step (:meth:`PipelineRunner.train`), in order:

1. the schedule runs every micro-batch (its loss is the stage program's own output; the
   last stage's ``loss_fn`` passes it through, times the loss scale under fp16, so every
   micro-batch's backward carries scaled gradients), gradients accumulate;
2. data-parallel gradients are all-reduced over the intra axes once (never per micro-batch:
   the per-rank graph defers them, see ``passes.insert_collectives``). A weight's all-reduce
   starts as soon as the last backward of every stage on this rank reading it is done, while
   the schedule goes on with the other stages and micro-batches; the step waits for it after
   the schedule (``GradSync.ready`` / ``GradSync.finish``);
3. a weight held by several pipeline ranks (tied) has its gradient summed among them (on a
   process group of those ranks only, as Megatron does for the tied embedding, when they
   are not the whole pipeline);
4. nothing is divided by ``m``: each micro-batch's graph outputs its term of the global loss
   (means divide by the global batch's denominator, fed as inputs by
   ``analysis.microbatch_loss``), so the loss is the sum of the micro-batch losses,
   broadcast from the last stage to every rank (started before 2 and 3, waited after them).

Skip values travel by ``autopar.ops.stage_ops`` (``skip_send`` / ``skip_recv``). Under
DualPipeV, where a stage's experts dispatch by all-to-all, each forward/backward pair runs
its two halves at once (``autopar.runtime.overlap``, :attr:`PipelineRunner.overlap`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleLoopedBFS
from torch.fx import GraphModule

from autopar.analysis.layers import layer_members, select_layers
from autopar.analysis.microbatch_loss import denominator_inputs
from autopar.analysis.stages import assign_stages, local_meta, no_grad_ops
from autopar.capture import Captured
from autopar.device import object_device, p2p_matched_by_tag
from autopar.errors import ArgumentError
from autopar.ops.comm import DistComm, is_comm_failure
from autopar.ops.experts import run_experts
from autopar.ops.stage_ops import StepContext, use_step_context
from autopar.passes.offload_activations import offload_layers
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.split_stages import StageGraph, split_stages
from autopar.placement import parse_placements, placements_str
from autopar.plan import NodePlacement, Plan
from autopar.runtime.compiled import CompiledStage, inductor_options
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.overlap import OverlapPairs, overlap_applies
from autopar.runtime.precision import AutocastStage, cast_once_per_step, compute_dtype
from autopar.runtime.receive_buffers import BufferMeter, InFlightBuffers
from autopar.runtime.shards import Shards
from autopar.runtime.weight_groups import GroupMerger
from autopar.schedule import rank_stages, stage_ranks, torch_schedule_class


class _Stage(InFlightBuffers, PipelineStage):
    """A PipelineStage that says when its last backward of a step is done (the full
    backward of the last micro-batch, or under zero bubble its last weight half), and holds
    receive buffers for the micro-batches in flight only (``runtime.receive_buffers``).

    Zero bubble splits a backward into the inputs' half (I) and the weights' half (W);
    torch computes W only for weights whose gradient reaches the stage output through a
    value computed from a differentiable stage input (its ``param_groups``), and the first
    stage as a whole at W. A later stage with a weight off that path (an embedding of
    token ids behind a stage of rotary tables only, whose inputs need no gradient) would
    lose that weight's gradient: such a stage (``split_backward=False``,
    :func:`split_backward_safe`) runs its whole backward at I and nothing at W.

    W runs torch's weight groups with every two whose passes share an autograd node merged
    (``runtime.weight_groups``): T5's relative position bias, one weight's value added to
    the scores of every decoder layer, put the layers between on two groups' passes, and
    the second failed ("backward through the graph a second time"; the seed-2026 sweep's
    t5:pp-dualpipev:200289:gloo, its last stage). W also runs again every meeting point of
    a weight's value with an input's, a skip's send among them (that case's stage 1 sends
    the encoder's output beside the decoder's embedding of the tied weight): its gradient
    is received once (``ops.stage_ops``), or the second receive waits forever."""

    on_last_backward = None
    split_backward = True
    _merger = None          # GroupMerger, made at the first weight half

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        whole = not full_backward and not self.split_backward
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward or whole,
                                   last_backward=last_backward)
        if last_backward and full_backward and self.on_last_backward is not None:
            self.on_last_backward(self.stage_index)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if self.split_backward:
            state = self.backward_state.get(bwd_chunk_id)
            if state is not None and state[1]:
                if self._merger is None:
                    self._merger = GroupMerger()
                groups = self._merger(state[1], self.submod.parameters())
                self.backward_state[bwd_chunk_id] = (state[0], groups, *state[2:])
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if last_backward and self.on_last_backward is not None:
            self.on_last_backward(self.stage_index)


def split_backward_safe(gm: GraphModule, input_requires_grad: list[bool]) -> bool:
    """Whether every weight's gradient in stage program ``gm`` flows only through values
    computed from its differentiable inputs (the placeholders flagged in
    ``input_requires_grad``, in order): then zero bubble's weight half finds every weight
    (see :class:`_Stage`). False when some weight reaches the output by a path that no
    differentiable input joins, or when a weight is read more than once in the stage
    (ALBERT's one layer run at every depth, T5's shared embedding): torch groups weights by
    the values they reach and computes each group's gradient with its own
    ``autograd.grad`` that frees the graph, so a weight in two groups' paths failed the
    second with "backward through the graph a second time". (``_Stage`` merges such groups
    now, ``runtime.weight_groups``, which also covers a weight read once whose value is read
    twice, T5's relative position bias under DualPipeV; the rule stays, so these stages run as before:
    their merged W would run the backward between the reads again.) False too for a stage that
    splits a mixture of experts' experts (``ops.experts.run_experts``): their gradient
    passes the dispatch's all-to-all, which the weight half would run again on one rank
    only (Mixtral under expert=2 and zero bubble: that error, then the peers hung)."""
    if any(n.op == "call_function" and n.target is run_experts for n in gm.graph.nodes):
        return False
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    joined = {n for n, rg in zip(placeholders, input_requires_grad) if rg}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in joined for a in n.all_input_nodes):
            joined.add(n)
    params = dict(gm.named_parameters())
    reads: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and getattr(params.get(n.target), "requires_grad", False):
            reads[n.target] = reads.get(n.target, 0) + len(n.users)
    if any(k > 1 for k in reads.values()):
        return False
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not getattr(params.get(n.target), "requires_grad", False):
            continue
        todo, seen = [n], {n}
        while todo:
            for u in todo.pop().users:
                if u.op == "output":
                    return False        # out of the stage without meeting an input's value
                if u not in joined and u not in seen:
                    seen.add(u)
                    todo.append(u)
    return True


def stage_plan(plan: Plan) -> Plan:
    """The plan of one stage: its placements without the leading pipeline axis."""
    def strip(x: str) -> str:
        return placements_str(parse_placements(x)[1:])
    nodes = {k: NodePlacement(tuple(strip(x) for x in v.inputs), tuple(strip(x) for x in v.outputs))
             for k, v in plan.nodes.items()}
    p = plan.pipeline_stages
    return replace(plan, nodes=nodes, world_size=plan.world_size // p, pipeline=None,
                   mesh_shape=tuple(plan.mesh_shape[1:]), mesh_axes=tuple(plan.mesh_axes[1:]))


STAGE_INPUTS_ALL_GRAD = torch.__version__ < (2, 13)     # a TorchVersion compares so
"""Torch before 2.13: ``PipelineStage`` makes every received tensor require grad and waits
for a gradient back for each (2.13 reads both from the example inputs); a cut that carries
a value without a gradient (integer ids, a router's counts) then fails on one rank while
the others wait. Such plans are refused on those versions (:func:`check_stage_inputs`)."""


def check_stage_inputs(parts, all_grad: bool | None = None) -> None:
    """ArgumentError naming the stage and the value when a stage receives a value that takes
    no gradient and this torch cannot pipeline it (:data:`STAGE_INPUTS_ALL_GRAD`)."""
    if not (STAGE_INPUTS_ALL_GRAD if all_grad is None else all_grad):
        return
    for sg in parts:
        for name, (shape, dtype, grad) in zip(sg.inputs, sg.input_meta):
            if sg.index > 0 and not grad:
                raise ArgumentError(
                    f"pipeline stage {sg.index} receives {name!r} ({dtype}, shape {list(shape)}), a "
                    f"value without a gradient, across its cut: torch {torch.__version__}'s "
                    "PipelineStage makes every received tensor require grad. Use torch >= 2.13, "
                    "or plan without pipeline= (or pin other stage cuts)")


class _VForward(ScheduleLoopedBFS):
    """Forward only (``eval``) over stages placed in DualPipeV's V (``schedule.stage_ranks``):
    torch's breadth-first order (every micro-batch through the rank's first stage, then its
    second) over the V's stages in place of the loop placement ``ScheduleLoopedBFS``
    assumes. torch reads the stage-to-rank map back from these actions
    (``_validate_and_set_stage_mapping``, which wants every backward listed too) before
    adding the sends and receives; the backwards and their transfers are then dropped from
    the lowered order: ``eval`` skips a backward, except that on the rank holding the V's
    middle pair (stages p - 1 and p) it still hands the gradient between them, which a
    forward-only stage refuses ("can't steal_bwd_input")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from torch.distributed.pipelining.schedules import _ComputationType as T

        forward = {T.FORWARD, T.SEND_F, T.RECV_F}
        self.pipeline_order_with_comms = {
            r: [a for a in acts if a.computation_type in forward]
            for r, acts in self.pipeline_order_with_comms.items()}

    def _calculate_single_rank_operations(self, rank):
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        mine = rank_stages("dualpipev", self.pp_group_size, 2)[rank]
        m = self._n_microbatches
        return ([_Action(k, _ComputationType.FORWARD, i) for k in mine for i in range(m)]
                + [_Action(k, _ComputationType.FULL_BACKWARD, i)
                   for k in reversed(mine) for i in reversed(range(m))])


class PipelineRunner:
    """This pipeline rank's stages of the ``programs`` (``"train"``, ``"forward"``: per-rank
    GraphModules over ``root``, which holds every shard) and the schedules that run them."""

    loss_scale = None      # fp16: the LossScaler (set by ParallelModule)

    def __init__(self, cap: Captured, plan: Plan, comm: DistComm, root: nn.Module, shards: Shards,
                 programs: dict[str, GraphModule], grad_axes: dict[str, tuple[int, ...]],
                 order_check=None):
        # compiled stages: their ranks compare the collectives Inductor's code issues before
        # it first runs (``runtime.collective_order``)
        self._order_check = order_check
        if not isinstance(comm, DistComm):
            raise ArgumentError("a pipelined plan runs on torch.distributed ranks (torchrun), "
                                "not on simulated ones")
        self._cap, self._shards = cap, shards
        p, v, m = plan.pipeline_stages, plan.virtual_stages, plan.n_microbatches
        self.n_stages, self.n_microbatches, self.p = p * v, m, p
        self.device = comm.device
        self._comm = comm       # names a send / recv that failed (axis 0: the pipeline's)
        self.pp_group, self.pp_rank = comm.groups[0], comm.coord[0]
        self._pp_global = dist.get_process_group_ranks(self.pp_group)
        # which pipeline rank runs each stage: k mod p, or DualPipeV's V
        self._stage_rank = stage_ranks(plan.schedule, p, v)
        self.my_stages = rank_stages(plan.schedule, p, v)[self.pp_rank]
        self._rank_of_stage = {k: self._pp_global[r] for k, r in enumerate(self._stage_rank)}
        self._intra = stage_plan(plan)
        self._dtype = compute_dtype(plan.options)     # mixed precision: stages run under autocast
        self.stages: dict[str, list[tuple[StageGraph, _Stage]]] = {}
        self.skip_edges: dict[str, dict] = {}
        self._reads: dict[str, set[int]] = {}     # attr -> every stage (of any program) reading it
        self._meters: dict[str, BufferMeter] = {}   # program -> its stages' receive buffers
        for which, gm in programs.items():
            self._split(which, gm, plan, root)
        # data-parallel gradients each local train stage completes (see _stage_done)
        self._stage_grads = {sg.index: sorted({n.target for n in sg.gm.graph.nodes if n.op == "get_attr"}
                                              & set(grad_axes))
                             for sg, _ in self.stages.get("train", [])}
        self._readers: dict[str, int] = {}
        for attrs in self._stage_grads.values():
            for a in attrs:
                self._readers[a] = self._readers.get(a, 0) + 1
        self._left: dict[str, int] = {}
        self.sync_order: list[int] = []     # stages whose reductions started, in order
        self._sync: GradSync | None = None
        self._skip_log: list = []
        self._mb_losses: list[torch.Tensor] = []
        self._schedule, self._eval = self._schedules(plan)
        # DualPipeV's forward/backward pairs at once where a stage's experts dispatch by
        # all-to-all (runtime.overlap): the forward thread's own process groups on the stage
        # axes, made on every rank in the same order (the condition is the plan's). Skip
        # values travel point to point on the world group from the stage programs: both
        # threads would send them at once, which only a backend matching them by tag allows
        self.overlap: OverlapPairs | None = None
        skips = bool(self.skip_edges.get("train")) and not p2p_matched_by_tag(self.device)
        if self._schedule is not None and overlap_applies(plan) and not skips:
            twin = comm.twin(range(1, len(comm.mesh_shape)))
            self.overlap = OverlapPairs(twin.inner(), self.device, self._dtype, comm.post_fault)
            self.overlap.register(self._schedule)
        self._tied_groups = self._tied_process_groups(comm)

    # ---- building ---------------------------------------------------------------------------
    def _split(self, which: str, gm: GraphModule, plan: Plan, root: nn.Module) -> None:
        """Cut program ``which`` into stages; wrap this rank's as PipelineStages."""
        cap, S = self._cap, self.n_stages
        model_inputs = list(cap.inputs[: cap.n_model_inputs])
        stage_of = assign_stages(cap, plan.stage_cuts, S)
        parts, edges = split_stages(gm, stage_of, S, model_inputs,
                                    lambda n: local_meta(cap, self._intra, n), root,
                                    no_grad_ops(cap))
        self.skip_edges[which] = {e.id: e for e in edges}
        check_stage_inputs(parts)
        for sg in parts:
            for n in sg.gm.graph.nodes:
                if n.op == "get_attr":
                    self._reads.setdefault(n.target, set()).add(sg.index)
        # recomputation: each of this rank's train stages checkpoints its share of the plan's
        # layers (passes/recompute; a layer across a cut is a region in each of its stages);
        # activation offload likewise: each train stage's share of the offloaded layers keeps
        # its saved tensors in host memory, every micro-batch's forward its own
        # (passes/offload_activations; the stage's program carries its hooks)
        regions = layer_members(cap.gm, plan.recompute) if which == "train" and plan.recompute else {}
        offload = plan.options.offload_activations
        moved = layer_members(cap.gm, select_layers(cap.gm, offload, "offload_activations")) \
            if which == "train" and offload not in (None, "none", ()) else {}
        mine = []
        self._meters[which] = meter = BufferMeter()
        for sg in parts:
            if sg.index not in self.my_stages:
                continue
            if regions:
                sg = replace(sg, gm=checkpoint_layers(sg.gm, regions))
            if moved:
                sg = replace(sg, gm=offload_layers(sg.gm, moved, self.device, keep_weight_casts=True))
            ins, outs = self._stage_examples(which, sg)
            dtype = self._dtype
            mod = sg.gm if dtype is None else AutocastStage(sg.gm, self.device, dtype)
            if plan.options.compile:
                mod = CompiledStage(mod, f"stage {sg.index} {which}", self._order_check,
                                    inductor_options(plan.options.compile, self.device))
            stage = _Stage(mod, sg.index, S, self.device, input_args=ins, output_args=outs,
                           group=self.pp_group)
            stage.meter = meter
            # (the first stage torch runs whole at W already). A compiled stage's backward is
            # one opaque autograd node: torch's split would find no weight behind it (its
            # weight half computed wrong gradients), so it runs whole at I.
            stage.split_backward = not plan.options.compile and (sg.index == 0 or split_backward_safe(
                sg.gm, [t.requires_grad for t in ins]))
            if which == "train":
                stage.on_last_backward = self._stage_done
            mine.append((sg, stage))
        self.stages[which] = mine

    def _stage_examples(self, which: str, sg: StageGraph) -> tuple[tuple, tuple]:
        """Example inputs and outputs of stage ``sg`` (their shapes and dtypes)."""
        cap, S = self._cap, self.n_stages

        def val(name):
            return cap.node(name).meta["val"]
        if sg.index == 0:
            ins = tuple(self._example(tuple(val(n).shape), val(n).dtype, False)
                        for n in cap.inputs[: cap.n_model_inputs])
        else:
            ins = tuple(self._example(*mt) for mt in sg.input_meta)
        if sg.index < S - 1:
            outs = tuple(self._example(*mt) for mt in sg.output_meta)
        elif which == "train":
            outs = (self._example((), val(cap.loss).dtype, True),)
        else:
            outs = tuple(self._example(tuple(val(o).shape), val(o).dtype, False) for o in cap.output)
        return ins, outs

    def _example(self, shape, dtype, requires_grad: bool) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        # a complex value carries a gradient too (Llama 4's rotary table, computed on one
        # stage and read on the next): split_stages says which do; a receive that took none
        # left its sender a gradient of None for a value that needed one
        return t.requires_grad_(requires_grad and (dtype.is_floating_point or dtype.is_complex))

    def _schedules(self, plan: Plan):
        m = self.n_microbatches
        multi = plan.schedule in ("interleaved-1f1b", "zero-bubble", "dualpipev")
        train_stages = [st for _, st in self.stages.get("train", [])]
        schedule = None
        if train_stages:
            schedule = torch_schedule_class(plan.schedule)(
                train_stages if multi else train_stages[0], n_microbatches=m,
                loss_fn=self._scaled_loss, scale_grads=False)
        fwd = [st for _, st in self.stages["forward"]]
        ev = (_VForward(fwd, n_microbatches=m, loss_fn=None) if plan.schedule == "dualpipev"
              else ScheduleLoopedBFS(fwd, n_microbatches=m, loss_fn=None) if plan.virtual_stages > 1
              else ScheduleGPipe(fwd[0], n_microbatches=m, loss_fn=None))
        return schedule, ev

    def _tied_process_groups(self, comm: DistComm) -> dict[tuple[int, ...], object]:
        """For each set of pipeline ranks holding a tied weight (fewer than all of them), the
        process group of those ranks beside this one (same intra coordinate). Every rank
        creates every such group, in the same order (``dist.new_group`` is collective)."""
        owners = self.owners()
        sets = sorted({tuple(owners[a]) for a in self._shards.params if 1 < len(owners[a]) < self.p})
        groups = {}
        ranks = comm.mesh.mesh.reshape(self.p, -1)        # pipeline rank x intra coordinate
        for pp in sets:
            for c in range(ranks.shape[1]):
                members = [int(ranks[k, c]) for k in pp]
                g = dist.new_group(members)
                if comm.rank in members:
                    groups[pp] = g
        return groups

    def _scaled_loss(self, output, target):
        """The last stage's loss of one micro-batch (its program's output) as the schedule
        back-propagates it: times the fp16 loss scale; the unscaled one is kept for the step."""
        self._mb_losses.append(output.detach())
        return output if self.loss_scale is None else output * self.loss_scale.scale

    def owners(self) -> dict[str, list[int]]:
        """Which pipeline ranks hold each parameter / buffer: those whose stages read it. The
        same answer on every rank (from all the stage programs, not this rank's): a buffer
        that feeds recomputed constants is read by every stage recomputing them."""
        return {attr: sorted({self._stage_rank[k] for k in self._reads.get(attr, ())} or {0})
                for attr in self._shards.placements}

    # ---- running ----------------------------------------------------------------------------
    def _context(self, which: str, inputs: tuple, target) -> StepContext:
        m = self.n_microbatches
        side = {}
        given = tuple(inputs) + ((target,) if target is not None else ())
        if which == "train":
            # the loss's scale inputs: 1 / the global batch's denominator (analysis.microbatch_loss)
            given += tuple(t.to(self.device) for t in denominator_inputs(self._cap, inputs, target, m))
        for name, t in zip(self._cap.inputs, given):
            if t.shape[0] % m:
                raise ArgumentError(f"the batch of input {name!r} ({t.shape[0]}) does not divide into "
                                    f"{m} micro-batches; pass the global batch the plan was made for")
            side[name] = list(t.tensor_split(m, dim=0))
        return StepContext(side, self.skip_edges[which], self._rank_of_stage, self.device)

    def train(self, inputs: tuple, target, sync: GradSync, params: dict[str, nn.Parameter],
              owners: dict[str, list[int]]) -> torch.Tensor:
        """Forward and backward of the global batch through the pipeline; the global mean
        loss on every rank. ``params`` (this rank's) start the step without gradients."""
        if self._schedule is None:
            raise ArgumentError("this model was captured without a loss: pass loss_fn and target=")
        losses: list = []
        self._mb_losses = []     # unscaled, by _scaled_loss
        self._left, self.sync_order, self._sync = dict(self._readers), [], sync
        ctx = self._context("train", inputs, target)
        self._meters["train"].reset()
        sync.begin()
        try:
            with use_step_context(ctx), cast_once_per_step(self.device, self._dtype):
                # a model that returns its own loss has no target: the schedule still hands
                # its loss_fn one per micro-batch, which _scaled_loss does not read
                mb_target = target if target is not None else torch.zeros(self.n_microbatches)
                self._schedule.step(*inputs, target=mb_target, losses=losses, return_outputs=False)
        except BaseException as e:
            sync.abort()
            if is_comm_failure(e):     # a stage's send / recv timed out or lost its peer
                raise self._comm.failure("send/recv", 0, e) from e
            raise
        self._skip_log = list(ctx.received)
        # each micro-batch's loss is its term of the global loss: no / m
        last = self._stage_rank[-1]         # the last stage's rank (rank 0 under DualPipeV)
        loss = torch.zeros((), dtype=self._cap.node(self._cap.loss).meta["val"].dtype, device=self.device)
        if self.pp_rank == last:
            loss = torch.stack(self._mb_losses).sum()
        sent = dist.broadcast(loss, self._pp_global[last], group=self.pp_group, async_op=True)
        with torch.no_grad():
            sync.finish()
            self._sum_tied(params, owners)
        sent.wait()
        return loss

    def forward(self, inputs: tuple) -> list:
        """The model's outputs for the global batch, flat (whole, on every rank)."""
        ctx = self._context("forward", inputs, None)
        with torch.no_grad(), use_step_context(ctx), cast_once_per_step(self.device, self._dtype):
            try:
                out = self._eval.eval(*inputs)
            except RuntimeError as e:
                if is_comm_failure(e):
                    raise self._comm.failure("send/recv", 0, e) from e
                raise
        last = self._stage_rank[-1]         # the last stage's rank (rank 0 under DualPipeV)
        flat = list(out) if isinstance(out, (tuple, list)) else [out] if out is not None else None
        box = [flat if self.pp_rank == last else None]
        dist.broadcast_object_list(box, self._pp_global[last], group=self.pp_group,
                                   device=object_device(self.device))
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in box[0]]

    def _stage_done(self, stage: int) -> None:
        """Stage ``stage``'s last backward of the step is done: start the all-reduce of every
        data-parallel gradient no other local stage still adds to. The ranks of an intra
        group run the same stages in the same order, so they start the same reductions in
        the same order."""
        ready = []
        for attr in self._stage_grads.get(stage, ()):
            self._left[attr] -= 1
            if self._left[attr] == 0:
                ready.append(attr)
        if ready and self._sync is not None:
            self.sync_order.append(stage)
            self._sync.ready(ready)

    def _sum_tied(self, params: dict[str, nn.Parameter], owners: dict[str, list[int]]) -> None:
        """Sum the gradient of every parameter held by several pipeline ranks among them."""
        tied = [a for a in self._shards.params if len(owners[a]) > 1]
        by_group: dict[tuple[int, ...], list[str]] = {}
        for a in tied:
            pp = tuple(owners[a])
            if len(pp) < self.p:                # a group of the holders only
                if self.pp_rank in pp:
                    by_group.setdefault(pp, []).append(a)
            else:
                by_group.setdefault((), []).append(a)
        for pp, attrs in by_group.items():
            self._sum_among(attrs, params, owners, self._tied_groups[pp] if pp else self.pp_group)

    def _sum_among(self, tied: list[str], params: dict[str, nn.Parameter],
                   owners: dict[str, list[int]], group) -> None:
        parts = []
        for attr in tied:
            p = params.get(attr) if self.pp_rank in owners[attr] else None
            if p is not None and p.grad is None:
                p.grad = torch.zeros_like(p)
            parts.append(p.grad if p is not None else
                         torch.zeros(self._shards.local_shape(attr, self._intra.mesh_shape),
                                     dtype=self._shards.dtypes[attr], device=self.device))
        flat = torch.cat([t.reshape(-1) for t in parts])
        dist.all_reduce(flat, group=group)
        off = 0
        for attr, t in zip(tied, parts):
            n = t.numel()
            if attr in params and self.pp_rank in owners[attr]:
                params[attr].grad.copy_(flat[off:off + n].view_as(t))
            off += n

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` of pipeline rank ``src`` on every pipeline rank."""
        dist.broadcast(t, self._pp_global[src], group=self.pp_group)
        return t

    def receive_buffer_bytes(self, which: str = "train") -> int:
        """The peak bytes of receive buffers this rank's ``which`` stages held at once in the
        last step (``runtime.receive_buffers``: one per micro-batch in flight for each value
        a stage receives and each gradient sent back to it); what the pipeline memory model
        counts as ``"pipeline_buffers"`` (``solver.stage_dp``)."""
        meter = self._meters.get(which)
        return meter.peak if meter is not None else 0

    def held_receive_buffer_bytes(self, which: str = "train") -> int:
        """Bytes of receive buffers this rank's ``which`` stages hold now (between steps: 0)."""
        meter = self._meters.get(which)
        return meter.live if meter is not None else 0

    def received_skips(self) -> list[tuple[int, int]]:
        """(skip edge, micro-batch) pairs this rank received in the last train step."""
        return list(self._skip_log)

    def code(self, which: str) -> str:
        """This rank's stage programs as Python."""
        return "\n".join(f"# stage {sg.index}\n{sg.gm.code}" for sg, _ in self.stages[which])
