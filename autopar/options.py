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

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Iterator, Literal, Union

from autopar.errors import ArgumentError, PinError
from autopar.mesh_roles import AXIS_NAMES, STAGE_AXES
from autopar.schedule import SCHEDULES, ScheduleKind

Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Union[bool, Literal["full", "none"], tuple[str, ...]]

OFFLOAD_DEFAULT_ZERO = 2
"""``offload="optimizer"`` without a ``zero=`` pin implies ZeRO stage 2, the pairing
DeepSpeed's ZeRO-Offload uses (Ren et al. 2021)."""

COMPRESS_HELP = ("'powersgd:R' (rank R, e.g. 'powersgd:4'), 'topk:F' (fraction 0 < F <= 1, e.g. "
                 "'topk:0.01'), 'nuq:S' (NUQSGD, S = 1..127 exponentially spaced levels, e.g. "
                 "'nuq:4'), 'accordion:powersgd:R1:R2' (rank R1 < R2, R2 in critical regimes, e.g. "
                 "'accordion:powersgd:1:4') or 'accordion:topk:F1:F2' (F1 < F2, e.g. "
                 "'accordion:topk:0.01:0.1'), 'bf16', 'int8', 'none', or 'auto' (the solver may "
                 "choose one)")
NUQ_MAX_LEVELS = 127
"""``nuq:S``: a coordinate's code (sign and level index, ``2S + 1`` values) fits one byte."""
AVERAGING = ("decentralized", "async")
WORKERS_LR = ("linear", "constant")
MESH_AXIS_PINS = AXIS_NAMES
"""Every option that is the degree of a mesh axis, under the axis's name (``Plan.mesh_axes``
uses the same names): ``autopar.mesh_roles.AXIS_NAMES``. A new axis is a field of
``MeshRoles`` (and an option here), so that what reads every mesh pin (``autopar.elastic``'s
re-plan for a new world size) sees it."""
WORKERS_HELP = ("'accordion:W1:W2': W1 data-parallel workers train in critical regimes, W2 (W1 <= "
                "W2 <= the data degree) otherwise, e.g. workers='accordion:2:8'")


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
    context: int | None = None
    """Degree of the context-parallel mesh axis: the sequence (dim 1 of every input that has
    one) is split over it through the whole model, attention included: each rank's queries
    attend to every rank's keys and values, passed around a ring or all-gathered
    (``context_attention``; ``autopar.ops.context_attention``). Weights are read whole on it
    and their gradients summed over it, as on the data axis."""
    context_attention: Literal["ring", "all-gather"] | None = None
    """How attention crosses the context axis: ``"ring"`` (each K/V block sent on to the next
    rank while the current one is computed) or ``"all-gather"`` (K/V gathered whole, as Llama 3
    trained); unset, the planner takes the one it predicts faster."""
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
    stage_split: Literal["balanced", "even-layers"] | None = None
    """Where a pipeline's stages are cut: ``"balanced"`` (the default) by the stage DP, the
    cuts of least predicted step; ``"even-layers"`` as Megatron-LM and torchtitan split
    (``num_layers / p`` transformer layers a stage, embedding with the first, output layer
    and loss with the last): each stage (each virtual stage under interleaving) holds the
    same number of repeated layers, what precedes the first on the first stage and what
    follows the last on the last (``autopar.solver.even_split``); needs ``pipeline`` > 1."""
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
    averaging: Literal["decentralized", "async"] | None = None
    """BAGUA's model averaging (Gan et al. 2021; ``autopar.runtime.averaging``), instead of
    the gradient all-reduce over the data axis: ``"decentralized"`` (each rank steps on its
    own gradient, then averages its parameters with its two ring neighbours, D-PSGD) or
    ``"async"`` (the parameters' average over the data axis is all-reduced in the background
    while training goes on and folded in ``averaging_period`` steps later)."""
    averaging_period: int | None = None
    """Steps between averagings under ``averaging=`` (default 1)."""
    staleness: int | None = None
    """Stale-synchronous data parallelism (``autopar.runtime.stale``): the gradient of step
    t - s is applied at step t (s >= 1), so each step's reduction runs behind the next s
    steps; the first s steps apply none (``pm.step(opt)`` skips them). With
    ``param_server=`` the servers apply the pushed gradients that late."""
    param_server: int | None = None
    """Parameter servers (Li et al. 2014; ``autopar.runtime.param_server``): this many ranks
    of the data axis each own a shard of the parameters and their optimizer state; workers
    push gradients to the owners (point-to-point), the owners step, workers pull the
    parameters back. Exact without ``staleness=``."""
    hogwild: int | None = None
    """Hogwild (Recht et al. 2011; ``autopar.hogwild``): this many processes of one host
    update one copy of the parameters in shared memory without locks. CPU only, and only
    through ``autopar.hogwild(...)`` (not torchrun ranks)."""
    learners: int | None = None
    """Crossbow (Koliousis et al. 2019; ``autopar.runtime.crossbow``): this many learners (model
    replicas) per rank, each training on its own batch (``train_step`` takes that many
    batches stacked), pulled toward a central average model by synchronous model averaging
    (SMA, with momentum) every step."""
    workers: str | None = None
    """Accordion's batch-size form (Agarwal et al. 2021; ``autopar.runtime.workers``) as the
    number of data-parallel workers that train: ``"accordion:W1:W2"``. Every 10 steps the
    norm of the whole model's gradient, accumulated since the last check, is compared with
    the last check's; a relative change of 0.5 or more (and the start) is a critical regime,
    where data ranks ``0 .. W1-1`` train, else ``0 .. W2-1``. The other data ranks skip
    forward and backward (their batch is not used), contribute a zero gradient, and the
    gradient is averaged over the ranks that trained. Relaxed: it changes the optimisation;
    never chosen by the solver."""
    workers_lr: Literal["linear", "constant"] | None = None
    """Under ``workers=``: ``"linear"`` (the default, Accordion's linear scaling rule) steps
    with the learning rate times (workers training) / W2 in ``pm.step(opt)``; ``"constant"``
    keeps the optimizer's learning rate."""
    branch: int | None = None
    """Branch parallelism: independent branches spread over this many groups of ranks."""
    offload: Literal["optimizer", "disk"] | None = None
    """ZeRO-Offload: each rank's optimizer shard, fp32 master copy and step on the host;
    ``"disk"`` (ZeRO-Infinity's disk tier): the shard lives in files on local disk between
    steps and is streamed through host memory a bucket at a time
    (``autopar.runtime.disk_offload``)."""
    offload_dir: str | None = None
    """Under ``offload="disk"``: the local directory the optimizer state's files go in (each
    rank makes its own directory inside it, removed when the module is); default a temporary
    directory under ``tempfile.gettempdir()`` (``$TMPDIR``)."""
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
        if given.get("stage_split") == "balanced":     # the default: one form for both
            del given["stage_split"]
        if given.get("offload_dir") is not None:      # a path as the plan file stores it
            given["offload_dir"] = os.fspath(given["offload_dir"])
        if given.get("offload") in ("optimizer", "disk") and given.get("zero") is None:
            given["zero"] = OFFLOAD_DEFAULT_ZERO
        if given.get("compress") not in (None, "none") or given.get("local_sgd") \
                or given.get("offload") or any(given.get(n) for n in ASYNC_PINS) \
                or given.get("averaging") or given.get("workers"):
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

    @property
    def worker_counts(self) -> tuple[int, int] | None:
        """``workers=``'s ``(W1, W2)``: the data-parallel workers that train in critical
        regimes and otherwise; None when unset."""
        return workers_schedule(self.workers)

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
STAGE_SPLITS = ("balanced", "even-layers")
"""Values of the ``stage_split=`` pin."""
KNOWN_PINS = frozenset(NAMES)


