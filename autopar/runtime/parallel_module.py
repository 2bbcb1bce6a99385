"""The module a user trains: the per-rank graphs, the local shards, gradient sync.

``ParallelModule`` holds this rank's shard of every parameter (under ``module.<name>``, so
``pm.parameters()`` feeds any torch optimizer), two rewritten graphs (training: returns the
global loss; forward: returns the model's outputs, replicated) and the communicator.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture import Captured
from autopar.passes.insert_collectives import insert_collectives
from autopar.analysis.layers import layer_members
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.shard_parameters import shard_tensor, unshard
from autopar.plan import Plan
from autopar.ops.collectives import regathered_weights
from autopar.ops.comm import Comm, use_comm

BUCKET_BYTES = 25 * 2**20


class ParallelModule(nn.Module):
    """A model parallelized by a Plan. Build it with ``autopar.parallelize``."""

    def __init__(self, cap: Captured, plan: Plan, comm: Comm, model: nn.Module,
                 loss_fn: Callable | None = None):
        super().__init__()
        self.plan = plan
        self.comm = comm
        self._cap = cap
        self._loss_fn = loss_fn
        self.module = nn.Module()
        self._placements: dict[str, tuple] = {}     # attr -> placements
        self._aliases: dict[str, list[str]] = {}     # attr -> every parameter name it is
        attr_of: dict[str, str] = {}
        full = dict(model.named_parameters(remove_duplicate=False))
        full_buffers = dict(model.named_buffers())
        mesh = tuple(plan.mesh_shape)
        for ph, names in cap.params.items():
            attr = names[0]
            placements = plan.nodes[ph].output(0)
            src = full[names[0]]
            if src.is_meta:
                raise ValueError(f"parameter {names[0]!r} is on the meta device: build the "
                                 "model on a real device to run it (plan-only works on meta)")
            local = shard_tensor(src.detach(), placements, comm.coord, mesh)
            set_tensor(self.module, attr, nn.Parameter(local, requires_grad=src.requires_grad))
            self._placements[attr], self._aliases[attr] = placements, list(names)
            attr_of[ph] = attr
        for ph, name in cap.buffers.items():
            placements = plan.nodes[ph].output(0)
            set_tensor(self.module, name, shard_tensor(full_buffers[name], placements, comm.coord, mesh),
                 buffer=True)
            self._placements[name], self._aliases[name] = placements, [name]
            attr_of[ph] = name
        graphs = {}
        if cap.has_loss:
            graphs["train"] = insert_collectives(cap, plan, self.module, attr_of, "loss")
        graphs["forward"] = insert_collectives(cap, plan, self.module, attr_of, "model")
        if plan.recompute and "train" in graphs:
            graphs["train"] = checkpoint_layers(graphs["train"], layer_members(cap.gm, plan.recompute))
        self._graphs = graphs            # plain dict: not submodules (params live in .module)
        self._n_inputs = cap.n_model_inputs
        self._out_spec = model_out_spec(cap)
        self._grad_sync = _GradSync(self.module, graphs.get("train", graphs["forward"]).meta["grad_sync"], comm)

    # ---- running ------------------------------------------------------------------------
    def forward(self, *inputs):
        """The model's outputs (whole, on every rank) for the global batch ``inputs``."""
        self._check_inputs(inputs)
        with use_comm(self.comm):
            flat = self._graphs["forward"](*inputs)
        return pytree.tree_unflatten(list(flat), self._out_spec)

    def train_step(self, *inputs, target=None) -> torch.Tensor:
        """Forward and backward on the global batch; returns the global mean loss. Gradients
        are added to the local shards' ``.grad`` (call the optimizer's ``zero_grad`` between
        steps as usual)."""
        self._check_inputs(inputs)
        with use_comm(self.comm), self._saved_tensor_policy():
            with self._grad_sync.step():
                if "train" in self._graphs:
                    if target is None and self._cap.takes_target:
                        raise ValueError("train_step needs target=: the loss is part of the plan's graph")
                    loss = self._graphs["train"](*inputs, *((target,) if self._cap.takes_target else ()))
                elif self._loss_fn is not None:
                    out = pytree.tree_unflatten(list(self._graphs["forward"](*inputs)), self._out_spec)
                    loss = self._loss_fn(out, target)
                else:
                    loss = self._graphs["forward"](*inputs)[0]
                loss.backward()
        return loss.detach()

    @contextlib.contextmanager
    def _saved_tensor_policy(self):
        """Under zero=3, gathered weights are not saved for backward but gathered again."""
        if (self.plan.pins.get("zero") or 0) < 3:
            yield
            return
        reg = regathered_weights()
        try:
            with reg.hooks():
                yield
        finally:
            reg.clear()

    def _check_inputs(self, inputs) -> None:
        if len(inputs) != self._n_inputs:
            raise TypeError(f"expected {self._n_inputs} inputs (the global batch, as in "
                            f"example_inputs), got {len(inputs)}")

    # ---- state --------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers by their names in the original model (collective:
        every rank must call it)."""
        out = {}
        with use_comm(self.comm):
            for attr, t in _named_tensors(self.module):
                whole = unshard(t.detach(), self._placements[attr])
                for name in self._aliases[attr]:
                    out[name] = whole
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load whole tensors (as from ``model.state_dict()``); each rank keeps its block."""
        mesh = tuple(self.plan.mesh_shape)
        missing = [n for n in self._placements if n not in state_dict]
        if missing:
            raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for attr, t in _named_tensors(self.module):
                t.copy_(shard_tensor(state_dict[attr], self._placements[attr], self.comm.coord, mesh))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole gradients by original parameter name (collective)."""
        out = {}
        with use_comm(self.comm):
            for attr, p in self.module.named_parameters():
                if p.grad is None:
                    continue
                whole = unshard(p.grad, self._placements[attr])
                for name in self._aliases[attr]:
                    out[name] = whole
        return out

    def code(self, which: str = "train") -> str:
        """The rewritten per-rank program as Python."""
        return self._graphs[which].code


class _GradSync:
    """All-reduce each step's gradient of replicated parameters, once per step, in buckets
    launched as soon as backward has produced every gradient of the bucket."""

    def __init__(self, module: nn.Module, axes_of: dict[str, tuple[int, ...]], comm: Comm):
        self.comm = comm
        params = dict(module.named_parameters())
        self.buckets: list[tuple[tuple[int, ...], list[nn.Parameter]]] = []
        by_axes = defaultdict(list)
        for attr, axes in axes_of.items():
            by_axes[tuple(axes)].append(params[attr])
        for axes, ps in by_axes.items():
            # backward produces gradients roughly in reverse order of use
            cur, size = [], 0
            for p in reversed(ps):
                cur.append(p)
                size += p.numel() * p.element_size()
                if size >= BUCKET_BYTES:
                    self.buckets.append((axes, cur))
                    cur, size = [], 0
            if cur:
                self.buckets.append((axes, cur))
        self.bucket_of = {id(p): i for i, (_, ps) in enumerate(self.buckets) for p in ps}
        for _, ps in self.buckets:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._ready)
        self._active = False

    def step(self):
        return _SyncContext(self)

    def _ready(self, p: nn.Parameter) -> None:
        if not self._active:
            return
        i = self.bucket_of[id(p)]
        self.pending[i] += 1
        axes, ps = self.buckets[i]
        if self.pending[i] == len(ps):
            self.handles.append((i, self.comm.all_reduce_coalesced([q.grad for q in ps], axes[0])))


class _SyncContext:
    def __init__(self, sync: _GradSync):
        self.sync = sync

    def __enter__(self):
        s = self.sync
        s._active, s.pending, s.handles = True, defaultdict(int), []
        # gradients from earlier steps are set aside so only this step's are reduced
        self.stash = {}
        for _, ps in s.buckets:
            for p in ps:
                if p.grad is not None:
                    self.stash[id(p)] = p.grad
                    p.grad = None

    def __exit__(self, exc_type, exc, tb):
        s = self.sync
        s._active = False
        if exc_type is not None:
            return False
        done = set()
        for i, h in s.handles:
            h.wait()
            done.add(i)
            axes, ps = s.buckets[i]
            for a in axes[1:]:
                s.comm.all_reduce_coalesced([q.grad for q in ps], a).wait()
        for i, (axes, ps) in enumerate(s.buckets):
            if i not in done and any(p.grad is not None for p in ps):
                for p in ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                for a in axes:
                    s.comm.all_reduce_coalesced([q.grad for q in ps], a).wait()
        for _, ps in s.buckets:
            for p in ps:
                old = self.stash.get(id(p))
                if old is not None:
                    p.grad = old if p.grad is None else old + p.grad
        s.handles, s.pending, self.stash = [], defaultdict(int), {}   # hold no finished work
        return False


def get_tensor(root: nn.Module, path: str):
    """The parameter or buffer at dotted ``path`` under ``root``."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_tensor(root: nn.Module, path: str, value, buffer: bool = False) -> None:
    """Register ``value`` at dotted ``path``, creating the modules on the way."""
    *mods, leaf = path.split(".")
    m = root
    for name in mods:
        if not hasattr(m, name):
            m.add_module(name, nn.Module())
        m = getattr(m, name)
    if buffer:
        m.register_buffer(leaf, value)
    else:
        m.register_parameter(leaf, value)


def _named_tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def model_out_spec(cap: Captured):
    spec = cap.output_spec
    # the captured wrapper returns (loss, model_output)
    return spec.child(1) if spec is not None and spec.num_children == 2 else spec
