"""Pictures of a plan: the graph (collectives as nodes, repeated layers folded) in DOT, SVG
and PNG, the memory and swimlane charts, the self-contained HTML report, and that report
rendered in headless Chromium."""
from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from autopar import cli as cli_mod
from autopar.api import plan_captured
from autopar.cli import cli
from autopar.cost_models.hardware import parse_cluster
from autopar.placement import parse_placements
from autopar.report import fmt_bytes, fmt_time
from autopar.sharding.redistribute import plan_steps
from autopar.viz import charts, graph, render
from conftest import example_and_capture

GPT = "examples.models:gpt_factory"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    ex, cap = example_and_capture("gpt")
    cli_mod._CAPTURED[(GPT, (), False)] = (ex, cap)
    p = plan_captured(cap, parse_cluster("1x4xH100"), 4, pins={"data": 2, "tensor": 2})
    path = tmp_path_factory.mktemp("viz") / "plan.json"
    p.save(path)
    return path, p, cap


@pytest.fixture(scope="module")
def g(planned):
    _, p, cap = planned
    return graph.build_graph(cap, p)


def viz(*args, code=0):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


def test_collectives_sit_where_placements_differ(g, planned):
    _, p, cap = planned
    # every collective node is a step of plan_steps between its edge's two placements
    expected = 0
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.name not in p.nodes:
            continue
        for k, a in enumerate(graph.tensor_args(n)):
            src = a.name if a.name in p.nodes else a.args[0].name
            out = 0 if a.name in p.nodes else a.args[1]
            want = p.nodes[n.name].inputs[k]
            expected += len(plan_steps(parse_placements(p.nodes[src].outputs[out]),
                                       parse_placements(want),
                                       graph.grad_partial(want, p.nodes[n.name].outputs)))
    assert len(g.collectives) == expected > 0
    # every replicated parameter that feeds a data-parallel op syncs its gradient
    labels = [c.label for c in g.collectives]
    assert any(lab.startswith("grad_all_reduce@data") for lab in labels)
    assert {n.id for n in g.nodes.values() if n.kind in ("op", "loss")} == set(p.node_ops)
    for n in g.nodes.values():
        if n.kind in ("op", "loss"):
            assert str(p.nodes[n.id]) in n.label


def test_fold_keeps_the_first_layer_and_boxes_the_rest(g):
    f = graph.fold(g)
    boxes = [n for n in f.nodes.values() if n.kind == "fold"]
    assert [b.layer for b in boxes] == [("transformer.h", 1)]
    inside = [n for n in g.nodes.values() if n.layer == ("transformer.h", 1)]
    assert len(f.nodes) == len(g.nodes) - len(inside) + 1
    assert "same placements as transformer.h.0" in boxes[0].label
    assert all(s in f.nodes and d in f.nodes for s, d, _ in f.edges)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # pydot's parser on pyparsing 3.3
def test_viz_writes_each_format(planned, g, tmp_path):
    path = planned[0]
    folded = graph.fold(g)
    out = viz("viz", path, "-o", tmp_path / "g.dot", "--factory", GPT)
    assert f"{len(g.nodes)} nodes, {len(g.collectives)} collectives, {len(folded.nodes)} when folded" in out
    import pydot
    (d,) = pydot.graph_from_dot_data((tmp_path / "g.dot").read_text())
    ids = {n.get_name().strip('"') for sg in [d, *d.get_subgraphs()] for n in sg.get_nodes()}
    assert set(folded.nodes) <= ids
    viz("viz", path, "-o", tmp_path / "full.dot", "--factory", GPT, "--unfold")
    (d,) = pydot.graph_from_dot_data((tmp_path / "full.dot").read_text())
    assert len(d.get_edges()) + sum(len(s.get_edges()) for s in d.get_subgraphs()) == len(g.edges)

    viz("viz", path, "-o", tmp_path / "g.svg", "--factory", GPT)
    svg = ET.parse(tmp_path / "g.svg").getroot()
    assert svg.tag.endswith("svg")
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert str(planned[1].nodes["linear"]) in texts            # the node's placements
    assert any(t and t.startswith("grad_all_reduce@data") for t in texts)   # a collective

    viz("viz", path, "-o", tmp_path / "g.png", "--factory", GPT)
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_MAGIC