def compress_scheme(value) -> tuple[str, Any] | None:
    """The data-parallel gradient compression a ``compress=`` value asks for: ``(kind,
    parameter)`` with kind "powersgd" (parameter: the rank), "topk" (the fraction), "nuq"
    (the levels), "accordion" (parameter ``(kind, A, B)``: powersgd ranks or topk fractions,
    A < B, B the less compressed, used in critical regimes), "bf16" or "int8" (parameter
    0); None for no compression (None, "none") and for "auto" (the
    solver's choice: ``autopar.solver.compress``). PinError on anything else."""
    if value is None or value in ("none", "auto"):
        return None
    kind, _, arg = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind == "accordion":
        return kind, _accordion(value, arg)
    try:
        if kind in ("bf16", "int8") and not arg:
            return kind, 0
        if kind == "powersgd" and int(arg) >= 1 and str(int(arg)) == arg:
            return kind, int(arg)
        if kind == "topk" and 0 < float(arg) <= 1:
            return kind, float(arg)
        if kind == "nuq" and str(int(arg)) == arg and 1 <= int(arg) <= NUQ_MAX_LEVELS:
            return kind, int(arg)
    except ValueError:
        pass
    raise PinError(f"compress={value!r}: use {COMPRESS_HELP}")


def workers_schedule(value) -> tuple[int, int] | None:
    """``(W1, W2)`` of a ``workers=`` value ``"accordion:W1:W2"`` (1 <= W1 <= W2); None for
    None. PinError naming the form otherwise."""
    if value is None:
        return None
    parts = value.split(":") if isinstance(value, str) else []
    if len(parts) == 3 and parts[0] == "accordion" and all(x.isdigit() for x in parts[1:]):
        lo, hi = int(parts[1]), int(parts[2])
        if 1 <= lo <= hi:
            return lo, hi
        if lo > hi >= 1:
            raise PinError(f"workers={value!r}: W1 (critical regimes) is the smaller count: give "
                           f"them in increasing order, workers='accordion:{hi}:{lo}'")
    raise PinError(f"workers={value!r}: use {WORKERS_HELP}")


