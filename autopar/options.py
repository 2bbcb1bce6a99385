"""What a user may fix about a plan, typed: the keyword arguments of ``autopar.plan`` /
``autopar.parallelize`` (and ``--pin NAME=VALUE`` of the CLI), each fixing one choice and
leaving the rest to the solver.

:class:`Options` is the one place that says what each option is, which values it takes,
which combinations are refused (with the words of ``autopar.errors``' catalogue) and what
one implies (``offload`` implies ``zero=2``). The data-parallel update schemes are values
(``Options.update``, one field holding an ``autopar.update_schemes`` value, written with the
schemes' pins), each declaring what it refuses. It is built once, from the user's keywords
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
from autopar.update_schemes import (  # noqa: F401  (the values' names, read from here too)
    AVERAGING, COMPRESS_HELP, COUNT_PINS, NUQ_MAX_LEVELS, SCHEMES, WORKERS_HELP, WORKERS_LR,
    Exact, UpdateScheme, check_update_pins, compress_scheme, pinned_schemes, scheme_of,
    workers_schedule,
)

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Fp8Scaling = Literal["tensorwise", "rowwise"]
Recompute = Union[bool, Literal["full", "none"], tuple[str, ...]]

OFFLOAD_DEFAULT_ZERO = 2
"""``offload="optimizer"`` without a ``zero=`` pin implies ZeRO stage 2, the pairing
DeepSpeed's ZeRO-Offload uses (Ren et al. 2021)."""

MESH_AXIS_PINS = AXIS_NAMES
"""Every option that is the degree of a mesh axis, under the axis's name (``Plan.mesh_axes``
uses the same names): ``autopar.mesh_roles.AXIS_NAMES``. A new axis is a field of
``MeshRoles`` (and an option here), so that what reads every mesh pin (``autopar.elastic``'s
re-plan for a new world size) sees it."""

