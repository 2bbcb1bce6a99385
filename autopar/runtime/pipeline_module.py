"""The pipelined module: stage programs run by torch.distributed.pipelining.

The mesh is ``(p, *intra)`` with the leading axis ``"pipeline"``. Pipeline rank ``r`` runs
stages ``r, r + p, ...`` (``v`` of them under an interleaved schedule) as ``PipelineStage``s
on the pipeline-axis process group; inside a stage every collective runs on the intra mesh
(a ``DistComm`` over the sub-mesh at this rank's pipeline coordinate). autopar chooses the
cuts, micro-batches and schedule; torch's schedule classes run them.

One step (``train_step``), in order:

1. the schedule runs every micro-batch (its loss is the stage program's own output; the
   last stage's ``loss_fn`` passes it through), gradients accumulate;
2. data-parallel gradients are all-reduced over the intra axes once (never per micro-batch:
   the per-rank graph defers them, see ``passes.insert_collectives``). A weight's all-reduce
   starts as soon as the last backward of every stage on this rank reading it is done, while
   the schedule goes on with the other stages and micro-batches; the step waits for it after
   the schedule;
3. a weight held by several pipeline ranks (tied) has its gradient summed among them;
4. nothing is divided by ``m``: each micro-batch's graph outputs its term of the global loss
   (means divide by the global batch's denominator, fed as inputs by
   ``analysis.microbatch_loss``), so the loss is the sum of the micro-batch losses,
   broadcast from the last stage to every rank.

Skip values travel by ``autopar.ops.stage_ops`` (``skip_send`` / ``skip_recv``).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture import Captured
from autopar.passes.insert_collectives import insert_collectives
from autopar.passes.shard_parameters import shard_tensor, unshard
from autopar.placement import local_shape
from autopar.plan import Plan
from autopar.ops.comm import use_comm
from autopar.runtime.parallel_module import get_tensor as _get
from autopar.runtime.parallel_module import model_out_spec as _model_out_spec
from autopar.runtime.parallel_module import set_tensor as _set
from autopar.ops.stage_ops import StepContext, use_step_context


@functools.cache
def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        """A PipelineStage that says when its last backward of a step is done (the full
        backward of the last micro-batch, or under zero bubble its last weight half)."""

        on_last_backward = None

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if last_backward and full_backward and self.on_last_backward is not None:
                self.on_last_backward(self.stage_index)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if last_backward and self.on_last_backward is not None:
                self.on_last_backward(self.stage_index)

    return _Stage


def _identity_loss(output, target):
    return output


# ---- the module -------------------------------------------------------------------------------


class PipelineModule(nn.Module):
    """A model pipelined (and sharded within each stage) by a Plan with ``pipeline_stages > 1``.
    Build it with ``autopar.parallelize(..., pipeline=p)``."""

    def __init__(self, cap: Captured, plan: Plan, mesh, model: nn.Module):
        super().__init__()
        from autopar.schedule import torch_schedule_class
        from autopar.analysis.stages import assign_stages, local_meta
        from autopar.passes.split_stages import split_stages
        from autopar.ops.comm import DistComm

        self.plan = plan
        self._cap = cap
        p, v, m = plan.pipeline_stages, plan.virtual_stages, plan.n_microbatches
        S = p * v
        self.n_stages, self.n_microbatches = S, m
        intra_axes = tuple(plan.mesh_axes[1:])
        self.intra_plan = intra = replace(plan, nodes=_intra_nodes(plan), world_size=plan.world_size // p,
                                          mesh_shape=tuple(plan.mesh_shape[1:]), mesh_axes=intra_axes)
        self.comm = DistComm(mesh[intra_axes if len(intra_axes) > 1 else intra_axes[0]])
        self.pp_group = mesh.get_group("pipeline")
        self.pp_rank = mesh.get_coordinate()[0]
        pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self._pp_global = pp_ranks
        self.my_stages = [k for k in range(S) if k % p == self.pp_rank]

        # ---- parameters: every one sharded into a scratch root; this rank keeps its own ----
        full = dict(model.named_parameters(remove_duplicate=False))
        full_buffers = dict(model.named_buffers())
        imesh = tuple(intra.mesh_shape)
        root = nn.Module()
        attr_of, self._placements, self._aliases = {}, {}, {}
        for ph, names in cap.params.items():
            attr, src = names[0], full[names[0]]
            if src.is_meta:
                raise ValueError(f"parameter {attr!r} is on the meta device: build the model on "
                                 "a real device to run it (plan-only works on meta)")
            placements = intra.nodes[ph].output(0)
            local = shard_tensor(src.detach(), placements, self.comm.coord, imesh)
            _set(root, attr, nn.Parameter(local, requires_grad=src.requires_grad))
            self._placements[attr], self._aliases[attr] = placements, list(names)
            attr_of[ph] = attr
        for ph, name in cap.buffers.items():
            placements = intra.nodes[ph].output(0)
            _set(root, name, shard_tensor(full_buffers[name], placements, self.comm.coord, imesh), buffer=True)
            self._placements[name], self._aliases[name] = placements, [name]
            attr_of[ph] = name

        stage_of = assign_stages(cap, plan.stage_cuts, S)
        self._shapes = {attr: tuple(cap.node(ph).meta["val"].shape) for ph, attr in attr_of.items()}

        # ---- programs ----
        model_inputs = list(cap.inputs[: cap.n_model_inputs])
        meta_of = lambda n: local_meta(cap, intra, n)  # noqa: E731
        self._side_names = list(cap.inputs)
        self.stages: dict[str, list] = {}
        self.skip_edges = {}
        graphs = {}
        if cap.has_loss:
            graphs["train"] = insert_collectives(cap, intra, root, attr_of, "loss")
        graphs["forward"] = insert_collectives(cap, intra, root, attr_of, "model")
        self._grad_sync = dict(graphs.get("train", graphs["forward"]).meta["grad_sync"])
        device = torch.device("cpu")
        _Stage = _stage_class()
        reads: dict[str, set[int]] = {}      # attr -> every stage (of any program) reading it
        for which, gm in graphs.items():
            parts, edges = split_stages(gm, stage_of, S, model_inputs, meta_of, root)
            self.skip_edges[which] = {e.id: e for e in edges}
            for sg in parts:
                for n in sg.gm.graph.nodes:
                    if n.op == "get_attr":
                        reads.setdefault(n.target, set()).add(sg.index)
            mine = []
            for sg in parts:
                if sg.index not in self.my_stages:
                    continue
                if sg.index == 0:
                    ins = tuple(_example(tuple(cap.node(n).meta["val"].shape), cap.node(n).meta["val"].dtype, False)
                                for n in model_inputs)
                else:
                    ins = tuple(_example(*mt) for mt in sg.input_meta)
                if sg.index < S - 1:
                    outs = tuple(_example(*mt) for mt in sg.output_meta)
                elif which == "train":
                    outs = (_example((), cap.node(cap.loss).meta["val"].dtype, True),)
                else:
                    outs = tuple(_example(tuple(cap.node(o).meta["val"].shape), cap.node(o).meta["val"].dtype,
                                          False) for o in cap.output)
                stage = _Stage(sg.gm, sg.index, S, device, input_args=ins, output_args=outs,
                               group=self.pp_group)
                if which == "train":
                    stage.on_last_backward = self._stage_done
                mine.append((sg, stage))
            self.stages[which] = mine
        self._skip_log: list = []

        # ---- which pipeline ranks hold each parameter / buffer: those whose stages read it.
        # The same answer on every rank (from all the stage programs, not this rank's): a
        # buffer that feeds recomputed constants is read by every stage recomputing them.
        # A parameter held by several ranks (tied) has its gradient summed among them.
        self._owners = {attr: sorted({k % p for k in reads.get(attr, ())} or {0})
                        for attr in self._placements}
        self._tied = [a for a, r in self._owners.items() if len(r) > 1
                      and isinstance(_get(root, a), nn.Parameter)]
        self.module = nn.Module()
        for attr in self._placements:
            if self.pp_rank in self._owners[attr]:
                t = _get(root, attr)
                _set(self.module, attr, t, buffer=not isinstance(t, nn.Parameter))

        # data-parallel gradients each local train stage completes (see _stage_done)
        self._stage_grads = {sg.index: sorted({n.target for n in sg.gm.graph.nodes if n.op == "get_attr"}
                                              & set(self._grad_sync))
                             for sg, _ in self.stages.get("train", [])}
        self._readers: dict[str, int] = {}
        for attrs in self._stage_grads.values():
            for a in attrs:
                self._readers[a] = self._readers.get(a, 0) + 1
        self._left: dict[str, int] = {}
        self._inflight: list = []
        self._sync_order: list[int] = []     # stages whose reductions started, in order

        cls = torch_schedule_class(plan.schedule)
        multi = plan.schedule in ("interleaved-1f1b", "zero-bubble")
        train_stages = [st for _, st in self.stages.get("train", [])]
        self._schedule = None
        if train_stages:
            self._schedule = cls(train_stages if multi else train_stages[0], n_microbatches=m,
                                 loss_fn=_identity_loss, scale_grads=False)
        from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS
        fwd_stages = [st for _, st in self.stages["forward"]]
        self._eval = (ScheduleLoopedBFS(fwd_stages, n_microbatches=m, loss_fn=None) if v > 1
                      else ScheduleGPipe(fwd_stages[0], n_microbatches=m, loss_fn=None))
        self._out_spec = _model_out_spec(cap)
        self._rank_of_stage = {k: pp_ranks[k % p] for k in range(S)}

    # ---- running ------------------------------------------------------------------------------
    def _context(self, which: str, inputs: tuple, target) -> StepContext:
        m = self.n_microbatches
        side = {}
        given = tuple(inputs) + ((target,) if target is not None else ())
        if which == "train":
            # the loss's scale inputs: 1 / the global batch's denominator (analysis.microbatch_loss)
            from autopar.analysis.microbatch_loss import denominator_inputs
            given += denominator_inputs(self._cap, inputs, target, m)
        for name, t in zip(self._cap.inputs, given):
            if t.shape[0] % m:
                raise ValueError(f"the batch of input {name!r} ({t.shape[0]}) does not divide into "
                                 f"{m} micro-batches; pass the global batch the plan was made for")
            side[name] = list(t.tensor_split(m, dim=0))
        return StepContext(side, self.skip_edges[which], self._rank_of_stage)

    def train_step(self, *inputs, target=None) -> torch.Tensor:
        """Forward and backward of the global batch through the pipeline; returns the global
        mean loss on every rank. Gradients are added to the local shards' ``.grad``."""
        if self._schedule is None:
            raise ValueError("this model was captured without a loss: pass loss_fn and target=")
        if target is None and self._cap.takes_target:
            raise ValueError("train_step needs target=: the loss is part of the plan's graph")
        self._check_inputs(inputs)
        params = [p for p in self.module.parameters()]
        stash = {id(p): p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = None
        losses: list = []
        self._left, self._inflight, self._sync_order = dict(self._readers), [], []
        ctx = self._context("train", inputs, target)
        with use_comm(self.comm), use_step_context(ctx):
            self._schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        self._skip_log = list(ctx.received)
        with torch.no_grad():
            self._sync_grads()
            for p in params:      # each micro-batch's loss is its term of the global loss: no / m
                old = stash.get(id(p))
                if old is not None:
                    p.grad = old if p.grad is None else old + p.grad
        last = (self.n_stages - 1) % self.plan.pipeline_stages
        loss = torch.zeros((), dtype=self._cap.node(self._cap.loss).meta["val"].dtype)
        if self.pp_rank == last:
            loss = torch.stack([torch.as_tensor(x).detach() for x in losses]).sum()
        dist.broadcast(loss, self._pp_global[last], group=self.pp_group)
        return loss

    def forward(self, *inputs):
        """The model's outputs for the global batch (whole, on every rank)."""
        self._check_inputs(inputs)
        ctx = self._context("forward", inputs, None)
        with torch.no_grad(), use_comm(self.comm), use_step_context(ctx):
            out = self._eval.eval(*inputs)
        last = (self.n_stages - 1) % self.plan.pipeline_stages
        flat = list(out) if isinstance(out, (tuple, list)) else [out] if out is not None else None
        box = [flat if self.pp_rank == last else None]
        dist.broadcast_object_list(box, self._pp_global[last], group=self.pp_group)
        return pytree.tree_unflatten(list(box[0]), self._out_spec)

    def _check_inputs(self, inputs) -> None:
        if len(inputs) != self._cap.n_model_inputs:
            raise TypeError(f"expected {self._cap.n_model_inputs} inputs (the global batch, as in "
                            f"example_inputs), got {len(inputs)}")

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
        if ready:
            self._sync_order.append(stage)
            self._start_sync(ready)

    def _start_sync(self, attrs) -> None:
        """Start the all-reduce of ``attrs``' gradients over their first axis, one bucket per
        set of axes; ``_sync_grads`` waits and runs the other axes."""
        params = dict(self.module.named_parameters())
        by_axes: dict[tuple, list] = {}
        for attr in attrs:
            p = params.get(attr)
            if p is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                by_axes.setdefault(tuple(self._grad_sync[attr]), []).append(p.grad)
        for axes, grads in by_axes.items():
            if axes:
                self._inflight.append((self.comm.all_reduce_coalesced(grads, axes[0]), grads, axes[1:]))

    def _sync_grads(self) -> None:
        """Finish the data-parallel all-reduce over the intra axes (started during the
        schedule, see ``_stage_done``), then sum tied weights over the pipeline."""
        params = dict(self.module.named_parameters())
        # gradients held here that no local train stage completed (read by no train stage)
        rest = [a for a in self._grad_sync if a in params and self._left.get(a, 1) != 0]
        if rest:
            self._start_sync(rest)
        for work, grads, more in self._inflight:
            work.wait()
            for a in more:
                self.comm.all_reduce_coalesced(grads, a).wait()
        self._inflight = []
        if self._tied:
            parts = []
            for attr in self._tied:
                p = params.get(attr) if self.pp_rank in self._owners[attr] else None
                if p is not None and p.grad is None:
                    p.grad = torch.zeros_like(p)
                parts.append(p.grad if p is not None else torch.zeros(self._local_shape(attr)))
            flat = torch.cat([t.reshape(-1) for t in parts])
            dist.all_reduce(flat, group=self.pp_group)
            off = 0
            for attr, t in zip(self._tied, parts):
                n = t.numel()
                if attr in params and self.pp_rank in self._owners[attr]:
                    params[attr].grad.copy_(flat[off:off + n].view_as(t))
                off += n

    def _local_shape(self, attr: str) -> tuple[int, ...]:
        return local_shape(self._shapes[attr], self._placements[attr], self.intra_plan.mesh_shape)

    # ---- state ----------------------------------------------------------------------------------
    def _gather(self, attr: str, local: torch.Tensor | None, dtype) -> torch.Tensor:
        """The whole tensor of ``attr`` on every rank, from the first pipeline rank holding it."""
        src = self._owners[attr][0]
        if self.pp_rank == src:
            with use_comm(self.comm):
                whole = unshard(local.detach(), self._placements[attr]).contiguous()
        else:
            whole = torch.empty(self._shapes[attr], dtype=dtype)
        dist.broadcast(whole, self._pp_global[src], group=self.pp_group)
        return whole

    def _all_attrs(self):
        for ph, names in self._cap.params.items():
            yield names[0], self._cap.node(ph).meta["val"].dtype, True
        for ph, name in self._cap.buffers.items():
            yield name, self._cap.node(ph).meta["val"].dtype, False

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers by their original names, on every rank (collective)."""
        mine = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        out = {}
        for attr, dtype, _ in self._all_attrs():
            whole = self._gather(attr, mine.get(attr), dtype)
            for name in self._aliases[attr]:
                out[name] = whole
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole gradients by original parameter name, on every rank (collective)."""
        mine = dict(self.module.named_parameters())
        out = {}
        for attr, dtype, is_param in self._all_attrs():
            if not is_param:
                continue
            p = mine.get(attr)
            local = None if p is None else (p.grad if p.grad is not None else torch.zeros_like(p))
            whole = self._gather(attr, local, dtype)
            for name in self._aliases[attr]:
                out[name] = whole
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load whole tensors; each rank keeps the blocks of the stages it runs."""
        missing = [n for n in self._placements if n not in state_dict]
        if missing:
            raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
        imesh = tuple(self.intra_plan.mesh_shape)
        with torch.no_grad():
            for attr, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
                t.copy_(shard_tensor(state_dict[attr], self._placements[attr], self.comm.coord, imesh))

    def received_skips(self) -> list[tuple[int, int]]:
        """(skip edge, micro-batch) pairs this rank received in the last train step."""
        return list(self._skip_log)

    def code(self, which: str = "train") -> str:
        """This rank's stage programs as Python."""
        return "\n".join(f"# stage {sg.index}\n{sg.gm.code}" for sg, _ in self.stages[which])


def _intra_nodes(plan: Plan) -> dict:
    """The plan's placements without the leading pipeline axis (the stage's own mesh)."""
    from autopar.placement import parse_placements, placements_str
    from autopar.plan import NodePlacement

    def strip(x: str) -> str:
        return placements_str(parse_placements(x)[1:])
    return {k: NodePlacement(tuple(strip(x) for x in v.inputs), tuple(strip(x) for x in v.outputs))
            for k, v in plan.nodes.items()}


def _example(shape, dtype, requires_grad: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype).requires_grad_(requires_grad and dtype.is_floating_point)
