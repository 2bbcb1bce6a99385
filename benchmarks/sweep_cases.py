"""The differential sweep's cases: how one is drawn from a seed, run, and judged.

A case is (architecture of ``examples/zoo.py``, plan kind, seed). The seed draws the rest
deterministically (``random.Random("<arch>:<kind>:<seed>")``): the world size, the pins,
the loss and the batch. The case id ``<arch>:<kind>:<seed>`` (``:gloo`` appended when it
runs on real gloo processes) is all ``python benchmarks/sweep.py --case ID`` needs to run
it again.

Running a case, on ranks simulated as threads (:func:`run_threads`: the same capture, plan,
rewrite and runtime code as torchrun, only the communicator differs) or on every rank of a
torchrun job (:func:`run_dist`, ``tests/sweep_worker.py``):

1. plan it: ``autopar.solver.driver.solve`` as ``autopar.parallelize`` does (threads), or
   ``autopar.parallelize`` itself (gloo); an ``autopar.AutoparInputError`` there is a
   REFUSAL (its message's first line is reported), anything else a FAILURE; then every
   rank's programs are checked statically (:func:`static_problem`, ``autopar verify
   --static``): a program that does not type-check is a FAILURE before anything trains;
2. train 3 steps of SGD with momentum under the plan and on one device (a copy of the same
   model, same batch): the loss of every step, every gradient by name, the weights after
   the steps (``autopar.verify.compare``: weights relative to how far each moved);
3. train 3 steps of AdamW (a fresh module from the same plan): the losses, and the weights
   relative to how far each moved (``compare_adamw``; in fp32 the loss is also allowed 4x
   one device's distance from its twin with the gradients' rounding noise zeroed, which
   AdamW steps by ~lr either way: ``reference``'s ``exact_zeros``);
4. mixed precision is compared with a one-device run under ``torch.autocast`` (fp16 with
   ``torch.amp.GradScaler``) at looser tolerances (``PRECISION_TOL``); fp8 with one device
   running the same fp8 recipe on the plan's row blocks (``sweep_fp8``, tolerances from the
   formats); compiled plans (``compile``, gloo only) with one device eager, as fp32.

BatchNorm models under accumulation or a pipeline are compared with one device on the
same micro-batches (their statistics are per micro-batch), each micro-batch's loss its term
of the global loss (``zoo.LossSpec``).
"""
from __future__ import annotations

import copy
import json
import math
import random
import time
import sys
import traceback
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from examples import zoo

try:
    import sweep_fp8
except ImportError:         # imported as benchmarks.sweep_cases
    from benchmarks import sweep_fp8

# ---- the plan space ----------------------------------------------------------------------

SCHEDULES = {"pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved-1f1b",
             "pp-zero-bubble": "zero-bubble", "pp-dualpipev": "dualpipev"}
PLAN_KINDS = ("free", "free-budget", "data", "tensor", "2d", "zero1", "zero2", "zero3",
              "offload", "accumulate", "recompute", "offload-activations", *SCHEDULES, "branch", "bf16", "fp16",
              "per-rank", "expert", "context", "param-server", "fp8", "compile", "pp-offload")
"""Appending a kind changes which kind ``draw_cases`` draws for a seed (it picks among
``kinds_for``), never a case id's case: ``draw_case`` is keyed by the id alone."""
# the world sizes each kind is drawn on (repeats weight the draw)
WORLDS = {
    "free": (1, 2, 2, 3, 4, 4), "free-budget": (2, 2, 3, 4), "data": (2, 3, 4), "tensor": (2, 3, 4, 4),
    "2d": (4,), "zero1": (2, 3, 4), "zero2": (2, 3, 4), "zero3": (2, 3, 4, 4),
    "offload": (2, 4), "accumulate": (1, 2, 4), "recompute": (1, 2, 4),
    "offload-activations": (1, 2, 4),
    "pp-gpipe": (2, 3, 4), "pp-1f1b": (2, 3, 4), "pp-interleaved": (2, 4), "pp-zero-bubble": (2, 4),
    "pp-dualpipev": (2, 4), "branch": (2,), "bf16": (1, 2, 4), "fp16": (1, 2, 4), "per-rank": (2, 3, 4),
    "expert": (2, 4, 4), "context": (2, 4, 4), "param-server": (2, 3, 4),
    "fp8": (1, 2, 2, 3, 4), "compile": (2,), "pp-offload": (2, 4),
}
FP8_SCALINGS = ("tensorwise", "rowwise")
NO_FP8_LINEARS = ("ex-inception", "ex-resnet", "ex-unet", "falcon", "gpt2", "resnet")
"""The zoo's models with no linear ``precision="fp8"`` converts (``analysis.fp8_layers``:
convolutions, transformers' Conv1D, fused QKV read by no nn.Linear): an fp8 case of one
would be a bf16 case. ``tests/test_sweep.py`` checks the list against ``fp8_linears``."""
COMPILE_ARCHS = ("ex-mlp", "ex-gpt", "llama")
"""``compile`` is drawn on small models only: Inductor compiles every kernel of a case on
its first run (a C++ compiler run each, ``benchmarks/compiled_plans.py``): tens of CPU
seconds a rank on this 2-core machine for a one-layer GPT."""
EXPERT_DISPATCH = (None, "all-to-all", "all-gather")
# torch.distributed ranks only (compile=True refuses thread ranks: runtime.compiled)
GLOO_ONLY = frozenset(SCHEDULES) | {"param-server", "compile", "pp-offload"}
SEQUENCE_MODELS = ("ex-gpt", "ex-gpt-deep", "ex-llama")
"""Besides the decoders, the zoo's models over a sequence of tokens (``context`` plans)."""


def kinds_for(arch: str) -> tuple[str, ...]:
    """The plan kinds drawn for ``arch``: branch parallelism only where there are branches,
    expert parallelism only in a mixture of experts, context parallelism only over a
    sequence of tokens (decoders and the examples' language models); fp8 only with a linear
    fp8 converts and no BatchNorm (its reference steps through the plan's row blocks, whose
    statistics would be per block: :data:`NO_FP8_LINEARS`); compile on :data:`COMPILE_ARCHS`."""
    e = zoo.ZOO[arch]
    return tuple(k for k in PLAN_KINDS if (k != "branch" or "branches" in e.tags)
                 and (k != "expert" or e.family == "moe")
                 and (k != "context" or e.family == "decoder" or arch in SEQUENCE_MODELS)
                 and (k != "fp8" or (arch not in NO_FP8_LINEARS and "batchnorm" not in e.tags))
                 and (k != "compile" or arch in COMPILE_ARCHS))


@dataclass(frozen=True)
class Case:
    arch: str
    kind: str
    seed: int
    world: int
    loss: str
    pins: tuple                 # sorted (name, value) pairs
    batch: int
    budget: bool = False        # free-budget: a memory budget replication does not fit
    per_rank: bool = False      # batch="per_rank"
    gloo: bool = False

    @property
    def id(self) -> str:
        if self.seed < 0:       # an explicit case (make_case)
            pins = ",".join(f"{k}={v}" for k, v in self.pins)
            return (f"{self.arch}:{self.kind}:w{self.world}:{self.loss}" + (f":{pins}" if pins else "")
                    + (":gloo" if self.gloo else ""))
        return f"{self.arch}:{self.kind}:{self.seed}" + (":gloo" if self.gloo else "")

    @property
    def repro(self) -> str:
        return f"python benchmarks/sweep.py --case {self.id}"

    @property
    def pin_dict(self) -> dict:
        return dict(self.pins)

    def describe(self) -> str:
        pins = " ".join(f"{k}={v}" for k, v in self.pins) or "no pins"
        extra = (" +budget" if self.budget else "") + (" batch=per_rank" if self.per_rank else "")
        return f"w{self.world} {pins}{extra} loss={self.loss} batch={self.batch}"

    def to_json(self) -> dict:
        return {**asdict(self), "pins": [list(p) for p in self.pins]}

    @staticmethod
    def from_json(d: dict) -> "Case":
        return Case(**{**d, "pins": tuple(tuple(p) for p in d["pins"])})


