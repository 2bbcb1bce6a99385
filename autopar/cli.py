"""The ``autopar`` command: plan, show, explain, diff, viz, verify, demo.

Exit codes: 0 ok; 1 a check failed (``verify``); 2 bad usage or input, with one line that
says what is wrong and how to fix it (no traceback for a user's error).

    autopar plan examples.models:gpt_factory --cluster 2xdgx-a100 --meta \\
        --factory-args config=gpt-1.3b -o plan.json
    autopar show plan.json
    autopar explain plan.json linear --factory examples.models:gpt_factory ...
    autopar viz plan.json -o report.html --factory examples.models:gpt_factory ...
    autopar verify examples.models:gpt_factory --nproc 4 --pin data=2 --pin tensor=2
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import click

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.solver.driver import solve
from autopar.solver.pins import KNOWN_PINS, check_pins, pipelined

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, NotImplementedError, FileNotFoundError)


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


class _Group(click.Group):
    """Turns the library's errors about the user's input into exit code 2 and one line."""

    def invoke(self, ctx):
        from autopar.capture import CaptureError
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (CaptureError, *USER_ERRORS) as e:
            raise UserError(_one_line(e)) from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines) if len(lines) <= 6 else " ".join(lines[:6]) + " ..."


# ---- consoles --------------------------------------------------------------------------------
def _console(stderr: bool = False):
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else 200, highlight=False,
                   soft_wrap=not tty, force_terminal=None if tty else False)


@contextlib.contextmanager
def _progress():
    """Steps with spinners and times, on stderr (stdout stays for the result)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=_console(stderr=True), transient=False) as p:
        @contextlib.contextmanager
        def step(text: str):
            task = p.add_task(text, total=1)
            yield
            p.update(task, completed=1, description=text + " [green]done[/]")
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
def load_factory(spec: str):
    """``package.module:factory`` or ``path/to/file.py:factory`` -> the callable."""
    if ":" not in spec:
        raise UserError(f"{spec!r} is not MODULE:FACTORY (e.g. examples.models:gpt_factory)")
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
    import torch
    fn = load_factory(spec)
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            got = fn(**args)
    except Exception as e:  # noqa: BLE001 - the factory is the user's code: say which call failed
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


_CAPTURED: dict = {}      # (spec, args, meta) -> (example, captured): one capture per process


def capture_for(plan, spec: str, args: dict, meta: bool):
    """The captured graph of the factory's model, checked against the plan's fingerprint."""
    from autopar.capture import capture, fingerprint
    from autopar.plan import PlanError
    key = (spec, tuple(sorted((k, repr(v)) for k, v in args.items())), meta)
    if key not in _CAPTURED:
        ex = build_example(spec, args, meta)
        _CAPTURED[key] = ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    ex, cap = _CAPTURED[key]
    fp = fingerprint(cap)
    if fp != plan.fingerprint:
        raise PlanError(f"the plan was made for another graph (fingerprint {plan.fingerprint}, "
                        f"{spec} gives {fp}): pass the --factory and --factory-args the plan was "
                        "made with")
    return ex, cap


def load_plan(path: str):
    from autopar.plan import Plan, PlanError
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no plan file {path!r}: make one with `autopar plan MODULE:FACTORY -o {path}`")
    try:
        return Plan.load(p)
    except PlanError as e:
        raise UserError(f"{path}: {_one_line(e)}; make a new one with `autopar plan`") from e
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path}: cannot read the plan ({e})") from e


_factory_options = [
    click.option("--factory-args", "factory_args", multiple=True, metavar="KEY=VALUE[,...]",
                 help="keyword arguments for the factory, e.g. batch=8,config=gpt-1.3b"),
    click.option("--meta", is_flag=True, help='build the model under torch.device("meta") (no memory)'),
]


def factory_options(f):
    for opt in reversed(_factory_options):
        f = opt(f)
    return f


def _solve(step, ex: Example, cl, world: int, pins: dict, **kw):
    """``autopar.solver.driver.solve`` (as ``autopar.plan``), its steps shown by ``step``:
    the full-batch capture (unless a pipeline is pinned: that captures at its micro-batch),
    then the search."""
    cap, capture_s = None, None
    if not pipelined(pins):
        with step("capturing the training graph (torch.export)"):
            t0 = time.perf_counter()
            cap = capture(ex.model, ex.inputs, ex.loss_fn if ex.target is not None else None,
                          ex.target)
            capture_s = time.perf_counter() - t0
    what = "pipelines, meshes" if pipelined(pins) or cl.nodes > 1 else "meshes"
    with step(f"solving ({what}) for {world} devices of {cl.name}"):
        return solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cl,
                     world_size=world, pins=pins, captured=cap, capture_s=capture_s, **kw).plan


