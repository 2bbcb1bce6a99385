"""Collectives over the axes of a device mesh, for the rank this process (or thread) is.

Two implementations of one small interface:

- :class:`DistComm` — the real thing: torch.distributed collectives on the process groups
  of a ``DeviceMesh`` (gloo on CPU, NCCL on CUDA). Used by ``autopar.parallelize``.
- :class:`ThreadComm` — ranks simulated as threads of one process exchanging tensors in
  memory. Used by tests and property checks so that hundreds of sharded cases run without
  spawning processes; the rewritten graph is the same code either way.

The rewritten per-rank graph never holds a communicator: its collective nodes look up the
current one (:func:`current_comm`), which the runtime sets around every call.

No hang: :class:`DistComm` waits for each collective at most ``timeout`` seconds
(:func:`collective_timeout`: ``autopar.parallelize(..., timeout=)`` or the environment
variable ``AUTOPAR_COLLECTIVE_TIMEOUT``; neither: the process group's own timeout). A
collective that times out, or fails because a peer died, raises :class:`CollectiveError`
naming the op, the mesh axis and the ranks of its group.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import math
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import Backend as C10dBackend   # as torch's device_mesh does

from autopar.device import mesh_device
from autopar.errors import ArgumentError
from autopar.ops import fault_notice

_local = threading.local()

TIMEOUT_ENV = "AUTOPAR_COLLECTIVE_TIMEOUT"

_timer: Callable[[str, str, float], None] | None = None


@contextlib.contextmanager
def collective_timer(fn: Callable[[str, str, float], None]):
    """Call ``fn(op, axis name, seconds)`` after every :class:`DistComm` wait for a
    collective inside the block (``autopar.runtime.timing``); off, one check per wait."""
    global _timer
    prev, _timer = _timer, fn
    try:
        yield
    finally:
        _timer = prev


_COLLECT_AT_EXIT = False
_COLLECTIVE_FAILED = False      # set by CollectiveError: a group may hold unfinished work


def _collect_at_exit() -> None:
    """Free the process groups before the interpreter shuts down (registered with
    ``atexit`` by the first :class:`DistComm`): collect garbage once more, then destroy
    the groups still registered, the default one included, when the program ends cleanly.

    A gloo group's worker threads let go of each finished collective's tensors after the
    rank has moved on. One that does so once interpreter shutdown has begun needs the GIL
    to free a tensor Python also referenced, which a thread cannot take then: the process
    aborts with "terminate called without an active exception" (exit -6, now and then,
    more often under load). It happens to any gloo program that ends without
    ``destroy_process_group`` (plain torch, two ranks, three all-gathers, three busy loops
    beside them: 18 of 50 runs aborted; destroyed at exit: 0 of 60), such as a Hugging
    Face ``Trainer`` script (``examples/hf_trainer.py``). Destroying a group joins its
    threads while the interpreter is whole. A ParallelModule let go (a local of a function
    that returned) is freed by the collector, not at once (its graphs are reference cycles),
    and its groups with it: hence the collection first.

    Left alone: after an uncaught exception or a failed collective (:class:`CollectiveError`),
    where a group may still hold a collective no peer will join and destroying it would
    wait for the group's timeout."""
    gc.collect()
    failed = _COLLECTIVE_FAILED or getattr(sys, "last_value", None) is not None
    if not failed and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def _free_groups_at_exit() -> None:
    global _COLLECT_AT_EXIT
    if not _COLLECT_AT_EXIT:
        _COLLECT_AT_EXIT = True
        atexit.register(_collect_at_exit)