def test_own_layout_without_graphviz(g, monkeypatch, tmp_path):
    monkeypatch.setattr(render, "dot_binary", lambda: None)
    assert "Graphviz not installed" in render.renderer()
    f = graph.fold(g)
    svg = render.render(f, "svg").decode()
    root = ET.fromstring(svg)
    rects = root.findall(".//{http://www.w3.org/2000/svg}rect")
    assert len(rects) == len(f.nodes)
    assert svg.count("<line ") == len(f.edges)
    assert render.render(f, "png")[:8] == PNG_MAGIC


def test_swimlane_of_a_schedule_matches_the_simulator(tmp_path):
    from autopar.schedule import schedule_actions
    from autopar.pricing.simulate import simulate
    lane = charts.swimlane(schedule="1f1b", stages=4, microbatches=8)
    sim = simulate(schedule_actions("1f1b", 4, 8), forward=1.0, backward=2.0)
    assert len(lane.blocks) == 2 * 4 * 8 and lane.n_lanes == 4
    assert lane.bubble_fraction == pytest.approx(sim.bubble_fraction)
    assert f"bubble {sim.bubble_fraction:.1%}" in lane.title
    out = viz("viz", "-o", tmp_path / "lane.png", "--schedule", "1f1b", "--stages", 4,
              "--microbatches", 8)
    assert f"bubble {sim.bubble_fraction:.1%}" in out
    assert (tmp_path / "lane.png").read_bytes()[:8] == PNG_MAGIC
    viz("viz", "-o", tmp_path / "lane.png", "--schedule", "1f1b", "--stages", 4,
        "--microbatches", 2, code=2)     # 1F1B needs m >= p: a usage error


def test_swimlane_of_a_plan_without_pipeline_is_labelled(planned):
    p = planned[1]
    lane = charts.swimlane(p)
    assert lane.n_lanes == p.world_size and "no pipeline" in lane.note
    ends = {b["end"] for b in lane.blocks}
    assert max(ends) == pytest.approx(p.estimate.step_time_s)
    assert charts.memory_chart(p)[:8] == PNG_MAGIC


def test_memory_bars_are_the_phases_and_the_tallest_is_the_estimate(planned):
    """An unpipelined step's estimate is a peak of phases: one bar each, the tallest equal to
    memory_total (the old chart stacked every term, taller than the estimate it titled)."""
    p = planned[1]
    bars = charts.memory_bars(p)
    assert len(bars) == len(p.estimate.memory_phases) >= 2
    heights = [sum(b for _, b in terms) for _, terms in bars]
    assert max(heights) == pytest.approx(p.estimate.memory_total)
    assert sum(p.estimate.memory_bytes.values()) > max(heights)


