"""What a training step costs beyond its operators and collectives: the optimizer step,
host overhead, and the overlap rules the estimate follows (stated once, here).

Overlap rules (GPU; where each is applied):

- data-parallel gradient reduction overlaps backward, except the last bucket
  (:func:`~autopar.cost_models.comm.grad_sync_time`: ``exposed = max(t_bucket, total -
  backward * (1 - 1/k))``). The solver applies it as ``exposed = max(t_bucket, total -
  backward)`` with GradSync's 25 MiB bucket (``pricing/costing.CostModel.overlap_rule``):
  the flat ILP through a continuous variable ``E >= t_bucket``, ``E >= overlappable -
  hiding compute`` (``solver/ilp.py``); a pipeline rank's once-per-step reduction hides
  behind its stages' backward of the last micro-batch only (``solver/pipeline_price.py``;
  the stage DP's cuts still weigh it in full). ZeRO-3's per-block gathers and
  reduce-scatters hide behind forward and backward alike, the first block's (one bucket)
  exposed (FSDP-style prefetch; flat plans only). The estimate shows the hidden seconds as
  a negative ``overlapped`` row of ``comm``. What follows each ZeRO-3 gather on the
  compute stream, its copy-out into whole weights (FSDP2's ``foreach_all_gather_copy_out``
  in ``FSDPParamGroup.wait_for_unshard``; ``ParamBucket._unflatten``), is never hidden:
  the ``copy_out`` row, the gathered bytes read and written once at HBM bandwidth;
- tensor-parallel collectives sit on the critical path: every collective of a
  redistribution between two ops is added to the step (``pricing/costing.edge_time``);
- pipeline bubbles by schedule (:func:`bubble_fraction`): GPipe and 1F1B idle
  ``(p - 1) / (m + p - 1)`` of the step, interleaved 1F1B with ``v`` chunks per stage
  ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, Sec. 2.2.1-2.2.2);
- recomputation costs its forward again (``compute.node_time``'s caller adds the forward
  once more for every recomputed node);
- the optimizer step (:func:`optimizer_step_time`) and the host's per-step work
  (:data:`HOST_OVERHEAD_S`) are not overlapped with anything;
- host time of an eager program on a GPU (``cost_models.host``: every ATen call of the step,
  forward, backward and optimizer, at ``Device.host_op_s``) overlaps the device's work: the
  host queues kernels while the GPU runs them, so the step is ``max(device, host)``
  (:func:`step_time`), the device side being compute + exposed communication. Flat plans
  (``solver/flat._to_plan``; gradient accumulation k times, ``solver/accumulate``; branch
  plans, a group's rank dispatching only its branches, ``solver/branches``) apply it.
  Pipelined plans apply it per rank (``solver/stage_dp``'s host rule): a rank dispatches
  its stages' calls once per micro-batch, forward and backward, and its optimizer's once,
  so a stage's micro-batch takes ``max(device, its calls x host_op_s)`` in the stage DP's
  cuts and the simulated schedule, and the step is at least the busiest rank's
  ``(m x its stages' calls + optimizer calls) x host_op_s`` (``StagePlan.host_time``,
  ``solver/pipeline_price.pipeline_estimate``); the optimizer's calls are dispatched after
  the rank's last backward, beside its exposed gradient reduction (the step ends
  ``max(exposed reduction, optimizer calls x host_op_s)`` after the pipeline). Compiled programs (``compile=True``) pay
  ``cost_models.host.COMPILED_HOST_FRACTION`` (0.99) of the eager calls, flat or pipelined.
  The estimate shows the host seconds as ``Estimate.host_s``. CPU ranks price their host
  in ``launch_overhead`` / ``view_overhead`` (their host is the device) and keep 0 here.

Every constant cites its source.
"""
from __future__ import annotations

from .devices import Device

