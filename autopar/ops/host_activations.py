"""Activation offload: the tensors a layer saves for backward kept in host memory between its
forward and its backward (``offload_activations=``; the rewrite is
``autopar.passes.offload_activations``, the price ``autopar.pricing.activation_offload``).

Autograd hands every tensor an op saves for backward to the innermost
``torch.autograd.graph.saved_tensors_hooks`` (``pack``), and hands back what ``unpack``
returns when backward needs it. :class:`HostActivations` is one such pair of hooks per
program, shared by its offloaded layers (each layer's region enters :meth:`HostActivations.layer`
with its index in forward order):

- **pack** (forward): a tensor the layer saves is copied into a host buffer and the packed
  handle keeps the host copy only, so the device tensor is freed as soon as forward no
  longer reads it. Parameters are left as they are (they live through the step anyway:
  copying them frees nothing).
- **unpack** (backward): the host copy goes back to the device.

On a CUDA rank the copies run on a side stream (``torch.cuda.Stream``) into pinned
(page-locked) host memory, ``non_blocking``, so the copy of layer l's tensors overlaps the
forward of layer l + 1 (the side stream first waits for the compute stream to have
produced them; ``Tensor.record_stream`` keeps the caching allocator from reusing their
memory before the copy has read it). In backward the first unpack of layer l starts the
copies of layer l - 1's tensors back, on the side stream, so they overlap layer l's
backward (a prefetch); the compute stream waits on each tensor's copy only when it reads
it. At most two layers' saved tensors are on the device at once in backward: the one whose
backward runs and the one prefetched (what the price counts, ``activation_offload``).

On a CPU rank host and device are one memory: each saved tensor is still copied into a
separate host buffer and back (synchronously, no side stream), so the path the tests run
is the one a GPU runs, hooks and copies included.

torch ships ``torch.autograd.graph.save_on_cpu`` (the same hooks without a side stream, the
copy back on the compute stream, parameters copied too); this adds the overlap, the
prefetch and the parameters left alone.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from autopar.device import CUDA, HOST, pin_host_memory


class _Packed:
    """One saved tensor in host memory: its host copy, the device it goes back to, the copy's
    event (CUDA: when the host copy is complete), the layer it belongs to, and the device copy
    a prefetch made (with its event) until backward reads it."""
    __slots__ = ("host", "device", "done", "layer", "back", "back_done", "__weakref__")

    def __init__(self, host, device, done, layer):
        self.host, self.device, self.done, self.layer = host, device, done, layer
        self.back = self.back_done = None


class HostActivations:
    """The saved-tensor hooks of one program's offloaded layers (module docstring), on
    ``device``. ``packed`` / ``unpacked`` count the tensors that went to the host and came
    back (the tests read them)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == CUDA
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pinned = pin_host_memory(self.device)
        self._by_layer: dict[int, list] = {}     # layer -> weak references to its _Packed
        self._layer: int | None = None
        self._started: set[int] = set()    # layers whose copies back were started (CUDA)
        self.packed = self.unpacked = 0

    @contextmanager
    def layer(self, index: int):
        """Run a layer's forward (its region, ``index`` in forward order) with its saved
        tensors offloaded."""
        self._by_layer[index] = []
        self._started.discard(index)
        before, self._layer = self._layer, index
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._layer = before

    # ---- the hooks ---------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t                                   # nothing to free
        host = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=self.pinned)
        done = None
        if self.cuda and t.device.type == CUDA:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
                done = self.stream.record_event()
        else:
            host.copy_(t)
        p = _Packed(host, t.device, done, self._layer)
        # weakly: a handle autograd has dropped (its backward ran) frees its host copy
        self._by_layer.setdefault(self._layer, []).append(weakref.ref(p))
        self.packed += 1
        return p

    def _unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self.unpacked += 1
        if not self.cuda or p.device.type != CUDA:
            return p.host.to(p.device, copy=True) if p.device.type != HOST else p.host.clone()
        for layer in (p.layer, p.layer - 1):    # this layer's first read in backward: fetch
            if layer not in self._started:      # it, and start the layer before (the prefetch)
                self._fetch(layer)
        current = torch.cuda.current_stream(p.device)
        if p.back is None:             # read again (a graph kept, retain_graph=True): on demand
            current.wait_event(p.done)
            return p.host.to(p.device, non_blocking=True)
        current.wait_event(p.back_done)
        t = p.back
        t.record_stream(current)
        p.back = p.back_done = None
        return t

    def _fetch(self, layer: int) -> None:
        """Start the copies of ``layer``'s saved tensors back to the device on the side
        stream (those not started yet)."""
        self._started.add(layer)
        todo = [p for p in (r() for r in self._by_layer.get(layer, ())) if p is not None and p.back is None]
        if not todo:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for p in todo:
                self.stream.wait_event(p.done)
                p.back = p.host.to(p.device, non_blocking=True)
                p.back_done = self.stream.record_event()


__all__ = ["HostActivations"]
