"""Pins: keyword arguments of ``autopar.plan`` / ``autopar.parallelize`` (and ``--pin`` of the
CLI) that fix one choice each and leave the rest to the solver; and the optimizers whose
state the memory model counts."""
from __future__ import annotations

from typing import Any

from autopar.errors import ArgumentError, PinError

KNOWN_PINS = frozenset({"data", "tensor", "zero", "pipeline", "micro_batch_size", "schedule",
                        "virtual_stages", "recompute", "precision", "grad_reduce", "accumulate"})
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer tensors kept per parameter."""


def check_pins(pins: dict[str, Any]) -> dict[str, Any]:
    """``pins``, after checking every name and value; raises TypeError on an unknown pin and
    ValueError on a value the solver cannot honour."""
    unknown = set(pins) - KNOWN_PINS
    if unknown:
        raise ArgumentError(f"unknown pin(s) {sorted(unknown)}; pins are {sorted(KNOWN_PINS)}")
    pipe = pins.get("pipeline")
    if pipe is not None and (not isinstance(pipe, int) or pipe < 1):
        raise PinError(f"pin pipeline={pipe!r} must be a positive integer")
    rec = pins.get("recompute")
    if not (rec is None or isinstance(rec, bool) or rec in ("full", "none")
            or (isinstance(rec, (list, tuple)) and all(isinstance(r, str) for r in rec))):
        raise PinError(f"recompute={rec!r}: use 'full' (every repeated layer), None, or a "
                       "list of layer names such as ['h.0', 'h.1']")
    for name in ("schedule", "virtual_stages"):
        if pins.get(name) is not None and (pipe or 1) == 1:
            raise PinError(f"the pin {name}= needs pipeline parallelism: pin pipeline= > 1 too")
    # micro_batch_size= without a pipeline (or pipeline=1): gradient accumulation, as accumulate=
    for name in ("accumulate", "micro_batch_size"):
        v = pins.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise PinError(f"pin {name}={v!r} must be a positive integer")
    if pins.get("accumulate") is not None and (pipe or 1) > 1:
        raise PinError("accumulate= is gradient accumulation without a pipeline; a pipeline "
                       "runs its own micro-batches: pin micro_batch_size= with pipeline= instead")
    if pins.get("precision") not in (None, "fp32", "bf16", "fp16"):
        raise PinError(f"precision={pins['precision']!r}: use 'fp32', 'bf16' or 'fp16'")
    # grad_reduce: the dtype data-parallel gradients are summed in (all-reduce, ZeRO's
    # reduce-scatter); fp32 by default, "bf16" halves those bytes under mixed precision
    if pins.get("grad_reduce") not in (None, "fp32", "bf16"):
        raise PinError(f"grad_reduce={pins['grad_reduce']!r}: use 'fp32' (the default) or 'bf16'")
    if pins.get("grad_reduce") == "bf16" and pins.get("precision") not in ("bf16", "fp16"):
        raise PinError("grad_reduce='bf16' needs mixed precision: pin precision='bf16' too")
    zero = pins.get("zero", 0) or 0
    if zero not in (0, 1, 2, 3):
        raise PinError(f"zero={zero!r}: ZeRO stages are 0 (replicated), 1 and 2 (parameters, "
                       "gradients and optimizer state stored sharded over the data-parallel "
                       "axis, weights gathered once and kept for backward) and 3 (as 2, and "
                       "gathered weights freed after use and gathered again in backward)")
    for name in ("data", "tensor"):
        v = pins.get(name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise PinError(f"pin {name}={v!r} must be a positive integer")
    return pins


def check_optimizer(optimizer: str) -> int:
    """Optimizer tensors per parameter of ``optimizer``; ValueError when unknown."""
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def pipelined(pins: dict) -> bool:
    """Whether the pins ask for a pipeline (``pipeline=1`` means none)."""
    return (pins.get("pipeline") or 1) > 1
