"""What a user may fix about a plan, typed: the keyword arguments of ``autopar.plan`` /
``autopar.parallelize`` (and ``--pin NAME=VALUE`` of the CLI), each fixing one choice and
leaving the rest to the solver.

:class:`Options` is the one place that says what each option is, which values it takes,
which combinations are refused (with the words of ``autopar.errors``' catalogue) and what
one implies (``offload`` implies ``zero=2``). It is built once, from the user's keywords
(:meth:`Options.from_pins`), never mutates them, and travels as it is: the solver reads
it, the plan stores the options it runs with (``Plan.options``: the user's, plus what the
search chose, such as the ZeRO stage), and the runtime reads only that.

An option left out is ``None``: the solver chooses. ``Options`` also reads as a mapping of
the options that are set (``opts.get("zero")``, ``dict(opts)``), the form plans and code
written before it used.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Iterator, Literal, Union

from autopar.errors import ArgumentError, PinError
from autopar.schedule import SCHEDULES, ScheduleKind

Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Union[bool, Literal["full", "none"], tuple[str, ...]]

OFFLOAD_DEFAULT_ZERO = 2
"""``offload="optimizer"`` without a ``zero=`` pin implies ZeRO stage 2, the pairing
DeepSpeed's ZeRO-Offload uses (Ren et al. 2021)."""

COMPRESS_HELP = ("'powersgd:R' (rank R, e.g. 'powersgd:4'), 'topk:F' (fraction 0 < F <= 1, e.g. "
                 "'topk:0.01'), 'bf16', 'int8', 'none', or 'auto' (the solver may choose one)")