class CollectiveError(RuntimeError):
    """A collective that did not finish: it timed out (a peer hangs or stopped calling it) or
    failed (a peer died). The message names the op, the mesh axis and the group's ranks."""

    def __init__(self, message: str, *, op: str, axis: str, ranks: list[int], timed_out: bool,
                 peer_fault: str | None = None):
        super().__init__(message)
        global _COLLECTIVE_FAILED
        _COLLECTIVE_FAILED = True
        self.op, self.axis, self.ranks, self.timed_out = op, axis, ranks, timed_out
        self.peer_fault = peer_fault
        """What a peer posted before it stopped (``autopar.ops.fault_notice``: e.g. that it
        ran out of memory), or None."""


def collective_timeout(timeout: float | None = None) -> float | None:
    """Seconds a collective may wait for its peers: ``timeout`` if given, else the
    environment variable ``AUTOPAR_COLLECTIVE_TIMEOUT``, else None (the process group's
    own timeout, torch's default 30 minutes for gloo, 10 for NCCL)."""
    where = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return None
        where = f"{TIMEOUT_ENV}={raw!r}"
        try:
            timeout = float(raw)
        except ValueError:
            raise ArgumentError(f"{where} is not a number of seconds: set it to e.g. 300 (how "
                                "long a collective may wait for its peers), or unset it") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ArgumentError(f"{where}={timeout!r} is not a positive number of seconds: give how "
                            "long a collective may wait for its peers (e.g. 300), or None for the "
                            "process group's own timeout")
    return float(timeout)