def _schedule_runs(kind: str, stages: int, micro_batches: int, virtual: int) -> bool:
    """Whether ``kind`` runs ``stages`` ranks with ``micro_batches`` (``schedule.check_schedule``):
    a draw of pins the schedule refuses (1F1B's 3 stages with 2 micro-batches) tests the
    refusal, not the pipeline, and ``tests/test_bad_inputs.py`` has that already."""
    from autopar.errors import AutoparInputError
    from autopar.schedule import check_schedule
    try:
        check_schedule(kind, stages, micro_batches, virtual)
    except AutoparInputError:
        return False
    return True


def draw_case(arch: str, kind: str, seed: int, gloo: bool = False) -> Case:
    """The case ``arch:kind:seed``: world, pins and loss drawn from the seed alone."""
    if arch not in zoo.ZOO:
        raise ValueError(f"unknown architecture {arch!r}; the zoo has {zoo.NAMES}")
    if kind not in kinds_for(arch):
        raise ValueError(f"plan kind {kind!r} does not apply to {arch}; kinds {kinds_for(arch)}")
    rng = random.Random(f"{arch}:{kind}:{seed}")
    e = zoo.ZOO[arch]
    w = rng.choice(WORLDS[kind])
    loss = rng.choice(e.losses)
    batch = 6 if w == 3 else 4
    pins: dict = {}
    budget = per_rank = False
    base = lambda: rng.choice([{}, {"data": w}, {"tensor": w}] if w > 1 else [{}])  # noqa: E731
    if kind == "free-budget":
        budget = True
    elif kind == "data":
        pins = {"data": w}
    elif kind == "tensor":
        pins = {"tensor": w} if w != 4 else rng.choice([{"tensor": 4}, {"tensor": 2}])
    elif kind == "2d":
        pins = {"data": 2, "tensor": 2}
    elif kind in ("zero1", "zero2", "zero3"):
        pins = {"data": w, "zero": int(kind[-1])}
        if w == 4 and rng.random() < 0.3:
            pins = {"data": 2, "tensor": 2, "zero": int(kind[-1])}
    elif kind == "offload":
        pins = {"data": w, "offload": rng.choice(["optimizer", "optimizer", "disk"])}
        z = rng.choice([None, 1, 3])
        if z:
            pins["zero"] = z
    elif kind == "accumulate":
        pins = base()
        if batch % (2 * pins.get("data", 1)):      # micro-batches the data axis still splits
            pins = {"data": w // 2} if w // 2 > 1 else {}
        d = pins.get("data", 1)
        pins["accumulate"] = rng.choice([a for a in (2, 3, 4) if batch % (a * d) == 0])
    elif kind == "recompute":
        pins = {"recompute": "full", **base()}
    elif kind == "offload-activations":
        pins = {"offload_activations": "full", **base()}
        if w > 1 and rng.random() < 0.3:
            pins = {"offload_activations": "full", "data": w, "zero": 3}
    elif kind in SCHEDULES:
        pins, batch = _pipeline_pins(rng, kind, w, batch, e)
    elif kind == "pp-offload":
        # a pipeline schedule that runs on w ranks, each stage's activations offloaded
        sched = rng.choice([k for k in SCHEDULES if w in WORLDS[k]])
        pins, batch = _pipeline_pins(rng, sched, w, batch, e)
        pins["offload_activations"] = "full"
    elif kind == "fp8":
        pins = {"precision": "fp8", "fp8_scaling": rng.choice(FP8_SCALINGS)}
        plans = [{}] if w == 1 else [{"data": w}, {"data": w, "zero": 3}] + \
            ([{"tensor": w}] if w in (2, 4) else [])
        pins.update(rng.choice(plans))
        # every linear: on this machine's ranks the price keeps every eager cast in bf16 (a
        # bf16 case; tests/test_fp8.py checks the price's choice)
        pins["fp8_layers"] = "all"
    elif kind == "compile":
        pins = {"compile": True, **rng.choice([{}, {"data": w}, {"data": w, "zero": 3}, {"tensor": w}])}
    elif kind == "branch":
        pins = {"branch": 2}
    elif kind in ("bf16", "fp16"):
        pins = {"precision": kind, **base()}
        if w > 1 and rng.random() < 0.25:
            pins = {"precision": kind, "data": w, "zero": 3}
    elif kind == "expert":
        pins = rng.choice([{"expert": w}] + ([{"expert": 2, "data": 2}, {"expert": 2, "tensor": 2}]
                                             if w == 4 else []))
        dispatch = rng.choice(EXPERT_DISPATCH)
        if dispatch:
            pins["expert_dispatch"] = dispatch
    elif kind == "context":
        pins = rng.choice([{"context": w}] + ([{"context": 2, "data": 2}, {"context": 2, "tensor": 2}]
                                              if w == 4 else []))
        if rng.random() < 0.3:
            pins["context_attention"] = "all-gather"
    elif kind == "param-server":
        pins = {"data": w, "param_server": rng.choice([k for k in (1, 2) if k <= w])}
    elif kind == "per-rank":
        per_rank = True
        pins = rng.choice([{"data": w}, {}] + ([{"data": 2, "tensor": 2}] if w == 4 else []))
    return Case(arch, kind, seed, w, loss, tuple(sorted(pins.items())), batch, budget,
                per_rank, gloo or kind in GLOO_ONLY)


def _pipeline_pins(rng, kind: str, w: int, batch: int, e) -> tuple[dict, int]:
    """A pipeline schedule's pins on ``w`` ranks (``kind`` of :data:`SCHEDULES`) and the batch."""
    if kind == "pp-dualpipev":
        # two stages a rank in a V and at least 2p micro-batches (schedule.check_schedule):
        # 2 ranks, or 2 stages x data 2 over a batch of 8 (micro-batches of 2, one a rank)
        d = w // 2
        pins = {"pipeline": 2, "schedule": "dualpipev", "micro_batch_size": d}
        if d > 1:
            pins["data"] = d
        return pins, 4 * d
    # the zoo's models have 2 layers: more stages than layers is drawn too, but less often
    p = 2 if w == 4 and rng.random() < 0.6 else w
    d = w // p
    v = 2 if kind == "pp-interleaved" else 1
    pins = {"pipeline": p, "schedule": SCHEDULES[kind],
            "micro_batch_size": rng.choice([m for m in (1, 2, 3) if batch % m == 0
                                            and m % d == 0 and batch // m >= 2
                                            and _schedule_runs(SCHEDULES[kind], p, batch // m, v)])}
    if d > 1:
        pins["data"] = d
        if e.family == "moe" and rng.random() < 0.5:   # the stage's ranks split experts
            pins = {k: v for k, v in pins.items() if k != "data"}
            pins["expert"] = d
    if kind == "pp-interleaved":
        pins["virtual_stages"] = 2
    return pins, batch


def make_case(arch: str, kind: str, world: int, loss: str = "mean", pins: dict | None = None,
              gloo: bool = False) -> Case:
    """An explicit case (no draw): ``kind`` names it (``free-budget`` adds the budget,
    ``per-rank`` the batch mode; pipelines run on gloo); its id is
    ``arch:kind:w<world>:<loss>[:<pin>=<value>,...][:gloo]``."""
    if arch not in zoo.ZOO:
        raise ValueError(f"unknown architecture {arch!r}; the zoo has {zoo.NAMES}")
    if loss not in zoo.ZOO[arch].losses:
        raise ValueError(f"{arch} takes the losses {zoo.ZOO[arch].losses}, not {loss!r}")
    pins = dict(pins or {})
    return Case(arch, kind, -1, world, loss, tuple(sorted(pins.items())), 6 if world == 3 else 4,
                kind == "free-budget", kind == "per-rank",
                gloo or kind in GLOO_ONLY or "pipeline" in pins or bool(pins.get("compile")))


def _pin_value(v: str):
    return int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)


def parse_case_id(text: str) -> Case:
    """``arch:kind:seed[:gloo]`` (drawn from the seed) or
    ``arch:kind:w<world>:<loss>[:<pins>][:gloo]`` (explicit) -> the Case."""
    parts = text.split(":")
    if len(parts) >= 4 and parts[2].startswith("w") and parts[2][1:].isdigit():
        gloo = parts[-1] == "gloo"
        rest = parts[4:len(parts) - gloo]
        if len(rest) > 1:
            raise ValueError(f"case id {text!r}: expected ARCH:KIND:wWORLD:LOSS[:PIN=V,...][:gloo]")
        pins = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
        return make_case(parts[0], parts[1], int(parts[2][1:]), parts[3],
                         {k: _pin_value(v) for k, v in pins.items()}, gloo)
    if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("gloo", "threads")):
        raise ValueError(f"case id {text!r}: expected ARCH:KIND:SEED or ARCH:KIND:SEED:gloo")
    return draw_case(parts[0], parts[1], int(parts[2]), gloo=len(parts) == 4 and parts[3] == "gloo")


def draw_cases(n: int, seed: int, gloo_share: float = 0.1) -> list[Case]:
    """``n`` cases drawn from ``seed``: architectures in turn from a shuffled zoo (every
    architecture about equally often), each with a plan kind drawn among those that apply
    (the free plan twice as often: it is what a user gets first); a ``gloo_share`` of the
    others run on gloo processes (pipelines always do). A kind added to ``PLAN_KINDS``
    changes which cases a seed draws here (issue 43 added ``fp8``, ``compile`` and
    ``pp-offload``), never the case an id names (``draw_case`` is keyed by the id)."""
    rng = random.Random(seed)
    out: list[Case] = []
    archs: list[str] = []
    for _ in range(n):
        if not archs:
            archs = list(zoo.NAMES)
            rng.shuffle(archs)
        arch = archs.pop()
        kinds = list(kinds_for(arch)) + ["free"]
        kind = rng.choice(kinds)
        case_seed = rng.randrange(1_000_000)
        out.append(draw_case(arch, kind, case_seed, gloo=rng.random() < gloo_share))
    return out


# ---- running -----------------------------------------------------------------------------

LR, MOMENTUM, STEPS = 0.05, 0.9, 3
ADAM_LR = 1e-3
# AdamW normalizes each gradient by its running size, so a gradient element that is zero in
# exact arithmetic (rounding noise on both sides) moves its weight by ~lr either way: such
# elements are left out (compare_adamw); an element whose gradient is tiny but real keeps
# a relative rounding error that AdamW turns into a small change, hence a looser tolerance
# than SGD's. A wrong update is of the size of the update itself (err ~ 1).
ADAM_WEIGHT_RTOL, ADAM_FLOOR, NOISE = 1e-2, 0.05, 1e-4
ADAM_LOSS_RTOL = 1e-5
# mixed precision against one device under autocast: (loss, gradient by parameter, weights
# over every parameter together), relative (tests/test_precision.py measures the GPT at
# loss <= 2.2e-4 bf16 / 1e-5 fp16, weights <= 0.068 / 0.029)
PRECISION_TOL = {"bf16": {"loss": 2e-3, "grad": 0.1, "weight": 0.15},
                 "fp16": {"loss": 5e-4, "grad": 0.03, "weight": 0.08}}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Run:
    losses: list
    grads: list            # per step: {name: whole gradient} (SGD runs only)
    weights: dict          # after the steps, parameters by name
    initial: dict | None = None


@dataclass
class Result:
    id: str
    status: str                     # "pass", "fail", "refused"
    message: str = ""               # first line of the failure / refusal
    detail: str = ""                # numbers, or the traceback's tail
    numbers: dict = field(default_factory=dict)
    mesh: list = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Result":
        return Result(**{f.name: d[f.name] for f in fields(Result) if f.name in d})


class Refused(Exception):
    pass


PHASE_HOOK = None      # called with each phase's name as a case enters it (sweep.py's workers)


def _phase(name: str) -> None:
    if PHASE_HOOK is not None:
        PHASE_HOOK(name)


def model_inputs(case: Case) -> zoo.Built:
    return zoo.build(case.arch, batch=case.batch, loss=case.loss)


_model_inputs = model_inputs


def _loss_of(b: zoo.Built, out, target):
    return b.loss_fn(out, target) if b.loss_fn is not None else out


def reference(b: zoo.Built, opt_kind: str, precision: str | None = None, micro: int = 1,
              steps: int = STEPS, float64: bool = False, accumulate: bool = False,
              exact_zeros: bool = False) -> Run:
    """``steps`` steps of ``opt_kind`` ("sgd": SGD with momentum; "adamw") on one device (a
    copy of the model); under ``precision`` in torch.autocast (fp16: with GradScaler);
    ``micro`` > 1: on that many equal micro-batches, each loss its term of the global one;
    ``accumulate``: each micro-batch's backward its own (the gradients summed in ``.grad``,
    in fp32, as ranks' are; one backward of the sum would add the micro-batches' gradients
    of autocast's cached 16-bit weight copies in 16 bits first); ``float64``: in double
    precision (weights, floating inputs and target); ``exact_zeros``: each step's gradient
    elements that are rounding noise (not :func:`kept_elements`) set to zero before the step,
    as exact arithmetic has them."""
    model = copy.deepcopy(b.model)
    if float64:
        model = double_model(model)
        f64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        b = zoo.Built(model, tuple(f64(x) for x in b.inputs), b.loss_fn, f64(b.target), b.spec)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = (torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM) if opt_kind == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=ADAM_LR))
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = DTYPES.get(precision)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        if accumulate and micro > 1:
            loss = _accumulated_step(b, model, micro, dtype, scaler)
        else:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = _step_loss(b, model, micro)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        scale = scaler.get_scale() if scaler is not None else 1.0
        losses.append(float(loss.detach()))
        if exact_zeros:
            named = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            for n, keep in kept_elements(named).items():
                named[n].masked_fill_(~keep, 0.0)
        if opt_kind == "sgd":
            grads.append({n: _at_least_fp32(p.grad.detach()) / scale
                          for n, p in model.named_parameters() if p.grad is not None})
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return Run(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, initial)


def _step_loss(b: zoo.Built, model, micro: int):
    """One step's loss on ``micro`` equal micro-batches in one graph (``reference``)."""
    if micro == 1:
        return _loss_of(b, model(*b.inputs), b.target)
    xs = [x.tensor_split(micro) for x in b.inputs]
    if b.loss_fn is None:      # the model's own loss: a mean of equal micro-batches
        return sum(model(*(x[k] for x in xs)) for k in range(micro)) / micro
    ys, den = b.target.tensor_split(micro), b.spec.denominator(b.target)
    return sum(b.spec.term(model(*(x[k] for x in xs)), ys[k]) for k in range(micro)) / den


def _accumulated_step(b: zoo.Built, model, micro: int, dtype, scaler):
    """The forward and backward of one step on ``micro`` micro-batches, each its own backward
    (``reference``'s ``accumulate``); the step's loss (the terms summed, over the global
    denominator)."""
    xs = [x.tensor_split(micro) for x in b.inputs]
    ys, den = b.target.tensor_split(micro), b.spec.denominator(b.target)
    total = 0.0
    for k in range(micro):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = b.spec.term(model(*(x[k] for x in xs)), ys[k]) / den
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = total + loss.detach()
    return total


def train(pm, inputs, target, opt_kind: str, steps: int = STEPS) -> Run:
    """The same under the plan, on this rank (``pm.step(opt)``: fp16 loss scaling, ZeRO,
    offload); gradients whole by name (``pm.full_grads``, unscaled)."""
    params = list(pm.parameters())
    opt = (torch.optim.SGD(params, lr=LR, momentum=MOMENTUM) if opt_kind == "sgd"
           else torch.optim.AdamW(params, lr=ADAM_LR))
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = pm.train_step(*inputs, target=target)
        losses.append(float(loss))
        if opt_kind == "sgd":
            scale = pm.scaler.scale if pm.scaler is not None else 1.0
            grads.append({n: _at_least_fp32(g) / scale for n, g in pm.full_grads().items()})
        pm.step(opt)
    return Run(losses, grads, pm.full_state_dict())


def _at_least_fp32(g: torch.Tensor) -> torch.Tensor:
    return g.to(torch.promote_types(g.dtype, torch.float32))


def references(b: zoo.Built, precision: str | None, micro: int, exact: bool = True) -> tuple:
    """One device: (SGD run, AdamW run) in ``precision``, and under mixed precision the
    same two in fp32 (what the precision's own rounding is measured against); in fp32, the
    same two in float64 (the fp32 runs' own rounding, which 3 steps amplify in
    ill-conditioned models), or ``(None, None)`` without ``exact`` (:func:`judged`)."""
    runs = (reference(b, "sgd", precision, micro), reference(b, "adamw", precision, micro))
    if precision is None:
        return (*runs, *(float64_references(b, micro) if exact else (None, None)))
    return (*runs, reference(b, "sgd", None, micro), reference(b, "adamw", None, micro))


def float64_references(b: zoo.Built, micro: int) -> tuple:
    """The fp32 references' float64 twins (``(None, None)`` for a model that cannot run in
    float64: no allowance)."""
    try:
        with float64_casts(b.model):
            return (reference(b, "sgd", None, micro, float64=True),
                    reference(b, "adamw", None, micro, float64=True))
    except Exception:  # noqa: BLE001 - a model that cannot run in float64: no allowance
        return (None, None)


def judged(case, per_rank, b: zoo.Built, precision, micro: int, mesh, t0, first_rank: int = 0,
           split: int = 1) -> Result:
    """:func:`judge` against :func:`references`, the float64 ones made only when needed: in
    fp32 they only widen what is allowed (each allowance is the larger of a tolerance and
    the one-device fp32 run's distance from float64, a weight past NOISE_CAP is skipped), so
    a case that passes without them passes with them; one that fails is judged again with
    them (two of the four one-device runs saved on most cases). Mixed precision: a case that
    fails is judged again against the one-device run on the plan's split of the batch
    (:func:`split_references`), where there is one."""
    refs = references(b, precision, micro, exact=False)
    r = judge(case, per_rank, refs, precision, mesh, t0, first_rank)
    if r.status == "fail" and precision is None:
        exact = (*refs[:2], *float64_references(b, micro))
        r = judge(case, per_rank, exact, precision, mesh, t0, first_rank)
        if r.status == "fail" and r.message.startswith("AdamW: loss"):
            # AdamW's steps of gradients that are zero in exact arithmetic (compare_adamw)
            zeros = reference(b, "adamw", None, micro, exact_zeros=True)
            again = judge(case, per_rank, (*exact, zeros), precision, mesh, t0, first_rank)
            if again.status == "pass":
                own = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(zeros.losses, refs[1].losses))
                return replace(again, message=f"AdamW's loss within {NOISE_FACTOR:g}x one device's "
                                              f"distance {own:.1e} from its twin with exact zeros "
                                              f"({r.message})")
    twin = split_references(case, b, precision, micro, split) if r.status == "fail" and precision else None
    if twin is not None:
        # the same arithmetic as the plan's: judged by the precision's tolerances alone (an
        # fp32 run, which never skips a step fp16 skips, would excuse every row)
        again = judge(case, per_rank, (*twin, None, None), precision, mesh, t0, first_rank)
        if again.status == "pass":
            return replace(again, message=f"judged against one device on {split} micro-batches, the "
                                          f"plan's split of the batch (full batch: {r.message})")
    return r


