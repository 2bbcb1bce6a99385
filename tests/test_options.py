"""Options as data (``autopar/options.py``): one typed value per option, checked once,
values before combinations, implications applied without touching the user's pins, and a
mapping of the options that are set (the form plans and pins had)."""
from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from autopar import options as options_mod
from autopar.errors import ArgumentError, PinError
from autopar.options import NAMES, UPDATE_PIN_HELP, Options
from autopar.update_schemes import Exact, LocalSGD, ParamServer


def test_every_option_is_typed_and_documented():
    """Each field has a type and a docstring under it (the one place that says what it is)."""
    tree = ast.parse(Path(inspect.getsourcefile(options_mod)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    body = cls.body
    documented = {s.target.id for s, nxt in zip(body, body[1:])
                  if isinstance(s, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    # the update scheme is one field (``update``), written with its pins, each documented
    assert "update" in documented and all(UPDATE_PIN_HELP.values())
    pins = (documented - {"update"}) | set(UPDATE_PIN_HELP)
    assert set(NAMES) == pins, set(NAMES) ^ pins


def test_the_update_scheme_is_one_stored_field():
    """``Options.update`` holds the scheme; its pins are parsed into it and read back."""
    stored = [f.name for f in fields(Options)]
    assert "update" in stored and not set(UPDATE_PIN_HELP) & set(stored)
    opts = Options.from_pins(data=2, param_server=1, staleness=2)
    assert opts.update == ParamServer(1, 2) and (opts.param_server, opts.staleness) == (1, 2)
    assert opts.pinned() == {"data": 2, "pipeline": 1, "staleness": 2, "param_server": 1}
    assert Options.from_pins(update=LocalSGD(8, 3), data=2) == Options.from_pins(
        local_sgd=8, local_sgd_warmup=3, data=2)
    assert opts.replace(update=LocalSGD(4)).update == LocalSGD(4)
    assert opts.replace(param_server=None, staleness=None).update == Exact()
    none = Options.from_pins(compress="none")      # the exact all-reduce, written out
    assert none.update == Exact() and none.compress is None and none == {}
    with pytest.raises(ArgumentError, match="update='local_sgd': pass a scheme"):
        Options.from_pins(update="local_sgd")


def test_built_once_without_touching_the_pins():
    given = {"data": 2, "offload": "optimizer", "recompute": ["h.0"]}
    opts = Options.from_pins(given)
    assert given == {"data": 2, "offload": "optimizer", "recompute": ["h.0"]}
    assert opts.zero == 2 and opts.pipeline == 1 and opts.recompute == ("h.0",)
    assert Options.from_pins(opts) == opts and hash(Options.from_pins(opts)) == hash(opts)
    with pytest.raises(Exception):
        opts.zero = 3                                   # frozen


def test_an_unknown_value_is_named_before_a_combination():
    """``schedule="banana"`` without a pipeline is first an unknown schedule (a value), not
    "schedule= needs pipeline parallelism" (a combination)."""
    with pytest.raises(PinError, match="unknown schedule 'banana'"):
        Options.from_pins(schedule="banana")
    with pytest.raises(PinError, match="the pin schedule= needs pipeline parallelism"):
        Options.from_pins(schedule="gpipe")
    with pytest.raises(ArgumentError, match=r"unknown pin\(s\) \['dta'\]"):
        Options.from_pins(dta=2)


def test_replace_checks_again():
    opts = Options.from_pins(data=2, compress="bf16")
    with pytest.raises(PinError, match="ZeRO shards it"):
        opts.replace(zero=3)
    assert opts.replace(compress=None) == {"data": 2, "pipeline": 1}


def test_a_mapping_of_what_is_set():
    opts = Options.from_pins(data=2, precision="bf16")
    assert dict(opts) == {"data": 2, "precision": "bf16"} and opts.get("zero") is None
    assert "data" in opts and "zero" not in opts and len(opts) == 2
    assert opts.pinned() == {"data": 2, "precision": "bf16"} and opts.data == 2
    assert {**opts, "tensor": 2} == {"data": 2, "precision": "bf16", "tensor": 2}
