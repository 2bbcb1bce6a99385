"""Draw a :class:`~autopar.viz.graph.Graph`: DOT through pydot; SVG and PNG through
Graphviz's ``dot`` where its binary is installed, else through a small layered layout of
our own (SVG text, or matplotlib for PNG). ``renderer()`` says which one is in use."""
from __future__ import annotations

import io
import re
import shutil
import subprocess
from html import escape

import pydot

from autopar.errors import ArgumentError
from autopar.viz.graph import Graph, GNode

# fill colour by node kind; layers get a tinted cluster background in DOT.
FILL = {"param": "#fff2b3", "buffer": "#f0e0ff", "input": "#cfe8ff", "op": "#ffffff",
        "op_sharded": "#d4f4d4", "loss": "#ffd1a3", "collective": "#ff9d9d", "fold": "#e6e6e6"}
LAYER_TINTS = ["#f3f7ff", "#fff7ef", "#f2fbf2", "#fdf2fb", "#f5f5f5", "#fffbe6"]
LEGEND = [("parameter", FILL["param"]), ("input", FILL["input"]),
          ("op, replicated", FILL["op"]), ("op, sharded", FILL["op_sharded"]),
          ("loss", FILL["loss"]), ("collective", FILL["collective"]),
          ("folded layer", FILL["fold"])]


# pipeline plans: ops and folded layers filled by their stage's pipeline rank
STAGE_FILLS = ["#cfe2ff", "#d4f4d4", "#ffe5b4", "#f3d1f4", "#d9f2f2", "#fff3b0", "#e2d9f3",
               "#f8d7da"]


def fill_of(n: GNode, g: Graph | None = None) -> str:
    if g is not None and g.stage_ranks and n.stage is not None and n.kind in ("op", "fold"):
        return STAGE_FILLS[g.stage_ranks[n.stage] % len(STAGE_FILLS)]
    if n.kind == "op":
        return FILL["op_sharded"] if n.sharded else FILL["op"]
    return FILL.get(n.kind, "#ffffff")


def legend(g: Graph | None = None) -> list[tuple[str, str]]:
    """(label, colour) pairs: the node kinds, or for a pipeline plan the ranks' colours."""
    if g is None or not g.stage_ranks:
        return LEGEND
    ranks = sorted(set(g.stage_ranks))
    stages = {r: [k for k, q in enumerate(g.stage_ranks) if q == r] for r in ranks}
    per_rank = [(f"pipeline rank {r}: stage{'s' if len(stages[r]) > 1 else ''} "
                 f"{', '.join(map(str, stages[r]))}", STAGE_FILLS[r % len(STAGE_FILLS)])
                for r in ranks]
    return per_rank + [e for e in LEGEND if e[0] not in ("op, replicated", "op, sharded")]


def dot_binary() -> str | None:
    return shutil.which("dot")


def renderer() -> str:
    return "graphviz dot" if dot_binary() else "autopar's own layered layout (Graphviz not installed)"


# ---- DOT -------------------------------------------------------------------------------
def to_dot(g: Graph, title: str = "autopar plan") -> str:
    d = pydot.Dot("plan", graph_type="digraph", rankdir="TB", label=_q(title), labelloc="t",
                  fontname="Helvetica", fontsize="12", nodesep="0.25", ranksep="0.35")
    d.set_node_defaults(fontname="Helvetica", fontsize="9", style="filled", shape="box")
    d.set_edge_defaults(fontname="Helvetica", fontsize="8", color="#666666")
    clusters: dict = {}
    for n in g.nodes.values():
        shape = {"collective": "hexagon", "fold": "box3d", "param": "note", "input": "cds",
                 "loss": "doubleoctagon"}.get(n.kind, "box")
        node = pydot.Node(_q(n.id), label=_q(n.label), fillcolor=fill_of(n, g), shape=shape,
                          tooltip=_q(n.detail or n.label.replace("\n", " ")))
        if n.layer is not None and n.kind != "fold":
            key = f"{n.layer[0]}.{n.layer[1]}"
            if key not in clusters:
                tint = LAYER_TINTS[len(clusters) % len(LAYER_TINTS)]
                clusters[key] = pydot.Cluster(re.sub(r"\W", "_", "layer_" + key), label=_q(key),
                                              style="filled", fillcolor=tint, color="#aaaaaa")
                d.add_subgraph(clusters[key])
            clusters[key].add_node(node)
        else:
            d.add_node(node)
    for s, t, lab in g.edges:
        d.add_edge(pydot.Edge(_q(s), _q(t), label=_q(lab) if lab else '""'))
    return d.to_string()


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render(g: Graph, fmt: str, title: str = "autopar plan") -> bytes:
    """``fmt`` in dot / svg / png."""
    if fmt == "dot":
        return to_dot(g, title).encode()
    binary = dot_binary()
    if binary:
        proc = subprocess.run([binary, f"-T{fmt}"], input=to_dot(g, title).encode(),
                              capture_output=True, timeout=120)
        if proc.returncode == 0:
            return proc.stdout
        raise RuntimeError(f"dot -T{fmt} failed: {proc.stderr.decode()[:500]}")
    if fmt == "svg":
        return layout_svg(g, title).encode()
    if fmt == "png":
        return layout_png(g, title)
    raise ArgumentError(f"unknown graph format {fmt!r}; use dot, svg or png")