CUDA_GRAPHS = "reduce-overhead"
"""``compile=``'s value that also records each compiled program as CUDA graphs and replays
them (the name of torch.compile's mode that does so)."""


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
    dualpipev_overlap: bool | None = None
    """Under ``schedule="dualpipev"``: whether each of its forward/backward pairs runs at once
    (the forward on a second thread with process groups of its own, ``runtime.overlap``), so
    that one micro-batch's expert all-to-all hides behind the other's compute, and is priced
    so. None (the default) or True: where it applies (:attr:`dualpipev_overlaps`, and a stage
    dispatching tokens to experts by all-to-all); False: the pairs run one after the other,
    as torch runs them."""
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
    offload_activations: Recompute | None = None
    """Activation offload: what these repeated layers save for backward is kept in host
    memory between their forward and their backward (``"full"``: every repeated layer;
    ``"none"``; or layer names as for ``recompute``), copied on a side stream overlapped
    with the neighbouring layers' compute on CUDA (``autopar.ops.host_activations``). A
    layer is offloaded or recomputed, not both. Left unset, the solver may choose it per
    layer where memory binds (``autopar.solver.offload_choice``)."""
    precision: Precision | None = None
    """Mixed precision: costs, memory and ``torch.autocast`` in 16 bits, fp32 master
    weights; fp16 adds dynamic loss scaling. ``"fp8"``: bf16 as above, and the GEMMs of
    the model's ``nn.Linear`` layers (all but the output head) in float8 with dynamic
    scaling (``fp8_scaling``; ``autopar.ops.fp8``)."""
    fp8_scaling: Fp8Scaling | None = None
    """Under ``precision="fp8"``: torchao's float8 training recipe, ``"tensorwise"`` (the
    default: one scale per tensor, e4m3 forward, e5m2 gradients) or ``"rowwise"`` (one
    scale per row along each GEMM's contraction, e4m3 throughout, power-of-2 scales)."""
    fp8_layers: tuple[str, ...] | Literal["all"] | None = None
    """Under ``precision="fp8"``: which linear layers run in fp8, by module name
    (``("layers.0.attention.wq", ...)``); ``"all"``: every one the recipe converts (all
    ``nn.Linear`` layers but the head, ``autopar.analysis.fp8_layers``). None: the solver
    chooses each by price (fp8 where its fp8 GEMMs and casts beat bf16 under the plan's
    placement, ``autopar.pricing.fp8``) and the plan records the names it chose."""
    fp8_all_gather: bool | None = None
    """Under ``precision="fp8"``, the tensorwise recipe and ``zero=3``: whether ZeRO-3
    gathers the fp8 linears' weights in float8 (each shard cast with the whole weight's
    scale, 1 byte an element on the wire; torchao's ``enable_fsdp_float8_all_gather``,
    ``passes/fp8_gathers.py``) or in bf16. None: in float8 wherever it applies (eager
    programs; bit-equal to the bf16 gather, :attr:`fp8_gathers`); False: bf16, as
    torchtitan runs by default."""
    grad_reduce: Literal["fp32", "bf16"] | None = None
    """The dtype data-parallel gradients are summed in (all-reduce, ZeRO's reduce-scatter):
    fp32 by default; bf16 halves those bytes (needs ``precision``)."""
    accumulate: int | None = None
    """Gradient accumulation without a pipeline: micro-batches per step."""
    update: UpdateScheme = Exact()
    """How the step's data-parallel update is made: one frozen scheme value
    (``autopar.update_schemes``: ``Compressed("powersgd:4")``, ``LocalSGD(8)``,
    ``Stale(1)``, ...; ``Exact()``, the exact all-reduce, when none is pinned). Users write it
    with the schemes' own pins (:data:`UPDATE_PIN_HELP`: ``compress=``, ``local_sgd=``,
    ``averaging=``, ``staleness=``, ``param_server=``, ``hogwild=``, ``learners=``,
    ``workers=`` and their parameters), which :meth:`from_pins` parses into it and which read
    back as attributes (``opts.staleness``) and in the mapping, or pass ``update=`` a scheme."""
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
    compile: bool | str | None = None
    """Run each rank's programs through ``torch.compile`` (Inductor), forward and backward,
    collectives included as torch's functional collectives (``autopar.runtime.compiled``);
    the cost model then prices memory-bound ops as fused into their neighbours.
    ``"reduce-overhead"``: the same, and on CUDA ranks each compiled program is recorded as
    CUDA graphs and replayed (torch.compile's mode of that name: Inductor's
    ``triton.cudagraphs``), so a launch-bound step pays one launch a program instead of one
    a kernel; priced with the host time of the replays (``cost_models.host``)."""

    # ---- building -----------------------------------------------------------------------
    @classmethod
    def from_pins(cls, pins: "Mapping[str, Any] | Options | None" = None, **more) -> "Options":
        """The options of keyword arguments ``pins`` (and ``more``), checked, with their
        implications applied; ``pins`` is not changed. An unknown name is an
        ``ArgumentError``, a value or combination the solver cannot honour a ``PinError``."""
        given = {**dict(pins or {}), **more}
        if given.get("update") is not None:       # a scheme value: written as its pins
            scheme = given.pop("update")
            if not isinstance(scheme, UpdateScheme):
                raise ArgumentError(f"update={scheme!r}: pass a scheme of autopar.update_schemes "
                                    "(e.g. LocalSGD(8)), or its pins (local_sgd=8)")
            given = {**scheme.pins(), **given}
        given.pop("update", None)
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
        if given.get("precision") == "fp8":       # the recipe stated in the plan
            given.setdefault("fp8_scaling", "tensorwise")
        if given.get("stage_split") == "balanced":     # the default: one form for both
            del given["stage_split"]
        if given.get("offload_dir") is not None:      # a path as the plan file stores it
            given["offload_dir"] = os.fspath(given["offload_dir"])
        if given.get("offload") in ("optimizer", "disk") and given.get("zero") is None:
            given["zero"] = OFFLOAD_DEFAULT_ZERO
        if pinned_schemes(given) or given.get("offload"):
            given.setdefault("pipeline", 1)     # not offered with pipelines (yet)
        for name in ("recompute", "offload_activations"):
            if isinstance(given.get(name), list):
                given[name] = tuple(given[name])
        if given.get("offload_activations") == ():      # one form for none: "none" (a pin)
            given["offload_activations"] = "none"
        if isinstance(given.get("fp8_layers"), (list, tuple)):      # one order: the plan's
            given["fp8_layers"] = tuple(sorted(given["fp8_layers"]))
        scheme = scheme_of(given)       # the update's pins, as one value (compress="none": Exact)
        return cls(**{k: v for k, v in given.items() if k not in UPDATE_PIN_HELP}, update=scheme)

    def replace(self, **changes) -> "Options":
        """These options with ``changes`` (None unsets one; ``update=`` replaces the scheme),
        checked again."""
        mine = self.pinned()
        if "update" in changes:
            mine = {k: v for k, v in mine.items() if k not in UPDATE_PIN_HELP}
        return Options.from_pins({**mine, **changes})

    def pinned(self) -> dict[str, Any]:
        """The options that are set, by name (the JSON form; tuples as lists)."""
        out = {}
        for name in NAMES:
            v = getattr(self, name)
            if v is not None:
                out[name] = list(v) if isinstance(v, tuple) else v
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
    def fp8_gathers(self) -> bool:
        """Whether ZeRO-3 gathers the fp8 linears' weights in float8 (``fp8_all_gather``):
        precision fp8, the tensorwise recipe, ZeRO-3, eager (a compiled program's gathers
        are Inductor's), not pinned off."""
        return (self.precision == "fp8" and (self.fp8_scaling or "tensorwise") == "tensorwise"
                and self.zero_stage >= 3 and not self.compile and self.fp8_all_gather is not False)

    @property
    def dualpipev_overlaps(self) -> bool:
        """Whether DualPipeV's pairs may run at once under these options (``runtime.overlap``
        adds the plan's conditions: a stage's expert all-to-all, no context axis): not pinned
        off, eager programs (a compiled stage's collectives are bound to the groups it was
        traced with), ZeRO below 3 (its regathered weights' hooks keep the forward's
        communicator for backward)."""
        return self.dualpipev_overlap is not False and not self.compile and self.zero_stage < 3

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


