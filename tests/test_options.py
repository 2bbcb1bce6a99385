"""Options as data (``autopar/options.py``): one typed value per option, checked once,
values before combinations, implications applied without touching the user's pins, and a
mapping of the options that are set (the form plans and pins had)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from autopar import options as options_mod
from autopar.errors import ArgumentError, PinError
from autopar.options import NAMES, Options


def test_every_option_is_typed_and_documented():
    """Each field has a type and a docstring under it (the one place that says what it is)."""
    tree = ast.parse(Path(inspect.getsourcefile(options_mod)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    body = cls.body
    documented = {s.target.id for s, nxt in zip(body, body[1:])
                  if isinstance(s, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    assert set(NAMES) == documented, set(NAMES) ^ documented


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