def split_references(case: Case, b: zoo.Built, precision: str, micro: int, split: int):
    """Mixed precision: one device's (SGD run, AdamW run) on ``split`` equal micro-batches
    (each loss its term of the global one), the reductions over the batch summed from the
    parts a plan's ranks make (``split``: its batch degree times its micro-batches,
    :func:`batch_split`); None where that run would not compute the same function (``split``
    1, a BatchNorm model, whose statistics are per micro-batch, or a model's own loss, a
    mean per micro-batch) or the reference is split already.

    Each micro-batch has its own backward, as each rank does (``reference``'s
    ``accumulate``). Why: in 16 bits the order of a reduction changes the result by the
    format's rounding, and a data-parallel plan sums each rank's part: ConvNeXt under bf16, one device, full
    batch against 2 micro-batches: the third step's loss 2.0e-3 apart, and data=2 2.7e-3
    from the full batch, 7.3e-4 from the 2 micro-batches; Llama under fp16 with a summed
    loss: the full batch's weight gradient overflows fp16 where 4 parts do not, so one
    device skips a step a plan of data=4 takes. Either one-device run is the model in the
    precision: a plan within the tolerances of either computes what one device computes."""
    if split <= 1 or micro > 1 or b.loss_fn is None or "batchnorm" in zoo.ZOO[case.arch].tags:
        return None
    if int(b.inputs[0].shape[0]) % split:
        return None
    return (reference(b, "sgd", precision, split, accumulate=True),
            reference(b, "adamw", precision, split, accumulate=True))