# ---- commands --------------------------------------------------------------------------------
@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autopar")
def cli():
    """autopar: automatic parallelization for PyTorch. Plan, read, check."""


@cli.command()
@click.argument("factory")
@click.option("--cluster", default="cpu:4", show_default=True,
              help="e.g. 4xdgx-h100, 4x8xH100, 128xdgx-a100, cpu:4")
@click.option("--budget", default=None, help="memory per device, e.g. 40GB or 40GiB")
@click.option("--pin", "pins", multiple=True, metavar="NAME=VALUE",
              help="fix one choice: data=, tensor=, zero= (repeatable)")
@click.option("--world", type=click.IntRange(min=1), default=None, help="devices (default: the cluster's)")
@click.option("--mesh", default=None, help="mesh shape, e.g. 2x4")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "adam", "sgd_momentum", "sgd"]))
@click.option("--time-limit", default=60.0, show_default=True, help="solver time limit (s)")
@click.option("-o", "--output", default=None, help="write the plan here (JSON)")
@click.option("--all-nodes", is_flag=True, help="list every sharded node instead of groups")
@factory_options
def plan(factory, cluster, budget, pins, world, mesh, optimizer, time_limit, output, all_nodes,
         factory_args, meta):
    """Plan MODULE:FACTORY for a cluster and print the summary."""
    from autopar.viz.summary import print_summary
    pins = check_pins(parse_pins(pins))
    args = parse_pairs(factory_args, "--factory-args")
    budget_b = parse_bytes(budget) if budget else None
    cl = parse_cluster(cluster)
    with _progress() as step:
        with step(f"building {factory}" + (" on the meta device" if meta else "")):
            ex = build_example(factory, args, meta)
        p = _solve(step, ex, cl, world or cl.world_size, pins, memory_budget=budget_b,
                   mesh_shape=parse_mesh(mesh), optimizer=optimizer, time_limit_s=time_limit)
    print_summary(p, _console(), all_nodes)
    if output:
        p.save(output)
        _console().print(f"\nplan written to {output}")


@cli.command()
@click.argument("plan_file", metavar="PLAN")
@click.option("--json", "as_json", is_flag=True, help="the plan as JSON (for scripts)")
@click.option("--code", is_flag=True, help="print the rewritten per-rank program (needs --factory)")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--forward", is_flag=True, help="with --code: the forward-only program")
@click.option("--factory", default=None, help="MODULE:FACTORY the plan was made from")
@click.option("--all-nodes", is_flag=True, help="list every sharded node instead of groups")
@factory_options
def show(plan_file, as_json, code, rank, forward, factory, all_nodes, factory_args, meta):
    """Print a plan file: the summary, --json, or --code for one rank."""
    p = load_plan(plan_file)
    if as_json:
        click.echo(p.to_json())
        return
    if not code:
        from autopar.viz.summary import print_summary
        print_summary(p, _console(), all_nodes)
        return
    if factory is None:
        raise UserError("--code needs the model: add --factory MODULE:FACTORY (and the "
                        "--factory-args the plan was made with)")
    if rank >= p.world_size:
        raise UserError(f"--rank {rank} is outside the plan's world of {p.world_size} ranks")
    if meta:
        raise UserError("--code builds the per-rank module from real weights: drop --meta "
                        "(use a small config of the model to read its program)")
    from autopar.ops.comm import ThreadWorld
    from autopar.runtime.parallel_module import ParallelModule
    ex, cap = capture_for(p, factory, parse_pairs(factory_args, "--factory-args"), meta)
    comm = ThreadWorld(p.mesh_shape).comm(rank)
    pm = ParallelModule(cap, p, comm, ex.model, None if cap.has_loss else ex.loss_fn)
    which = "forward" if forward or not cap.has_loss else "train"
    click.echo(f"# rank {rank} at mesh coordinate {tuple(comm.coord)} of {tuple(p.mesh_shape)} "
               f"{tuple(p.mesh_axes)}: the {which} program")
    click.echo(pm.code(which).strip("\n"))