@pytest.fixture(scope="module")
def report(planned, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    text = viz("viz", planned[0], "-o", out, "--factory", GPT)
    assert "wrote report" in text
    return out


def test_report_is_self_contained_and_has_the_numbers(report, planned):
    p = planned[1]
    html = report.read_text()
    assert not re.search(r"""(src|href)=["'](https?:|//)""", html)
    assert html.count('src="data:image/png;base64,') == 2            # memory, swimlane
    assert html.count("<svg") == 2                                    # folded, full graph
    e = p.estimate
    for s in (fmt_time(e.step_time_s), fmt_time(e.compute_s), fmt_time(e.comm_s),
              fmt_bytes(e.memory_total), *map(fmt_bytes, e.memory_bytes.values()),
              *map(fmt_time, e.comm.values())):
        assert s in html, s


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                    "apt-get install chromium); the HTML render check needs a browser")
def test_report_renders_in_headless_chromium(report):
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", report.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    m = re.search(r'<body data-rendered="([^"]*)"', dom)
    assert m, dom[:500]
    assert set(m.group(1).split()) == {"graph", "memory", "swimlane"}
    shot = report.with_suffix(".png")
    subprocess.run([*flags, "--window-size=1400,2400", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 50_000     # a page with pictures, not blank


def test_pipeline_plan_graph_is_coloured_by_stage_and_its_swimlane_is_its_schedule():
    """A pipeline plan: every op node carries the stage the runtime gives it (the cut node
    starts stage 1), the fill colour says the pipeline rank, the legend names the ranks, and
    the swimlane runs the plan's own schedule on its ranks."""
    import autopar
    from autopar.capture import capture
    from autopar.analysis.stages import assign_stages
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()
    p = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                     pipeline=2, schedule="1f1b", micro_batch_size=2)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    gr = graph.build_graph(cap, p)
    want = assign_stages(cap, p.stage_cuts, 2)
    ops = [n for n in gr.nodes.values() if n.kind == "op"]
    assert ops and all(n.stage == want[n.id] for n in ops)
    assert gr.nodes[p.stage_cuts[0]].stage == 1
    fills = {n.stage: render.fill_of(n, gr) for n in ops}
    assert fills[0] != fills[1]
    names = [name for name, _ in render.legend(gr)]
    assert names[:2] == ["pipeline rank 0: stage 0", "pipeline rank 1: stage 1"]
    svg = render.render(graph.fold(gr), "svg")
    assert fills[0].encode() in svg and fills[1].encode() in svg
    lane = charts.swimlane(p)
    assert lane.n_lanes == 2 and len(lane.blocks) == 2 * 2 * p.n_microbatches
    assert {b["rank"] for b in lane.blocks} == {0, 1}
    assert "1f1b" in lane.title


def test_a_summarys_pins_fold_layer_names_into_runs():
    """A pin listing 72 layers shows as one run, not 72 names (``report.fold_indexed``);
    gaps split runs and names without an index stay as they are."""
    from autopar.report import fold_indexed
    assert fold_indexed([f"model.layers.{i}" for i in range(72)]) == ["model.layers.{0..71}"]
    assert fold_indexed(["h.0.mlp", "h.1.mlp", "h.3.mlp", "emb", "h.2.attn"]) == \
        ["h.{0..1}.mlp", "h.3.mlp", "emb", "h.2.attn"]
    assert fold_indexed(["a.5", "a.4"]) == ["a.{4..5}"]


def test_the_communication_table_shares_what_was_issued(planned):
    """The summary's communication rows are shares of the communication issued, the
    overlapped part (a negative time, in the unit that suits its size: it was printed as
    -302626.5 us for a ZeRO-3 Llama-3-8B) among them, so the rows sum to the exposed share
    and none passes 100% (they were shares of the exposed time: 471%, -706%)."""
    from dataclasses import replace
    from rich.console import Console
    from autopar.viz.summary import summary_renderable
    assert fmt_time(-0.3026265) == "-302.627 ms" and fmt_time(-2.5) == "-2.500 s"
    assert fmt_time(-4e-6) == "-4.0 us"
    _, p, _ = planned
    comm = {"all_gather@data": 0.2018, "reduce_scatter@data": 0.1009, "overlapped": -0.2600}
    p = replace(p, estimate=replace(p.estimate, comm=comm, comm_s=sum(comm.values())))
    console = Console(width=200, record=True)
    console.print(summary_renderable(p))
    text = console.export_text()
    assert "302.700 ms issued, 42.700 ms exposed" in text
    rows = {ln.split()[0]: ln.split()[-1] for ln in text.splitlines()
            if ln.strip().startswith(tuple(comm))}
    assert rows == {"all_gather@data": "66.7%", "reduce_scatter@data": "33.3%",
                    "overlapped": "-85.9%"}, rows


def test_a_gpu_plan_in_the_models_fp32_says_how_to_plan_bf16(planned):
    """A GPU plan without a ``precision=`` pin prices the model's fp32 matmuls at the vector
    units' rate: its summary says so (both layouts) and names the pin; a bf16 plan and a
    CPU plan have no such line."""
    from dataclasses import replace
    from rich.console import Console
    from autopar.report import plan_summary, precision_lines
    from autopar.viz.summary import summary_renderable
    _, p, _ = planned
    line, = precision_lines(p)
    assert "pin precision=bf16" in line and "15x below" in line, line
    console = Console(width=400, record=True)
    console.print(summary_renderable(p))
    assert line in console.export_text() and line in plan_summary(p)
    assert precision_lines(replace(p, options=p.options.replace(precision="bf16"))) == []
    assert precision_lines(replace(p, cluster="cpu:4")) == []