def batch_split(cap, plan) -> int:
    """How many parts a plan's reductions over the batch are summed from: the devices it
    splits the batch over (``pipeline_price.batch_degree``) times its micro-batches."""
    from autopar.solver.pipeline_price import batch_degree
    micro = plan.n_microbatches if plan.pipeline_stages > 1 else plan.accumulate
    return batch_degree(cap, plan) * max(int(micro or 1), 1)


def micro_batches(case: Case, plan) -> int:
    """The micro-batches a one-device reference must use: BatchNorm's statistics are per
    micro-batch under accumulation and pipelines."""
    if "batchnorm" not in zoo.ZOO[case.arch].tags:
        return 1
    return max(plan.accumulate, plan.n_microbatches if plan.pipeline_stages > 1 else 1)


def _norm(t) -> float:
    return float(t.double().norm())


def compare_sgd(ref: Run, got: Run, precision: str | None, fp32: Run | None = None) -> dict:
    """fp32: ``autopar.verify.compare`` (loss, every gradient, weights relative to their
    change; its tolerances). Mixed precision (``ref`` under autocast): each measure of
    :func:`_precision_errors` within :data:`PRECISION_TOL`, or within NOISE_FACTOR x the
    same measure of the one-device autocast run against the one-device fp32 run ``fp32``
    (the precision's own rounding on this model: T5's attention, unscaled, under fp16
    rounds a key projection's gradient by 5%)."""
    from autopar import verify
    if precision is None:
        c = verify.compare(verify.Run(ref.losses, ref.grads, ref.weights, ref.initial),
                           verify.Run(got.losses, got.grads, got.weights))
        tol = {"loss": verify.LOSS_RTOL, "grad": verify.GRAD_RTOL, "weight": verify.WEIGHT_RTOL}
        out = {"loss": c.loss_err, "grad": c.grad_err, "grad_worst": f"{c.grad_worst}@{c.grad_step}",
               "weight": c.weight_err, "weight_worst": c.weight_worst, "problems": list(c.problems),
               "ok": c.ok, "tol": tol}
        if c.ok or c.problems or fp32 is None:
            return out
        # beyond verify's tolerances: within the model's own fp32 rounding (``fp32`` is the
        # one-device run in float64)? Ill-conditioned models amplify it over 3 steps
        # (MobileViT's BatchNorm over a 1x1 map of 2 samples)
        e, noise = _fp32_errors(ref, got), _fp32_errors(ref, fp32)
        worst = _worst(e, noise, tol)
        return {**out, "ok": worst[0] <= 1.0, "worst": list(worst)}
    tol = PRECISION_TOL[precision]
    problems: list = []
    e = _precision_errors(ref, got, problems)
    noise = _precision_errors(ref, fp32, []) if fp32 is not None else None
    worst = _worst(e, noise, tol)
    by = {what: max((err for w, _, err, _ in e if w == what), default=0.0) for what in tol}
    grad_worst = max(((err, where) for w, _, err, where in e if w == "grad"), default=(0, ""))[1]
    return {"loss": by["loss"], "grad": by["grad"], "grad_worst": grad_worst,
            "weight": by["weight"], "weight_worst": "", "problems": problems,
            "ok": not problems and worst[0] <= 1.0, "tol": tol, "worst": list(worst)}


def _worst(e, noise, tol) -> tuple:
    """(error / allowed, what, error, allowed, where) of the row of ``e`` farthest beyond
    what is allowed: ``tol[what]``, or NOISE_FACTOR x the same row of ``noise`` (one
    device against itself in a higher precision). A row whose allowance would pass
    NOISE_CAP is left out: one device's own rounding moves it too far to tell a wrong
    number (AdamW under bf16 on MobileViT: autocast and fp32 1.2 apart)."""
    worst = (0.0, "loss", 0.0, 0.0, "")
    for what, key, err, where in e:
        own = NOISE_FACTOR * noise.get(key, 0.0) if noise is not None else 0.0
        if own > NOISE_CAP:
            continue        # one device is that far from itself: this row proves nothing
        allowed = max(tol[what], own)
        ratio = err / allowed if math.isfinite(err) else math.inf
        if ratio > worst[0]:
            worst = (ratio, what, err, allowed, where)
    return worst