def _accordion(value: str, arg: str) -> tuple[str, Any, Any]:
    """``accordion:KIND:A:B``'s ``(KIND, A, B)``; PinError naming the fix."""
    inner, a, b = (arg.split(":") + ["", "", ""])[:3] if arg.count(":") == 2 else ("", "", "")
    if inner not in ("powersgd", "topk"):
        raise PinError(f"compress={value!r}: Accordion switches between two settings of one "
                       "scheme: use 'accordion:powersgd:R1:R2' (ranks) or 'accordion:topk:F1:F2' "
                       "(fractions), e.g. 'accordion:powersgd:1:4'")
    try:
        lo, hi = (compress_scheme(f"{inner}:{x}")[1] for x in (a, b))    # each checked alone
    except PinError:
        raise PinError(f"compress={value!r}: " + ("each rank R a positive integer, e.g. "
                       "'accordion:powersgd:1:4'" if inner == "powersgd" else "each fraction F "
                       "0 < F <= 1, e.g. 'accordion:topk:0.01:0.1'")) from None
    if not lo < hi:
        raise PinError(f"compress={value!r}: the first {inner} setting is the more compressed one "
                       "(used outside critical regimes), the second the less compressed: give "
                       f"them in increasing order, e.g. 'accordion:{inner}:{min(lo, hi)}:{max(lo, hi)}'"
                       if lo != hi else f"compress={value!r}: Accordion needs two different "
                       f"settings; for a fixed one pin compress='{inner}:{lo}'")
    return inner, lo, hi


# ---- validation: each value on its own first, then the combinations ----------------------

