"""What a pipeline stage's program calls (the instruction set of a stage, beside the
collectives): its side inputs, skip sends and receives straight from producer to consumer,
and its inputs' and outputs' gradient hygiene. They read the step's ``StepContext``, which
the pipelined runtime installs with ``use_step_context`` around each schedule step.

Skip values (a tensor read several stages after it is made) go straight from producer to
consumer with their own point-to-point messages on the world group, tagged by edge and
micro-batch; their gradients come back the same way, once per micro-batch: zero bubble's
weight half can run a skip's backward node a second time (see ``_SkipSend.backward``).
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

_local = threading.local()
_TAG_STRIDE = 1 << 16


# ---- what the stage graphs call ---------------------------------------------------------------


class StepContext:
    """Per-step state the stage programs read: the batch's micro-batches, skip edges, counters."""

    def __init__(self, side: dict[str, list[torch.Tensor]], edges: dict, rank_of_stage: dict[int, int],
                 device: torch.device):
        self.side = side
        self.device = device             # where received values are put
        self.edges = edges
        self.rank_of_stage = rank_of_stage
        self.counters: dict[tuple, int] = {}
        self.pending: list = []          # (work, tensor) of sends in flight
        self.mailbox: dict[int, torch.Tensor] = {}   # same-rank skips
        self.received: list[tuple[int, int]] = []    # (edge, micro-batch) this rank received

    def next(self, key) -> int:
        k = self.counters.get(key, 0)
        self.counters[key] = k + 1
        return k

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        if dst == dist.get_rank():
            self.mailbox[tag] = t.clone()
        else:
            self.pending.append((dist.isend(t, dst, tag=tag), t))

    def recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        if src == dist.get_rank():
            return self.mailbox.pop(tag)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src, tag=tag)
        return buf

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _ctx() -> StepContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("a pipeline stage program ran outside a pipelined ParallelModule's step")
    return ctx


@contextlib.contextmanager
def use_step_context(ctx: StepContext):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        ctx.finish()
        _local.ctx = prev


def step_context() -> StepContext | None:
    """The step context this thread runs under (None outside a step)."""
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def carry_step_context(ctx: StepContext | None):
    """``ctx`` on a second thread of the step (DualPipeV's overlapped forward,
    ``runtime.overlap``); the sends it starts are finished by the step's own
    :func:`use_step_context`."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev


def side_input(name: str, stage: int) -> torch.Tensor:
    """This micro-batch's block of user input ``name``, read by ``stage`` (not stage 0)."""
    ctx = _ctx()
    return ctx.side[name][ctx.next(("side", name, stage))]


def _tag(edge: int, mb: int, backward: bool) -> int:
    return 1 + (2 * edge + int(backward)) * _TAG_STRIDE + mb


class _SkipSend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, anchor, edge, mb):
        c = _ctx()
        e = c.edges[edge]
        ctx.edge, ctx.mb, ctx.shape, ctx.dtype = edge, mb, value.shape, value.dtype
        ctx.got = None
        c.send(value, c.rank_of_stage[e.dst], _tag(edge, mb, False))
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, g):
        # zero bubble's weight half runs this node again when a weight's value (the anchor:
        # T5's decoder embedding of the tied weight) meets here an input's (the value, the
        # encoder's output): the gradient is received once, at the input half
        if ctx.got is None:
            c = _ctx()
            e = c.edges[ctx.edge]
            ctx.got = c.recv(ctx.shape, ctx.dtype, c.rank_of_stage[e.dst], _tag(ctx.edge, ctx.mb, True))
        return ctx.got, g, None, None


class _SkipRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, edge, mb):
        c = _ctx()
        e = c.edges[edge]
        ctx.edge, ctx.mb, ctx.sent = edge, mb, False
        c.received.append((edge, mb))
        return c.recv(e.shape, e.dtype, c.rank_of_stage[e.src], _tag(edge, mb, False))

    @staticmethod
    def backward(ctx, g):
        if not ctx.sent:        # once, as _SkipSend receives it
            c = _ctx()
            e = c.edges[ctx.edge]
            c.send(g, c.rank_of_stage[e.src], _tag(ctx.edge, ctx.mb, True))
            ctx.sent = True
        return None, None, None


def skip_send(value: torch.Tensor, anchor: torch.Tensor | None, edge: int):
    """Send ``value`` to the stage that reads it (skip ``edge``); returns ``anchor`` (an output
    of this stage), whose backward receives ``value``'s gradient."""
    c = _ctx()
    mb = c.next(("send", edge))
    if anchor is None or not value.requires_grad:
        e = c.edges[edge]
        c.send(value, c.rank_of_stage[e.dst], _tag(edge, mb, False))
        return anchor
    return _SkipSend.apply(value, anchor, edge, mb)


def skip_recv(anchor: torch.Tensor | None, edge: int) -> torch.Tensor:
    """Receive skip ``edge``'s value; its gradient is sent back when backward reaches it."""
    c = _ctx()
    e = c.edges[edge]
    mb = c.next(("recv", edge))
    if anchor is None or not e.requires_grad or not torch.is_grad_enabled():
        c.received.append((edge, mb))
        return c.recv(e.shape, e.dtype, c.rank_of_stage[e.src], _tag(edge, mb, False))
    return _SkipRecv.apply(anchor, edge, mb)


class _StageOutput(torch.autograd.Function):
    """Identity whose output is a new tensor over the same (contiguous) storage."""

    @staticmethod
    def forward(ctx, value):
        return value.contiguous().detach()

    @staticmethod
    def backward(ctx, g):
        return g


def stage_output(value: torch.Tensor) -> torch.Tensor:
    """What a stage returns for ``value``: contiguous (the schedule sends the buffer as it is)
    and a tensor of its own, never ``value`` itself. After a split backward's input half
    (zero bubble's ``I``) torch detaches the stage outputs *in place*; were an output the very
    tensor some op of the stage saved for its weight gradient (a residual stream that feeds a
    LayerNorm and the next stage), the ``W`` half would find that saved tensor detached."""
    if not value.requires_grad:
        return value.contiguous()
    return _StageOutput.apply(value)


class _StageInput(torch.autograd.Function):
    """Identity whose gradient is made contiguous."""

    @staticmethod
    def forward(ctx, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def stage_input(value: torch.Tensor) -> torch.Tensor:
    """A stage's differentiable input as the program reads it. Its gradient goes back to the
    stage before as it is, and a split backward's input half (``torch.autograd.grad``, no
    accumulation into ``.grad``) can give a strided one (a transpose's, an expand's): this
    makes it contiguous."""
    return _StageInput.apply(value)
