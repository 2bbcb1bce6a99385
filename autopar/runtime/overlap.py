"""DualPipeV's forward/backward pairs run at once: one micro-batch's forward on a second host
thread while the other's backward runs on the calling one (issue 44, item 4).

``ScheduleDualPipeV``'s steady state lists ``OVERLAP_F_B`` actions: the forward of one
micro-batch on one of the rank's two stages paired with the full backward of another on the
other stage (DeepSeek-V3 report, arXiv 2412.19437 sec. 3.2.1: each pair's all-to-all and
pipeline communication hidden behind the other half's compute). torch 2.13 runs the two
sub-actions one after the other unless a caller registers its own function for the action
(``_PipelineScheduleRuntime.register_custom_function``); :class:`OverlapPairs` is that
function. Per pair:

- the forward runs on a daemon worker thread (one per runner, kept between steps), under
  what the calling thread's step has set that is thread-local: its communicator (a
  :meth:`DistComm.twin` with process groups of its own on the stage axes, so that the two
  threads' collectives never meet on one group, where they would be ordered differently on
  different ranks), the step context (skip values, side inputs), grad mode, the
  autocast nesting that keeps 16-bit weight casts for the step (``cast_once_per_step``),
  the innermost saved-tensor hooks, and on CUDA a stream of its own (``device.SideStream``);
- the backward runs on the calling thread, on the step's own communicator;
- both are joined; the micro-batches' P2P stays with the schedule (its RECV actions posted
  before the pair, each half waits for its own; its SEND actions after).

What a half does is what torch's ``_perform_action`` does for ``FORWARD`` and
``FULL_BACKWARD`` (schedules.py, torch 2.13): wait for the stage's received input (not when
the neighbouring stage is on this rank: the V's middle), run the stage, compute the loss on
the last stage, hand the output (the input gradient) to the neighbouring local stage.

Errors. A half that raises has the pair named on it (stage, micro-batch, the other half),
posts a fault to the module's ranks (``Comm.post_fault``: a peer waiting for this rank in
one of the pair's collectives stops at once), and is raised after the other half ends;
the other half is waited for at most :attr:`OverlapPairs.grace` seconds once one failed
(the worker is a daemon thread: an abandoned forward does not hold the process).

Where it runs (:func:`overlap_applies`): ``schedule="dualpipev"`` and a stage that dispatches
tokens to experts by all-to-all (the communication DualPipe overlaps, and the one the pricing
hides, ``solver.pipeline_price``), eager programs (a compiled stage's collectives are bound
to the groups it was traced with), no context axis (its attention keeps the forward's
communicator for backward) and ZeRO below 3 (the gathered weights' hooks, the same); not when
``dualpipev_overlap=False``; on CUDA, not when values skip stages (their point-to-point
messages on the world group would be issued by both threads, and NCCL matches them by issue
order: ``device.p2p_matched_by_tag``). Elsewhere the pairs run as torch runs them. Measured
on CPU gloo ranks only: the CUDA stream handling (``device.SideStream``) has not run on a
GPU.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref

import torch
from torch.distributed.pipelining.schedules import (
    FORWARD, FULL_BACKWARD, OVERLAP_F_B, _wait_batch_p2p,
)

from autopar.device import SideStream
from autopar.ops.comm import use_comm
from autopar.ops.stage_ops import carry_step_context, step_context
from autopar.placement import Shard
from autopar.plan import Plan
from autopar.runtime.precision import cast_once_per_step

EXPERTS_OP = "autopar.moe_experts.default"


def expert_all_to_all_axes(plan: Plan) -> list[int]:
    """Mesh axes (of ``plan``'s mesh, the pipeline axis excluded) on which some experts op
    splits both its experts and its tokens: its dispatch is an all-to-all there."""
    axes = set()
    for name, op in plan.node_ops.items():
        if op != EXPERTS_OP or name not in plan.nodes:
            continue
        node = plan.nodes[name]
        hidden, stack = node.input(0), node.input(3)
        for a, n in enumerate(plan.mesh_shape):
            if n > 1 and plan.mesh_axes[a] != "pipeline" and stack[a] == Shard(0) \
                    and isinstance(hidden[a], Shard):
                axes.add(a)
    return sorted(axes)


def overlap_applies(plan: Plan) -> bool:
    """Whether the runtime runs ``plan``'s DualPipeV pairs at once (module docstring)."""
    o = plan.options
    return (plan.schedule == "dualpipev" and o.dualpipev_overlaps
            and "context" not in plan.mesh_axes and bool(expert_all_to_all_axes(plan)))


class _Job:
    """One forward handed to the worker: its outcome and when it ran."""

    def __init__(self, fn):
        self.fn, self.done = fn, threading.Event()
        self.error: BaseException | None = None
        self.start = self.end = 0.0

    def run(self) -> None:
        self.start = time.perf_counter()
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.error = e
        finally:
            self.fn = None          # the step's stages and batch, let go
            self.end = time.perf_counter()
            self.done.set()


class _Worker:
    """A daemon thread running jobs one at a time."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="autopar-overlap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()
            del job

    def submit(self, fn) -> _Job:
        job = _Job(fn)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)


class OverlapPairs:
    """The ``OVERLAP_F_B`` function of one runner's train schedule (module docstring).
    ``comm``: the stage communicator the forward thread uses (a twin's ``inner()``);
    ``device``, ``dtype``: the stages' device and autocast dtype (None: fp32)."""

    grace = 120.0
    """Seconds the other half is waited for once one half failed."""

    def __init__(self, comm, device: torch.device, dtype, poster=None):
        self.comm, self.device, self.dtype = comm, device, dtype
        self._post = poster             # posts a fault to the module's ranks (DistComm.post_fault)
        self._stream = SideStream(device)
        self._worker: _Worker | None = None
        self.pairs = 0                  # pairs whose forward ran on the worker
        self.concurrent = 0             # of them, those whose halves ran at the same time

    def register(self, schedule) -> None:
        schedule.register_custom_function(OVERLAP_F_B, self)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __call__(self, action, ctx) -> None:
        sched = ctx.schedule_ref
        f, b = action.sub_actions
        if (f.computation_type, b.computation_type) != (FORWARD, FULL_BACKWARD):
            raise RuntimeError(f"autopar's OVERLAP_F_B function runs a forward with a full "
                               f"backward (torch 2.13's DualPipeV); this schedule paired {f} with "
                               f"{b}: pin dualpipev_overlap=False")
        stages = {st.stage_index: st for st in sched._stages}
        carried = (torch.is_grad_enabled(), step_context(), self._stream.caller(),
                   torch._C._autograd._top_saved_tensors_default_hooks(False))

        handed: list = []      # what the forward hands to this thread: its output, its loss

        def forward():
            with self._carried(*carried):
                handed.extend(_forward(sched, stages, f, ctx))

        if self._worker is None:
            self._worker = worker = _Worker()
            weakref.finalize(self, worker.close)       # the thread ends with its runner
        job = self._worker.submit(forward)
        t0 = time.perf_counter()
        try:
            _backward(sched, stages, b)
        except BaseException as e:
            self._fault(e, f"stage {b.stage_index} backward of micro-batch {b.microbatch_index}",
                        f"stage {f.stage_index} forward of micro-batch {f.microbatch_index}")
            job.done.wait(self.grace)
            raise
        t1 = time.perf_counter()
        job.done.wait()
        self._stream.join(carried[2], handed)
        if job.error is not None:
            self._fault(job.error, f"stage {f.stage_index} forward of micro-batch {f.microbatch_index}",
                        f"stage {b.stage_index} backward of micro-batch {b.microbatch_index}")
            raise job.error
        self.pairs += 1
        self.concurrent += int(job.start < t1 and t0 < job.end)

    @contextlib.contextmanager
    def _carried(self, grad, step, caller, hooks):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            stack.enter_context(use_comm(self.comm))
            stack.enter_context(carry_step_context(step))
            stack.enter_context(cast_once_per_step(self.device, self.dtype))
            if hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
            stack.enter_context(self._stream.run(caller))
            yield

    def _fault(self, e: BaseException, what: str, other: str) -> None:
        note = (f"autopar: in DualPipeV's overlapped pair, the {what} failed (run at once with "
                f"the {other}, runtime.overlap); dualpipev_overlap=False runs the pairs one "
                "after the other")
        e.add_note(note)
        # a peer's posted fault stays the one the ranks read (``CollectiveError.peer_fault``)
        if self._post is not None and getattr(e, "peer_fault", None) is None:
            with contextlib.suppress(Exception):
                self._post(f"rank {self.comm.rank}: {what} failed in an overlapped pair: "
                           f"{type(e).__name__}: {str(e)[:200]}")


def _forward(sched, stages: dict, action, ctx) -> list:
    """torch's ``_perform_action`` for ``FORWARD`` (schedules.py, torch 2.13; the output not
    kept: ``PipelineRunner.train`` steps with ``return_outputs=False``); returns the tensors
    it made that the calling thread reads next (the output, the loss)."""
    k, mb = action.stage_index, action.microbatch_index
    stage = stages[k]
    if not stage.is_first and k - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((k, mb)))
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                     save_forward_output=False)
    losses = len(sched._internal_losses)
    sched._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if k + 1 in stages:
        stages[k + 1].set_local_fwd_input(output, mb)
    made = list(output) if isinstance(output, (tuple, list)) else [output]
    return made + list(sched._internal_losses[losses:])


def _backward(sched, stages: dict, action) -> None:
    """torch's ``_perform_action`` for ``FULL_BACKWARD`` (schedules.py, torch 2.13)."""
    k, mb = action.stage_index, action.microbatch_index
    stage = stages[k]
    if not stage.is_last and k + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((k, mb)))
    loss = sched._maybe_get_loss(stage, mb)
    sched.backward_counter[k] += 1
    last = sched.backward_counter[k] == sched._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if k - 1 in stages:
        stages[k - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