def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_values(p: dict) -> None:
    if p.get("schedule") is not None and p["schedule"] not in SCHEDULES:
        raise PinError(f"unknown schedule {p['schedule']!r}; choose one of {', '.join(SCHEDULES)}")
    pipe = p.get("pipeline")
    if pipe is not None and not _positive_int(pipe):
        raise PinError(f"pin pipeline={pipe!r} must be a positive integer")
    for name in (*STAGE_AXES, "accumulate", "micro_batch_size"):
        if name in p and not _positive_int(p[name]):
            raise PinError(f"pin {name}={p[name]!r} must be a positive integer")
    if p.get("stage_split") is not None and p["stage_split"] not in STAGE_SPLITS:
        raise PinError(f"stage_split={p['stage_split']!r}: use 'balanced' (the stage DP's "
                       "cuts, the default) or 'even-layers' (the same number of repeated "
                       "layers on every stage, as Megatron-LM and torchtitan)")
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
    if p.get("offload") not in (None, "none", "optimizer", "disk"):
        raise PinError(f"offload={p['offload']!r}: use 'optimizer' (ZeRO-Offload: optimizer state, "
                       "fp32 master weights and the optimizer step on the host), 'disk' (the same "
                       "state in files on local disk between steps, ZeRO-Infinity) or None")
    d = p.get("offload_dir")
    if d is not None and (not isinstance(d, (str, os.PathLike)) or not os.fspath(d)):
        raise PinError(f"offload_dir={d!r}: give the path of a local directory (a str) for "
                       "the files of offload='disk', or leave it out (a temporary directory)")
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
    if p.get("context_attention") not in (None, "ring", "all-gather"):
        raise PinError(f"context_attention={p['context_attention']!r}: use 'ring' or 'all-gather'")
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
    _check_async_values(p)
    _check_workers_values(p)
    if p.get("averaging") not in (None, *AVERAGING):
        raise PinError(f"averaging={p['averaging']!r}: use 'decentralized' (each rank averages its "
                       "parameters with its ring neighbours) or 'async' (parameters averaged in the "
                       "background while training goes on)")
    period = p.get("averaging_period")
    if period is not None and (not _positive_int(period) or p.get("averaging") is None):
        raise PinError(f"averaging_period={period!r}: the steps between model averagings, a "
                       "positive integer, with averaging='decentralized' or 'async' pinned too")


