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

The caching allocator holds more than the sum of live tensors; :func:`allocator_overhead`
and :func:`allocation_size` state how much we add. They are starting values to be checked
against measured peaks (``benchmarks/cost_model_accuracy.py``), not fitted to them.
"""
from __future__ import annotations

_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
_PRECISIONS = ("fp32", "bf16", "fp16")


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