# Bytes one optimizer step moves per parameter held by the device (fused multi-tensor
# Adam, apex FusedAdam / torch.optim.AdamW(fused=True): one pass over the state). State
# sizes from the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1): mixed precision keeps a
# 16-bit weight and grad, an fp32 master weight and two fp32 moments (K = 12 bytes).
# Mixed: read grad 2 + read/write master 8 + read/write two moments 16 + write weight 2.
# fp32: read grad 4 + read/write weight 8 + read/write two moments 16.
# AdamW as torch's foreach implementation runs it (``foreach=True``, not fused: torch's
# ``optim/adam.py`` ``_multi_tensor_adam`` with decoupled weight decay, not capturable), one
# pass per ``torch._foreach_*`` call over fp32 weight, grad and moments: mul_ (weight decay,
# r/w weight 8), lerp_ (first moment: read it and the grad, write it, 12), mul_ (second
# moment 8), addcmul_ (second moment += grad^2: read it and the grad, write it, 12), sqrt
# (read the second moment, write a new tensor, 8), div_ (bias correction, 8), add_ (eps, 8),
# addcdiv_ (weight += step * m / denom: read three, write one, 16): 80 bytes a parameter.
OPTIMIZER_BYTES_PER_PARAM = {
    ("adamw", "mixed"): 28, ("adamw", "fp32"): 28, ("adamw_foreach", "fp32"): 80,
    ("sgd_momentum", "mixed"): 20, ("sgd_momentum", "fp32"): 20,
    ("sgd", "mixed"): 12, ("sgd", "fp32"): 12,
}
# Kernels of one fused optimizer step: multi-tensor apply launches one kernel per chunk of
# tensors (apex multi_tensor_apply, chunk_size 2**16 elements x 110 tensors per launch);
# a handful per step beside the bandwidth term. 10 is a stated round figure.
OPTIMIZER_KERNELS = 10

# Host and data overhead per step (seconds), not overlapped: the loss' .item() sync,
# logging, learning-rate schedule, the data loader's hand-off of a prefetched batch.
# Megatron-LM's published throughputs include "data loading, optimization, and even
# logging" (Megatron-LM README, "Training speed and scalability"). ASSUMED: 10 ms, a
# stated constant, not measured and not fitted to any published run.
HOST_OVERHEAD_S = 0.010


def optimizer_step_time(params_on_device: float, device: Device, *, optimizer: str = "adamw",
                        mixed: bool = True) -> float:
    """Seconds of one optimizer step over ``params_on_device`` parameters (already divided
    by tensor / pipeline sharding and, under ZeRO >= 1, by the data axis): memory-bound at
    the device's achieved bandwidth, plus its kernels' launches.

    >>> from autopar.cost_models.gpus import A100_80GB
    >>> round(optimizer_step_time(1e9, A100_80GB) * 1e3, 1)
    15.3
    """
    if params_on_device <= 0:
        return 0.0
    key = ("adam" if optimizer == "adam" else optimizer, "mixed" if mixed else "fp32")
    key = ("adamw", key[1]) if key[0] == "adam" else key
    nbytes = OPTIMIZER_BYTES_PER_PARAM[key] * params_on_device
    return (nbytes / (device.mem_bandwidth * device.mem_efficiency)
            + OPTIMIZER_KERNELS * device.launch_overhead)


def step_time(device_s: float, host_s: float) -> float:
    """A step whose device side takes ``device_s`` and whose host dispatches take
    ``host_s``, overlapped (module docstring): ``max(device_s, host_s)``."""
    return max(device_s, host_s)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Fraction of a pipelined step the average stage idles (Narayanan et al. 2021,
    Sec. 2.2): ``(p - 1) / (v m + p - 1)``; zero bubble schedules: 0 in the ideal."""
    p, m, v = stages, microbatches, max(1, virtual)
    if p <= 1:
        return 0.0
    if schedule == "zero-bubble":
        return 0.0
    if schedule != "interleaved-1f1b":
        v = 1
    return (p - 1) / (v * m + p - 1)
