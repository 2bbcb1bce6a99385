"""The data-parallel update schemes as values (``autopar.update_schemes``) and their runtime
contract (``autopar.runtime.updates``): one table each, one generic check.

- every scheme reads its pins and writes them back unchanged (the pins users write keep
  working), and ``Options.update`` is that value;
- any two schemes pinned together are refused by the one generic check, with a message that
  names both pins and the fix (``param_server=`` with ``staleness=`` is one scheme);
- every refusal a scheme declares fires, naming the scheme's pin and the other;
- the runtime's table has a rule maker for every scheme, and the runtime's callers
  (``ParallelModule``, ``dcp_state``) probe no scheme class;
- the contract's defaults are the exact all-reduce's.
"""
from __future__ import annotations

import inspect
import itertools
import re

import pytest
import torch

from autopar.errors import PinError
from autopar.options import NAMES, Options
from autopar.runtime import dcp_state, parallel_module
from autopar.runtime.updates import RULES, ExactAllReduce, UpdateRule
from autopar.update_schemes import (
    SCHEMES, UPDATE_PINS, Averaging, Compressed, Exact, Hogwild, Learners, LocalSGD, ParamServer,
    Stale, Workers, pinned_schemes,
)

EXAMPLES = {
    Compressed: {"compress": "powersgd:4"},
    LocalSGD: {"local_sgd": 8, "local_sgd_warmup": 3},
    Averaging: {"averaging": "async", "averaging_period": 2},
    Stale: {"staleness": 1},
    ParamServer: {"param_server": 1, "staleness": 2},
    Learners: {"learners": 2},
    Workers: {"workers": "accordion:1:4", "workers_lr": "constant"},
    Hogwild: {"hogwild": 3},
}
"""One pinning of every scheme, with its parameters."""


def test_every_scheme_has_an_example():
    assert set(EXAMPLES) == set(SCHEMES)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.pin)
def test_scheme_reads_and_writes_its_pins(scheme):
    pins = EXAMPLES[scheme]
    value = scheme.parse(pins)
    assert value.pins() == pins
    assert set(pins) == {scheme.pin, *scheme.takes}, "a pin of the scheme is not its own"
    assert set(pins) <= set(NAMES)
    opts = Options.from_pins(pins)
    assert opts.update == value
    assert {k: v for k, v in dict(opts).items() if k in pins} == pins


def test_no_scheme_is_the_exact_all_reduce():
    assert Options.from_pins(data=2).update == Exact()
    assert Options.from_pins(compress="none").update == Exact()
    assert Options.from_pins(compress="auto").update == Compressed("auto")   # the solver chooses


def _pair_pins(a, b) -> dict:
    if ParamServer in (a, b):      # its example pins staleness=, a scheme of its own
        return {**EXAMPLES[a if b is ParamServer else b], "param_server": 1}
    return {**EXAMPLES[a], **EXAMPLES[b]}


@pytest.mark.parametrize("a,b", [(a, b) for a, b in itertools.combinations(SCHEMES, 2)
                                 if {a, b} != {Stale, ParamServer}], ids=lambda s: s.pin)
def test_two_schemes_are_refused_naming_both(a, b):
    pins = _pair_pins(a, b)
    assert len(pinned_schemes(pins)) == 2, pins
    with pytest.raises(PinError) as e:
        Options.from_pins(pins)
    msg = str(e.value)
    assert f"{a.pin}=" in msg and f"{b.pin}=" in msg, msg
    assert "pin one of them" in msg or "drop" in msg, msg


def test_param_server_takes_staleness():
    assert pinned_schemes({"param_server": 1, "staleness": 2}) == [ParamServer(1, 2)]
    Options.from_pins(param_server=1, staleness=2)      # one scheme: accepted


_REFUSED_VALUE = {"zero": 1, "pipeline": 2, "branch": 2, "expert": 2, "offload": "optimizer",
                  "precision": "fp16", "grad_reduce": "bf16", "accumulate": 2, "tensor": 2,
                  "context": 2, "compile": True}


@pytest.mark.parametrize("scheme,refusal", [(s, r) for s in SCHEMES for r in s.refuses],
                         ids=lambda x: getattr(x, "pin", None) or "")
def test_declared_refusal_fires_naming_both(scheme, refusal):
    value = _REFUSED_VALUE[refusal.pin]
    assert refusal.when(value)
    pins = {**EXAMPLES[scheme], refusal.pin: value}
    if refusal.pin == "grad_reduce":
        pins["precision"] = "bf16"
    with pytest.raises(PinError) as e:
        Options.from_pins(pins)
    msg = str(e.value)
    assert f"{scheme.pin}=" in msg and refusal.pin in msg, msg
    assert re.search(r"drop|pin", msg), msg


def test_runtime_table_has_every_scheme():
    assert set(RULES) == set(UPDATE_PINS)


def test_runtime_callers_do_not_probe_schemes():
    """ParallelModule and dcp_state call the UpdateRule contract: no getattr/hasattr on the
    rule, no scheme class named."""
    classes = {"LocalSGD", "ModelAveraging", "ActiveWorkers", "ParamServer", "Stale", "Delayed",
               "LocalGrads", "Accordion", "PowerSGD"}
    for module in (parallel_module, dcp_state):
        src = inspect.getsource(module)
        assert not re.search(r"(getattr|hasattr)\([^)]*reducer", src), module.__name__
        named = {c for c in classes if re.search(rf"\b{c}\b", src)}
        assert not named, (module.__name__, named)


def test_contract_defaults_are_the_exact_all_reduce():
    rule = ExactAllReduce()
    assert isinstance(rule, UpdateRule) and rule.axis is None
    assert rule.lr_scale is None and rule.state_dict() is None
    calls = []
    assert rule.optimizer_step(lambda: calls.append(1) or True, []) is True and calls == [1]
    grads = {"w": torch.ones(2)}
    assert rule.global_grads(grads) is grads
    rule.load_state_dict({"anything": 1})       # a rule with no state takes none
    with pytest.raises(NotImplementedError, match="define start"):
        type("Axis", (UpdateRule,), {"axis": 0})().start((), [])
