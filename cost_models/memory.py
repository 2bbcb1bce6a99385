"""Memory of training state per device: parameters, gradients, optimizer states.

For ``Psi`` parameters (after the ZeRO paper, Rajbhandari et al. 2020, Sec. 3.1, with
mixed precision as ``torch.autocast`` and autopar's runtime keep it: the parameters are the
fp32 master weights, their gradients fp32 (the backward of autocast's cast returns fp32),
the 16-bit weights are the copies autocast makes for the forward, 2 bytes each; the ZeRO
paper's 2 Psi gradients are fp16 ones, which no one here keeps):

==============================  ========  ========  =========================================
precision / optimizer           params    grads     optimizer
==============================  ========  ========  =========================================
bf16 mixed, AdamW               2 Psi     4 Psi     12 Psi (fp32 master, 2 fp32 moments)
bf16 mixed, SGD with momentum   2 Psi     4 Psi     8 Psi (fp32 master, fp32 momentum)
bf16 mixed, plain SGD           2 Psi     4 Psi     4 Psi (fp32 master)
fp32, AdamW                     4 Psi     4 Psi     8 Psi (2 moments)
fp32, SGD with momentum         4 Psi     4 Psi     4 Psi
fp32, plain SGD                 4 Psi     4 Psi     0
==============================  ========  ========  =========================================

ZeRO stage ``z`` over ``dp`` data-parallel ranks divides by ``dp``: stage 1 the optimizer
states, stage 2 also the gradients, stage 3 also the parameters.

Not every term is live at once. An unpipelined step of one micro-batch peaks at one of
three moments:

- the loss's backward, the first backward op: every activation saved for backward (under
  mixed precision with the 16-bit weight copies, which backward frees with the activations
  that saved them) and the input-sized gradients the loss's backward makes beside them
  (``loss_grads``, ``analysis.saved.LOSS_GRADIENTS``); no gradient of a weight yet;
- a repeated layer's backward: the activations still saved, and the layer that
  recomputation rebuilds (``recompute``) or activation offload brings back from the host
  (``offload``: the layers in flight). The loss's gradients are gone by then: the loss's
  backward has finished before the first layer's backward starts, so the rebuilt or
  fetched layer never sits beside them (measured: ``tests/test_offload_memory.py``, and the
  H200 run of ``benchmarks/gpu_check.py``'s offload section, whose peak fell at the loss's
  backward with every offloaded layer on the host);
- the end of backward: every gradient, and the flat buffers the runtime sums them in
  (``runtime.grad_sync``); the activations freed;
- the optimizer's step: every gradient, and what the step makes beside them
  (``optimizer_step``, :func:`optimizer_step_bytes`): torch's Adam and AdamW on a GPU
  (``foreach``, torch's default there) take the square root of every second moment at once
  into new tensors, one moment's bytes. Measured (the H200 run of
  ``benchmarks/gpu_check.py``'s scale section, 2026-11-30): a DeepSeek-V3-shaped rank
  under ``expert=8`` peaked at 102.78 GB, its master weights and moments (61.66 GB), its
  gradients (20.55 GB) and one more moment's bytes (20.55 GB) making 102.76 GB; the
  gradient buckets were gone by then.

Backward trades activations for gradients layer by layer, so its live bytes in between lie
between the ends (a sum of layers freed and layers produced, linear in the step).
:func:`step_phases` names the three groups and :func:`peak_bytes` takes the largest:
parameters and optimizer state (and inputs, buffers) are live throughout. A pipeline or gradient accumulation keeps the
gradients of earlier micro-batches beside the activations of later ones: all terms add.
Measured against the runtime's peak: ``benchmarks/precision_memory.py``.

The caching allocator holds more than the sum of live tensors; :func:`allocator_overhead`
and :func:`allocation_size` state how much we add. They are starting values to be checked
against measured peaks (``benchmarks/cost_model_accuracy.py``), not fitted to them.
"""
from __future__ import annotations

_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""fp8 keeps the state bf16 does: fp32 master weights, 16-bit working copies (its fp8
copies are transient casts inside each GEMM, ``autopar.ops.fp8``)."""


def training_state_bytes(param_numel: int, optimizer: str = "adamw", precision: str = "fp32",
                         zero: int = 0, dp: int = 1) -> dict[str, float]:
    """Bytes per device of ``{"params", "grads", "optimizer"}`` for ``param_numel``
    parameters held by this device (already divided by tensor / pipeline sharding).

    >>> training_state_bytes(10**9, "adamw", "bf16", zero=1, dp=8)["optimizer"]
    1500000000.0
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(_OPTIMIZERS)}")
    if precision not in _PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(_PRECISIONS)}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp!r}")
    psi = float(param_numel)
    states = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]
    if precision == "fp32":
        params, grads, opt = 4 * psi, 4 * psi, 4 * states * psi
    else:  # mixed: 16-bit weight copies; fp32 grads, master weights and states
        params, grads, opt = 2 * psi, 4 * psi, 4 * (1 + states) * psi
    if zero >= 1:
        opt /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        params /= dp
    return {"params": params, "grads": grads, "optimizer": opt}


