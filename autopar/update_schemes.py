"""The data-parallel update schemes a user may pin, as values: :data:`SCHEMES`.

How a step's update is made over the data axis is one choice among these (none pinned: the
exact all-reduce, :class:`Exact`). Each is a small frozen dataclass that reads its value
from the pins users write (:meth:`UpdateScheme.parse`: ``compress="powersgd:4"``,
``local_sgd=8`` with ``local_sgd_warmup=``, ``averaging="async"`` with
``averaging_period=``, ``staleness=1``, ``param_server=1`` (with ``staleness=``),
``learners=2``, ``workers="accordion:1:4"`` with ``workers_lr=``, ``hogwild=4``), prints
them back (:meth:`UpdateScheme.pins`), and declares what it cannot be combined with
(:attr:`UpdateScheme.refuses`, other pins with the message that names both and the fix),
which :func:`check_update_pins` checks for every scheme alike: at most one scheme a plan,
and none of the pins it refuses.

``Options.update`` is the scheme of a set of options; the runtime's rule of each scheme is
``autopar.runtime.updates.table.RULES`` (keyed by :attr:`UpdateScheme.pin`), its price
``autopar.pricing`` (``costing`` prices the data axis's traffic of each, and
``pricing.updates.reprice_updates`` re-prices the plan of those with :attr:`repriced`).

A new scheme: a class here (added to :data:`SCHEMES`), a rule in ``autopar/runtime/updates/``
(a row of ``RULES``), and its price.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from autopar.errors import PinError

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

WORKERS_HELP = ("'accordion:W1:W2': W1 data-parallel workers train in critical regimes, W2 (W1 <= "
                "W2 <= the data degree) otherwise, e.g. workers='accordion:2:8'")


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


def positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class Refusal:
    """A pin a scheme cannot be combined with: ``pin`` when ``when(its value)``; the
    ``message`` (``str.format`` fields: ``scheme``, the scheme's pin as written; ``pin`` and
    ``value``, the other pin's name and value) names both and the fix."""
    pin: str
    when: Callable[[Any], bool]
    message: str


def above(n: int) -> Callable[[Any], bool]:
    """A pin's value refused when it is set and above ``n`` (``pipeline=2``, ``zero=1``)."""
    return lambda v: v is not None and v > n


def set_but(*allowed) -> Callable[[Any], bool]:
    """A pin's value refused when it is set to anything but ``allowed``."""
    return lambda v: v not in (None, *allowed)


def equals(x) -> Callable[[Any], bool]:
    return lambda v: v == x


def _apart(scheme_words: str, *pins: tuple[str, Callable]) -> tuple[Refusal, ...]:
    """Refusals of ``pins`` (name, when) with one message: the scheme works on (or needs)
    what ``scheme_words`` says."""
    return tuple(Refusal(p, when, "{scheme} with {pin}={value!r} is not supported: " + scheme_words
                         + "; drop one of the two pins") for p, when in pins)


# the mesh and memory features the relaxed schemes work without (the replicated update)
_REPLICATED = (("zero", set_but(0)), ("pipeline", set_but(1)), ("branch", set_but(1)),
               ("expert", set_but(1)), ("offload", set_but()))


@dataclass(frozen=True)
class UpdateScheme:
    """One way of making a step's data-parallel update (module docstring)."""

    pin: ClassVar[str | None] = None
    """The pin that chooses the scheme (``RULES``' key)."""
    takes: ClassVar[tuple[str, ...]] = ()
    """Further pins that are the scheme's parameters (given only with :attr:`pin`)."""
    doing: ClassVar[str] = "sums the gradients over the data axis exactly"
    """What the scheme does to the update, in the words of the refusal of two schemes."""
    refuses: ClassVar[tuple[Refusal, ...]] = ()
    """The other pins the scheme cannot be combined with (beside the other schemes)."""
    count_help: ClassVar[str | None] = None
    """For a scheme pinned by a count (a positive integer): what the count is, and an example."""
    repriced: ClassVar[bool] = False
    """Whether ``pricing.updates.reprice_updates`` prices the searched plan again under it."""
    check_refusal: ClassVar[str | None] = None
    """Why ``check=`` (the first step against one device) cannot run under it, or None."""

    @classmethod
    def check_values(cls, pins: dict) -> None:
        """PinError naming the form when ``pins`` give the scheme's pins a value it does not
        take (a pin of :attr:`takes` without :attr:`pin` included); the default: a count."""
        v = pins.get(cls.pin)
        if cls.count_help is not None and v is not None and not positive_int(v):
            raise PinError(f"{cls.pin}={v!r}: give {cls.count_help}")

    @classmethod
    def parse(cls, pins: dict) -> "UpdateScheme":
        """The scheme's value from ``pins`` (whose values are checked), its pin set."""
        raise NotImplementedError

    def pins(self) -> dict:
        """The pins that write this value (those set)."""
        return {}

    def written(self) -> str:
        """The scheme's pin as a user writes it, e.g. ``staleness=1``."""
        p = self.pins()
        return f"{self.pin}={p[self.pin]!r}" if self.pin in p else "the exact all-reduce"

    def check(self, pins: dict) -> None:
        """Refusals that depend on the scheme's value (beside :attr:`refuses`)."""


@dataclass(frozen=True)
class Exact(UpdateScheme):
    """No scheme pinned: the gradients summed over the data axis exactly (DDP's all-reduce)."""

    @classmethod
    def parse(cls, pins):
        return cls()


_LOSSY = (Refusal("offload", lambda v: v in ("optimizer", "disk"), "{pin}={value!r} with {scheme} is "
                  "not supported: drop one of the two pins"),
          Refusal("zero", above(0), "{scheme} works on the replicated data-parallel gradient "
                  "all-reduce; ZeRO shards it: drop zero= or the lossy pin"),
          Refusal("pipeline", above(1), "{scheme} is not supported with a pipeline yet: drop "
                  "pipeline= or the lossy pin"),
          Refusal("expert", above(1), "{pin}={value} with {scheme} is not supported yet: drop one of "
                  "the two pins"))


@dataclass(frozen=True)
class Compressed(UpdateScheme):
    """``compress=``: lossy gradient reduction (``autopar.runtime.updates.compression``);
    ``"auto"``: the solver's choice."""
    scheme: str
    pin = "compress"
    doing = "compresses each step's gradient all-reduce"
    refuses = _LOSSY + (Refusal("grad_reduce", equals("bf16"), "{scheme} and grad_reduce='bf16' both "
                                "choose how gradients are reduced: pin one of them (compress='bf16' "
                                "is the bf16 reduction)"),)

    @classmethod
    def check_values(cls, pins):
        compress_scheme(pins.get("compress"))

    @classmethod
    def parse(cls, pins):
        return cls(pins["compress"])

    def pins(self):
        return {"compress": self.scheme}


@dataclass(frozen=True)
class LocalSGD(UpdateScheme):
    """``local_sgd=H`` (``local_sgd_warmup=``): parameters averaged every H steps."""
    period: int
    warmup: int | None = None
    pin = "local_sgd"
    takes = ("local_sgd_warmup",)
    doing = "has no per-step gradient reduction: parameters are averaged every H steps"
    refuses = _LOSSY

    @classmethod
    def check_values(cls, pins):
        h, warm = pins.get("local_sgd"), pins.get("local_sgd_warmup")
        if h is not None and not positive_int(h):
            raise PinError(f"local_sgd={h!r}: give the period H (a positive integer) of parameter "
                           "averaging, e.g. local_sgd=8")
        if warm is not None and (h is None or not isinstance(warm, int) or isinstance(warm, bool)
                                 or warm < 0):
            raise PinError(f"local_sgd_warmup={warm!r}: the steps of gradient all-reduce before local "
                           "SGD begins, a non-negative integer, with local_sgd= pinned too")

    @classmethod
    def parse(cls, pins):
        return cls(pins["local_sgd"], pins.get("local_sgd_warmup"))

    def pins(self):
        return {"local_sgd": self.period} | ({} if self.warmup is None else {"local_sgd_warmup": self.warmup})


@dataclass(frozen=True)
class Averaging(UpdateScheme):
    """``averaging=`` (``averaging_period=``): BAGUA's model averaging."""
    kind: str
    period: int | None = None
    pin = "averaging"
    takes = ("averaging_period",)
    doing = "averages parameters instead of reducing gradients"
    refuses = _apart("it averages whole replicated parameters over the data axis", *_REPLICATED) + (
        Refusal("precision", equals("fp16"), "{scheme} with precision='fp16': ranks skipping different "
                "steps under dynamic loss scaling would average unlike models; pin precision='bf16'"),
        Refusal("grad_reduce", equals("bf16"), "{scheme} reduces no gradient over the data axis: drop "
                "grad_reduce='bf16'"))

    @classmethod
    def check_values(cls, pins):
        if pins.get("averaging") not in (None, *AVERAGING):
            raise PinError(f"averaging={pins['averaging']!r}: use 'decentralized' (each rank averages "
                           "its parameters with its ring neighbours) or 'async' (parameters averaged in "
                           "the background while training goes on)")
        period = pins.get("averaging_period")
        if period is not None and (not positive_int(period) or pins.get("averaging") is None):
            raise PinError(f"averaging_period={period!r}: the steps between model averagings, a "
                           "positive integer, with averaging='decentralized' or 'async' pinned too")

    @classmethod
    def parse(cls, pins):
        return cls(pins["averaging"], pins.get("averaging_period"))

    def pins(self):
        return {"averaging": self.kind} | ({} if self.period is None else {"averaging_period": self.period})


_RELAXED = _apart("it works on the replicated data-parallel update", *_REPLICATED) + (
    Refusal("precision", equals("fp16"), "{scheme} with precision='fp16': a delayed or averaged update "
            "cannot follow dynamic loss scaling's skipped steps; pin precision='bf16'"),
    Refusal("grad_reduce", equals("bf16"), "{scheme} reduces gradients (or parameters) in fp32: drop "
            "grad_reduce='bf16'"))
_NOT_HELD = ("a rank does not hold them (delayed, on their server, or per learner): pass check=False "
             "(or unset AUTOPAR_CHECK)")


@dataclass(frozen=True)
class Stale(UpdateScheme):
    """``staleness=s``: each step applies the gradient of s steps before."""
    staleness: int
    pin = "staleness"
    doing = "applies each gradient s steps late"
    refuses = _RELAXED
    count_help = ("the delay s >= 1 in steps of each gradient (1: a step's reduction overlaps the whole "
                  "next step), e.g. staleness=1; drop it for synchronous updates")
    repriced = True
    check_refusal = _NOT_HELD

    @classmethod
    def parse(cls, pins):
        return cls(pins["staleness"])

    def pins(self):
        return {"staleness": self.staleness}


@dataclass(frozen=True)
class ParamServer(UpdateScheme):
    """``param_server=k`` (with ``staleness=``: the servers apply pushed gradients that late)."""
    servers: int
    staleness: int | None = None
    pin = "param_server"
    takes = ("staleness",)
    doing = "pushes gradients to server ranks that step the parameters"
    refuses = _RELAXED
    count_help = ("the number of server ranks (>= 1, at most the data-parallel degree) that own the "
                  "parameter shards, e.g. param_server=1")
    repriced = True
    check_refusal = _NOT_HELD

    @classmethod
    def parse(cls, pins):
        return cls(pins["param_server"], pins.get("staleness"))

    def pins(self):
        return {"param_server": self.servers} | ({} if self.staleness is None else {"staleness": self.staleness})


@dataclass(frozen=True)
class Learners(UpdateScheme):
    """``learners=m``: Crossbow's m model replicas a rank."""
    learners: int
    pin = "learners"
    doing = "trains m replicas a rank, each stepping every step on its own share of the batch"
    refuses = (Refusal("accumulate", set_but(), "{scheme} (Crossbow) with {pin}={value!r} is not "
                       "supported: each learner steps every step on its own share of the batch; drop "
                       "one of the two pins"),) + tuple(
        Refusal(p, above(1), "{scheme} (Crossbow) keeps whole model replicas per rank; {pin}={value} "
                "splits them: drop {pin}= (or pin {pin}=1)") for p in ("tensor", "context")) + _RELAXED
    count_help = "the number of learners (model replicas, >= 1) per rank, e.g. learners=2"
    repriced = True
    check_refusal = _NOT_HELD

    @classmethod
    def parse(cls, pins):
        return cls(pins["learners"])

    def pins(self):
        return {"learners": self.learners}


_WHY_IDLE = {"pipeline": "a pipeline's stages exchange activations across ranks",
             "zero": "ZeRO shards the data axis's reduction (zero=3 gathers weights over it in forward)",
             "offload": "offload runs on ZeRO's shards",
             "expert": "the expert axis splits the batch and exchanges tokens across it in forward",
             "branch": "branch groups exchange activations",
             "compile": "the compiled programs are not checked for it"}


@dataclass(frozen=True)
class Workers(UpdateScheme):
    """``workers="accordion:W1:W2"`` (``workers_lr=``): Accordion's batch-size form."""
    schedule: str
    lr: str | None = None
    pin = "workers"
    takes = ("workers_lr",)
    doing = "trains W1 or W2 of the data ranks each step"
    refuses = tuple(
        Refusal(p, when, "{scheme} with {pin}={value!r} is not supported: idle data ranks skip forward "
                "and backward, and " + _WHY_IDLE[p] + "; drop one of the two pins")
        for p, when in (("pipeline", set_but(1)), ("zero", set_but(0)), ("offload", set_but()),
                        ("expert", set_but(1)), ("branch", set_but(1)), ("compile", set_but(False)))) + (
        Refusal("grad_reduce", equals("bf16"), "{scheme} reduces the data axis's gradient in the "
                "gradients' dtype: drop grad_reduce='bf16'"),)
    repriced = True

    @classmethod
    def check_values(cls, pins):
        workers_schedule(pins.get("workers"))
        lr = pins.get("workers_lr")
        if lr is not None and (lr not in WORKERS_LR or pins.get("workers") is None):
            raise PinError(f"workers_lr={lr!r}: 'linear' (the default: the learning rate scaled by the "
                           "workers that train over W2) or 'constant', with workers='accordion:W1:W2' "
                           "pinned too")

    @classmethod
    def parse(cls, pins):
        return cls(pins["workers"], pins.get("workers_lr"))

    def pins(self):
        return {"workers": self.schedule} | ({} if self.lr is None else {"workers_lr": self.lr})

    @property
    def counts(self) -> tuple[int, int]:
        """(W1, W2)."""
        return workers_schedule(self.schedule)

    def check(self, pins):
        high, data = self.counts[1], pins.get("data")
        if data is not None and data < high:
            raise PinError(f"{self.written()} trains W2={high} data-parallel workers outside critical "
                           f"regimes, more than data={data}: pin data= >= {high}, or a smaller W2")

    @property
    def check_refusal(self) -> str:
        return (f"the first step (a critical regime) trains on W1={self.counts[0]} workers' batches "
                "only: pass check=False (or unset AUTOPAR_CHECK)")


@dataclass(frozen=True)
class Hogwild(UpdateScheme):
    """``hogwild=P``: P processes of one host on shared parameters (``autopar.hogwild``)."""
    processes: int
    pin = "hogwild"
    doing = "runs processes of one host on shared parameters"
    count_help = ("the number of processes (>= 1) that share the parameters on this host, e.g. "
                  "autopar.hogwild(model, ..., processes=4)")

    @classmethod
    def parse(cls, pins):
        return cls(pins["hogwild"])

    def pins(self):
        return {"hogwild": self.processes}

    def check(self, pins):
        """Hogwild takes no other pin (the defaults written out are not others)."""
        others = sorted(n for n, v in pins.items() if n != "hogwild" and v is not None
                        and not (n == "pipeline" and v == 1) and not (n == "offload" and v == "none")
                        and not (n == "compile" and v is False))
        if others:
            raise PinError(f"hogwild={self.processes} runs the whole model in each process of one host "
                           f"on shared parameters; it takes no other pin ({', '.join(others)}): drop "
                           "them, or drop hogwild=")


SCHEMES: tuple[type[UpdateScheme], ...] = (Compressed, LocalSGD, Averaging, Stale, ParamServer,
                                           Learners, Workers, Hogwild)
"""Every scheme but :class:`Exact`, in the order refusals name them."""
UPDATE_PINS = tuple(s.pin for s in SCHEMES)
"""The pins that choose a scheme."""
COUNT_PINS = tuple(s.pin for s in SCHEMES if s.count_help is not None)
"""The schemes pinned by a count (``staleness``, ``param_server``, ``learners``, ``hogwild``)."""


def _chosen(pins: dict, scheme: type[UpdateScheme]) -> bool:
    v = pins.get(scheme.pin)
    return v not in (None, "none") if scheme is Compressed else v is not None


def pinned_schemes(pins: dict) -> list[UpdateScheme]:
    """The schemes ``pins`` choose (a pin that is another chosen scheme's parameter, as
    ``staleness=`` is ``param_server=``'s, is not a scheme of its own)."""
    chosen = [s for s in SCHEMES if _chosen(pins, s)]
    taken = {p for s in chosen for p in s.takes}
    return [s.parse(pins) for s in chosen if s.pin not in taken]


def scheme_of(pins: dict) -> UpdateScheme:
    """The one scheme ``pins`` choose (checked), or :class:`Exact`."""
    chosen = pinned_schemes(pins)
    return chosen[0] if chosen else Exact()


def check_update_pins(pins: dict) -> None:
    """Refuse, for every scheme alike, two schemes at once and a scheme with a pin it
    declares it cannot be combined with (PinError naming both pins and the fix)."""
    chosen = pinned_schemes(pins)
    if len(chosen) > 1:
        a, b = chosen[:2]
        raise PinError(f"{a.written()} ({a.doing}) and {b.written()} ({b.doing}) both change how the "
                       f"data-parallel update is made: pin one of them (drop one of the two pins, {b.pin}= or "
                       f"{a.pin}=)")
    for scheme in chosen:
        scheme.check(pins)
        for r in scheme.refuses:
            if r.when(pins.get(r.pin)):
                raise PinError(r.message.format(scheme=scheme.written(), pin=r.pin, value=pins[r.pin]))