def _fp32_errors(ref: Run, got: Run):
    """``autopar.verify.compare``'s measures, one row per loss, gradient (by parameter and
    step) and weight: (what, key, error, where)."""
    from autopar.verify import WEIGHT_ATOL, WEIGHT_RTOL
    rows = _Rows()
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        rows.append(("loss", f"loss@{step}", abs(a - b) / max(abs(b), 1e-12), f"step {step}"))
    for step, (rg, gg) in enumerate(zip(ref.grads, got.grads)):
        total = math.sqrt(sum(_norm(g) ** 2 for g in rg.values()))
        for name, g in rg.items():
            if name in gg:
                err = _norm(gg[name].double() - g.double()) / max(_norm(g), 1e-5 * total, 1e-30)
                rows.append(("grad", f"{name}@{step}", err, f"{name}@{step}"))
    for name, w in ref.weights.items():
        if name in got.weights:
            moved = _norm(w - ref.initial[name])
            floor = WEIGHT_ATOL / WEIGHT_RTOL * math.sqrt(w.numel())
            err = _norm(got.weights[name].double() - w.double()) / max(moved + floor, 1e-30)
            rows.append(("weight", f"w:{name}", err, name))
    return rows


# the allowance for one device's own rounding (fp32 against float64, autocast against
# fp32): NOISE_FACTOR x its distance (MobileViT under data=2, fp32: the worst of 372
# gradient rows is 3.2x the one-device distance, the median 1.4x); past NOISE_CAP the
# row tells nothing (a doubled gradient is an error of 1) and is left out
NOISE_FACTOR, NOISE_CAP = 4.0, 0.5


def _precision_errors(ref: Run, got: Run, problems: list):
    """Mixed precision's measures of ``got`` against ``ref``, as (what, key, error, where)
    rows: the loss of every step (relative); each parameter's gradient at the first step
    (both runs start from the same weights, so only roundings differ; relative to its norm
    with a floor of 1e-2 of the whole gradient's); the whole gradient at every step (later
    steps start from weights that already differ by rounding, which a few steps amplify in
    a single small parameter); the weights after the steps, every parameter together,
    relative to how far they moved. A list of rows, and ``.get(key)`` by key."""
    rows = _Rows()
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        rows.append(("loss", f"loss@{step}", abs(a - b) / max(abs(b), 1e-12), f"step {step}"))
    for step, (rg, gg) in enumerate(zip(ref.grads, got.grads)):
        missing = [n for n in rg if n not in gg]
        if missing:
            problems.append(f"no gradient for {missing[0]}")
            continue
        # fp16: a step whose scaled gradients overflow is skipped (GradScaler; pm.step):
        # both sides must overflow, and then there is nothing more to compare
        over_ref = not all(bool(torch.isfinite(g).all()) for g in rg.values())
        over_got = not all(bool(torch.isfinite(gg[n]).all()) for n in rg)
        if over_ref or over_got:
            if over_ref != over_got:
                problems.append(f"step {step}: the gradients overflow "
                                f"{'on one device' if over_ref else 'under the plan'} only")
            continue
        total = math.sqrt(sum(_norm(g) ** 2 for g in rg.values()))
        if step == 0:
            for name, g in rg.items():
                err = _norm(gg[name].double() - g.double()) / max(_norm(g), 1e-2 * total, 1e-30)
                rows.append(("grad", f"grad:{name}", err, f"{name}@0"))
        err = math.sqrt(sum(_norm(gg[n].double() - g.double()) ** 2 for n, g in rg.items()))
        rows.append(("grad", f"grad@{step}", err / max(total, 1e-30), f"all@{step}"))
    rows.append(("weight", "weight", _weights_together(ref, got, problems), "all"))
    return rows


class _Rows(list):
    def get(self, key, default=None):
        return next((err for _, k, err, _ in self if k == key), default)


def _weights_together(ref: Run, got: Run, problems: list) -> float:
    num = den = 0.0
    for name, w in ref.weights.items():
        if name not in got.weights:
            problems.append(f"no weight for {name}")
            continue
        num += _norm(got.weights[name].double() - w.double()) ** 2
        den += _norm(w.double() - ref.initial[name].double()) ** 2
    return math.sqrt(num / max(den, 1e-30))


def kept_elements(grads: dict) -> dict:
    """By parameter name, the elements of ``grads`` that are no rounding noise: above NOISE x
    the gradient's RMS (the parameter's, or the whole gradient's where the parameter's norm
    is below 1e-5 of the whole's). The others are zero in exact arithmetic (:func:`compare_adamw`)."""
    total_sq = sum(_norm(g) ** 2 for g in grads.values())
    total_rms = math.sqrt(total_sq / max(sum(g.numel() for g in grads.values()), 1))
    keep = {}
    for name, g in grads.items():
        rms = _norm(g) / math.sqrt(max(g.numel(), 1))
        if _norm(g) <= 1e-5 * math.sqrt(total_sq):
            rms = total_rms
        keep[name] = g.abs() > NOISE * rms
    return keep


def compare_adamw(ref: Run, got: Run, precision: str | None, first_grads: dict,
                  fp32: Run | None = None, exact_zeros: Run | None = None) -> dict:
    """AdamW: the loss of every step, and each weight relative to how far it moved (with a
    floor of ADAM_FLOOR x lr per element); mixed precision: every weight together. ``fp32``:
    the same one-device run in fp32 (mixed precision) or float64 (fp32): within
    NOISE_FACTOR x its distance, where larger than the tolerance. AdamW can amplify
    rounding: ex-resnet on 4 micro-batches, one device, summing the micro-batches in the
    reverse order moves 3 AdamW steps' gradients by 6%.

    Elements whose first gradient (``first_grads``, one device) is zero in exact arithmetic
    (an attention key's bias, alone or fused into a QKV bias) hold rounding noise, which
    AdamW divides by its own size and so moves by about lr in a random direction on each
    side: those are left out, elements below NOISE x the gradient's RMS (of the parameter,
    or of the whole gradient when the parameter's is itself below verify's floor of 1e-5 of
    the whole). The SGD run checks their gradients.

    Their steps move the loss too, where they decide something: a skewed router's rows for
    the experts top-k does not pick (their gradient is zero in exact arithmetic through the
    renormalized top-k weights) step by about lr either way and change later routing. fp32:
    ``exact_zeros`` (:func:`reference`'s twin whose noise elements are zeroed every step,
    as exact arithmetic has them) measures that; the loss is allowed NOISE_FACTOR x its
    distance too (``mixtral-skewed:2d:239343:gloo``: 2.2e-5 from float64, 3.5e-4 from the
    twin; the plan 1.0e-4)."""
    problems: list = []
    keep = kept_elements(first_grads)
    loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got.losses, ref.losses))
    if any(not math.isfinite(x) for x in got.losses):
        problems.append(f"non-finite loss {got.losses}")
    if precision is not None:
        tol = dict(PRECISION_TOL[precision])
        weight = _weights_together(ref, got, problems)
        if fp32 is not None:       # the precision's own rounding on this model, as for SGD
            own_w = NOISE_FACTOR * _weights_together(ref, fp32, [])
            own_l = NOISE_FACTOR * max(abs(a - b) / max(abs(b), 1e-12)
                                       for a, b in zip(fp32.losses, ref.losses))
            tol["weight"] = max(tol["weight"], own_w) if own_w <= NOISE_CAP else math.inf
            tol["loss"] = max(tol["loss"], own_l) if own_l <= NOISE_CAP else math.inf
        return {"loss": loss, "weight": weight, "weight_worst": "", "problems": problems,
                "ok": not problems and loss <= tol["loss"] and weight <= tol["weight"], "tol": tol}
    weight, worst, ratio, weight_tol = 0.0, "", 0.0, ADAM_WEIGHT_RTOL
    for name, w in ref.weights.items():
        if name not in got.weights:
            problems.append(f"no weight for {name}")
            continue
        m = keep.get(name)
        if m is None:
            m = torch.ones_like(w, dtype=torch.bool)
        if not bool(m.any()):
            continue
        w0, gw = ref.initial[name][m], got.weights[name][m]
        moved = _norm(w[m] - w0)
        floor = ADAM_FLOOR * ADAM_LR * math.sqrt(int(m.sum()))
        e = _norm(gw.double() - w[m].double()) / (moved + floor)
        allowed = ADAM_WEIGHT_RTOL
        if fp32 is not None and name in fp32.weights:     # fp32 against float64, the same way
            own = NOISE_FACTOR * _norm(w[m].double() - fp32.weights[name][m].double()) / (moved + floor)
            if own > NOISE_CAP:
                continue            # one device is that far from itself (see _worst)
            allowed = max(allowed, own)
        if e / allowed > ratio or not math.isfinite(e):
            ratio, weight, worst, weight_tol = e / allowed, e, name, allowed
    loss_tol = ADAM_LOSS_RTOL
    for twin in (fp32, exact_zeros):
        if twin is not None:
            own = NOISE_FACTOR * max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ref.losses, twin.losses))
            loss_tol = max(loss_tol, own) if own <= NOISE_CAP else math.inf
    ok = not problems and loss <= loss_tol and ratio <= 1.0
    return {"loss": loss, "weight": weight, "weight_worst": worst, "problems": problems, "ok": ok,
            "tol": {"loss": loss_tol, "weight": weight_tol}}