@cli.command()
@click.argument("plan_file", metavar="PLAN")
@click.argument("node")
@click.option("--factory", required=True, help="MODULE:FACTORY the plan was made from")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "adam", "sgd_momentum", "sgd"]))
@click.option("--all", "show_all", is_flag=True, help="every option, not the 12 cheapest")
@factory_options
def explain(plan_file, node, factory, optimizer, show_all, factory_args, meta):
    """Why NODE got its placement: the cost of every option it had.

    NODE is a graph node (as `autopar show` lists them) or a parameter's name."""
    from autopar.report import fmt_bytes, fmt_time
    from autopar.solver.costing import INF
    from autopar.viz.explain import explain as explain_node
    from autopar.viz.summary import _table
    p = load_plan(plan_file)
    _, cap = capture_for(p, factory, parse_pairs(factory_args, "--factory-args"), meta)
    x = explain_node(cap, p, p.params.get(node, node), optimizer)
    con = _console()
    con.print(f"[bold]{x.node}[/] ({x.op}) chose [bold]{x.chosen_placement}[/] on mesh "
              f"{tuple(p.mesh_shape)} {tuple(p.mesh_axes)}")
    if x.representative != x.node:
        con.print(f"it shares the choice of {x.representative} (a repeated layer; "
                  f"{len(x.members)} nodes decide together)")
    elif len(x.members) > 1:
        con.print(f"{len(x.members)} nodes of repeated layers share this choice; costs count all of them")
    if x.follows:
        con.print(f"it follows its producer {x.follows}: the solver takes, for each of "
                  f"{x.follows}'s options, this node's cheapest option")
    chosen = x.chosen
    ref = chosen.total_s if chosen else 0.0
    fmt = lambda s: "infeasible" if s == INF else fmt_time(s)  # noqa: E731
    t = _table(f"{len(x.options)} options, costed against the neighbours' placements in the plan "
               "(held fixed)", "", "inputs -> outputs", "compute", "resharding", "total",
               "vs chosen", "memory", "largest resharding")
    shown = x.options if show_all else x.options[:12]
    if chosen and chosen not in shown:
        shown = shown + [chosen]
    for o in shown:
        big = max(o.edges, key=lambda e: e[2], default=None)
        delta = ("" if o.chosen else "n/a" if o.total_s == INF else
                 ("+" if o.total_s >= ref else "-") + fmt_time(abs(o.total_s - ref)))
        t.add_row("*" if o.chosen else "", o.placement, fmt_time(o.compute_s), fmt(o.reshard_s),
                  fmt(o.total_s), delta, fmt_bytes(o.memory_bytes),
                  f"{big[0]} ({big[1]}) {fmt(big[2])}" if big and big[2] > 0 else "-")
    con.print(t)
    if len(shown) < len(x.options):
        con.print(f"... {len(x.options) - len(shown)} more (--all)")
    if chosen:
        edges = _table("resharding of the chosen option, by neighbour", "neighbour", "direction", "time")
        for nb, d, s in sorted(chosen.edges, key=lambda e: -e[2]):
            edges.add_row(nb, d, fmt(s))
        con.print()
        con.print(edges)
        cheaper = [o for o in x.options if o.total_s < chosen.total_s - 1e-15]
        if cheaper:
            con.print(f"\n{len(cheaper)} option(s) cost less here alone; the solver still chose "
                      f"{chosen.placement} because it minimises the whole step (a neighbour "
                      "would have to change, or the memory budget binds)")