def mesh_group_options(ndim: int, timeout: float | None):
    """``init_device_mesh``'s ``backend_override`` that creates the process group of each of
    ``ndim`` mesh axes with ``timeout`` seconds (this job's backend), so that waits outside
    :class:`DistComm` (``torch.distributed.pipelining``'s send / recv) end too; None without
    a timeout."""
    if timeout is None:
        return None
    backend = dist.get_backend()
    return {a: (backend, C10dBackend.Options(backend, timedelta(seconds=timeout))) for a in range(ndim)}


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a backend's report that a collective or a send / recv timed out or
    lost its peer (torch's ``DistError``, gloo's transport errors, NCCL's), not yet named by
    a :class:`CollectiveError`."""
    if isinstance(e, CollectiveError) or not isinstance(e, RuntimeError):
        return False
    text = str(e)
    return (isinstance(e, dist.DistError) or "gloo/transport" in text or "NCCL" in text
            or "timed out" in text.lower())


_process_comm: "weakref.ref | None" = None
"""The last communicator of this process's own rank made current (a :class:`DistComm`), by
weak reference (its process groups must still be freed at shutdown): what a thread that
never entered :func:`use_comm` reads. On a GPU the autograd engine runs
backward on a thread of its own per device, so the collectives' backward, the gradient
buckets and the experts op's recomputation run where no ``use_comm`` block is active.
Ranks simulated as threads share a process and set none: each must enter ``use_comm``."""


def current_comm() -> "Comm":
    comm = getattr(_local, "comm", None) or (_process_comm() if _process_comm is not None else None)
    if comm is None:
        raise RuntimeError("no communicator is active: run the per-rank module through "
                           "autopar's ParallelModule (or `with use_comm(comm):`)")
    return comm


@contextlib.contextmanager
def use_comm(comm: "Comm"):
    global _process_comm
    prev = getattr(_local, "comm", None)
    _local.comm = comm
    if comm is not None and comm.one_per_process:
        _process_comm = weakref.ref(comm)
    try:
        yield comm
    finally:
        _local.comm = prev


@dataclass
class StepSettings:
    """What the module running on a communicator asks of the collectives its step starts,
    beyond the mesh: set once, by the module, from its plan (``ParallelModule``)."""
    grad_reduce_dtype: torch.dtype | None = None
    """The dtype data-parallel gradients are summed in (the plan's ``grad_reduce``); None:
    the master weights' dtype."""
    context_attention: str = "ring"
    """How context-parallel attention crosses its axis (the plan's ``context_attention``):
    ``"ring"`` or ``"all-gather"`` (``autopar.ops.context_attention``)."""
    context_layout: str = "contiguous"
    """Which positions a rank's shard of the sequence holds in context-parallel attention:
    ``"balanced"`` when the graph runs its token stream in the balanced order
    (``autopar.capture.sequence_layout``: pin ``context=``), else ``"contiguous"``."""
    bucket_listener: Any = None
    """Handed each gradient bucket's shards as soon as its reduction finishes (ZeRO-Offload's
    ``runtime.offload.HostOptimizer``, which copies them to the host); None: nobody."""


class Comm:
    """Collectives along one mesh axis. All reduce with SUM."""
    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]   # this rank's coordinate on the mesh
    rank: int
    device: torch.device     # where this rank's tensors live
    _regathered = None       # ZeRO-3's per-communicator record (ops.collectives.regathered_weights)
    _settings: StepSettings | None = None
    one_per_process = False  # the process's own rank (DistComm): threads without use_comm read it
    _first_on_axis = None

    @property
    def first_on_axis(self) -> tuple[torch.Tensor, ...]:
        """Whether this rank is first on each axis, as 0-dim tensors a compiled program reads
        at run time (``ops.collectives.to_partial``): made before any tracing (DistComm makes
        them at construction), so that Dynamo lifts them as inputs and every rank's graph
        is the same; made on first use elsewhere (simulated ranks)."""
        if self._first_on_axis is None:
            self._first_on_axis = tuple(torch.tensor(c == 0, device=self.device) for c in self.coord)
        return self._first_on_axis

    @property
    def settings(self) -> StepSettings:
        """This communicator's :class:`StepSettings` (the defaults until ``configure``)."""
        if self._settings is None:
            self._settings = StepSettings()
        return self._settings

    def configure(self, settings: StepSettings) -> None:
        self._settings = settings

    def size(self, axis: int) -> int:
        return self.mesh_shape[axis]

    def inner(self) -> "Comm":
        """The same rank on the mesh without axis 0 (a pipeline stage's own mesh): axis
        ``a`` of the result is axis ``a + 1`` here."""
        return _Inner(self)

    def all_reduce(self, t: torch.Tensor, axis: int) -> torch.Tensor: ...
    def all_gather(self, t: torch.Tensor, axis: int, dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, t: torch.Tensor, axis: int, dim: int) -> torch.Tensor: ...
    def all_to_all(self, t: torch.Tensor, axis: int, split_dim: int, cat_dim: int) -> torch.Tensor: ...

    def all_to_all_v(self, t: torch.Tensor, axis: int, send: Sequence[int],
                     recv: Sequence[int]) -> torch.Tensor:
        """Rows ``t[sum(send[:j]) : sum(send[:j+1])]`` go to rank ``j`` of ``axis``; the
        result stacks what each rank sent here (``recv[j]`` rows from rank ``j``) in rank
        order: an all-to-all with sizes known only at run time (a mixture of experts'
        token dispatch)."""
        raise NotImplementedError

    def shift(self, t: torch.Tensor, axis: int, offset: int = 1) -> torch.Tensor:
        """Send ``t`` to the rank ``offset`` places ahead on ``axis`` (coordinate
        ``(i + offset) % n``) and return what the rank ``offset`` places behind sent: one step
        of a ring (context parallelism's ring attention)."""
        raise NotImplementedError

    def shift_start(self, t: torch.Tensor, axis: int, offset: int = 1, tag: int = 0):
        """Start :meth:`shift`; returns an object whose ``wait()`` returns what it would (the
        ring attention's next block, sent while the current one is computed). ``tag``: two
        shifts in flight at once between the same ranks are told apart by it (gloo matches
        point-to-point messages by tag; NCCL by the order issued, the same on every rank)."""
        return _Ready(self.shift(t, axis, offset))

    def all_reduce_coalesced(self, tensors: Sequence[torch.Tensor], axis: int):
        """Start summing ``tensors`` in place; returns an object whose ``wait()`` finishes."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        out = self.all_reduce(flat, axis)
        return _Done(tensors, out)

    def reduce_scatter_start(self, flat: torch.Tensor, axis: int):
        """Start summing the 1-D ``flat`` over ``axis``, this rank receiving its block (of
        ``numel / size``); returns an object whose ``wait()`` returns that block."""
        return _Ready(self.reduce_scatter(flat, axis, 0).clone())    # a buffer of its own size

    def all_gather_start(self, t: torch.Tensor, axis: int, dim: int):
        """Start gathering ``t`` along ``dim`` over ``axis``; returns an object whose
        ``wait()`` returns what :meth:`all_gather` would (ZeRO-3's prefetch)."""
        return _Ready(self.all_gather(t, axis, dim))


class _Shifting:
    """A point-to-point shift in flight (:meth:`DistComm.shift_start`)."""

    def __init__(self, comm, works, out, axis):
        self.comm, self.works, self.out, self.axis = comm, works, out, axis

    def wait(self):
        for work in self.works:
            self.comm._wait(work, "shift", self.axis)
        return self.out


class _Ready:
    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out


class _Done:
    def __init__(self, tensors, flat):
        self.tensors, self.flat = tensors, flat

    def wait(self):
        off = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[off: off + n].view_as(t))
            off += n


class _Inner(Comm):
    """``outer`` without its axis 0 (see :meth:`Comm.inner`)."""

    def __init__(self, outer: Comm):
        self.outer = outer
        self.one_per_process = outer.one_per_process
        self.mesh_shape = tuple(outer.mesh_shape[1:])
        self.coord = tuple(outer.coord[1:])
        self.rank = outer.rank
        self.device = outer.device
        self._first_on_axis = outer.first_on_axis[1:]

    def all_reduce(self, t, axis):
        return self.outer.all_reduce(t, axis + 1)

    def all_gather(self, t, axis, dim):
        return self.outer.all_gather(t, axis + 1, dim)

    def reduce_scatter(self, t, axis, dim):
        return self.outer.reduce_scatter(t, axis + 1, dim)

    def all_to_all(self, t, axis, split_dim, cat_dim):
        return self.outer.all_to_all(t, axis + 1, split_dim, cat_dim)

    def all_to_all_v(self, t, axis, send, recv):
        return self.outer.all_to_all_v(t, axis + 1, send, recv)

    def shift(self, t, axis, offset=1):
        return self.outer.shift(t, axis + 1, offset)

    def shift_start(self, t, axis, offset=1, tag=0):
        return self.outer.shift_start(t, axis + 1, offset, tag)

    def all_reduce_coalesced(self, tensors, axis):
        return self.outer.all_reduce_coalesced(tensors, axis + 1)

    def reduce_scatter_start(self, flat, axis):
        return self.outer.reduce_scatter_start(flat, axis + 1)

    def all_gather_start(self, t, axis, dim):
        return self.outer.all_gather_start(t, axis + 1, dim)


_POLLED = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})
"""The ops whose gloo wait may stop and start again: a collective's timed ``Work.wait`` that
expires leaves it pending; a point-to-point one (``shift``) closes the pair ("Application
timeout caused pair closure", measured on torch 2.13's gloo), so it is waited whole."""


