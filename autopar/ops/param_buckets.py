"""ZeRO-3 by buckets: one all-gather for a block's weights, one reduce-scatter for their
gradients, as FSDP2 does per ``fully_shard`` unit.

The rewritten program (``passes.prefetch``) starts a :class:`ParamBucket` for each bucket of
ZeRO-3 weights (a repeated layer's, in order of use): one flat all-gather of the bucket's
shards, launched asynchronously one block ahead of the ops that read them. Each weight's
``all_gather(..., bucket=, index=)`` node takes its whole tensor from the finished bucket
(:meth:`ParamBucket.member`), through :class:`_Member`, whose backward is ZeRO-3's:

- backward needs a weight again (autograd did not keep it: ``ops.collectives.RegatheredWeights``
  packs it away): the bucket gathers all its weights again in one collective, once for
  all of them, and then starts the gather of the bucket used before it in forward (the next
  needed in backward): backward prefetch;
- the weight's gradient (partial over the axis) is copied into the bucket's flat send buffer,
  laid out rank by rank; when every gradient of the bucket has arrived, one asynchronous
  reduce-scatter leaves each rank the sum of its blocks. At most :data:`IN_FLIGHT` of them
  are in flight (an older one is finished first, which frees its buffer); the rest are
  finished when backward ends (an autograd engine callback), which sets each shard's
  ``.grad`` (adding to one already there: gradient accumulation, tied weights gathered
  twice). A ``settings.bucket_listener`` on the communicator is then handed the bucket's shards
  (``listener.reduced(shards)``: ZeRO-Offload copies their gradients to the host while
  backward goes on).

Every rank runs the same program and the same backward, so every rank starts the same
collectives in the same order. Layouts: a shard of ``dim`` (strided: of ``dim`` in
``groups`` groups) is rank ``j``'s block of the whole tensor as
``ops.collectives`` cuts it (:func:`rank_blocks`).
"""
from __future__ import annotations

import weakref

import torch

from autopar.ops.collectives import _slice, fp8_bytes, regathered_weights
from autopar.ops.comm import Comm, current_comm
from autopar.ops.fp8 import E4M3, HP, fp8_weight, weight_scales

IN_FLIGHT = 2
"""Gradient reduce-scatters in flight at once; launching another finishes the oldest."""


def rank_blocks(full: torch.Tensor, dim: int, n: int, groups: int = 1) -> torch.Tensor:
    """A view of ``full`` whose index 0 runs over the ``n`` ranks of an axis sharding it on
    ``dim`` (in ``groups`` strided groups): ``rank_blocks(...)[j]`` is rank ``j``'s block (its
    dim ``dim`` split into ``(groups, L)`` when ``groups > 1``)."""
    if groups == 1:
        return full.unflatten(dim, (n, -1)).movedim(dim, 0)
    return full.unflatten(dim, (groups, n, -1)).movedim(dim + 1, 0)