def verdict(sgd: dict, adam: dict) -> tuple[str, str]:
    """(status, first line) from the two comparisons."""
    for what, c in (("SGD", sgd), ("AdamW", adam)):
        if c["problems"]:
            return "fail", f"{what}: {c['problems'][0]}"
    if not sgd["ok"] and "worst" in sgd:
        _, what, err, allowed, where = sgd["worst"]
        return "fail", f"SGD: {what} err {err:.2e} > {allowed:.1e} ({where})"
    if not sgd["ok"]:
        t = sgd["tol"]
        bad = [f"{k} err {sgd[k]:.2e} > {t[k]:.0e}" + (f" ({sgd[k + '_worst']})"
                                                      if sgd.get(k + "_worst") else "")
               for k in ("loss", "grad", "weight") if not sgd[k] <= t[k]]
        return "fail", "SGD: " + "; ".join(bad)
    if not adam["ok"]:
        t = adam["tol"]
        bad = [f"{k} err {adam[k]:.2e} > {t[k]:.0e}" + (f" ({adam[k + '_worst']})"
                                                       if adam.get(k + "_worst") else "")
               for k in ("loss", "weight") if not adam[k] <= t[k]]
        return "fail", "AdamW: " + "; ".join(bad)
    return "pass", ""


def numbers(sgd: dict, adam: dict) -> dict:
    return {"loss": sgd["loss"], "grad": sgd["grad"], "grad_worst": sgd["grad_worst"],
            "weight": sgd["weight"], "weight_worst": sgd["weight_worst"],
            "adam_loss": adam["loss"], "adam_weight": adam["weight"],
            "adam_worst": adam["weight_worst"]}


def first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _precision(case: Case) -> str | None:
    return case.pin_dict.get("precision")


def _slice(t, case: Case, pm):
    """This rank's slice under batch="per_rank": data rank r of data_world contiguous parts."""
    if not case.per_rank or pm.data_world == 1 or not isinstance(t, torch.Tensor):
        return t
    return t.tensor_split(pm.data_world)[pm.data_rank]


def _rank_inputs(case: Case, b: zoo.Built, pm):
    return tuple(_slice(x, case, pm) for x in b.inputs), _slice(b.target, case, pm)


def _no_params_check(pm, rank) -> None:
    if not list(pm.parameters()):
        raise RuntimeError(f"rank {rank} holds no parameter (a pipeline stage with nothing to "
                           "train): torch.optim.SGD(pm.parameters()) raises 'optimizer got an "
                           "empty parameter list'")


# ---- on thread ranks ---------------------------------------------------------------------

_CAPTURES: dict = {}


def _captured(case: Case, b: zoo.Built):
    from autopar.capture import capture
    key = (case.arch, case.batch, case.loss)
    if key not in _CAPTURES:
        _CAPTURES[key] = capture(b.model, b.inputs, b.loss_fn, b.target)
    return _CAPTURES[key]


def plan_case(case: Case, b: zoo.Built, captured=None):
    """What ``autopar.parallelize`` does before it builds the module, on one capture:
    (plan, the graph it runs on). Raises Refused on an AutoparInputError."""
    from autopar.errors import AutoparInputError
    from autopar.solver.driver import solve
    from autopar.options import Options
    from cost_models.local_devices import local_cluster
    cluster = local_cluster(case.world)
    try:
        pins = Options.from_pins(case.pin_dict)
        cap = captured if captured is not None else _captured(case, b)
        budget = None
        if case.budget:
            budget = budget_for(case, b, cap)
        planned = solve(b.model, b.inputs, b.loss_fn, target=b.target, cluster=cluster,
                        world_size=case.world, pins=pins, memory_budget=budget, captured=cap,
                        **({"time_limit_s": BUDGET_TIME_LIMIT} if budget else {}))
    except AutoparInputError as e:
        raise Refused(first_line(e)) from e
    return planned.plan, planned.captured


# the solver's time limit per program under a memory budget: near the smallest plan it
# proves optimality slowly (the default 60 s per program took bert on 4 ranks past 3
# minutes); a FEASIBLE plan is as good a test
BUDGET_TIME_LIMIT = 5.0


def budget_for(case: Case, b: zoo.Built, cap) -> float:
    """A memory budget replication does not fit (``tests/equivalence.sharding_budget``)."""
    from autopar.solver.driver import solve
    from cost_models.local_devices import local_cluster
    rep = solve(b.model, b.inputs, b.loss_fn, target=b.target, cluster=local_cluster(case.world),
                world_size=case.world, pins={"data": case.world}, captured=cap).plan
    phased = {k for g in rep.estimate.memory_phases for k in g}
    state = sum(rep.estimate.memory_bytes.get(k, 0) for k in ("params", "grads", "optimizer")
                if k not in phased)
    return rep.estimate.memory_total - 0.4 * state


def static_problem(cap, plan, model) -> str | None:
    """``autopar verify --static`` on the case's plan (``runtime.static_verify``: every
    rank's programs type-checked, their collective orders compared): None, or the first
    problem. Run on every case before it trains, so that a rewrite the check misjudges
    (or a fault it would catch) shows in the sweep."""
    from autopar.runtime.static_verify import first_error, static_verify
    return first_error(static_verify(cap, plan, model))


def run_threads(case: Case) -> Result:
    """Run ``case`` on ranks simulated as threads of this process (an fp32 failure by a
    little is rechecked in float64: :func:`float64_recheck`)."""
    t0 = time.perf_counter()
    if case.kind in GLOO_ONLY:
        raise ValueError(f"{case.id}: {case.kind} cases run on gloo processes only (GLOO_ONLY)")
    try:
        _phase("build")
        b = zoo.cached(case.arch, case.batch, case.loss)
        phases = {"build": time.perf_counter() - t0}
        _phase("plan")
        try:
            plan, cap = plan_case(case, b)
        except Refused as e:
            return Result(case.id, "refused", str(e), seconds=time.perf_counter() - t0)
        phases["plan"] = time.perf_counter() - t0 - sum(phases.values())
        _phase("static check of every rank's programs")
        problem = static_problem(cap, plan, b.model)
        phases["static"] = time.perf_counter() - t0 - sum(phases.values())
        if problem is not None:
            return Result(case.id, "fail", f"static check: {problem.splitlines()[0][:300]}", problem,
                          seconds=time.perf_counter() - t0)
        precision = _precision(case)
        micro = micro_batches(case, plan)
        _phase(f"thread ranks on mesh {tuple(plan.mesh_shape)}")
        per_rank = _thread_runs(case, b, plan, cap)
        phases["ranks"] = time.perf_counter() - t0 - sum(phases.values())
        _phase("one-device reference")
        if precision == "fp8":
            r = judge_fp8(case, per_rank, b, (cap, plan), t0)
            if r.status == "fail" and (plan.options.zero or 0) >= 3:
                _phase("the plan's bf16 twin")
                r = judge_fp8(case, per_rank, b, (cap, plan), t0,
                              twin=bf16_twin_distances(case, b, cap, plan))
        else:
            r = judged(case, per_rank, b, precision, micro, list(plan.mesh_shape), t0,
                       split=batch_split(cap, plan))
        phases["reference"] = time.perf_counter() - t0 - sum(phases.values())
        if r.status == "fail" and precision is None and rounding_suspect(r):
            _phase("float64 recheck")
            r = float64_recheck(case, r)
            phases["float64"] = time.perf_counter() - t0 - sum(phases.values())
        r.numbers["phases"] = {k: round(v, 2) for k, v in phases.items()}
        return r
    except Exception as e:  # noqa: BLE001 - a failure of the case, reported
        from autopar.errors import AutoparInputError
        cause = e if isinstance(e, AutoparInputError) else e.__cause__
        if isinstance(cause, AutoparInputError):     # refused while building the module
            return Result(case.id, "refused", first_line(cause), seconds=time.perf_counter() - t0)
        return Result(case.id, "fail", first_line(e), traceback.format_exc()[-4000:],
                      seconds=time.perf_counter() - t0)