LOSS_BACKWARD = ("activations", "loss_grads")
"""Terms live at the loss's backward: saved activations and the gradients the loss makes."""
LAYER_BACKWARD = ("activations", "recompute", "offload")
"""Terms live at a repeated layer's backward: saved activations, the layer recomputation
rebuilds and the offloaded layers brought back (never beside the loss's gradients)."""
BACKWARD_END = ("grads", "grad_buffers")
"""Terms born in backward: gradients, and the flat buffers they are summed in."""


OPTIMIZER_STEP = ("grads", "optimizer_step")
"""Terms live at the optimizer's step: the gradients and the step's own temporaries."""


def step_phases(mixed: bool = False) -> tuple[tuple[str, ...], ...]:
    """The groups of memory terms of an unpipelined step of one micro-batch that are never
    live at once (module docstring): the loss's backward, a layer's backward, the end of
    backward, the optimizer's step. Under mixed precision the ``params`` term is the 16-bit
    weight copies, made in forward and freed with the activations that saved them, so it
    joins the first two."""
    params = ("params",) if mixed else ()
    return (LOSS_BACKWARD + params, LAYER_BACKWARD + params, BACKWARD_END, OPTIMIZER_STEP)


def optimizer_step_bytes(moment_bytes: float, optimizer_states: int, device_name: str) -> float:
    """Bytes the optimizer's step allocates beside the gradients, for parameters whose
    moments take ``moment_bytes`` (one moment, fp32, as held on this device) under an
    optimizer of ``optimizer_states`` tensors per parameter.

    Adam and AdamW (2 states) on a GPU run torch's ``foreach`` implementation (its default
    where every tensor is on CUDA: ``torch.optim.optimizer._default_to_fused_or_foreach``):
    ``_multi_tensor_adam`` makes ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, a
    new tensor per moment, all alive until the update, then divides and adds into it in
    place: one moment's bytes. On CPU ranks torch runs the per-parameter loop, one
    parameter's temporary at a time: counted as none. SGD (with or without momentum)
    updates in place: none.

    >>> optimizer_step_bytes(4e9, 2, "H100-SXM")
    4000000000.0
    >>> optimizer_step_bytes(4e9, 2, "cpu"), optimizer_step_bytes(4e9, 1, "H100-SXM")
    (0.0, 0.0)
    """
    if optimizer_states != 2 or device_name.startswith("cpu"):
        return 0.0
    return float(moment_bytes)


def peak_bytes(terms: dict[str, float], phases: tuple[tuple[str, ...], ...] = ()) -> float:
    """Peak bytes per device of memory ``terms`` (term -> bytes): every term in no group of
    ``phases`` plus the largest group's sum. No phases: every term live at once.

    >>> peak_bytes({"params": 1, "activations": 5, "grads": 3}, step_phases())
    6.0
    >>> peak_bytes({"activations": 5, "loss_grads": 2, "offload": 3, "grads": 3}, step_phases())
    8.0
    >>> peak_bytes({"activations": 5, "grads": 3, "optimizer_step": 3}, step_phases())
    6.0
    """
    grouped = {k for group in phases for k in group}
    always = sum(b for k, b in terms.items() if k not in grouped)
    return float(always + max((sum(terms.get(k, 0.0) for k in g) for g in phases), default=0.0))


# Fragmentation of PyTorch's caching allocator: memory reserved beyond memory allocated.
# It is real and model-dependent: the ZeRO paper (Sec. 6.3, "Memory fragmentation") saw
# OOM "with over 30% of memory still available" on very large models. 10% is an ASSUMED
# starting value, not a measured constant; the accuracy benchmark compares it with
# torch.cuda.max_memory_reserved / max_memory_allocated and this number should follow.
ALLOCATOR_FRAGMENTATION = 0.10


def allocator_overhead(nbytes: float, fraction: float = ALLOCATOR_FRAGMENTATION) -> float:
    """Bytes the allocator reserves to hold ``nbytes`` of live tensors at peak:
    ``nbytes * (1 + fraction)``."""
    return nbytes * (1.0 + fraction)


def allocation_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator sets aside for one tensor of ``nbytes``
    (c10/cuda/CUDACachingAllocator.cpp): the block is rounded up to 512 bytes
    (``kMinBlockSize``); from ``kMinLargeAlloc = 10 MiB`` up, the segment is its own and
    rounded up to 2 MiB (``kRoundLarge``). Smaller blocks share 2 / 20 MiB segments."""
    if nbytes <= 0:
        return 0
    size = -(-nbytes // 512) * 512
    if size > 10 * 2**20:
        size = -(-size // (2 * 2**20)) * (2 * 2**20)
    return size