class DistComm(Comm):
    """torch.distributed on the process groups of a DeviceMesh. Tensors live on the mesh's
    device type (the current CUDA device under NCCL, else the CPU). Every collective waits
    at most ``timeout`` seconds (None: the process group's own timeout), then raises
    :class:`CollectiveError`."""

    one_per_process = True
    fault_key: str | None = None    # its key of the job's store (autopar.ops.fault_notice)
    _polls = False                  # whether its waits stop to read the store (gloo)

    def __init__(self, mesh, timeout: float | None = None):
        _free_groups_at_exit()
        self.dist = dist
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.coord = tuple(mesh.get_coordinate())
        self.rank = dist.get_rank()
        self.groups = [mesh.get_group(a) for a in range(mesh.ndim)]
        self.device = mesh_device(mesh.device_type)
        self.first_on_axis     # made here, before any tracing (Comm.first_on_axis)
        self.timeout = timeout
        self.axis_names = tuple(mesh.mesh_dim_names or (f"dim{a}" for a in range(mesh.ndim)))
        self.group_ranks = [dist.get_process_group_ranks(g) for g in self.groups]
        self.fault_key = fault_notice.next_key()    # where a rank of this module posts its fault
        # gloo's wait blocks the host, so it can stop to read the store; NCCL's wait only
        # makes the current stream wait (the host blocks later, on a sync): waited whole
        self._polls = dist.get_backend(self.groups[0]) == "gloo"

    def twin(self, axes: Sequence[int]) -> "DistComm":
        """The same rank and mesh with process groups of its own on ``axes`` (the others
        shared): a second thread's collectives on those axes then never meet this one's on a
        group, where two threads issuing on one group would order them differently on
        different ranks (DualPipeV's overlapped forward, ``runtime.overlap``). Collective:
        every rank of the job calls it with the same ``axes``, in the same order (each
        ``dist.new_group`` is). The twin shares the fault key (a peer's posted fault stops
        its waits too) and is never the process's communicator (``one_per_process``)."""
        mesh = self.mesh.mesh
        groups = list(self.groups)
        # the mesh's groups' timeout (``mesh_group_options``)
        kw = {} if self.timeout is None else {"timeout": timedelta(seconds=self.timeout)}
        for a in axes:
            for row in mesh.movedim(a, -1).reshape(-1, mesh.shape[a]).tolist():
                g = dist.new_group(row, **kw)
                if self.rank in row:
                    groups[a] = g
        twin = copy.copy(self)
        twin.groups, twin.one_per_process = groups, False
        twin._regathered = None
        return twin

    def post_fault(self, message: str) -> None:
        """Tell the ranks of this module, waiting for this one in a collective, that it
        stopped: ``message`` (``autopar.ops.fault_notice``)."""
        fault_notice.post(self.fault_key, message)

    def _wait(self, work, op: str, axis: int) -> None:
        """Wait for ``work`` (collective ``op`` on mesh axis ``axis``) at most ``timeout``
        seconds; a timeout or a failure (a peer died) is a :class:`CollectiveError`, and so
        is a peer's posted fault, read every ``fault_notice.POLL_S`` seconds of waiting."""
        t0 = time.monotonic()
        try:
            if not self._polls or op not in _POLLED:
                work.wait() if self.timeout is None else work.wait(timedelta(seconds=self.timeout))
            else:
                self._wait_polling(work, op, axis, t0)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses
            notice = fault_notice.posted(self.fault_key)     # the peer said why, then left
            if notice is not None:
                raise self.peer_failure(op, axis, notice, time.monotonic() - t0) from e
            raise self.failure(op, axis, e, time.monotonic() - t0) from e
        if _timer is not None:
            _timer(op, self.axis_names[axis], time.monotonic() - t0)

    def _wait_polling(self, work, op: str, axis: int, t0: float) -> None:
        """gloo collectives: wait in slices of ``POLL_S`` (a timed-out ``Work.wait`` leaves
        the work pending, so it can be waited for again: ``_POLLED``), reading the store
        between them."""
        while True:
            left = None if self.timeout is None else self.timeout - (time.monotonic() - t0)
            try:
                work.wait(timedelta(seconds=fault_notice.POLL_S if left is None
                                    else max(1e-3, min(fault_notice.POLL_S, left))))
                return
            except RuntimeError:
                if work.is_completed():
                    # it finished since the slice ran out (the peer came as it expired: a
                    # compiling rank's first step), or it failed (a peer died, gloo's own
                    # timeout): an untimed wait returns for the one, raises the other's
                    work.wait()
                    return
                notice = fault_notice.posted(self.fault_key)
                if notice is not None:
                    raise self.peer_failure(op, axis, notice, time.monotonic() - t0) from None
                if left is not None and time.monotonic() - t0 >= self.timeout:
                    raise

    def peer_failure(self, op: str, axis: int, notice: str, waited: float) -> CollectiveError:
        """The :class:`CollectiveError` of this rank's wait for ``op`` when a peer posted
        ``notice`` (it stopped, e.g. out of memory): the peer's message first."""
        name, ranks = self.axis_names[axis], self.group_ranks[axis]
        return CollectiveError(
            f"{notice} (rank {self.rank} stopped waiting for {op} on mesh axis {name!r}, group "
            f"ranks {ranks}, after {waited:.1f} s)", op=op, axis=name, ranks=list(ranks),
            timed_out=False, peer_fault=notice)

    def failure(self, op: str, axis: int, cause: BaseException, waited: float | None = None
                ) -> CollectiveError:
        """The :class:`CollectiveError` for ``op`` on mesh axis ``axis`` that raised ``cause``
        after ``waited`` seconds (None: not measured, e.g. a pipeline's send / recv)."""
        name, ranks = self.axis_names[axis], self.group_ranks[axis]
        others = [r for r in ranks if r != self.rank]
        timed_out = "timed out" in str(cause).lower() or (
            self.timeout is not None and waited is not None and waited >= 0.95 * self.timeout)
        after = "" if waited is None else f" after {waited:.1f} s"
        if timed_out:
            limit = f"timeout {self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
            what = (f"did not finish within {waited:.1f} s ({limit})" if waited is not None
                    else f"timed out ({limit})")
        else:
            what = f"failed{after} ({type(cause).__name__}: {str(cause)[:300]})"
        return CollectiveError(
            f"{op} on mesh axis {name!r} (group ranks {ranks}) {what} on rank {self.rank}: a peer "
            f"died or stopped calling it; look at the logs of ranks {others}. If they are only "
            f"slow, raise the limit with autopar.parallelize(..., timeout=SECONDS) or "
            f"{TIMEOUT_ENV}=SECONDS", op=op, axis=name, ranks=list(ranks), timed_out=timed_out)

    # Under torch.compile (a plan with ``compile=True``), each collective is torch's
    # functional collective: an op in the compiled graph that Inductor may reorder and
    # overlap with compute, waited on where its result is first read. Its limit is then the
    # process group's timeout (``mesh_group_options``), not a per-collective wait.

    def all_reduce(self, t, axis):
        if torch.compiler.is_compiling():
            return funcol.all_reduce(t, "sum", self.groups[axis])
        out = t.contiguous().clone()
        self._wait(self.dist.all_reduce(out, group=self.groups[axis], async_op=True), "all_reduce", axis)
        return out

    def all_gather(self, t, axis, dim):
        if torch.compiler.is_compiling():
            # gathered on dim 0, then each rank's block joined on ``dim`` (funcol's own
            # gather_dim != 0 calls a helper Dynamo skips on torch 2.11: a graph break)
            out = funcol.all_gather_tensor(t.contiguous(), 0, self.groups[axis])
            return out if dim == 0 else torch.cat(out.chunk(self.mesh_shape[axis], 0), dim=dim)
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.mesh_shape[axis])]
        self._wait(self.dist.all_gather(parts, t, group=self.groups[axis], async_op=True),
                   "all_gather", axis)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, t, axis, dim):
        if torch.compiler.is_compiling():
            return funcol.reduce_scatter_tensor(t.contiguous(), "sum", dim, self.groups[axis])
        n = self.mesh_shape[axis]
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=t.dtype, device=t.device)
        self._wait(self.dist.reduce_scatter_tensor(out, moved, group=self.groups[axis], async_op=True),
                   "reduce_scatter", axis)
        return out.movedim(0, dim)

    def all_to_all(self, t, axis, split_dim, cat_dim):
        n = self.mesh_shape[axis]
        stacked = torch.stack(t.chunk(n, dim=split_dim)).contiguous()
        if torch.compiler.is_compiling():
            out = funcol.all_to_all_single(stacked, None, None, self.groups[axis])
            return torch.cat(out.unbind(0), dim=cat_dim)
        out = torch.empty_like(stacked)
        self._wait(self.dist.all_to_all_single(out, stacked, group=self.groups[axis], async_op=True),
                   "all_to_all", axis)
        return torch.cat(out.unbind(0), dim=cat_dim)

    def all_to_all_v(self, t, axis, send, recv):
        t = t.contiguous()
        if torch.compiler.is_compiling():
            return funcol.all_to_all_single(t, list(recv), list(send), self.groups[axis])
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self._wait(self.dist.all_to_all_single(out, t, list(recv), list(send),
                                               group=self.groups[axis], async_op=True),
                   "all_to_all", axis)
        return out

    def shift(self, t, axis, offset=1):
        # point-to-point: the peers' global ranks in the axis' group
        n, i, ranks = self.mesh_shape[axis], self.coord[axis], self.group_ranks[axis]
        t = t.contiguous()
        if offset % n == 0:
            return t.clone()
        out = torch.empty_like(t)
        group = self.groups[axis]
        works = self.dist.batch_isend_irecv([
            self.dist.P2POp(self.dist.isend, t, ranks[(i + offset) % n], group),
            self.dist.P2POp(self.dist.irecv, out, ranks[(i - offset) % n], group)])
        for work in works:
            self._wait(work, "shift", axis)
        return out

    def shift_start(self, t, axis, offset=1, tag=0):
        n, i, ranks = self.mesh_shape[axis], self.coord[axis], self.group_ranks[axis]
        t = t.contiguous()
        if offset % n == 0:
            return _Ready(t.clone())
        out = torch.empty_like(t)
        group = self.groups[axis]
        works = self.dist.batch_isend_irecv([
            self.dist.P2POp(self.dist.isend, t, ranks[(i + offset) % n], group, tag),
            self.dist.P2POp(self.dist.irecv, out, ranks[(i - offset) % n], group, tag)])
        return _Shifting(self, works, out, axis)

    def all_reduce_coalesced(self, tensors, axis):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = self.dist.all_reduce(flat, group=self.groups[axis], async_op=True)
        return _Pending(self, work, axis, tensors, flat)

    def reduce_scatter_start(self, flat, axis):
        out = torch.empty(flat.numel() // self.mesh_shape[axis], dtype=flat.dtype, device=flat.device)
        work = self.dist.reduce_scatter_tensor(out, flat.contiguous(), group=self.groups[axis], async_op=True)
        return _Waiting(self, work, axis, out)

    def all_gather_start(self, t, axis, dim):
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] * self.mesh_shape[axis], *moved.shape[1:]),
                          dtype=t.dtype, device=t.device)
        work = self.dist.all_gather_into_tensor(out, moved, group=self.groups[axis], async_op=True)
        return _Gathering(self, work, axis, out, dim)