def _thread_runs(case: Case, b: zoo.Built, plan, cap) -> list:
    """Every thread rank's (SGD run, AdamW run) of ``case`` under ``plan``."""
    from autopar.ops.comm import ThreadWorld
    from autopar.runtime import build
    world = ThreadWorld(plan.mesh_shape)
    copies = [copy.deepcopy(b.model) for _ in range(2 * world.world)]
    loss_fn = b.loss_fn if b.target is None else None
    batch = "per_rank" if case.per_rank else "global"

    def body(comm):
        runs = []
        for i, opt_kind in enumerate(("sgd", "adamw")):
            pm = build(cap, plan, copies[2 * comm.rank + i], loss_fn, comm, batch=batch)
            _no_params_check(pm, comm.rank)
            inputs, target = _rank_inputs(case, b, pm)
            runs.append(train(pm, inputs, target, opt_kind))
        return runs
    return world.run(body)


# ---- fp32 rounding or a wrong number? The float64 recheck ---------------------------------

# an fp32 case past its tolerances by less than this (every measure of :func:`numbers`) is
# run again in float64; past it, it is a wrong number at any precision (a doubled gradient
# is an error of 1, a gradient missing from one rank's share 0.5 and more)
ROUNDING_SUSPECT = 0.1
# float64: the plan must equal one device to these (MobileViT under data=4, where fp32
# rounding amplified by AdamW over 3 steps reaches 2e-2, agrees to 1e-13 in float64)
F64_TOL = {"loss": 1e-9, "grad": 1e-7, "weight": 1e-7, "adam_loss": 1e-9, "adam_weight": 1e-6}


def rounding_suspect(r: Result) -> bool:
    """An fp32 failure on tolerance alone (no missing gradient, no non-finite loss), every
    measure below ROUNDING_SUSPECT."""
    nums = [r.numbers.get(k) for k in ("loss", "grad", "weight", "adam_loss", "adam_weight")]
    return " err " in r.message and all(isinstance(x, float) and x < ROUNDING_SUSPECT for x in nums)


def double_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64. A transformers mixture of experts computes its experts one by
    one there (``experts_implementation="eager"``): torch's grouped matmul has no float64
    kernel ("Expected mat_a to be Float32, BFloat16 or Float16")."""
    model = model.double()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"
    return model


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling file sees it under :func:`float64_casts`: its float32 is float64
    (a twin has no other floats: 16-bit casts are left alone)."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


_casts_kept = 0      # how deep :func:`float64_casts` is entered (threads, nested calls)


@contextmanager
def float64_casts(model: torch.nn.Module):
    """While the float64 twin of ``model`` is captured, planned and run: the model's own
    casts to float32 keep float64 (``x.float()`` of a float64 tensor, and ``torch.float32``
    read by the files its modules' classes are defined in). Hugging Face models cast inside
    (Qwen3-Next's gated delta rule and RMSNorms run in float32 whatever the weights are), and
    a twin with them computes partly in fp32, whose rounding cancellation amplifies: Qwen3-Next
    under ``tensor=2`` had its ``A_log`` gradient 4e-4 apart from one device in its "float64"
    twin, and 1e-16 apart with its casts kept float64."""
    global _casts_kept
    names = {type(m).__module__ for m in model.modules()} - {None}
    # those not entered already (an outer call restores its own)
    files = [sys.modules[n] for n in sorted(names)
             if not n.startswith("torch.") and getattr(sys.modules.get(n), "torch", None) is torch]
    float_ = torch.Tensor.float
    if _casts_kept == 0:
        torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else float_(t, *a, **k)
    _casts_kept += 1
    for f in files:
        f.torch = _Float64Torch("torch")
    try:
        yield
    finally:
        for f in files:
            f.torch = torch
        _casts_kept -= 1
        if _casts_kept == 0:
            torch.Tensor.float = float_


def as_float64(b: zoo.Built) -> zoo.Built:
    """A copy of the model, its floating inputs and target in float64."""
    f64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return zoo.Built(double_model(copy.deepcopy(b.model)), tuple(f64(x) for x in b.inputs), b.loss_fn,
                     f64(b.target), b.spec)


def float64_recheck(case: Case, r32: Result) -> Result:
    """Plan and run ``case`` again with the model in float64 (its own float32 casts too:
    :func:`float64_casts`), on thread ranks, against one device in float64: a rule, rewrite or runtime that computes a different function shows
    at any precision, rounding does not. Passes (saying so) where every measure is within
    F64_TOL; else the fp32 failure stands, with the float64 numbers beside it."""
    from autopar.capture import capture
    t0 = time.perf_counter()
    try:
        b = as_float64(zoo.build(case.arch, case.batch, case.loss))
        with float64_casts(b.model):
            cap = capture(b.model, b.inputs, b.loss_fn, b.target)
            plan, cap = plan_case(case, b, captured=cap)
            micro = micro_batches(case, plan)
            refs = (reference(b, "sgd", None, micro), reference(b, "adamw", None, micro), None, None)
            r64 = judge(case, _thread_runs(case, b, plan, cap), refs, None, list(plan.mesh_shape), t0)
    except Exception as e:  # noqa: BLE001 - no recheck possible: the fp32 verdict stands
        return replace(r32, detail=f"{r32.detail}; float64 recheck failed: {first_line(e)}")
    return float64_verdict(r32, r64, time.perf_counter() - t0)


def within_f64(r64: Result) -> bool:
    """Whether every measure of a float64 run is within F64_TOL (and it ran at all)."""
    return r64.status == "pass" and all(r64.numbers.get(k, 0.0) <= tol for k, tol in F64_TOL.items())


def float64_verdict(r32: Result, r64: Result, seconds: float) -> Result:
    """The fp32 failure ``r32`` judged again by its float64 run ``r64``: a pass (saying so)
    where every measure is within F64_TOL, else the failure with the float64 numbers."""
    worst = max(F64_TOL, key=lambda k: r64.numbers.get(k, 0.0) / F64_TOL[k])
    f64 = " ".join(f"{k} {r64.numbers.get(k, 0.0):.1e}" for k in F64_TOL)
    if within_f64(r64):
        return replace(r32, status="pass", message=f"fp32 rounding ({r32.message}); float64: {f64}",
                       seconds=r32.seconds + seconds)
    where = {"grad": "grad_worst", "weight": "weight_worst", "adam_weight": "adam_worst"}
    return replace(r32, detail=f"{r32.detail}; float64 recheck: {f64} ({worst} past "
                               f"{F64_TOL[worst]:.0e} {r64.numbers.get(where.get(worst), '')})",
                   seconds=r32.seconds + seconds)


def judge(case, per_rank, refs, precision, mesh, t0, first_rank: int = 0) -> Result:
    """The worst rank's verdict (``per_rank``: ranks ``first_rank, ...``; ``refs``:
    :func:`references`)."""
    worst = None
    ref_sgd, ref_adam, fp32_sgd, fp32_adam, *zeros = refs
    for rank, (sgd_run, adam_run) in enumerate(per_rank, start=first_rank):
        sgd = compare_sgd(ref_sgd, sgd_run, precision, fp32_sgd)
        adam = compare_adamw(ref_adam, adam_run, precision, ref_sgd.grads[0], fp32_adam, *zeros)
        status, msg = verdict(sgd, adam)
        nums = {**numbers(sgd, adam), "rank": rank}
        if worst is None or (status == "fail" and worst[0] != "fail"):
            worst = (status, msg, nums)
        if status == "fail":
            break
    status, msg, nums = worst
    detail = (f"loss {nums['loss']:.1e} grad {nums['grad']:.1e} ({nums['grad_worst']}) weight "
              f"{nums['weight']:.1e} ({nums['weight_worst']}); AdamW loss {nums['adam_loss']:.1e} "
              f"weight {nums['adam_weight']:.1e} ({nums['adam_worst']}); rank {nums['rank']}")
    return Result(case.id, status, msg, detail, nums, mesh, time.perf_counter() - t0)


FP8_HYPER = {"lr": LR, "momentum": MOMENTUM, "adam_lr": ADAM_LR, "steps": STEPS}


def judge_fp8(case, per_rank, b: zoo.Built, cap_plan, t0, first_rank: int = 0,
              twin: dict | None = None) -> Result:
    """An fp8 case's worst rank against one device running the same fp8 recipe on the
    plan's row blocks (``sweep_fp8``: its tolerances come from the formats). ``twin``: the
    distances of the same plan in bf16 from one device in bf16 (:func:`bf16_twin_distances`),
    allowed on top (``sweep_fp8.verdict``)."""
    cap, plan = cap_plan
    refs = sweep_fp8.references(b, cap, plan, FP8_HYPER)
    worst = None
    for rank, (sgd_run, adam_run) in enumerate(per_rank, start=first_rank):
        m = sweep_fp8.measure(sgd_run, adam_run, refs, NOISE)
        status, msg = sweep_fp8.verdict(m, twin)
        nums = {k: v for k, v in m.items() if k != "problems"}
        if worst is None or (status == "fail" and worst[0] != "fail"):
            worst = (status, msg, {**nums, "rank": rank}, sweep_fp8.detail(m, refs, plan.options.fp8_scaling))
        if status == "fail":
            break
    status, msg, nums, detail = worst
    return Result(case.id, status, msg, f"{detail}; rank {nums['rank']}", nums, list(plan.mesh_shape),
                  time.perf_counter() - t0)


def bf16_twin_distances(case: Case, b: zoo.Built, cap, plan) -> dict:
    """Under ZeRO-3 a plan gathers its weights and reduce-scatters their gradients in 16 bits,
    arithmetic the one-device fp8 recipe does not do (``torch-encoder:fp8:449841``: data 4,
    ZeRO-3, 5.58e-2 from the recipe against the bf16 run's 5.5e-2; the same plan under
    ZeRO-1 4.9e-4). Its size, measured: the same pins in bf16 (no fp8), on thread ranks,
    against one device in bf16; the worst rank's (loss, grad, weight, adam_weight)
    distances, as ``sweep_fp8`` measures them."""
    fp8_only = ("precision", "fp8_layers", "fp8_scaling", "fp8_all_gather")
    pins = {k: v for k, v in case.pin_dict.items() if k not in fp8_only}
    twin_case = replace(case, kind="bf16", pins=tuple(sorted({**pins, "precision": "bf16"}.items())))
    twin_plan, twin_cap = plan_case(twin_case, b, captured=cap)
    refs = sweep_fp8.references(b, cap, plan, FP8_HYPER)
    keep = sweep_fp8.adam_keep(refs["fp8"][0][1][0], NOISE)
    worst: dict = {}
    for sgd_run, adam_run in _thread_runs(twin_case, b, twin_plan, twin_cap):
        d = sweep_fp8.distances_of(sgd_run, adam_run, refs["bf16"], keep)
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in d.items()}
    return worst


# ---- on torch.distributed ranks (tests/sweep_worker.py) ------------------------------------

def run_dist(case: Case, float64: bool = False, group=None) -> dict:
    """Run ``case`` on this torchrun job's ranks (every rank calls it); every rank returns
    the same Result as a dict (rank 0's refusal or error; the worst rank's numbers).
    ``float64``: the model, inputs and target in float64 (:func:`float64_casts`), judged by
    F64_TOL (the recheck of a pipeline, which runs on gloo only: :func:`float64_verdict`). ``group``: where the
    ranks' outcomes are gathered (``tests/worker_loop.verdict_group``), a group none of the
    case's collectives use. A rank that fails inside ``parallelize`` raises at once (the
    worker writes its error down) rather than wait to gather: its peers may be inside
    ``parallelize``'s collectives, which would never end."""
    if float64:         # the model's own float32 casts too
        with float64_casts(_model_inputs(case).model):
            return _run_dist(case, True, group)
    return _run_dist(case, False, group)


