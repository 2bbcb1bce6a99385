"""Reading a plan: rich text (summary, explain, diff) and pictures (graph, memory, swimlane,
one self-contained HTML report).

>>> from autopar.viz import write
>>> write("report.html", plan, cap)          # cap: the captured model, for the graph
"""
from __future__ import annotations

from pathlib import Path

from autopar.errors import ArgumentError
from autopar.plan import Plan
from autopar.viz import charts, graph, render
from autopar.viz.html import report_html

__all__ = ["write", "FORMATS"]

FORMATS = ("html", "svg", "dot", "png")


def write(out: str | Path, plan: Plan | None, cap=None, *, schedule: str | None = None,
          stages: int = 4, microbatches: int = 8, virtual: int = 1, fold: bool = True) -> dict:
    """Write ``out`` (by its suffix): ``.html`` the report; ``.svg``/``.png``/``.dot`` the
    graph (needs ``cap``), or, without a plan or graph, the swimlane (``.svg``/``.png``).
    Returns what was drawn: {"kind", "renderer", "nodes", "collectives", ...}."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise ArgumentError(f"cannot write {out.name!r}: use an output ending in "
                            f"{', '.join('.' + f for f in FORMATS)}")
    info: dict = {"renderer": render.renderer()}
    g_full = g_fold = None
    if cap is not None and plan is not None:
        g_full = graph.build_graph(cap, plan)
        g_fold = graph.fold(g_full)
        info.update(nodes=len(g_full.nodes), collectives=len(g_full.collectives),
                    folded_nodes=len(g_fold.nodes))
    title = (f"autopar plan: mesh {tuple(plan.mesh_shape)} {tuple(plan.mesh_axes)} on {plan.cluster}"
             if plan is not None else "autopar")
    if fmt == "html":
        if plan is None:
            raise ArgumentError("an HTML report needs a plan file: autopar viz PLAN.json -o out.html")
        lane = charts.swimlane(plan, schedule=schedule, stages=stages, microbatches=microbatches,
                               virtual=virtual)
        note = (f"drawn with {info['renderer']}; collectives (red hexagons) sit on the edges "
                "where the producer's placement differs from what the consumer reads; clusters "
                "are repeated layers; "
                + ("ops are coloured by pipeline stage" if plan.pipeline_stages > 1 else
                   "this plan has no pipeline stages to colour by"))
        html = _html(plan, lane, g_fold, g_full, note, title)
        out.write_text(html)
        info.update(kind="report", swimlane=lane.title)
        return info
    if g_full is not None:
        data = render.render(g_fold if fold else g_full, fmt, title)
        out.write_bytes(data)
        info.update(kind="graph")
        return info
    if fmt == "dot":
        raise ArgumentError("a DOT graph needs the model: pass --factory MODULE:FACTORY (the plan "
                            "file holds placements, not the graph's edges)")
    lane = charts.swimlane(plan, schedule=schedule, stages=stages, microbatches=microbatches,
                           virtual=virtual)
    out.write_bytes(charts.swimlane_chart(lane, fmt))
    info.update(kind="swimlane", swimlane=lane.title, bubble_fraction=lane.bubble_fraction)
    return info


def _html(plan, lane, g_fold, g_full, note, title) -> str:
    folded = full = None
    if g_full is not None:
        folded = render.render(g_fold, "svg", title)
        full = render.render(g_full, "svg", title)
    else:
        note = ("no graph: the plan file holds placements, not the graph's edges; pass "
                "--factory MODULE:FACTORY to draw it")
    return report_html(plan, memory_png=charts.memory_chart(plan),
                       swimlane_png=charts.swimlane_chart(lane), swimlane_note=lane.note,
                       graph_folded_svg=folded, graph_full_svg=full, graph_note=note, title=title,
                       legend=render.legend(g_full))
