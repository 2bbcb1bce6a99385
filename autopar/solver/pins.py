"""Pins: keyword arguments of ``autopar.plan`` / ``autopar.parallelize`` (and ``--pin`` of the
CLI) that fix one choice each and leave the rest to the solver; and the optimizers whose
state the memory model counts."""
from __future__ import annotations

from typing import Any

from autopar.errors import ArgumentError, PinError

KNOWN_PINS = frozenset({"data", "tensor", "zero", "pipeline", "micro_batch_size", "schedule",
                        "virtual_stages", "recompute", "precision", "grad_reduce", "accumulate",
                        "compress", "local_sgd", "local_sgd_warmup", "branch", "offload"})
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
        raise PinError(f"zero={zero!r}: ZeRO stages over the data-parallel axis are 0 (none), "
                       "1 (optimizer state sharded), 2 (gradients too) and 3 (parameters too, "
                       "gathered per use and again in backward)")
    for name in ("data", "tensor"):
        v = pins.get(name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise PinError(f"pin {name}={v!r} must be a positive integer")
    _check_offload(pins)
    _check_lossy(pins)
    _check_branch(pins)
    return pins


OFFLOAD_DEFAULT_ZERO = 2
"""``offload="optimizer"`` without a ``zero=`` pin implies ZeRO stage 2, the pairing
DeepSpeed's ZeRO-Offload uses (Ren et al. 2021)."""


def _check_offload(pins: dict) -> None:
    """offload="optimizer" (ZeRO-Offload, ``autopar.runtime.offload``): each rank's optimizer
    shard, its fp32 master copy and the step on the host. Implies zero=2 when zero= is not
    pinned (sets it in ``pins``); zero=0 pinned is an error."""
    v = pins.get("offload")
    if v in (None, "none"):
        pins.pop("offload", None)
        return
    if v != "optimizer":
        raise PinError(f"offload={v!r}: use 'optimizer' (ZeRO-Offload: optimizer state, fp32 "
                       "master weights and the optimizer step on the host) or None")
    if pins.get("zero") == 0:
        raise PinError("offload='optimizer' moves each rank's ZeRO optimizer shard to the host; "
                       "zero=0 keeps no shard: pin zero=1, 2 or 3, or leave zero= out "
                       f"(offload implies zero={OFFLOAD_DEFAULT_ZERO}, as DeepSpeed's ZeRO-Offload)")
    for other, none in (("pipeline", 1), ("branch", 1), ("compress", "none"), ("local_sgd", None)):
        if pins.get(other) not in (None, none):
            raise PinError(f"offload='optimizer' with {other}={pins[other]!r} is not supported: "
                           "drop one of the two pins")
    if pins.get("zero") is None:
        pins["zero"] = OFFLOAD_DEFAULT_ZERO


def _check_branch(pins: dict) -> None:
    """branch=N: independent branches on N groups of ranks (``autopar.solver.branches``)."""
    n = pins.get("branch")
    if n is None:
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise PinError(f"pin branch={n!r} must be a positive integer (the number of device groups "
                       "the independent branches are spread over)")
    if n > 1:
        for other, none in (("pipeline", 1), ("zero", 0), ("accumulate", 1), ("micro_batch_size", None)):
            if pins.get(other) not in (None, none):
                raise PinError(f"branch={n} with {other}={pins[other]!r} is not supported yet: drop "
                               "one of the two pins")


COMPRESS_HELP = ("'powersgd:R' (rank R, e.g. 'powersgd:4'), 'topk:F' (fraction 0 < F <= 1, e.g. "
                 "'topk:0.01'), 'bf16', 'int8', 'none', or 'auto' (the solver may choose one)")


def compress_scheme(value) -> tuple[str, float] | None:
    """The data-parallel gradient compression a ``compress=`` pin asks for: ``(kind,
    parameter)`` with kind "powersgd" (parameter: the rank), "topk" (the fraction), "bf16"
    or "int8" (parameter 0); None for no compression (None, "none") and for "auto" (the
    solver's choice: ``autopar.solver.compress``). PinError on anything else."""
    if value is None or value in ("none", "auto"):
        return None
    kind, _, arg = value.partition(":") if isinstance(value, str) else ("", "", "")
    try:
        if kind in ("bf16", "int8") and not arg:
            return kind, 0
        if kind == "powersgd" and int(arg) >= 1 and str(int(arg)) == arg:
            return kind, int(arg)
        if kind == "topk" and 0 < float(arg) <= 1:
            return kind, float(arg)
    except ValueError:
        pass
    raise PinError(f"compress={value!r}: use {COMPRESS_HELP}")


def _check_lossy(pins: dict) -> None:
    """compress= and local_sgd= (lossy data parallelism, ``autopar.runtime.compression``)."""
    compress = pins.get("compress")
    compress_scheme(compress)
    h, warm = pins.get("local_sgd"), pins.get("local_sgd_warmup")
    if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h < 1):
        raise PinError(f"local_sgd={h!r}: give the period H (a positive integer) of parameter "
                       "averaging, e.g. local_sgd=8")
    if warm is not None and (h is None or not isinstance(warm, int) or isinstance(warm, bool)
                             or warm < 0):
        raise PinError(f"local_sgd_warmup={warm!r}: the steps of gradient all-reduce before local "
                       "SGD begins, a non-negative integer, with local_sgd= pinned too")
    lossy = [f"{n}={pins[n]!r}" for n in ("compress", "local_sgd")
             if pins.get(n) not in (None, "none")]
    if len(lossy) == 2:
        raise PinError(f"{lossy[0]} and {lossy[1]}: local SGD has no per-step gradient reduction "
                       "to compress; pin one of them")
    if not lossy:
        return
    if (pins.get("zero") or 0) > 0:
        raise PinError(f"{lossy[0]} works on the replicated data-parallel gradient all-reduce; "
                       "ZeRO shards it: drop zero= or the lossy pin")
    if pipelined(pins):
        raise PinError(f"{lossy[0]} is not supported with a pipeline yet: drop pipeline= or "
                       "the lossy pin")
    if pins.get("grad_reduce") == "bf16" and pins.get("compress") not in (None, "none"):
        raise PinError(f"{lossy[0]} and grad_reduce='bf16' both choose how gradients are "
                       "reduced: pin one of them (compress='bf16' is the bf16 reduction)")


def check_optimizer(optimizer: str) -> int:
    """Optimizer tensors per parameter of ``optimizer``; ValueError when unknown."""
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def pipelined(pins: dict) -> bool:
    """Whether the pins ask for a pipeline (``pipeline=1`` means none)."""
    return (pins.get("pipeline") or 1) > 1