def _run_dist(case: Case, float64: bool, group) -> dict:
    import torch.distributed as dist

    import autopar
    from autopar.errors import AutoparInputError
    t0 = time.perf_counter()
    rank = dist.get_rank()

    def model_inputs(case):
        return as_float64(_model_inputs(case)) if float64 else _model_inputs(case)
    b = model_inputs(case)
    precision = _precision(case)
    batch = "per_rank" if case.per_rank else "global"
    outcome, pms = None, []
    try:
        planned = None
        if case.budget:
            # rank 0 plans under the budget (with BUDGET_TIME_LIMIT, which parallelize does
            # not take) and every rank runs its plan
            box = [None, None]
            if rank == 0:
                try:
                    box = [plan_case(case, b)[0].to_json(), None]
                except Refused as e:
                    box = [None, str(e)]
                except Exception as e:  # noqa: BLE001 - every rank fails with it
                    box = [None, "!" + first_line(e)]
            dist.broadcast_object_list(box, 0)
            if box[1] is not None:
                if box[1].startswith("!"):
                    raise RuntimeError(f"planning on rank 0: {box[1][1:]}")
                raise Refused(box[1])
            from autopar.plan import Plan
            planned = Plan.from_dict(json.loads(box[0]))
        for _ in range(2):      # SGD's module and AdamW's, each of a fresh model
            kw = (dict(plan=pms[0].plan) if pms else dict(plan=planned) if planned is not None
                  else dict(**case.pin_dict))
            # built again, not copied: a class-weighted loss reads its model's buffer
            fresh = model_inputs(case)
            pms.append(autopar.parallelize(fresh.model, fresh.inputs, fresh.loss_fn,
                                           target=fresh.target, batch=batch, **kw))
        problem = static_problem(pms[0]._cap, pms[0].plan, b.model) if rank == 0 else None
        if problem is not None:      # rank 0's outcome is the case's (below)
            outcome = ("fail", f"static check: {problem.splitlines()[0][:300]}", problem)
    except AutoparInputError as e:
        outcome = ("refused", first_line(e), "")
    except Refused as e:
        outcome = ("refused", str(e), "")
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome, group=group)
    if any(o is not None for o in outcomes):
        # rank 0 plans: its refusal is the case's; any other rank's error is a failure
        r = 0 if outcomes[0] is not None else next(i for i, o in enumerate(outcomes) if o)
        status, msg, detail = outcomes[r]
        if r != 0:
            status, msg = "fail", f"rank {r}: {msg}"
        return Result(case.id, status, msg, detail, seconds=time.perf_counter() - t0).to_json()
    # a rank without parameters: every rank says so before any optimizer is made
    empty = [None] * dist.get_world_size()
    dist.all_gather_object(empty, not list(pms[0].parameters()), group=group)
    if any(empty):
        _no_params_check(pms[0] if empty[rank] else _Empty(), empty.index(True))
    runs = []
    for pm, opt_kind in zip(pms, ("sgd", "adamw")):
        inputs, target = _rank_inputs(case, b, pm)
        runs.append(train(pm, inputs, target, opt_kind))
    micro = micro_batches(case, pms[0].plan)
    if precision == "fp8":
        mine = judge_fp8(case, [runs], b, (pms[0]._cap, pms[0].plan), t0, first_rank=rank)
    else:
        mine = judged(case, [runs], b, precision, micro, list(pms[0].plan.mesh_shape), t0,
                      first_rank=rank, split=batch_split(pms[0]._cap, pms[0].plan))
    if float64 and mine.status == "pass" and not within_f64(mine):
        mine = replace(mine, status="fail", message="float64: past F64_TOL")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine.to_json(), group=group)
    bad = [r for r in every if r["status"] == "fail"]
    return bad[0] if bad else every[0]


class _Empty:
    def parameters(self):
        return iter(())