@dataclass(frozen=True, eq=False)
class Options(Mapping):
    data: int | None = None
    """Degree of the data-parallel mesh axis: the batch is split on it, weights read whole,
    gradients summed in buckets as backward produces them (DDP's overlap)."""
    tensor: int | None = None
    """Degree of the tensor-parallel mesh axis: weight matrices split on it."""
    expert: int | None = None
    """Degree of the expert-parallel mesh axis: each mixture-of-experts layer's experts are
    split over it, and the batch is split over it for every other op (its ranks are data
    parallel there, as torchtitan's dp2ep); tokens reach their experts by all-to-all or by
    all-gather, as the solver prices them (``autopar.sharding.rules.experts``)."""
    expert_dispatch: Literal["all-to-all", "all-gather", "tensor"] | None = None
    """How a mixture-of-experts layer is split where its experts are: ``"all-to-all"`` (each
    token-expert pair sent to its expert's rank and back), ``"all-gather"`` (every rank sees
    every token, computes its own experts, and the terms are summed), or ``"tensor"`` (every
    expert's MLP split instead, Megatron's expert tensor parallelism); unset, the solver
    prices them all."""
    expert_imbalance: float | None = None
    """The busiest expert-parallel rank's share of token-expert pairs over the mean, which
    the cost model multiplies its expert work and dispatch by (default 1.0: uniform)."""
    zero: Literal[0, 1, 2, 3] | None = None
    """ZeRO stage over the data axis: 0 none, 1 optimizer state sharded, 2 gradients too,
    3 parameters too (gathered per use and again in backward)."""
    pipeline: int | None = None
    """Pipeline stages (a leading mesh axis ``"pipeline"``); 1 means none."""
    micro_batch_size: int | None = None
    """Rows of a micro-batch: of a pipeline's, or, without a pipeline, of gradient
    accumulation's (as ``accumulate=`` batch / micro_batch_size)."""
    schedule: ScheduleKind | None = None
    """The pipeline schedule (``torch.distributed.pipelining``); needs ``pipeline`` > 1."""
    virtual_stages: int | None = None
    """Stages per pipeline rank (interleaved 1F1B); needs ``pipeline`` > 1."""
    recompute: Recompute | None = None
    """Activation recomputation: ``"full"`` (every repeated layer), ``"none"``, or layer
    names (``("h.0", "h.1")``, a unique suffix is enough)."""
    precision: Precision | None = None
    """Mixed precision: costs, memory and ``torch.autocast`` in 16 bits, fp32 master
    weights; fp16 adds dynamic loss scaling."""
    grad_reduce: Literal["fp32", "bf16"] | None = None
    """The dtype data-parallel gradients are summed in (all-reduce, ZeRO's reduce-scatter):
    fp32 by default; bf16 halves those bytes (needs ``precision``)."""
    accumulate: int | None = None
    """Gradient accumulation without a pipeline: micro-batches per step."""
    compress: str | None = None
    """Lossy data-parallel gradient reduction: see COMPRESS_HELP; ``"auto"`` lets the
    solver choose one (``autopar.solver.compress``)."""
    local_sgd: int | None = None
    """Local SGD: average parameters over the data axis every H steps instead of reducing
    gradients each step (after ``local_sgd_warmup`` exact steps)."""
    local_sgd_warmup: int | None = None
    """Steps of exact gradient all-reduce before Local SGD begins (default 100)."""
    branch: int | None = None
    """Branch parallelism: independent branches spread over this many groups of ranks."""
    offload: Literal["optimizer"] | None = None
    """ZeRO-Offload: each rank's optimizer shard, fp32 master copy and step on the host."""
    compile: bool | None = None
    """Run each rank's programs through ``torch.compile`` (Inductor), forward and backward,
    collectives included as torch's functional collectives (``autopar.runtime.compiled``);
    the cost model then prices memory-bound ops as fused into their neighbours."""

    # ---- building -----------------------------------------------------------------------
    @classmethod
    def from_pins(cls, pins: "Mapping[str, Any] | Options | None" = None, **more) -> "Options":
        """The options of keyword arguments ``pins`` (and ``more``), checked, with their
        implications applied; ``pins`` is not changed. An unknown name is an
        ``ArgumentError``, a value or combination the solver cannot honour a ``PinError``."""
        given = {**dict(pins or {}), **more}
        unknown = set(given) - set(NAMES)
        if unknown:
            raise ArgumentError(f"unknown pin(s) {sorted(unknown)}; pins are {sorted(NAMES)}")
        given = {k: v for k, v in given.items() if v is not None}
        _check_values(given)
        _check_combinations(given)
        if given.get("offload") == "none":
            del given["offload"]
        if given.get("compile") is False:      # eager is the default: one form for both
            del given["compile"]
        if given.get("offload") == "optimizer" and given.get("zero") is None:
            given["zero"] = OFFLOAD_DEFAULT_ZERO
        if given.get("compress") not in (None, "none") or given.get("local_sgd") \
                or given.get("offload"):
            given.setdefault("pipeline", 1)     # not offered with pipelines (yet)
        if isinstance(given.get("recompute"), list):
            given["recompute"] = tuple(given["recompute"])
        return cls(**given)

    def replace(self, **changes) -> "Options":
        """These options with ``changes`` (None unsets one), checked again."""
        return Options.from_pins({**self.pinned(), **changes})

    def pinned(self) -> dict[str, Any]:
        """The options that are set, by name (the JSON form; tuples as lists)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    # ---- what they mean -----------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """Whether a pipeline is asked for (``pipeline=1`` means none)."""
        return (self.pipeline or 1) > 1

    @property
    def zero_stage(self) -> int:
        return self.zero or 0

    @property
    def compression(self) -> tuple[str, float] | None:
        """The gradient compression asked for: ``(kind, parameter)``, or None (none, or
        ``"auto"``: the solver's choice)."""
        return compress_scheme(self.compress)

    # ---- read as the mapping of the options that are set ---------------------------------
    def __getitem__(self, name: str) -> Any:
        if name not in NAMES or getattr(self, name) is None:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return (n for n in NAMES if getattr(self, n) is not None)

    def __len__(self) -> int:
        return sum(getattr(self, n) is not None for n in NAMES)

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in self.items()) + ")"

    def __eq__(self, other) -> bool:
        """Equal to Options, or to a mapping, with the same options set to the same values."""
        if not isinstance(other, Mapping):
            return NotImplemented
        theirs = other.pinned() if isinstance(other, Options) else {
            k: list(v) if isinstance(v, tuple) else v for k, v in other.items() if v is not None}
        return self.pinned() == theirs

    def __hash__(self) -> int:
        return hash(tuple(self.items()))


NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options))
KNOWN_PINS = frozenset(NAMES)


def compress_scheme(value) -> tuple[str, float] | None:
    """The data-parallel gradient compression a ``compress=`` value asks for: ``(kind,
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


# ---- validation: each value on its own first, then the combinations ----------------------

def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_values(p: dict) -> None:
    if p.get("schedule") is not None and p["schedule"] not in SCHEDULES:
        raise PinError(f"unknown schedule {p['schedule']!r}; choose one of {', '.join(SCHEDULES)}")
    pipe = p.get("pipeline")
    if pipe is not None and not _positive_int(pipe):
        raise PinError(f"pin pipeline={pipe!r} must be a positive integer")
    for name in ("data", "tensor", "expert", "accumulate", "micro_batch_size"):
        if name in p and not _positive_int(p[name]):
            raise PinError(f"pin {name}={p[name]!r} must be a positive integer")
    rec = p.get("recompute")
    if not (rec is None or isinstance(rec, bool) or rec in ("full", "none")
            or (isinstance(rec, (list, tuple)) and all(isinstance(r, str) for r in rec))):
        raise PinError(f"recompute={rec!r}: use 'full' (every repeated layer), None, or a "
                       "list of layer names such as ['h.0', 'h.1']")
    if p.get("precision") not in (None, "fp32", "bf16", "fp16"):
        raise PinError(f"precision={p['precision']!r}: use 'fp32', 'bf16' or 'fp16'")
    if p.get("grad_reduce") not in (None, "fp32", "bf16"):
        raise PinError(f"grad_reduce={p['grad_reduce']!r}: use 'fp32' (the default) or 'bf16'")
    if p.get("zero", 0) not in (0, 1, 2, 3):
        raise PinError(f"zero={p['zero']!r}: ZeRO stages over the data-parallel axis are 0 (none), "
                       "1 (optimizer state sharded), 2 (gradients too) and 3 (parameters too, "
                       "gathered per use and again in backward)")
    if p.get("offload") not in (None, "none", "optimizer"):
        raise PinError(f"offload={p['offload']!r}: use 'optimizer' (ZeRO-Offload: optimizer state, "
                       "fp32 master weights and the optimizer step on the host) or None")
    n = p.get("branch")
    if n is not None and not _positive_int(n):
        raise PinError(f"pin branch={n!r} must be a positive integer (the number of device groups "
                       "the independent branches are spread over)")
    if p.get("expert_dispatch") not in (None, "all-to-all", "all-gather", "tensor"):
        raise PinError(f"expert_dispatch={p['expert_dispatch']!r}: use 'all-to-all', 'all-gather' "
                       "or 'tensor'")
    imb = p.get("expert_imbalance")
    if imb is not None and (isinstance(imb, bool) or not isinstance(imb, (int, float)) or imb < 1):
        raise PinError(f"expert_imbalance={imb!r}: the busiest rank's load over the mean, a "
                       "number >= 1 (1.0 is uniform routing)")
    if p.get("compile") not in (None, True, False):
        raise PinError(f"compile={p['compile']!r}: use True (torch.compile each rank's programs) "
                       "or False (eager, the default)")
    compress_scheme(p.get("compress"))
    h, warm = p.get("local_sgd"), p.get("local_sgd_warmup")
    if h is not None and not _positive_int(h):
        raise PinError(f"local_sgd={h!r}: give the period H (a positive integer) of parameter "
                       "averaging, e.g. local_sgd=8")
    if warm is not None and (h is None or not isinstance(warm, int) or isinstance(warm, bool)
                             or warm < 0):
        raise PinError(f"local_sgd_warmup={warm!r}: the steps of gradient all-reduce before local "
                       "SGD begins, a non-negative integer, with local_sgd= pinned too")


def _check_combinations(p: dict) -> None:
    pipe = p.get("pipeline") or 1
    for name in ("schedule", "virtual_stages"):
        if p.get(name) is not None and pipe == 1:
            raise PinError(f"the pin {name}= needs pipeline parallelism: pin pipeline= > 1 too")
    if p.get("accumulate") is not None and pipe > 1:
        raise PinError("accumulate= is gradient accumulation without a pipeline; a pipeline "
                       "runs its own micro-batches: pin micro_batch_size= with pipeline= instead")
    if p.get("grad_reduce") == "bf16" and p.get("precision") not in ("bf16", "fp16"):
        raise PinError("grad_reduce='bf16' needs mixed precision: pin precision='bf16' too")
    if p.get("offload") == "optimizer":
        if p.get("zero") == 0:
            raise PinError("offload='optimizer' moves each rank's ZeRO optimizer shard to the host; "
                           "zero=0 keeps no shard: pin zero=1, 2 or 3, or leave zero= out "
                           f"(offload implies zero={OFFLOAD_DEFAULT_ZERO}, as DeepSpeed's ZeRO-Offload)")
        for other, none in (("pipeline", 1), ("branch", 1), ("compress", "none"), ("local_sgd", None)):
            if p.get(other) not in (None, none):
                raise PinError(f"offload='optimizer' with {other}={p[other]!r} is not supported: "
                               "drop one of the two pins")
    lossy = [f"{n}={p[n]!r}" for n in ("compress", "local_sgd") if p.get(n) not in (None, "none")]
    if len(lossy) == 2:
        raise PinError(f"{lossy[0]} and {lossy[1]}: local SGD has no per-step gradient reduction "
                       "to compress; pin one of them")
    if lossy:
        if (p.get("zero") or 0) > 0:
            raise PinError(f"{lossy[0]} works on the replicated data-parallel gradient all-reduce; "
                           "ZeRO shards it: drop zero= or the lossy pin")
        if pipe > 1:
            raise PinError(f"{lossy[0]} is not supported with a pipeline yet: drop pipeline= or "
                           "the lossy pin")
        if p.get("grad_reduce") == "bf16" and p.get("compress") not in (None, "none"):
            raise PinError(f"{lossy[0]} and grad_reduce='bf16' both choose how gradients are "
                           "reduced: pin one of them (compress='bf16' is the bf16 reduction)")
    if (p.get("expert") or 1) > 1 and p.get("expert_dispatch") == "tensor":
        raise PinError(f"expert={p['expert']} splits the experts over an axis; "
                       "expert_dispatch='tensor' splits each expert instead (with tensor=): pin "
                       "expert_dispatch='all-to-all' or 'all-gather' with expert=, or drop expert=")
    if (p.get("expert") or 1) > 1:
        for other, none in (("zero", 0), ("branch", 1), ("compress", "none"), ("local_sgd", None),
                            ("offload", None)):
            if p.get(other) not in (None, none):
                raise PinError(f"expert={p['expert']} with {other}={p[other]!r} is not supported "
                               "yet: drop one of the two pins")
    n = p.get("branch")
    if n is not None and n > 1:
        for other, none in (("pipeline", 1), ("zero", 0), ("accumulate", 1), ("micro_batch_size", None)):
            if p.get(other) not in (None, none):
                raise PinError(f"branch={n} with {other}={p[other]!r} is not supported yet: drop "
                               "one of the two pins")


OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer tensors kept per parameter, by the ``optimizer=`` argument's names."""


def check_optimizer(optimizer: str) -> int:
    """Optimizer tensors per parameter of ``optimizer``; ArgumentError when unknown."""
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def as_options(pins: "Options | Mapping[str, Any] | None") -> Options:
    """``pins`` as Options (checked once: Options pass through as they are)."""
    return pins if isinstance(pins, Options) else Options.from_pins(pins)


__all__ = ["COMPRESS_HELP", "KNOWN_PINS", "NAMES", "OFFLOAD_DEFAULT_ZERO", "OPTIMIZER_STATES",
           "Options", "as_options", "check_optimizer", "compress_scheme"]