class _Gathering:
    """An all-gather in flight (:meth:`DistComm.all_gather_start`)."""

    def __init__(self, comm: DistComm, work, axis: int, out, dim: int):
        self.comm, self.work, self.axis, self.out, self.dim = comm, work, axis, out, dim

    def wait(self):
        self.comm._wait(self.work, "all_gather", self.axis)
        return self.out if self.dim == 0 else self.out.movedim(0, self.dim).contiguous()


class _Waiting:
    """A reduce-scatter in flight (:meth:`DistComm.reduce_scatter_start`)."""

    def __init__(self, comm: DistComm, work, axis: int, out):
        self.comm, self.work, self.axis, self.out = comm, work, axis, out

    def wait(self):
        self.comm._wait(self.work, "reduce_scatter", self.axis)
        return self.out


class _Pending(_Done):
    """An all-reduce in flight (:meth:`DistComm.all_reduce_coalesced`)."""

    def __init__(self, comm: DistComm, work, axis: int, tensors, flat):
        super().__init__(tensors, flat)
        self.comm, self.work, self.axis = comm, work, axis

    def wait(self):
        self.comm._wait(self.work, "all_reduce", self.axis)
        super().wait()


class ThreadWorld:
    """Shared state of ranks simulated as threads: one barrier and mailbox per axis group."""

    def __init__(self, mesh_shape: Sequence[int]):
        self.mesh_shape = tuple(mesh_shape)
        self.world = 1
        for n in self.mesh_shape:
            self.world *= n
        self._groups: dict = {}
        self._lock = threading.Lock()

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def group(self, axis: int, coord: tuple[int, ...]):
        key = (axis, coord[:axis] + coord[axis + 1:])
        with self._lock:
            if key not in self._groups:
                n = self.mesh_shape[axis]
                self._groups[key] = (threading.Barrier(n, timeout=120), [None] * n)
            return self._groups[key]

    def run(self, fn: Callable[["ThreadComm"], object]) -> list:
        """Run ``fn(comm)`` on every simulated rank at once; results in rank order.
        An exception on any rank is raised here (the others are released)."""
        results: list = [None] * self.world
        errors: list = []

        def body(rank):
            comm = self.comm(rank)
            try:
                with use_comm(comm):
                    results[rank] = fn(comm)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append((rank, e))
                for barrier, _ in list(self._groups.values()):
                    barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
            rank, err = errors[0]
            raise RuntimeError(f"simulated rank {rank} failed: {err}") from err
        return results