UPDATE_PIN_HELP: dict[str, str] = {
    'compress': """Lossy data-parallel gradient reduction: see COMPRESS_HELP; ``"auto"`` lets the
    solver choose one (``autopar.solver.compress``).""",
    'local_sgd': """Local SGD: average parameters over the data axis every H steps instead of reducing
    gradients each step (after ``local_sgd_warmup`` exact steps).""",
    'local_sgd_warmup': """Steps of exact gradient all-reduce before Local SGD begins (default 100).""",
    'averaging': """BAGUA's model averaging (Gan et al. 2021; ``autopar.runtime.updates.averaging``), instead of
    the gradient all-reduce over the data axis: ``"decentralized"`` (each rank steps on its
    own gradient, then averages its parameters with its two ring neighbours, D-PSGD) or
    ``"async"`` (the parameters' average over the data axis is all-reduced in the background
    while training goes on and folded in ``averaging_period`` steps later).""",
    'averaging_period': """Steps between averagings under ``averaging=`` (default 1).""",
    'staleness': """Stale-synchronous data parallelism (``autopar.runtime.updates.stale``): the gradient of step
    t - s is applied at step t (s >= 1), so each step's reduction runs behind the next s
    steps; the first s steps apply none (``pm.step(opt)`` skips them). With
    ``param_server=`` the servers apply the pushed gradients that late.""",
    'param_server': """Parameter servers (Li et al. 2014; ``autopar.runtime.updates.param_server``): this many ranks
    of the data axis each own a shard of the parameters and their optimizer state; workers
    push gradients to the owners (point-to-point), the owners step, workers pull the
    parameters back. Exact without ``staleness=``.""",
    'hogwild': """Hogwild (Recht et al. 2011; ``autopar.hogwild``): this many processes of one host
    update one copy of the parameters in shared memory without locks. CPU only, and only
    through ``autopar.hogwild(...)`` (not torchrun ranks).""",
    'learners': """Crossbow (Koliousis et al. 2019; ``autopar.runtime.updates.crossbow``): this many learners (model
    replicas) per rank, each training on its own batch (``train_step`` takes that many
    batches stacked), pulled toward a central average model by synchronous model averaging
    (SMA, with momentum) every step.""",
    'workers': """Accordion's batch-size form (Agarwal et al. 2021; ``autopar.runtime.updates.workers``) as the
    number of data-parallel workers that train: ``"accordion:W1:W2"``. Every 10 steps the
    norm of the whole model's gradient, accumulated since the last check, is compared with
    the last check's; a relative change of 0.5 or more (and the start) is a critical regime,
    where data ranks ``0 .. W1-1`` train, else ``0 .. W2-1``. The other data ranks skip
    forward and backward (their batch is not used), contribute a zero gradient, and the
    gradient is averaged over the ranks that trained. Relaxed: it changes the optimisation;
    never chosen by the solver.""",
    'workers_lr': """Under ``workers=``: ``"linear"`` (the default, Accordion's linear scaling rule) steps
    with the learning rate times (workers training) / W2 in ``pm.step(opt)``; ``"constant"``
    keeps the optimizer's learning rate.""",
}
"""The pins that write ``Options.update`` (each scheme's pin and its parameters), and what
each is; they read back as attributes of Options (``opts.compress``) and in its mapping."""


