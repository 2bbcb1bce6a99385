"""The ``autopar`` command: plan, show, explain, diff, viz, verify, demo, checkpoint.

Exit codes: 0 ok; 1 a check failed (``verify``); 2 bad usage or input, with one line that
says what is wrong and how to fix it (no traceback for a user's error): click's usage errors,
the library's input errors (``autopar.errors.AutoparInputError``) and files that cannot be
read or written; 3 an internal error, any other exception (a bug in autopar): its traceback
and a request to report it.

    autopar plan examples.models:gpt_factory --cluster 2xdgx-a100 --meta \\
        --factory-args config=gpt-1.3b -o plan.json
    autopar show plan.json
    autopar explain plan.json linear --factory examples.models:gpt_factory ...
    autopar viz plan.json -o report.html --factory examples.models:gpt_factory ...
    autopar verify examples.models:gpt_factory --nproc 4 --pin data=2 --pin tensor=2
    autopar plan hf:llama3-70b --cluster 8x8xH100 --batch 16 --seq 8192
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import click

from autopar import verify as verify_mod, viz as viz_mod
from autopar.capture import CaptureError, capture
from autopar.capture.cache import cache_dir, caching
from autopar.checkpoint import export_checkpoint, import_state_dict
from autopar.cli_args import (  # noqa: F401 - _CAPTURED, parse_* and USER_ERRORS: importable from here
    _CAPTURED, USER_ERRORS, Example, Failed, UserError, _console, _one_line, _progress,
    build_example, capture_for, factory_options, is_hf, load_factory, load_plan,
    parse_bytes, parse_mesh, parse_pairs, parse_pins, parse_value,
)
from autopar.cost_models.hardware import parse_cluster
from autopar.ops.comm import ThreadWorld
from autopar.report import expert_choice, fmt_bytes, fmt_time
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.static_verify import first_error, static_verify
from autopar.runtime.timing import TimingReport
from autopar.pricing.costing import INF
from autopar.solver import progress
from autopar.solver.driver import solve
from autopar.options import Options
from autopar.verify import GRAD_RTOL, LOSS_RTOL, STEPS, WEIGHT_RTOL
from autopar.viz.diff import diff as plan_diff
from autopar.viz.explain import explain as explain_node
from autopar.viz.summary import _table, fold_names, print_summary
from autopar.cost_models.local_devices import local_cluster


INTERNAL_ERROR = 3
"""The exit code of a bug in autopar (an exception that is not about the user's input)."""
REPORT = "this is a bug in autopar, please report it with the command line and the traceback above"


class InternalError(click.ClickException):
    """An exception that is no input error: the traceback, then the request to report it;
    exit code 3."""
    exit_code = INTERNAL_ERROR

    def __init__(self, error: BaseException):
        super().__init__(f"{type(error).__name__}: {_one_line(error)}")
        self.error = error

    def show(self, file=None) -> None:
        tb = "".join(traceback.format_exception(type(self.error), self.error, self.error.__traceback__))
        click.echo(tb.rstrip("\n"), err=True)
        click.echo(f"autopar: internal error: {self.format_message()}\n{REPORT}", err=True)


class _Group(click.Group):
    """Turns the library's errors about the user's input into exit code 2 and one line, and
    any other exception into exit code 3 with its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (CaptureError, *USER_ERRORS) as e:
            raise UserError(_one_line(e)) from e
        except Exception as e:  # noqa: BLE001 - not the user's input: a bug, reported as one
            raise InternalError(e) from e


def _solve(step, ex: Example, cl, world: int, pins: Options, cache: bool = True, **kw):
    """``autopar.solver.driver.solve`` (as ``autopar.plan``), its steps shown by ``step``:
    the full-batch capture (unless a pipeline is pinned: that captures at its micro-batch;
    from the capture cache when this model was planned before, ``cache``), then the search,
    its line rewritten with each stage and the best plan so far."""
    cap, capture_s = None, None
    with caching(cache) as use:
        if not pins.pipelined:
            with step("capturing the training graph (torch.export)") as line:
                t0 = time.perf_counter()
                cap = capture(ex.model, ex.inputs, ex.loss_fn if ex.target is not None else None,
                              ex.target)
                capture_s = time.perf_counter() - t0
                if use.hits:
                    line(f"read from the capture cache in {cache_dir()}", final=True)
        what = "pipelines, meshes" if pins.pipelined or cl.nodes > 1 else "meshes"
        with step(f"solving ({what}) for {world} devices of {cl.name}") as line:
            def stage(name: str, seconds, best_s) -> None:
                best = f", best so far {fmt_time(best_s)}" if best_s is not None else ""
                line(f"{name} ({seconds:.1f} s){best}" if seconds is not None else
                     f"{name}{best}")
            with progress.reporting(stage):
                return solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cl,
                             world_size=world, pins=pins, captured=cap, capture_s=capture_s,
                             **kw).plan


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
@click.option("--no-cache", is_flag=True,
              help="capture afresh: neither read nor write the capture cache "
                   "(~/.cache/autopar, $AUTOPAR_CACHE_DIR; AUTOPAR_CACHE=0 turns it off too)")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr (the summary only)")
@factory_options
def plan(factory, cluster, budget, pins, world, mesh, optimizer, time_limit, output, all_nodes,
         no_cache, quiet, factory_args, meta):
    """Plan MODULE:FACTORY, or hf:NAME / hf:PATH/config.json (a transformers model by its
    config, on the meta device: --batch, --seq), for a cluster and print the summary."""
    pins = Options.from_pins(parse_pins(pins))
    meta = meta or is_hf(factory)
    args = parse_pairs(factory_args, "--factory-args")
    budget_b = parse_bytes(budget) if budget else None
    cl = parse_cluster(cluster)
    load_factory(factory)           # a bad spec (an unknown hf: name) fails before the progress
    with _progress(quiet) as step:
        with step(f"building {factory}" + (" on the meta device" if meta else "")):
            ex = build_example(factory, args, meta)
        p = _solve(step, ex, cl, world or cl.world_size, pins, memory_budget=budget_b,
                   mesh_shape=parse_mesh(mesh), optimizer=optimizer, time_limit_s=time_limit,
                   cache=not no_cache)
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
@click.option("--factory", default=None, help="MODULE:FACTORY (or hf:NAME) the plan was made from")
@click.option("--all-nodes", is_flag=True, help="list every sharded node instead of groups")
@factory_options
def show(plan_file, as_json, code, rank, forward, factory, all_nodes, factory_args, meta):
    """Print a plan file: the summary, --json, or --code for one rank."""
    p = load_plan(plan_file)
    if as_json:
        click.echo(p.to_json())
        return
    if not code:
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
@click.option("--factory", required=True, help="MODULE:FACTORY (or hf:NAME) the plan was made from")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "adam", "sgd_momentum", "sgd"]))
@click.option("--all", "show_all", is_flag=True, help="every option, not the 12 cheapest")
@factory_options
def explain(plan_file, node, factory, optimizer, show_all, factory_args, meta):
    """Why NODE got its placement: the cost of every option it had.

    NODE is a graph node (as `autopar show` lists them) or a parameter's name."""
    p = load_plan(plan_file)
    _, cap = capture_for(p, factory, parse_pairs(factory_args, "--factory-args"),
                         meta or is_hf(factory))
    x = explain_node(cap, p, p.params.get(node, node), optimizer)
    con = _console()
    con.print(f"[bold]{x.node}[/] ({x.op}) chose [bold]{x.chosen_placement}[/] on mesh "
              f"{tuple(p.mesh_shape)} {tuple(p.mesh_axes)}")
    if "moe_experts" in str(x.op):
        con.print(f"a mixture of experts' experts: {expert_choice(p, x.node)} (its compute "
                  "includes the all-to-all dispatch, autopar/pricing/experts.py)")
    if x.representative != x.node:
        con.print(f"it shares the choice of {x.representative} (a repeated layer; "
                  f"{len(x.members)} nodes decide together)")
    elif len(x.members) > 1:
        con.print(f"{len(x.members)} nodes of repeated layers share this choice; costs count all of them")
    if x.fp8:
        con.print(f"fp8: {x.fp8}")
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
@click.option("--factory", default=None, help="MODULE:FACTORY (or hf:NAME) the plan was made from (for the graph)")
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
    p = load_plan(plan_file) if plan_file else None
    if p is None and schedule is None:
        raise UserError("give a PLAN file, or --schedule KIND to draw a pipeline swimlane")
    if p is None and factory:
        raise UserError("--factory draws a plan's graph: give the PLAN file too")
    cap = None
    if factory and p is not None:
        _, cap = capture_for(p, factory, parse_pairs(factory_args, "--factory-args"),
                             meta or is_hf(factory))
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
@click.option("--timing", is_flag=True, help="then time training steps: predicted against "
              "measured per rank (step, compute by op family, comm by collective, peak memory)")
@click.option("--timing-steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="steps --timing measures (after one warm-up)")
@click.option("--static", "static", is_flag=True, help="start no process: build every rank's "
              "programs here, type-check each (replicated / sharded / partial per mesh axis, "
              "collectives, local shapes, gradients reduced once) and compare the ranks' "
              "collective orders")
@factory_options
def verify(factory, plan_file, nproc, pins, timeout, timing, timing_steps, static, factory_args, meta):
    """Run MODULE:FACTORY on NPROC ranks under torchrun and compare with one device; with
    --static, check every rank's programs without running them."""
    if static:
        if timing:
            raise UserError("--timing runs the model: drop it, or drop --static")
        _verify_static(factory, parse_pairs(factory_args, "--factory-args"), nproc, plan_file,
                       parse_pins(pins), meta)
        return
    if meta:
        raise UserError("verify trains the model: drop --meta (or check it with --static)")
    _verify(factory, parse_pairs(factory_args, "--factory-args"), nproc, plan_file,
            parse_pins(pins), timeout, timing=timing_steps if timing else 0)


def _verify(factory, args, nproc, plan_file, pins, timeout, timing: int = 0):
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
            res = verify_mod.launch(factory, args, nproc, plan=plan_file, pins=pins, timeout_s=timeout,
                                    timing=timing)
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
    report = next((r.timing for r in res.results if r.timing), None)
    if timing:
        if report is None:
            raise Failed("verify --timing: rank 0 wrote no timing report")
        con.print()
        click.echo(str(TimingReport.from_dict(report)))


def _verify_static(factory, args, nproc, plan_file, pins, meta: bool):
    """``verify --static``: the plan (the file's, or solved for ``nproc`` ranks of this
    machine as ``autopar.parallelize`` would) and ``runtime.static_verify`` on every rank; one
    line per rank and program; exit 1 on any failure."""
    load_factory(factory)
    if plan_file and pins:
        raise UserError("pass --plan or --pin, not both (the pins are in the plan)")
    with _progress() as step:
        if plan_file:
            p = load_plan(plan_file)
            if p.world_size != nproc:
                raise UserError(f"{plan_file} is for {p.world_size} ranks: use --nproc {p.world_size}")
            with step("capturing the training graph (torch.export)"):
                ex, cap = capture_for(p, factory, args, meta)
        else:
            with step(f"building {factory}" + (" on the meta device" if meta else "")):
                ex = build_example(factory, args, meta)
            with step(f"solving for {nproc} ranks"):
                got = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                            cluster=local_cluster(nproc), world_size=nproc,
                            pins=Options.from_pins(pins))
                p, cap = got.plan, got.captured
        with step(f"building and checking every rank's programs ({p.world_size} ranks, no process)"):
            t0 = time.perf_counter()
            results = static_verify(cap, p, ex.model)
            seconds = time.perf_counter() - t0
    click.echo(f"verify --static {factory}: mesh {tuple(p.mesh_shape)} {tuple(p.mesh_axes)}"
               + (f", {p.pipeline_stages} pipeline stages" if p.pipeline_stages > 1 else ""))
    for r in results:
        status = "ok" if r.ok else f"FAIL {r.error}"
        click.echo(f"rank {r.rank} {r.coord} {r.which}: {r.collectives} collectives, "
                   f"{r.seconds:.2f} s: {status}")
    problem = first_error(results)
    if problem is not None:
        raise Failed(f"verify --static failed: {problem}")
    click.echo(f"all {p.world_size} ranks' programs check ({seconds:.1f} s)")


DEMO_FACTORY = "autopar.nanogpt:demo_factory"
"""The model ``autopar demo`` plans and verifies: in the package, so that the demo runs from an
installed wheel with no source tree (``tests/test_wheel.py``)."""


@cli.command()
@click.option("--cluster", default="2xdgx-a100", show_default=True)
@click.option("--config", default="gpt-1.3b", show_default=True, help="GPT preset to plan")
@click.option("--nproc", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--skip-verify", is_flag=True)
@click.option("-o", "--output", default=None, help="also write the GPU plan here (JSON)")
def demo(cluster, config, nproc, skip_verify, output):
    """Plan a GPT for a multi-node GPU cluster, then verify a small plan on CPU ranks."""
    con = _console()
    spec = DEMO_FACTORY
    cl = parse_cluster(cluster)
    con.rule(f"1. plan {config} for {cluster} ({cl.world_size} GPUs), on the meta device")
    with _progress() as step:
        with step(f"building {config} on the meta device"):
            ex = build_example(spec, {"batch": 8, "config": config}, meta=True)
        p = _solve(step, ex, cl, cl.world_size, Options())
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


@cli.group()
def checkpoint():
    """Sharded checkpoints (autopar.save_checkpoint): export to, import from plain state dicts."""


@checkpoint.command("export")
@click.argument("path", metavar="CHECKPOINT_DIR")
@click.option("-o", "--output", required=True, help="the state dict file to write (torch.save)")
def checkpoint_export(path, output):
    """Write a checkpoint's model tensors as one state dict that model.load_state_dict accepts."""
    sd = export_checkpoint(path, output)
    _console().print(f"wrote {len(sd)} tensors to {output}")


@checkpoint.command("import")
@click.argument("state_dict", metavar="MODEL.pt")
@click.option("-o", "--output", required=True, help="the checkpoint directory to write")
def checkpoint_import(state_dict, output):
    """Write a torch.save'd state dict as a checkpoint that autopar.load_checkpoint reads
    into any plan."""
    import_state_dict(state_dict, output)
    _console().print(f"wrote checkpoint {output}")


def main(argv=None) -> int:
    """Console-script entry point; returns the exit code."""
    try:
        cli.main(args=argv, prog_name="autopar", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
