"""Receive buffers for the micro-batches in flight only.

torch.distributed.pipelining's ``PipelineStage`` makes, on a stage's first step, one
receive buffer per micro-batch for every value the stage receives and for every gradient
sent back to it (``_prepare_forward_infra``, ``_setup_backward_recv_info``), and keeps them
from step to step: each stage holds the whole batch's boundary bytes both ways, whatever
the micro-batches (13 GiB of an H800 in DeepSeek-V3's published layout). Megatron-Core
receives into tensors it frees.

:class:`InFlightBuffers` (mixed into the runner's ``PipelineStage``) does the same with
torch's schedules unchanged:

- the buffers made at set-up are dropped at once (the metadata stays: shape, dtype,
  source);
- each receive (``get_fwd_recv_ops``, ``get_bwd_recv_ops``) gets a fresh buffer for its
  micro-batch;
- the stage lets go of it as soon as torch has read it: a received value after the
  micro-batch's forward (the autograd graph and torch's ``fwd_cache`` keep it until that
  micro-batch's backward has used it, zero bubble's weight half included), a received
  gradient after the micro-batch's backward (torch's ``backward_state`` keeps it for the
  weight half where that reads it).

So a value's buffer lives from its receive being posted to its micro-batch's backward, as
the stage's own activations do, and a gradient's from its receive to the backward that
reads it. :class:`BufferMeter` measures the peak bytes of these buffers alive at once
on a rank (weak references: a buffer counts while anything holds it), which the memory
model's ``pipeline_buffers`` term predicts (``solver.stage_dp``).

A buffer that is read before anything was received into it fails loudly (torch's
"has None buffer"), never with the last micro-batch's values.
"""
from __future__ import annotations

import weakref

import torch
from torch.distributed.pipelining._utils import _make_tensor_from_meta


class BufferMeter:
    """The receive buffers of one rank's stages: the bytes of those alive now and the peak
    since :meth:`reset` (raised at each new buffer, the only moment it can rise; each
    buffer, a storage of its own, counts until nothing holds it: ``weakref.finalize``)."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.live

    def add(self, t: torch.Tensor) -> None:
        n = t.untyped_storage().nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._freed, n)

    def _freed(self, n: int) -> None:
        self.live -= n


def _drop(infos) -> None:
    for info in infos:
        if not info.is_root_arg:
            info.buffer = None


class InFlightBuffers:
    """Mixed in before ``PipelineStage``: a receive buffer per micro-batch in flight (see
    the module docstring). ``meter`` (a :class:`BufferMeter`, shared by a rank's stages)
    counts them."""

    meter: BufferMeter | None = None

    def _fresh(self, infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
                if self.meter is not None:
                    self.meter.add(info.buffer)

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():
            _drop(infos)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _drop(infos)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._fresh(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._fresh(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # the V's middle pair hands gradients over in place; a missing one is zeros, which
        # torch writes into the buffer it kept: give it one
        for info, g in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs):
            if g is None and info.tensor_meta is not None:
                self._fresh((info,))
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        _drop(self.args_recv_info.get(fwd_chunk_id, ()))
        if not self.has_backward and fwd_chunk_id in self.fwd_cache:
            # forward only: nothing reads the inputs again (the outputs wait for their send)
            self.fwd_cache[fwd_chunk_id] = (self.fwd_cache[fwd_chunk_id][0], [])
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.has_backward:       # the sends hold the outputs until they are done
            self.fwd_cache.pop(fwd_chunk_id, None)
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        _drop(self.grad_recv_info.get(bwd_chunk_id, ()))