def _update_pin(name: str) -> property:
    return property(lambda self: self.update.pins().get(name), doc=UPDATE_PIN_HELP[name])


for _name in UPDATE_PIN_HELP:
    setattr(Options, _name, _update_pin(_name))

NAMES: tuple[str, ...] = tuple(n for f in fields(Options)
                               for n in (UPDATE_PIN_HELP if f.name == "update" else (f.name,)))
"""Every pin, in the order plans list them: the fields, ``update`` written as its pins."""
STAGE_SPLITS = ("balanced", "even-layers")
"""Values of the ``stage_split=`` pin."""
KNOWN_PINS = frozenset(NAMES)


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
    act = p.get("offload_activations")
    if not (act is None or act in ("full", "none")
            or (isinstance(act, (list, tuple)) and all(isinstance(r, str) for r in act))):
        raise PinError(f"offload_activations={act!r}: use 'full' (every repeated layer), "
                       "'none', or a list of layer names such as ['h.0', 'h.1']")
    if p.get("precision") not in (None, "fp32", "bf16", "fp16", "fp8"):
        raise PinError(f"precision={p['precision']!r}: use 'fp32', 'bf16', 'fp16' or 'fp8'")
    if p.get("fp8_scaling") not in (None, "tensorwise", "rowwise"):
        raise PinError(f"fp8_scaling={p['fp8_scaling']!r}: use 'tensorwise' (the default) or "
                       "'rowwise'")
    layers = p.get("fp8_layers")
    if not (layers is None or layers == "all" or (isinstance(layers, (list, tuple)) and all(
            isinstance(n, str) for n in layers))):
        raise PinError(f"fp8_layers={layers!r}: use 'all' (every linear but the head), a list "
                       "of linear module names such as ['layers.0.feed_forward.w1'], or leave it "
                       "out (the solver chooses each layer by price)")
    if p.get("dualpipev_overlap") not in (None, True, False):
        raise PinError(f"dualpipev_overlap={p['dualpipev_overlap']!r}: use True, False or leave it "
                       "out (DualPipeV's pairs run at once wherever a stage's experts dispatch by "
                       "all-to-all)")
    if p.get("dualpipev_overlap") is not None and p.get("schedule") not in (None, "dualpipev"):
        raise PinError(f"dualpipev_overlap= says how schedule='dualpipev' runs its forward/backward "
                       f"pairs; schedule={p['schedule']!r} has none: pin schedule='dualpipev', or "
                       "drop dualpipev_overlap=")
    if p.get("fp8_all_gather") not in (None, True, False):
        raise PinError(f"fp8_all_gather={p['fp8_all_gather']!r}: use True, False or leave it out "
                       "(float8 wherever it applies)")
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
    if p.get("compile") not in (None, True, False, CUDA_GRAPHS):
        raise PinError(f"compile={p['compile']!r}: use True (torch.compile each rank's programs), "
                       f"{CUDA_GRAPHS!r} (the same, replayed as CUDA graphs on GPUs) or False "
                       "(eager, the default)")
    for scheme in SCHEMES:       # the update schemes' own values (autopar.update_schemes)
        scheme.check_values(p)


