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

Layers are told apart by (forward, index): a program's forward enters its regions in
increasing index order, so a region entered at an index no greater than the last one
entered starts the program's next forward. Under a pipeline a stage program runs forward
for several micro-batches before their backwards (1F1B holds up to ``p`` in flight), each
a forward of its own, so a backward's prefetch brings back the layer before it of the
same micro-batch, never another micro-batch's.

Under a pipeline's step-long autocast cache (``runtime.precision.cast_once_per_step``)
the 16-bit casts of the weights live through the step whatever the hooks do (every
micro-batch saves the one cast): copying them would free nothing and copy them once per
micro-batch, so with ``keep_weight_casts`` they are left as parameters are (as is any
cast autocast caches, :func:`cached_cast`).

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

    def __init__(self, device: torch.device, keep_weight_casts: bool = False):
        self.device = torch.device(device)
        self.keep_weight_casts = keep_weight_casts
        self.cuda = self.device.type == CUDA
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pinned = pin_host_memory(self.device)
        self._by_layer: dict[tuple, list] = {}   # (forward, layer) -> weak references to its _Packed
        self._layer: tuple | None = None
        self._last = -1                      # the index last entered: a forward's regions ascend
        self._forward = 0                    # which forward of the program (micro-batch) runs
        self._started: set[tuple] = set()    # (forward, layer)s whose copies back were started (CUDA)
        self.packed = self.unpacked = 0
        self.packed_bytes = 0                # bytes copied to the host (the tests read them)

    @contextmanager
    def layer(self, index: int):
        """Run a layer's forward (its region, ``index`` in forward order) with its saved
        tensors offloaded."""
        if index <= self._last:              # the program's next forward (micro-batch)
            self._forward += 1
            self._drop_freed()
        self._last = index
        key = (self._forward, index)
        self._by_layer[key] = []
        self._started.discard(key)
        before, self._layer = self._layer, key
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._layer = before

    # ---- the hooks ---------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.device.type == "meta" or (
                self.keep_weight_casts and cached_cast(t)):
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
        self.packed_bytes += t.numel() * t.element_size()
        return p

    def _unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        self.unpacked += 1
        if not self.cuda or p.device.type != CUDA:
            return p.host.to(p.device, copy=True) if p.device.type != HOST else p.host.clone()
        forward, index = p.layer
        for layer in (p.layer, (forward, index - 1)):  # this layer's first read in backward: fetch
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

    def _drop_freed(self) -> None:
        """Forget the layers whose saved tensors autograd has all dropped (their backward ran)."""
        for key in [k for k, refs in self._by_layer.items() if all(r() is None for r in refs)]:
            del self._by_layer[key]
            self._started.discard(key)

    def _fetch(self, layer: tuple) -> None:
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


def cached_cast(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it is a view of: a linear saves its weight's transpose)
    is a cast autocast keeps in its cache: a copy of a leaf that requires grad (a weight; a
    pipeline stage's received input), autocast's rule for what it caches."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    return any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)


__all__ = ["HostActivations", "cached_cast"]
