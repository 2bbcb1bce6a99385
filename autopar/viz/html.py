"""One self-contained HTML report of a plan: summary, memory chart, swimlane and graph.

Everything is inline (SVG as markup, PNG as base64 data URIs, CSS and a few lines of JS):
the page opens without network access. After load, a script writes which pictures
actually rendered into ``<body data-rendered="...">`` (an image with a width, an SVG with a
bounding box), which the headless-browser test reads back.
"""
from __future__ import annotations

import base64
import re
from html import escape

from autopar.plan import Plan
from autopar.report import _group_layers, fmt_bytes, fmt_time, shown_pins
from autopar.viz.render import LEGEND
from autopar.viz.summary import fold_names, op_groups

CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #eee} td.n{text-align:right}
.muted{color:#666;font-size:13px} .row{display:flex;gap:30px;flex-wrap:wrap;align-items:flex-start}
.graph{overflow:auto;border:1px solid #ddd;max-height:900px;background:#fff}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #999;font-size:12px}
code{background:#f4f4f4;padding:1px 4px}
"""

JS = """
function showGraph(which){
  for (const id of ['graph-folded','graph-full']){
    const el=document.getElementById(id); if(el) el.style.display = (id==='graph-'+which)?'block':'none';
  }
  markRendered();
}
function markRendered(){
  const ok=[];
  for (const img of document.querySelectorAll('img[data-part]')){
    if (img.complete && img.naturalWidth>0) ok.push(img.dataset.part);
  }
  for (const div of document.querySelectorAll('div[data-part]')){
    const svg=div.querySelector('svg');
    if (svg && div.style.display!=='none'){ const b=svg.getBBox(); if(b.width>0&&b.height>0) ok.push(div.dataset.part); }
  }
  document.body.dataset.rendered=[...new Set(ok)].sort().join(' ');
}
window.addEventListener('load', markRendered);
"""


def _img(png: bytes, part: str, alt: str) -> str:
    data = base64.b64encode(png).decode()
    return f'<img data-part="{part}" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _svg_inline(svg: bytes) -> str:
    text = svg.decode()
    return text[text.index("<svg"):] if "<svg" in text else text


def _table(header, rows, numeric=()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(
            f'<td class="n">{escape(str(c))}</td>' if i in numeric else f"<td>{escape(str(c))}</td>"
            for i, c in enumerate(r)) + "</tr>")
    return "".join(out) + "</table>"


def report_html(plan: Plan, *, memory_png: bytes, swimlane_png: bytes, swimlane_note: str,
                graph_folded_svg: bytes | None, graph_full_svg: bytes | None,
                graph_note: str, title: str = "autopar plan",
                legend: list[tuple[str, str]] | None = None) -> str:
    e, s = plan.estimate, plan.solver
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
             f"<style>{CSS}</style><script>{JS}</script></head><body>",
             f"<h1>{escape(title)}</h1>",
             f"<p class='muted'>mesh {tuple(plan.mesh_shape)} axes {tuple(plan.mesh_axes)} on "
             f"<b>{escape(plan.cluster)}</b>, world {plan.world_size}"
             + (f", pins {escape(str(shown_pins(plan)))}" if plan.pins else "") + "</p>"]
    parts.append("<h2>Estimate</h2>" + _table(
        ("step", "compute", "communication", "bubble", "memory per device", "solver"),
        [(fmt_time(e.step_time_s), fmt_time(e.compute_s), fmt_time(e.comm_s),
          f"{e.bubble_fraction:.1%}", fmt_bytes(e.memory_total),
          f"{s.status} in {s.solve_time_s:.2f} s, gap {s.gap:.2%}, {s.n_graph_nodes} nodes "
          f"-> {s.n_decisions} decisions")]))
    mem_rows = [(k, fmt_bytes(v), f"{v / max(e.memory_total, 1e-30):.1%}")
                for k, v in sorted(e.memory_bytes.items(), key=lambda kv: -kv[1])]
    comm_rows = [(k, fmt_time(v), f"{v / max(e.comm_s, 1e-30):.1%}")
                 for k, v in sorted(e.comm.items(), key=lambda kv: -kv[1])]
    parts.append("<h2 id='memory'>Memory per device</h2><div class='row'>"
                 + _img(memory_png, "memory", "memory per device by term")
                 + "<div>" + _table(("term", "bytes", "share"), mem_rows, (1, 2))
                 + "<p class='muted'>communication per step</p>"
                 + _table(("collective@axis", "time", "share"), comm_rows, (1, 2)) + "</div></div>")
    parts.append("<h2 id='swimlane'>Timeline</h2>"
                 + _img(swimlane_png, "swimlane", f"swimlane: {swimlane_note}"))
    parts.append("<h2 id='graph'>Graph</h2>")
    if graph_folded_svg is not None:
        legend = "".join(f"<span style='background:{c}'>{escape(n)}</span>"
                         for n, c in (legend or LEGEND))
        parts.append(
            f"<p class='legend'>{legend}</p><p class='muted'>{escape(graph_note)}</p>"
            "<p><button onclick=\"showGraph('folded')\">repeated layers folded</button> "
            "<button onclick=\"showGraph('full')\">every layer</button></p>"
            f"<div class='graph' id='graph-folded' data-part='graph'>{_svg_inline(graph_folded_svg)}</div>"
            f"<div class='graph' id='graph-full' data-part='graph' style='display:none'>"
            f"{_svg_inline(graph_full_svg)}</div>")
    else:
        parts.append(f"<p class='muted'>{escape(graph_note)}</p>")
    prow = []
    for label, key, idx in _group_layers(list(plan.params)):
        first = key.replace("{}", str(idx[0])) if "{}" in key else key
        prow.append((label, str(list(plan.param_shapes.get(first, []))),
                     plan.nodes[plan.params[first]].outputs[0]))
    parts.append("<h2>Parameters</h2>" + _table(("name", "shape", "placement"), prow))
    orow = [(op, pl, len(names), fold_names(names, 6)) for op, pl, names in op_groups(plan)]
    parts.append("<h2>Ops by placement</h2>" + _table(("op", "inputs -> outputs", "count", "nodes"),
                                                      orow, (2,)))
    parts.append("</body></html>")
    html = "\n".join(parts)
    assert not re.search(r"""(src|href)=["']https?:""", html), "the report must not load from the network"
    return html