# ---- our own layered layout (no Graphviz) ------------------------------------------------
CHAR_W, LINE_H, PAD, GAP_X, GAP_Y = 6.2, 12.0, 6.0, 14.0, 34.0


def layout(g: Graph) -> tuple[dict[str, tuple[float, float, float, float]], float, float]:
    """Boxes (x, y, w, h) per node: rank = longest path from a source, in order of the
    graph within a rank."""
    succs: dict[str, list[str]] = {n: [] for n in g.nodes}
    indeg = dict.fromkeys(g.nodes, 0)
    for s, t, _ in g.edges:
        succs[s].append(t)
        indeg[t] += 1
    rank = dict.fromkeys(g.nodes, 0)
    ready = [n for n in g.nodes if indeg[n] == 0]
    while ready:                         # Kahn's order: a node after all its producers
        n = ready.pop()
        for t in succs[n]:
            rank[t] = max(rank[t], rank[n] + 1)
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    rows: dict[int, list[str]] = {}
    for n in g.nodes:
        rows.setdefault(rank[n], []).append(n)
    boxes, width, y = {}, 0.0, 30.0
    for r in sorted(rows):
        x, h_row = 10.0, 0.0
        for n in rows[r]:
            lines = g.nodes[n].label.split("\n")
            w = max(len(line) for line in lines) * CHAR_W + 2 * PAD
            h = len(lines) * LINE_H + 2 * PAD
            boxes[n] = (x, y, w, h)
            x += w + GAP_X
            h_row = max(h_row, h)
        width = max(width, x)
        y += h_row + GAP_Y
    return boxes, width + 10, y + 10


def layout_svg(g: Graph, title: str) -> str:
    boxes, W, H = layout(g)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H:.0f}" '
           f'viewBox="0 0 {W:.0f} {H:.0f}" font-family="Helvetica,Arial,sans-serif" font-size="10">',
           '<defs><marker id="arr" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
           'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker></defs>',
           f'<text x="10" y="18" font-size="13">{escape(title)}</text>']
    for s, t, _ in g.edges:
        xs, ys, ws, hs = boxes[s]
        xt, yt, wt, _ = boxes[t]
        out.append(f'<line x1="{xs + ws / 2:.1f}" y1="{ys + hs:.1f}" x2="{xt + wt / 2:.1f}" '
                   f'y2="{yt:.1f}" stroke="#888" stroke-width="0.8" marker-end="url(#arr)"/>')
    for n, (x, y, w, h) in boxes.items():
        node = g.nodes[n]
        dash = ' stroke-dasharray="4 2"' if node.kind == "fold" else ""
        out.append(f'<g class="node {node.kind}"><title>{escape(node.detail or node.label)}</title>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="3" '
                   f'fill="{fill_of(node, g)}" stroke="#444"{dash}/>')
        for i, line in enumerate(node.label.split("\n")):
            out.append(f'<text x="{x + PAD:.1f}" y="{y + PAD + (i + 0.8) * LINE_H:.1f}">'
                       f'{escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def layout_png(g: Graph, title: str) -> bytes:
    # lazy: matplotlib takes about a second to import and only the PNG output needs it
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    boxes, W, H = layout(g)
    scale = 1 / 72
    fig = plt.figure(figsize=(max(W * scale, 4), max(H * scale, 3)), dpi=72)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, W)
    ax.set_ylim(H, 0)
    ax.axis("off")
    ax.text(10, 18, title, fontsize=11)
    for s, t, _ in g.edges:
        xs, ys, ws, hs = boxes[s]
        xt, yt, wt, _ = boxes[t]
        ax.annotate("", xy=(xt + wt / 2, yt), xytext=(xs + ws / 2, ys + hs),
                    arrowprops=dict(arrowstyle="->", color="#888", lw=0.6))
    for n, (x, y, w, h) in boxes.items():
        node = g.nodes[n]
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=3",
                                    fc=fill_of(node, g), ec="#444", lw=0.6,
                                    ls="--" if node.kind == "fold" else "-"))
        ax.text(x + PAD, y + PAD, node.label, fontsize=7, va="top", family="sans-serif",
                linespacing=1.2)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