@cli.command()
@click.argument("a", metavar="A.json")
@click.argument("b", metavar="B.json")
def diff(a, b):
    """What changed from plan A to plan B, and what each change costs."""
    from autopar.report import fmt_bytes, fmt_time
    from autopar.viz.diff import diff as plan_diff
    from autopar.viz.summary import _table, fold_names
    pa, pb = load_plan(a), load_plan(b)
    d = plan_diff(pa, pb)
    con = _console()
    if d.empty:
        con.print("the plans are the same")
        return
    if not d.same_graph:
        con.print("[bold]note[/]: the plans were made for different graphs (fingerprints differ)")
    if d.setup:
        t = _table("setup", "what", "A", "B")
        for row in d.setup:
            t.add_row(*row)
        con.print(t)
        con.print()

    def rel(x):
        return "" if x.rel is None else f"{x.rel:+.1%}"

    def signed(v, f):
        return ("+" if v >= 0 else "-") + f(abs(v))

    t = _table("estimate (per step, per device)", "term", "A", "B", "change", "rel")
    for x in d.times:
        f = (lambda v: f"{v:.1%}") if x.name == "bubble_fraction" else fmt_time
        t.add_row(x.name, f(x.a), f(x.b), signed(x.change, f), rel(x))
    for x in d.comm:
        t.add_row("comm " + x.name, fmt_time(x.a), fmt_time(x.b), signed(x.change, fmt_time), rel(x))
    for x in d.memory:
        t.add_row("memory " + x.name, fmt_bytes(x.a), fmt_bytes(x.b), signed(x.change, fmt_bytes), rel(x))
    con.print(t)
    con.print()
    t = _table(f"placement changes: {d.n_changed} nodes in {len(d.placements)} groups", "op",
               "A", "B", "count", "nodes")
    for op, x, y, names in d.placements:
        t.add_row(op, x, y, str(len(names)), fold_names(names))
    con.print(t)
    if d.only_a or d.only_b:
        con.print(f"\nnodes only in A: {fold_names(d.only_a, 5) or '-'}; only in B: "
                  f"{fold_names(d.only_b, 5) or '-'}")


@cli.command()
@click.argument("plan_file", metavar="[PLAN]", required=False)
@click.option("-o", "--output", required=True, help="out.html | out.svg | out.dot | out.png")
@click.option("--factory", default=None, help="MODULE:FACTORY the plan was made from (for the graph)")
@click.option("--unfold", is_flag=True, help="draw every repeated layer (svg/png/dot)")
@click.option("--schedule", default=None, help="draw this pipeline schedule's swimlane "
              "(gpipe, 1f1b, interleaved-1f1b, zero-bubble)")
@click.option("--stages", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--microbatches", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--virtual", type=click.IntRange(min=1), default=1, show_default=True)
@factory_options
def viz(plan_file, output, factory, unfold, schedule, stages, microbatches, virtual,
        factory_args, meta):
    """Pictures of a plan: graph (svg/png/dot), or the HTML report with all of them.

    Without a plan, --schedule draws a pipeline swimlane (png/svg)."""
    from autopar import viz as viz_mod
    p = load_plan(plan_file) if plan_file else None
    if p is None and schedule is None:
        raise UserError("give a PLAN file, or --schedule KIND to draw a pipeline swimlane")
    if p is None and factory:
        raise UserError("--factory draws a plan's graph: give the PLAN file too")
    cap = None
    if factory and p is not None:
        _, cap = capture_for(p, factory, parse_pairs(factory_args, "--factory-args"), meta)
    fmt = Path(output).suffix.lstrip(".").lower()
    if fmt in ("svg", "png", "dot") and cap is None and schedule is None and p is not None:
        raise UserError(f"a .{fmt} graph needs the model: add --factory MODULE:FACTORY (the "
                        "plan file holds placements, not edges), or --schedule for a swimlane")
    if schedule is not None and cap is not None and fmt != "html":
        schedule_for_graph = None   # a graph file: the schedule goes to the report only
    else:
        schedule_for_graph = schedule
    info = viz_mod.write(output, p, cap, schedule=schedule_for_graph, stages=stages,
                         microbatches=microbatches, virtual=virtual, fold=not unfold)
    what = {"report": "report", "graph": "graph", "swimlane": "swimlane"}[info["kind"]]
    extra = []
    if "nodes" in info:
        extra.append(f"{info['nodes']} nodes, {info['collectives']} collectives, "
                     f"{info['folded_nodes']} when folded")
    if "swimlane" in info:
        extra.append(f"swimlane: {info['swimlane']}")
    if info["kind"] in ("graph", "report") and fmt != "dot":
        extra.append(f"graph drawn with {info['renderer']}")
    click.echo(f"wrote {what} {output}" + (" (" + "; ".join(extra) + ")" if extra else ""))


@cli.command()
@click.argument("factory")
@click.option("--plan", "plan_file", default=None, help="a plan file (default: solve on the ranks)")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="ranks")
@click.option("--pin", "pins", multiple=True, metavar="NAME=VALUE", help="pins for the solve")
@click.option("--timeout", default=600.0, show_default=True, help="seconds")
@factory_options
def verify(factory, plan_file, nproc, pins, timeout, factory_args, meta):
    """Run MODULE:FACTORY on NPROC ranks under torchrun and compare with one device."""
    if meta:
        raise UserError("verify trains the model: drop --meta")
    _verify(factory, parse_pairs(factory_args, "--factory-args"), nproc, plan_file,
            parse_pins(pins), timeout)