def _check_combinations(p: dict) -> None:
    pipe = p.get("pipeline") or 1
    for name in ("schedule", "virtual_stages", "stage_split"):
        if p.get(name) not in (None, "balanced") and pipe == 1:
            raise PinError(f"the pin {name}= needs pipeline parallelism: pin pipeline= > 1 too")
    if p.get("accumulate") is not None and pipe > 1:
        raise PinError("accumulate= is gradient accumulation without a pipeline; a pipeline "
                       "runs its own micro-batches: pin micro_batch_size= with pipeline= instead")
    if p.get("grad_reduce") == "bf16" and p.get("precision") not in ("bf16", "fp16", "fp8"):
        raise PinError("grad_reduce='bf16' needs mixed precision: pin precision='bf16' too")
    if p.get("fp8_scaling") is not None and p.get("precision") != "fp8":
        raise PinError(f"fp8_scaling={p['fp8_scaling']!r} is how precision='fp8' scales its "
                       f"GEMMs; precision={p.get('precision')!r} runs none: pin precision='fp8' "
                       "too, or drop fp8_scaling=")
    if p.get("fp8_layers") is not None and p.get("precision") != "fp8":
        raise PinError(f"fp8_layers= names the linears precision='fp8' runs in fp8; "
                       f"precision={p.get('precision')!r} runs none: pin precision='fp8' too, or "
                       "drop fp8_layers=")
    if p.get("fp8_all_gather") and (p.get("precision") != "fp8" or p.get("fp8_scaling") == "rowwise"
                                    or p.get("zero") not in (None, 3) or p.get("compile")):
        raise PinError("fp8_all_gather=True gathers ZeRO-3 weights of tensorwise fp8 linears in "
                       f"float8, eagerly; precision={p.get('precision')!r}, fp8_scaling="
                       f"{p.get('fp8_scaling')!r}, zero={p.get('zero')!r}, compile={p.get('compile')!r} "
                       "has none (rowwise scales are per row, torchao gathers them in bf16): pin "
                       "precision='fp8' with the tensorwise recipe, zero=3 and no compile, or drop "
                       "fp8_all_gather=")
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
        for other, none in (("pipeline", 1), ("branch", 1)):     # the update schemes: their own
            if p.get(other) not in (None, none):
                raise PinError(f"{off} with {other}={p[other]!r} is not supported: "
                               "drop one of the two pins")
    act = p.get("offload_activations")
    if act not in (None, "none", (), []):
        if p.get("compile") not in (None, False):
            raise PinError(f"offload_activations={act!r} with compile={p['compile']!r} is not "
                           "supported yet: drop one of the two pins")
        rec = p.get("recompute")
        if rec is True or rec == "full" or (act == "full" and rec not in (None, False, "none", (), [])):
            raise PinError(f"offload_activations={act!r} with recompute={rec!r}: a layer is "
                           "offloaded or recomputed, not both; name disjoint layers in the two "
                           "pins, or drop one")
        if isinstance(rec, (list, tuple)) and not isinstance(act, str) and set(rec) & set(act):
            raise PinError(f"offload_activations and recompute both name {sorted(set(rec) & set(act))}: "
                           "a layer is offloaded or recomputed, not both")
    # the update schemes (autopar.update_schemes): one at most, and what each refuses
    check_update_pins(p)
    if (p.get("expert") or 1) > 1 and p.get("expert_dispatch") == "tensor":
        raise PinError(f"expert={p['expert']} splits the experts over an axis; "
                       "expert_dispatch='tensor' splits each expert instead (with tensor=): pin "
                       "expert_dispatch='all-to-all' or 'all-gather' with expert=, or drop expert=")
    if (p.get("expert") or 1) > 1:
        for other, none in (("zero", 0), ("branch", 1), ("offload", None)):   # schemes: their own
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


ASYNC_PINS = COUNT_PINS
"""The update schemes pinned by a count (``staleness``, ``param_server``, ``learners``,
``hogwild``: ``autopar.update_schemes``), of issue 31; never chosen by the solver."""


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
           "UPDATE_PIN_HELP", "Options", "as_options", "check_optimizer", "compress_scheme"]