def _check_combinations(p: dict) -> None:
    pipe = p.get("pipeline") or 1
    for name in ("schedule", "virtual_stages", "stage_split"):
        if p.get(name) not in (None, "balanced") and pipe == 1:
            raise PinError(f"the pin {name}= needs pipeline parallelism: pin pipeline= > 1 too")
    if p.get("accumulate") is not None and pipe > 1:
        raise PinError("accumulate= is gradient accumulation without a pipeline; a pipeline "
                       "runs its own micro-batches: pin micro_batch_size= with pipeline= instead")
    if p.get("grad_reduce") == "bf16" and p.get("precision") not in ("bf16", "fp16"):
        raise PinError("grad_reduce='bf16' needs mixed precision: pin precision='bf16' too")
    if p.get("offload_dir") is not None and p.get("offload") != "disk":
        raise PinError(f"offload_dir={p['offload_dir']!r} is where offload='disk' keeps the "
                       f"optimizer state; offload={p.get('offload')!r} writes no files: pin "
                       "offload='disk' too, or drop offload_dir=")
    if p.get("offload") in ("optimizer", "disk"):
        off = f"offload={p['offload']!r}"
        if p.get("zero") == 0:
            raise PinError(f"{off} moves each rank's ZeRO optimizer shard off the device; "
                           "zero=0 keeps no shard: pin zero=1, 2 or 3, or leave zero= out "
                           f"(offload implies zero={OFFLOAD_DEFAULT_ZERO}, as DeepSpeed's ZeRO-Offload)")
        for other, none in (("pipeline", 1), ("branch", 1), ("compress", "none"), ("local_sgd", None)):
            if p.get(other) not in (None, none):
                raise PinError(f"{off} with {other}={p[other]!r} is not supported: "
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
    _check_async_combinations(p)
    _check_averaging_combinations(p)
    _check_workers_combinations(p)
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
    if (p.get("context") or 1) > 1:
        for other, none in (("expert", 1), ("branch", 1), ("compile", False)):
            if p.get(other) not in (None, none):
                raise PinError(f"context={p['context']} with {other}={p[other]!r} is not supported "
                               "yet: drop one of the two pins")
    n = p.get("branch")
    if n is not None and n > 1:
        for other, none in (("pipeline", 1), ("zero", 0), ("accumulate", 1), ("micro_batch_size", None)):
            if p.get(other) not in (None, none):
                raise PinError(f"branch={n} with {other}={p[other]!r} is not supported yet: drop "
                               "one of the two pins")


ASYNC_PINS = ("staleness", "param_server", "hogwild", "learners")
"""The relaxed (or, for ``param_server`` alone, exact) update schemes of issue 31 that change
how a step's update reaches the parameters; never chosen by the solver, only pinned."""

_ASYNC_HELP = {
    "staleness": "the delay s >= 1 in steps of each gradient (1: a step's reduction overlaps "
                 "the whole next step), e.g. staleness=1; drop it for synchronous updates",
    "param_server": "the number of server ranks (>= 1, at most the data-parallel degree) that "
                    "own the parameter shards, e.g. param_server=1",
    "hogwild": "the number of processes (>= 1) that share the parameters on this host, "
               "e.g. autopar.hogwild(model, ..., processes=4)",
    "learners": "the number of learners (model replicas, >= 1) per rank, e.g. learners=2",
}


def _check_async_values(p: dict) -> None:
    for name in ASYNC_PINS:
        v = p.get(name)
        if v is not None and not _positive_int(v):
            raise PinError(f"{name}={v!r}: give {_ASYNC_HELP[name]}")


def _check_async_combinations(p: dict) -> None:
    """Refuse what the relaxed update schemes cannot combine with (autopar.runtime.stale,
    param_server, hogwild, crossbow)."""
    set_ = [n for n in ASYNC_PINS if p.get(n) is not None]
    if not set_:
        return
    if p.get("hogwild") is not None:
        others = sorted(n for n, v in p.items() if n != "hogwild" and v is not None
                        and not (n == "pipeline" and v == 1) and not (n == "offload" and v == "none")
                        and not (n == "compile" and v is False))
        if others:
            raise PinError(f"hogwild={p['hogwild']} runs the whole model in each process of one "
                           f"host on shared parameters; it takes no other pin ({', '.join(others)}): "
                           "drop them, or drop hogwild=")
        return
    if p.get("learners") is not None:
        for other in ("staleness", "param_server", "accumulate"):
            if p.get(other) is not None:
                raise PinError(f"learners={p['learners']} (Crossbow) with {other}={p[other]!r} is "
                               "not supported: each learner steps every step on its own share of "
                               "the batch; drop one of the two pins")
        for other in ("tensor", "context"):
            if (p.get(other) or 1) > 1:
                raise PinError(f"learners={p['learners']} (Crossbow) keeps whole model replicas "
                               f"per rank; {other}={p[other]} splits them: drop {other}= (or pin "
                               f"{other}=1)")
    first = f"{set_[0]}={p[set_[0]]!r}"
    for other, none in (("compress", "none"), ("local_sgd", None), ("averaging", None)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} and {other}={p[other]!r} both change how the data-parallel "
                           "update is made: pin one of them")
    for other, none in (("zero", 0), ("pipeline", 1), ("branch", 1), ("expert", 1), ("offload", None)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} with {other}={p[other]!r} is not supported: it works on the "
                           "replicated data-parallel update; drop one of the two pins")
    if p.get("precision") == "fp16":
        raise PinError(f"{first} with precision='fp16': a delayed or averaged update cannot follow "
                       "dynamic loss scaling's skipped steps; pin precision='bf16'")
    if p.get("grad_reduce") == "bf16":
        raise PinError(f"{first} reduces gradients (or parameters) in fp32: drop grad_reduce='bf16'")


def _check_averaging_combinations(p: dict) -> None:
    """Refuse what ``averaging=`` (``autopar.runtime.averaging``) cannot combine with: it
    replaces the data axis's gradient all-reduce with parameter averaging."""
    if p.get("averaging") is None:
        return
    first = f"averaging={p['averaging']!r}"
    for other, none in (("compress", "none"), ("local_sgd", None), *((n, None) for n in ASYNC_PINS)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} and {other}={p[other]!r} both change how the data-parallel "
                           "update is made: pin one of them")
    for other, none in (("zero", 0), ("pipeline", 1), ("branch", 1), ("expert", 1), ("offload", None)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} with {other}={p[other]!r} is not supported: it averages whole "
                           "replicated parameters over the data axis; drop one of the two pins")
    if p.get("precision") == "fp16":
        raise PinError(f"{first} with precision='fp16': ranks skipping different steps under dynamic "
                       "loss scaling would average unlike models; pin precision='bf16'")
    if p.get("grad_reduce") == "bf16":
        raise PinError(f"{first} reduces no gradient over the data axis: drop grad_reduce='bf16'")