def _verify(factory, args, nproc, plan_file, pins, timeout):
    from autopar.verify import GRAD_RTOL, LOSS_RTOL, STEPS, WEIGHT_RTOL, launch
    from autopar.viz.summary import _table
    if plan_file:
        p = load_plan(plan_file)
        if pins:
            raise UserError("pass --plan or --pin, not both (the pins are in the plan)")
        if p.world_size != nproc:
            raise UserError(f"{plan_file} is for {p.world_size} ranks: use --nproc {p.world_size}")
        plan_file = str(Path(plan_file).resolve())
    load_factory(factory)           # a bad spec is a usage error before any process starts
    con = _console()
    with _progress() as step:
        with step(f"torchrun: {nproc} ranks (gloo), {STEPS} SGD steps each against one device"):
            res = launch(factory, args, nproc, plan=plan_file, pins=pins, timeout_s=timeout)
    mesh = next((r for r in res.results if r.mesh_shape), None)
    t = _table(f"verify {factory} on {nproc} ranks" + (
        f", mesh {mesh.mesh_shape} {mesh.mesh_axes}" if mesh else "") +
        f" (tolerances: loss {LOSS_RTOL:g}, gradient {GRAD_RTOL:g}, weight {WEIGHT_RTOL:g})",
        "rank", "coord", "loss", "loss err", "max grad err", "worst param", "weight err", "status")
    by_rank = {r.rank: r for r in res.results}
    for rank in range(nproc):
        r = by_rank.get(rank)
        if r is None:
            t.add_row(str(rank), "", "", "", "", "", "", "[red]FAIL[/] (no result)")
        elif r.check is None:
            t.add_row(str(rank), "", "", "", "", "", "", f"[red]FAIL[/] {r.error}")
        else:
            c = r.check
            status = "[green]pass[/]" if r.ok else "[red]FAIL[/]" + (
                f" {'; '.join(c.problems)}" if c.problems else "")
            t.add_row(str(rank), str(r.coord), f"{r.loss:.6f}", f"{c.loss_err:.2e}",
                      f"{c.grad_err:.2e}", c.grad_worst, f"{c.weight_err:.2e}", status)
    con.print(t)
    if not res.ok:
        if res.stderr_tail and any(r.check is None for r in res.results) or len(res.results) < nproc:
            click.echo("\n".join(res.stderr_tail.splitlines()[-15:]), err=True)
        raise Failed(f"verify failed on {sum(not r.ok for r in res.results) + nproc - len(res.results)}"
                     f" of {nproc} ranks (torchrun exit code {res.returncode})")
    con.print(f"all {nproc} ranks match the single-device model")


@cli.command()
@click.option("--cluster", default="2xdgx-a100", show_default=True)
@click.option("--config", default="gpt-1.3b", show_default=True, help="GPT preset to plan")
@click.option("--nproc", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--skip-verify", is_flag=True)
@click.option("-o", "--output", default=None, help="also write the GPU plan here (JSON)")
def demo(cluster, config, nproc, skip_verify, output):
    """Plan a GPT for a multi-node GPU cluster, then verify a small plan on CPU ranks."""
    from autopar.viz.summary import print_summary
    con = _console()
    spec = "examples.models:gpt_factory"
    cl = parse_cluster(cluster)
    con.rule(f"1. plan {config} for {cluster} ({cl.world_size} GPUs), on the meta device")
    with _progress() as step:
        with step(f"building {config} on the meta device"):
            ex = build_example(spec, {"batch": 8, "config": config}, meta=True)
        p = _solve(step, ex, cl, cl.world_size, {})
    print_summary(p, con)
    if output:
        p.save(output)
        con.print(f"\nplan written to {output}")
    if skip_verify:
        return
    con.print()
    con.rule(f"2. verify the tiny GPT with data=2, tensor=2 on {nproc} CPU ranks (torchrun, gloo)")
    pins = {"data": 2, "tensor": nproc // 2} if nproc % 2 == 0 and nproc > 1 else {}
    _verify(spec, {"batch": 8}, nproc, None, pins, 600.0)


def main(argv=None) -> int:
    """Console-script entry point; returns the exit code."""
    try:
        cli.main(args=argv, prog_name="autopar", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
