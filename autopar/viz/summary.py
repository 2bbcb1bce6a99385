"""A plan's summary as rich tables (the content of ``autopar.report.plan_summary``, laid out
for a terminal): mesh, estimate, memory by term, communication by collective and mesh axis,
parameters grouped where layers repeat, sharded ops grouped by op and placement."""
from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from autopar.plan import Plan
from autopar.report import (_group_layers, accumulation_line, branch_lines, capture_cache_note,
                            context_lines, expert_lines, fmt_bytes, fmt_time, memory_phases_note,
                            offload_line, precision_lines, shown_pins)


def _table(title: str, *cols: str, **kw) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold",
              show_edge=False, pad_edge=False, box=None, **kw)
    for c in cols:
        right = c in ("bytes", "share", "time", "count", "seconds")
        wraps = c in ("nodes", "largest resharding", "worst param", "status")
        t.add_column(c, justify="right" if right else "left", no_wrap=not wraps,
                     overflow="fold", min_width=len(c))
    return t


def op_groups(plan: Plan) -> list[tuple[str, str, list[str]]]:
    """(op, placements, nodes) for every op node, grouped by op and placements, in order of
    first appearance: repeated layers fold into one row."""
    groups: dict[tuple[str, str], list[str]] = {}
    for n, op in plan.node_ops.items():
        groups.setdefault((op.replace("aten.", ""), str(plan.nodes[n])), []).append(n)
    return [(op, pl, names) for (op, pl), names in groups.items()]


def fold_names(names: list[str], shown: int = 3) -> str:
    head = ", ".join(names[:shown])
    return head + (f" (+{len(names) - shown} more)" if len(names) > shown else "")


def summary_renderable(plan: Plan, all_nodes: bool = False) -> Group:
    e, s = plan.estimate, plan.solver
    head = Text()
    head.append("autopar plan", style="bold")
    head.append(f": mesh {tuple(plan.mesh_shape)} axes {tuple(plan.mesh_axes)} on "
                f"{plan.cluster}, world {plan.world_size}")
    if plan.pins:
        head.append(f", pins {shown_pins(plan)}")
    head.append(f"\nestimate: step {fmt_time(e.step_time_s)} (compute {fmt_time(e.compute_s)}, "
                f"communication {fmt_time(e.comm_s)}"
        + (f", host {fmt_time(e.host_s)}: step = max(device, host)" if e.host_s else "")
        + f"), bubble {e.bubble_fraction:.1%}")
    head.append("\nstages: none (one SPMD program on every rank; no pipeline in this plan)"
                if e.bubble_fraction == 0 else "")
    for line in precision_lines(plan):
        head.append("\n" + line)
    if plan.accumulate > 1:
        head.append("\n" + accumulation_line(plan))
    if plan.offload:
        head.append("\n" + offload_line(plan))
    for line in expert_lines(plan) + branch_lines(plan) + context_lines(plan):
        head.append("\n" + line)
    head.append(f"\nsolver: {s.status} in {s.solve_time_s:.2f} s, gap {s.gap:.2%}; "
                f"{s.n_graph_nodes} graph nodes -> {s.n_decisions} decisions "
                f"({s.n_variables} variables); capture {s.capture_time_s:.2f} s"
                + capture_cache_note(s)
                + (f"; {s.time_limit}" if s.time_limit else ""))
    parts: list = [head, Text("")]

    mem = _table(f"memory per device: {fmt_bytes(e.memory_total)}"
                 + (f" (budget {fmt_bytes(plan.memory_budget)})" if plan.memory_budget else "")
                 + memory_phases_note(e),
                 "term", "bytes", "share")
    for k, v in sorted(e.memory_bytes.items(), key=lambda kv: -kv[1]):
        mem.add_row(k, fmt_bytes(v), f"{v / max(e.memory_total, 1e-30):.1%}")
    parts += [mem, Text("")]

    if e.comm:
        # shares of the communication issued (the overlapped row, negative, is the part of it
        # hidden behind compute; the rows sum to the exposed share)
        issued = sum(v for v in e.comm.values() if v > 0)
        comm = _table("communication per step (by collective @ mesh axis)", "collective", "time", "share")
        for k, v in sorted(e.comm.items(), key=lambda kv: -kv[1]):
            comm.add_row(k, fmt_time(v), f"{v / max(issued, 1e-30):.1%}")
        parts += [comm, Text(f"{fmt_time(issued)} issued, {fmt_time(e.comm_s)} exposed "
                             "(shares of the issued)"), Text("")]

    params = _table("parameters (placement per mesh axis; repeated layers grouped)",
                    "name", "shape", "placement")
    for label, key, idx in _group_layers(list(plan.params)):
        first = key.replace("{}", str(idx[0])) if "{}" in key else key
        params.add_row(label, str(list(plan.param_shapes.get(first, []))),
                       plan.nodes[plan.params[first]].outputs[0])
    parts += [params, Text("")]

    sharded = [(n, p) for n, p in plan.nodes.items()
               if n in plan.node_ops and any(c in "SP" for c in str(p))]
    title = f"sharded ops ({len(sharded)} of {len(plan.node_ops)}; the rest run replicated)"
    if all_nodes:
        ops = _table(title, "node", "op", "inputs -> outputs")
        for n, p in sharded:
            ops.add_row(n, plan.node_ops[n].replace("aten.", ""), str(p))
    else:
        ops = _table(title + ", grouped by op and placements", "op", "inputs -> outputs",
                     "count", "nodes")
        for op, pl, names in op_groups(plan):
            if any(c in "SP" for c in pl):
                ops.add_row(op, pl, str(len(names)), fold_names(names))
    parts.append(ops)
    return Group(*parts)


def print_summary(plan: Plan, console: Console, all_nodes: bool = False) -> None:
    console.print(summary_renderable(plan, all_nodes))
