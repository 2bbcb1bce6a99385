"""What the ``autopar`` commands share: errors that exit 2 (bad input) or 1 (a failed
check), consoles, parsing of ``KEY=VALUE`` options, pins, sizes and meshes, loading the
user's model factory and plan files."""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
import torch

from autopar import hf_models
from autopar.capture import capture, fingerprint
from autopar.errors import AutoparInputError
from autopar.plan import Plan, PlanError
from autopar.solver.accumulate import capture_accumulated
from autopar.options import KNOWN_PINS


# bad input (exit 2): the library's input errors, and files the user named that cannot be
# read or written; any other exception is a bug in autopar (exit 3)
USER_ERRORS: tuple[type[BaseException], ...] = (AutoparInputError, OSError)


class UserError(click.ClickException):
    """Bad input: printed as one line, exit code 2."""
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"autopar: error: {self.format_message()}", err=True)


class Failed(click.ClickException):
    """A check failed: exit code 1."""
    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"autopar: {self.format_message()}", err=True)


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 6 else " ".join(lines[:6]) + " ..."


# ---- consoles --------------------------------------------------------------------------------
def _console(stderr: bool = False):
    from rich.console import Console        # rich: loaded when there is something to print
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else 200, highlight=False,
                   soft_wrap=not tty, force_terminal=None if tty else False)


@contextlib.contextmanager
def _progress(quiet: bool = False):
    """Steps with spinners and times, on stderr (stdout stays for the result). ``with
    step(text) as line:`` shows one step; ``line(more)`` rewrites its line in place as
    ``short: more`` (``short``: ``text`` up to its first " (", to fit a terminal's line: a
    long search's stage and best plan so far), ``line(more, final=True)`` the text it ends
    with, ``short: more``.
    ``quiet``: nothing is shown."""
    if quiet:
        @contextlib.contextmanager
        def silent(text: str):
            yield lambda more, final=False: None
        yield silent
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # rich, as above
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=_console(stderr=True), transient=False) as p:
        @contextlib.contextmanager
        def step(text: str):
            task = p.add_task(text, total=1)
            end = [text + " [green]done[/]"]

            def line(more: str, final: bool = False) -> None:
                if final:
                    end[0] = f"{text.split(' (')[0]}: {more} [green]done[/]"
                else:
                    p.update(task, description=f"{text.split(' (')[0]}: {more}")
            yield line
            p.update(task, completed=1, description=end[0])
        yield step


# ---- parsing helpers -------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """``8`` -> 8, ``0.5`` -> 0.5, ``true`` -> True, ``none`` -> None, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        v = ast.literal_eval(text.strip())
        if isinstance(v, (int, float)):
            return v
    except (ValueError, SyntaxError):
        pass
    return text.strip()


def parse_pairs(items, what: str) -> dict[str, Any]:
    """``("batch=8", "config=gpt-1.3b,seed=1")`` -> {"batch": 8, "config": "gpt-1.3b", "seed": 1}."""
    out = {}
    for item in items or ():
        for part in filter(None, (p.strip() for p in item.split(","))):
            if "=" not in part:
                raise UserError(f"{what} {part!r} is not key=value (e.g. batch=8)")
            k, v = part.split("=", 1)
            out[k.strip()] = parse_value(v)
    return out


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.I)