class ParamBucket:
    """One bucket of ZeRO-3 weights gathered over mesh axis ``axis`` of ``comm`` in one
    collective: ``shards`` (this rank's blocks; shard ``i`` splits dim ``dims[i]`` in
    ``groups[i]`` groups), cast to ``dtype`` first when given (mixed precision).
    ``dtype=float8_e4m3fn``: tensorwise fp8 linears' weights, each shard cast with its whole
    weight's scale (amaxes max-reduced over ``axis`` and ``amax_axes``, once for the
    bucket, kept for backward's gather again) and gathered as fp8 bytes; a weight is
    taken as ``ops.fp8.fp8_weight`` (``passes/fp8_gathers.py``)."""

    def __init__(self, comm: Comm, shards, axis: int, dims, groups, dtype=None, amax_axes=()):
        self.comm, self.shards, self.axis, self.dtype = comm, list(shards), axis, dtype
        self.fp8, self.amax_axes, self.scales = dtype == E4M3, tuple(amax_axes), None
        self.dims = [d % max(s.dim(), 1) for d, s in zip(dims, self.shards)]
        self.groups = list(groups)
        self.n = comm.size(axis)
        self.offsets, total = [], 0
        for s in self.shards:
            self.offsets.append(total)
            total += s.numel()
        self.total = total
        self._full: list | None = None           # forward: whole weights not yet taken
        self._gathering = self._start()
        # backward's gather again (ParamBucket.regather)
        self.packs = 0                           # saved tensors of its weights not yet unpacked
        self._cache: list | None = None
        self._prefetch = None
        last = getattr(comm, "_last_bucket", None)
        self.prev = last                         # the bucket started before (a weak reference)
        comm._last_bucket = weakref.ref(self)
        # gradients (ParamBucket.deliver)
        self._expect = [False] * len(self.shards)
        self._got = [False] * len(self.shards)
        self._send = None
        self._launched = False

    # ---- gathering ---------------------------------------------------------------------------
    def _start(self):
        with torch.no_grad():
            if self.fp8:        # the scales: forward's, kept for backward's gather again
                if self.scales is None:
                    self.scales = weight_scales([s.detach().to(HP) for s in self.shards],
                                                (self.axis, *self.amax_axes))
                flat = torch.cat([fp8_bytes(s, c).reshape(-1) for s, c in zip(self.shards, self.scales)])
                return self.comm.all_gather_start(flat, self.axis, 0)
            flat = torch.cat([s.detach().reshape(-1) for s in self.shards])
            if self.dtype is not None and flat.dtype != self.dtype:
                flat = flat.to(self.dtype)
            return self.comm.all_gather_start(flat, self.axis, 0)

    def _unflatten(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The whole weights from the gathered flat buffer ``[rank 0's shards | rank 1's | ...]``
        (an fp8 bucket's bytes as e4m3)."""
        fulls = self._unflatten_flat(out)
        return [f.view(E4M3) for f in fulls] if self.fp8 else fulls

    def _unflatten_flat(self, out: torch.Tensor) -> list[torch.Tensor]:
        rows = out.view(self.n, self.total)
        fulls = []
        for s, d in zip(self.shards, self.dims):
            shape = list(s.shape)
            shape[d] *= self.n
            fulls.append(torch.empty(shape, dtype=out.dtype, device=out.device))
        if all(d == 0 for d in self.dims) and all(g == 1 for g in self.groups):
            # blocks of dim 0: each whole weight is its ranks' blocks one after the other
            torch.split_with_sizes_copy(rows, [s.numel() for s in self.shards], dim=1,
                                        out=[f.view(self.n, -1) for f in fulls])
            return fulls
        for s, full, off, d, g in zip(self.shards, fulls, self.offsets, self.dims, self.groups):
            rank_blocks(full, d, self.n, g).copy_(self._slot(rows, s, off, d, g))
        return fulls

    def _slot(self, rows: torch.Tensor, s: torch.Tensor, off: int, d: int, g: int) -> torch.Tensor:
        """Every rank's block of shard ``s`` in a flat buffer viewed as ``(n, total)``, shaped
        as :func:`rank_blocks` gives them."""
        slot = rows[:, off: off + s.numel()].view(self.n, *s.shape)
        return slot if g == 1 else slot.unflatten(d + 1, (g, -1))

    def take(self, i: int) -> torch.Tensor:
        """Forward: weight ``i`` whole (the first call waits for the gather)."""
        if self._full is None:
            self._full = self._unflatten(self._gathering.wait())
            self._gathering = None
        full, self._full[i] = self._full[i], None
        return full

    def member(self, x: torch.Tensor, i: int, grad_partial: bool) -> torch.Tensor:
        """The graph's ``all_gather(x, ..., bucket=self, index=i)``: weight ``i`` whole, with
        ZeRO-3's backward (:class:`_Member`)."""
        return _Member.apply(x, self, i, grad_partial)

    # ---- backward: gather again ----------------------------------------------------------------
    def packed(self) -> None:
        self.packs += 1

    def regather(self, i: int) -> torch.Tensor:
        """Backward: weight ``i`` whole again. The first call gathers the whole bucket (or waits
        for its prefetch) and starts the prefetch of the bucket before it; the whole weights
        are dropped when every saved tensor of them has been unpacked."""
        if self._cache is None:
            handle, self._prefetch = self._prefetch or self._start(), None
            self._cache = self._unflatten(handle.wait())
            before = self._previous()
            if before is not None:
                before._prefetch = before._start()
        full = self._cache[i]
        self.packs -= 1
        if self.packs <= 0:
            self._cache = None
        return full

    def _previous(self) -> "ParamBucket | None":
        """The nearest bucket started before this one whose weights backward still needs and
        has not begun gathering."""
        ref = self.prev
        while ref is not None:
            b = ref()
            if b is None:
                return None
            if b.packs > 0 and b._cache is None and b._prefetch is None:
                return b
            ref = b.prev
        return None

    # ---- backward: gradients -----------------------------------------------------------------
    def expect(self, i: int) -> None:
        self._expect[i] = True

    def deliver(self, i: int, grad: torch.Tensor, reduce_dtype: torch.dtype) -> None:
        """Weight ``i``'s whole gradient (partial over the axis): copy it into the send buffer;
        the last expected one launches the reduce-scatter."""
        scatters = _Scatters.current(self.comm)
        if self._send is None:
            k = [j for j in range(len(self.shards)) if self._expect[j]]
            self._send_layout, total = {}, 0
            for j in k:
                self._send_layout[j] = total
                total += self.shards[j].numel()
            self._send_total = total
            # a weight whose gradient never comes leaves its slot unset: its sum is not read
            self._send = torch.empty(self.n * total, dtype=reduce_dtype, device=grad.device)
            scatters.pending.append(self)
        rows = self._send.view(self.n, self._send_total)
        s, d, g = self.shards[i], self.dims[i], self.groups[i]
        with torch.no_grad():
            self._slot(rows, s, self._send_layout[i], d, g).copy_(rank_blocks(grad, d, self.n, g))
        self._got[i] = True
        if all(self._got[j] for j in self._send_layout):
            scatters.launch(self)

    def _launch(self):
        self._launched = True
        return self.comm.reduce_scatter_start(self._send, self.axis)

    def _finish(self, handle) -> None:
        """Set each delivered shard's gradient from the finished reduce-scatter."""
        out = handle.wait()
        self._send = None
        for j, off in self._send_layout.items():
            if not self._got[j]:
                continue
            s = self.shards[j]
            g = out[off: off + s.numel()].view(s.shape)
            if g.dtype != s.dtype:
                g = g.to(s.dtype)
            if s.grad is None:
                s.grad = g
            else:
                s.grad.add_(g)
        listener = self.comm.settings.bucket_listener
        if listener is not None:      # e.g. ZeRO-Offload: the shards' gradients to the host now
            listener.reduced([self.shards[j] for j in self._send_layout if self._got[j]])
        self._got = [False] * len(self.shards)


class _Scatters:
    """The gradient reduce-scatters of one backward pass on one communicator."""

    def __init__(self, comm: Comm, task: int):
        self.comm, self.task = comm, task
        self.pending: list[ParamBucket] = []      # buckets with a send buffer, in order
        self.inflight: list = []                  # (bucket, handle)

    @staticmethod
    def current(comm: Comm) -> "_Scatters":
        """This backward's record (made on its first gradient, with the engine callback that
        finishes it when backward ends)."""
        task = torch._C._current_graph_task_id()
        cur = getattr(comm, "_scatters", None)
        if cur is None or cur.task != task:
            cur = comm._scatters = _Scatters(comm, task)
            torch.autograd.Variable._execution_engine.queue_callback(cur.finish)
        return cur

    def launch(self, bucket: ParamBucket) -> None:
        self.inflight.append((bucket, bucket._launch()))
        while len(self.inflight) > IN_FLIGHT:
            b, h = self.inflight.pop(0)
            b._finish(h)

    def finish(self) -> None:
        """Backward ended: launch the buckets some of whose gradients never came (backward did
        not reach those weights: they stay without gradient), finish every reduce-scatter."""
        if getattr(self.comm, "_scatters", None) is self:
            self.comm._scatters = None
        for b in self.pending:
            if not b._launched:
                self.inflight.append((b, b._launch()))
        for b, h in self.inflight:
            b._finish(h)
        for b in self.pending:
            b._launched = False
            b._send = None
        self.pending, self.inflight = [], []


class _Member(torch.autograd.Function):
    """Weight ``i`` of a bucket, whole. Backward: registered to be gathered again with its
    bucket; its gradient reduce-scattered with the bucket's (``grad_partial``: partial over
    the axis) or cut to this rank's block (replicated there)."""

    @staticmethod
    def forward(ctx, x, bucket: ParamBucket, i: int, grad_partial: bool):
        ctx.bucket, ctx.i, ctx.grad_partial = bucket, i, grad_partial
        low = HP if bucket.fp8 else bucket.dtype      # the weight's dtype at its reader
        ctx.master = x.dtype if bucket.dtype is not None and x.dtype != low else None
        if grad_partial and ctx.needs_input_grad[0]:
            bucket.expect(i)
        out = bucket.take(i)
        regathered_weights().register(out, _Source(bucket, i), bucket.axis, bucket.dims[i],
                                      bucket.groups[i])
        return fp8_weight(out, bucket.scales[i].reciprocal()) if bucket.fp8 else out

    @staticmethod
    def backward(ctx, g):
        b, i = ctx.bucket, ctx.i
        if not ctx.grad_partial:
            g = _slice(g, b.axis, b.dims[i], b.groups[i])
            return (g if ctx.master is None else g.to(ctx.master)), None, None, None
        # reduced in the shard's dtype, or under mixed precision in grad_reduce's if set
        dtype = g.dtype if ctx.master is None else (
            current_comm().settings.grad_reduce_dtype or ctx.master)
        b.deliver(i, g, dtype)
        return None, None, None, None


class _Source:
    """What ``RegatheredWeights`` packs for a saved tensor of bucket weight ``i``: it is
    gathered again with its bucket."""

    __slots__ = ("bucket", "i")

    def __init__(self, bucket: ParamBucket, i: int):
        self.bucket, self.i = bucket, i

    def packed(self) -> None:
        self.bucket.packed()

    def regather(self) -> torch.Tensor:
        return self.bucket.regather(self.i)


def gather_bucket(shards, axis: int, dims, groups, dtype: torch.dtype | None = None,
                  amax_axes: tuple[int, ...] = ()) -> ParamBucket:
    """The graph's bucket start (``passes.prefetch``): launch the all-gather of ``shards``
    over ``axis`` (cast to ``dtype`` when given; fp8: :class:`ParamBucket`);
    ``all_gather(..., bucket=, index=)`` nodes take the weights from it."""
    return ParamBucket(current_comm(), shards, axis, dims, groups, dtype, amax_axes)