def _check_workers_values(p: dict) -> None:
    workers_schedule(p.get("workers"))
    lr = p.get("workers_lr")
    if lr is not None and (lr not in WORKERS_LR or p.get("workers") is None):
        raise PinError(f"workers_lr={lr!r}: 'linear' (the default: the learning rate scaled by the "
                       "workers that train over W2) or 'constant', with workers='accordion:W1:W2' "
                       "pinned too")


def _check_workers_combinations(p: dict) -> None:
    """Refuse what ``workers=`` (``autopar.runtime.workers``) cannot combine with: idle data
    ranks skip forward and backward, so nothing in them may cross the data axis, and the
    data axis's reduction is its own."""
    counts = workers_schedule(p.get("workers"))
    if counts is None:
        return
    first = f"workers={p['workers']!r}"
    data = p.get("data")
    if data is not None and data < counts[1]:
        raise PinError(f"{first} trains W2={counts[1]} data-parallel workers outside critical regimes, "
                       f"more than data={data}: pin data= >= {counts[1]}, or a smaller W2")
    for other, none in (("compress", "none"), ("local_sgd", None), ("averaging", None),
                        *((n, None) for n in ASYNC_PINS)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} and {other}={p[other]!r} both change how the data-parallel "
                           "update is made: pin one of them")
    why = {"pipeline": "a pipeline's stages exchange activations across ranks",
           "zero": "ZeRO shards the data axis's reduction (zero=3 gathers weights over it in forward)",
           "offload": "offload runs on ZeRO's shards",
           "expert": "the expert axis splits the batch and exchanges tokens across it in forward",
           "branch": "branch groups exchange activations",
           "compile": "the compiled programs are not checked for it"}
    for other, none in (("pipeline", 1), ("zero", 0), ("offload", None), ("expert", 1),
                        ("branch", 1), ("compile", False)):
        if p.get(other) not in (None, none):
            raise PinError(f"{first} with {other}={p[other]!r} is not supported: idle data ranks "
                           f"skip forward and backward, and {why[other]}; drop one of the two pins")
    if p.get("grad_reduce") == "bf16":
        raise PinError(f"{first} reduces the data axis's gradient in the gradients' dtype: drop "
                       "grad_reduce='bf16'")


def refuse_workers_check(options: "Options") -> None:
    """The ArgumentError of ``check=`` (the first step against one device) under ``workers=``."""
    if options.workers is not None:
        raise ArgumentError(f"check= compares the first step's gradients with one device's on the "
                            f"whole batch; under workers={options.workers!r} the first step (a "
                            "critical regime) trains on W1 workers' batches only: pass check=False "
                            "(or unset AUTOPAR_CHECK)")


OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer tensors kept per parameter, by the ``optimizer=`` argument's names."""


def check_optimizer(optimizer: str) -> int:
    """Optimizer tensors per parameter of ``optimizer``; ArgumentError when unknown."""
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def refuse_hogwild_plan(options: Options) -> None:
    """The ArgumentError of ``hogwild=`` given to a planner (``autopar.plan``,
    ``autopar.parallelize``, ``autopar plan --pin``): Hogwild runs no plan."""
    if options.hogwild is not None:
        raise ArgumentError(f"hogwild={options.hogwild} runs {options.hogwild} processes of one host "
                            "on shared parameters, not a plan over torchrun ranks: call "
                            f"autopar.hogwild(model, inputs, loss_fn, target=..., "
                            f"processes={options.hogwild})")


def as_options(pins: "Options | Mapping[str, Any] | None") -> Options:
    """``pins`` as Options (checked once: Options pass through as they are)."""
    return pins if isinstance(pins, Options) else Options.from_pins(pins)


__all__ = ["ASYNC_PINS", "AVERAGING", "WORKERS_HELP", "WORKERS_LR", "workers_schedule", "COMPRESS_HELP", "NUQ_MAX_LEVELS", "KNOWN_PINS", "NAMES", "OFFLOAD_DEFAULT_ZERO", "OPTIMIZER_STATES", "STAGE_SPLITS",
           "Options", "as_options", "check_optimizer", "compress_scheme"]