class ThreadComm(Comm):
    def __init__(self, world: ThreadWorld, rank: int):
        self.world = world
        self.rank = rank
        self.device = torch.device("cpu")     # simulated ranks exchange tensors in host memory
        self.mesh_shape = world.mesh_shape
        coord, r = [], rank
        for n in reversed(self.mesh_shape):
            coord.append(r % n)
            r //= n
        self.coord = tuple(reversed(coord))

    def _exchange(self, t: torch.Tensor, axis: int) -> list[torch.Tensor]:
        barrier, box = self.world.group(axis, self.coord)
        box[self.coord[axis]] = t.detach().clone()
        barrier.wait()
        parts = list(box)
        barrier.wait()
        return parts

    def all_reduce(self, t, axis):
        parts = self._exchange(t, axis)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, t, axis, dim):
        return torch.cat(self._exchange(t, axis), dim=dim)

    def reduce_scatter(self, t, axis, dim):
        total = self.all_reduce(t, axis)
        return total.chunk(self.mesh_shape[axis], dim=dim)[self.coord[axis]].contiguous()

    def all_to_all(self, t, axis, split_dim, cat_dim):
        parts = self._exchange(t, axis)
        i = self.coord[axis]
        n = self.mesh_shape[axis]
        return torch.cat([p.chunk(n, dim=split_dim)[i] for p in parts], dim=cat_dim)

    def all_to_all_v(self, t, axis, send, recv):
        parts = self._exchange(t, axis)
        i = self.coord[axis]
        out = [p.split(list(s), dim=0)[i] for p, s in zip(parts, self._exchange_sizes(send, axis))]
        assert [o.shape[0] for o in out] == list(recv), "all_to_all_v: sizes disagree"
        return torch.cat(out, dim=0)

    def shift(self, t, axis, offset=1):
        return self._exchange(t, axis)[(self.coord[axis] - offset) % self.mesh_shape[axis]]

    def _exchange_sizes(self, send, axis) -> list:
        barrier, box = self.world.group(axis, self.coord)
        box[self.coord[axis]] = tuple(send)
        barrier.wait()
        sizes = list(box)
        barrier.wait()
        return sizes