def parse_bytes(text: str) -> float:
    """``40GB`` (10^9) / ``40GiB`` (2^30) / ``512MiB`` / ``1e9`` -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"cannot read the memory budget {text!r}: write e.g. 40GB, 40GiB or 512MiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    power = " kmgtp".index(unit[0]) if unit else 0
    base = 1024 if unit.endswith("i") else 1000
    return float(m.group(1)) * base ** power


def parse_pins(items) -> dict[str, Any]:
    pins = parse_pairs(items, "--pin")
    unknown = sorted(set(pins) - KNOWN_PINS)
    if unknown:
        raise UserError(f"unknown pin(s) {unknown}: pins are {sorted(KNOWN_PINS)} (e.g. --pin tensor=2)")
    return pins


def parse_mesh(text: str | None):
    if not text:
        return None
    try:
        return tuple(int(n) for n in re.split(r"[x,]", text))
    except ValueError:
        raise UserError(f"cannot read --mesh {text!r}: write it as 2x4") from None


# ---- factories -------------------------------------------------------------------------------
def is_hf(spec: str | None) -> bool:
    """``hf:NAME`` / ``hf:PATH/config.json``: a transformers model by its config
    (``autopar.hf_models``), planned on the meta device."""
    return bool(spec) and spec.startswith("hf:")


def load_factory(spec: str):
    """``package.module:factory``, ``path/to/file.py:factory`` or ``hf:NAME`` -> the callable
    (for ``hf:``, the config is read now: a bad name or file fails here)."""
    if is_hf(spec):
        name = spec[3:]
        hf_models.load_config(name)
        return functools.partial(hf_models.build, name)
    if ":" not in spec:
        raise UserError(f"{spec!r} is not MODULE:FACTORY (e.g. examples.models:gpt_factory) "
                        "or hf:NAME (e.g. hf:llama3-8b)")
    mod_name, _, attr = spec.rpartition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())       # as `python -m` does: the current folder
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.exists():
                raise UserError(f"no file {mod_name} (from {spec!r})")
            s = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(s)
            sys.modules[path.stem] = module      # dataclasses and pickling look it up
            s.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise UserError(f"cannot import {mod_name!r} ({e}); run from the folder that holds it "
                        "or put it on PYTHONPATH") from e
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise UserError(f"importing {mod_name} failed: {type(e).__name__}: {_one_line(e)}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{mod_name} has no callable {attr!r}; FACTORY must be a function "
                        "returning (model, inputs, loss_fn, target) or an object with those fields")
    return fn


class Example:
    def __init__(self, model, inputs, loss_fn, target):
        self.model, self.inputs, self.loss_fn, self.target = model, inputs, loss_fn, target


def build_example(spec: str, args: dict, meta: bool = False) -> Example:
    """Call the factory (under ``torch.device("meta")`` when ``meta``) and normalise what
    it returns to (model, inputs tuple, loss_fn, target)."""
    fn = load_factory(spec)
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            got = fn(**args)
    except Exception as e:  # noqa: BLE001 - the factory is the user's code: say which call failed
        if is_hf(spec) and isinstance(e, AutoparInputError):
            raise             # hf_models' own message names the flag to fix
        call = f"{spec}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
        raise UserError(f"{call} failed: {type(e).__name__}: {_one_line(e)}") from e
    if all(hasattr(got, a) for a in ("model", "inputs")):
        model, inputs = got.model, got.inputs
        loss_fn, target = getattr(got, "loss_fn", None), getattr(got, "target", None)
    elif isinstance(got, (tuple, list)) and 2 <= len(got) <= 4:
        model, inputs, loss_fn, target = (*got, None, None)[:4]
    else:
        raise UserError(f"{spec} returned {type(got).__name__}; it must return (model, inputs, "
                        "loss_fn, target) or an object with .model .inputs .loss_fn .target")
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"{spec} returned a model of type {type(model).__name__}, not a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if target is None:
        loss_fn = None        # the model returns its own loss, or there is none
    return Example(model, tuple(inputs), loss_fn, target)


_CAPTURED: dict = {}      # (spec, args, meta, accumulate) -> (example, captured): one capture per process


def capture_for(plan, spec: str, args: dict, meta: bool):
    """The captured graph of the factory's model, checked against the plan's fingerprint."""
    key = (spec, tuple(sorted((k, repr(v)) for k, v in args.items())), meta, plan.accumulate)
    if key not in _CAPTURED:
        ex = build_example(spec, args, meta)
        # gradient accumulation: the graph of one micro-batch, as the plan was made for
        _CAPTURED[key] = ex, (capture_accumulated(ex.model, ex.inputs, ex.loss_fn, ex.target,
                                                  plan.accumulate) if plan.accumulate > 1 else
                              capture(ex.model, ex.inputs, ex.loss_fn, ex.target))
    ex, cap = _CAPTURED[key]
    fp = fingerprint(cap)
    if fp != plan.fingerprint:
        raise PlanError(f"the plan was made for another graph (fingerprint {plan.fingerprint}, "
                        f"{spec} gives {fp}): pass the --factory and --factory-args the plan was "
                        "made with")
    return ex, cap


def load_plan(path: str):
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no plan file {path!r}: make one with `autopar plan MODULE:FACTORY -o {path}`")
    try:
        return Plan.load(p)
    except PlanError as e:
        msg = _one_line(e)
        msg = msg if msg.startswith(str(path)) else f"{path}: {msg}"
        raise UserError(f"{msg}; make a new one with `autopar plan`") from e
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path}: cannot read the plan ({e})") from e


_factory_options = [
    click.option("--factory-args", "factory_args", multiple=True, metavar="KEY=VALUE[,...]",
                 help="keyword arguments for the factory, e.g. batch=8,config=gpt-1.3b"),
    click.option("--meta", is_flag=True, help='build the model under torch.device("meta") (no '
                 "memory; hf: models always are, but for verify and show --code)"),
    click.option("--batch", type=click.IntRange(min=1), default=None,
                 help="batch size (hf: models; a factory gets batch=)"),
    click.option("--seq", type=click.IntRange(min=1), default=None,
                 help="sequence length (hf: language models; a factory gets seq=)"),
    click.option("--layers", type=click.IntRange(min=1), default=None,
                 help="keep the first N layers (hf: models, for a quick look; a factory gets layers=)"),
]
_SHORTHANDS = ("batch", "seq", "layers")


def factory_options(f):
    """The model options every command that builds a model shares; ``--batch B`` /
    ``--seq S`` / ``--layers N`` reach the command as ``--factory-args`` ``batch=B`` ... ."""
    @functools.wraps(f)
    def wrapper(*a, **kw):
        given = {k: kw.pop(k) for k in _SHORTHANDS}
        extra = tuple(f"{k}={v}" for k, v in given.items() if v is not None)
        if extra:
            args = parse_pairs(kw.get("factory_args"), "--factory-args")
            twice = [k for k, v in given.items() if v is not None and k in args]
            if twice:
                raise UserError(f"--{twice[0]} and --factory-args {twice[0]}=...: give it once")
            kw["factory_args"] = tuple(kw.get("factory_args") or ()) + extra
        return f(*a, **kw)
    for opt in reversed(_factory_options):
        wrapper = opt(wrapper)
    return wrapper
