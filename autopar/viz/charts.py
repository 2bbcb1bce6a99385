"""Charts of a plan (matplotlib, Agg; PNG or SVG bytes): memory per device as stacked bars
by term, and a pipeline swimlane (ranks × time).

A pipeline plan's swimlane is its own schedule (micro-batches, virtual stages) simulated by
``autopar.pricing.simulate`` with the plan's predicted stage times where the estimate has
them (``estimate.stage_times_s``), one lane per pipeline rank. A plan without a pipeline
shows one lane per rank with the estimate's compute and communication as two blocks (every
rank runs the same SPMD program). Any schedule can be drawn on its own in unit times
(``swimlane(schedule="1f1b", stages=4, microbatches=8)``).
"""
from __future__ import annotations

import io
from dataclasses import dataclass

from autopar.cost_models.hardware import parse_cluster
from autopar.errors import ArgumentError
from autopar.plan import Plan
from autopar.report import fmt_bytes, fmt_time
from autopar.schedule import schedule_actions
from autopar.pricing.simulate import simulate

TERM_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52",
               "activations": "#8172b2", "loss_grads": "#937860", "inputs": "#ccb974", "buffers": "#64b5cd"}
MAX_LANES = 16


def _plt():
    # lazy: matplotlib takes about a second to import and only the charts need it
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, fmt: str) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight", dpi=110)
    _plt().close(fig)
    return buf.getvalue()


# ---- memory ------------------------------------------------------------------------------
def device_memory(plan: Plan) -> float | None:
    """The memory of one device of the plan's cluster (GPU presets); None for CPU clusters,
    whose preset measures this machine (slow, and not what a plan file is about)."""
    if plan.cluster.lower().startswith(("cpu", "local")):
        return None
    try:
        return float(parse_cluster(plan.cluster).device.memory_bytes)
    except Exception:  # noqa: BLE001 - a cluster name we cannot read just has no line
        return None


def memory_bars(plan: Plan) -> list[tuple[str, list[tuple[str, float]]]]:
    """The bars of the memory chart: (label, [(term, bytes), ...]) bottom to top. An
    estimate with memory phases (an unpipelined step peaks at the loss's backward, at a
    layer's backward, at the end of backward or in the optimizer's step, one at a time)
    gets one bar per phase: the terms always live plus that
    phase's own, so the tallest bar is the estimate; otherwise one bar of every term."""
    est = plan.estimate
    grouped = {k for group in est.memory_phases for k in group}
    always = sorted(((k, b) for k, b in est.memory_bytes.items() if k not in grouped),
                    key=lambda kv: -kv[1])
    if not est.memory_phases:
        return [(f"every device\n(x{plan.world_size}, SPMD)", always)]
    names = {4: ("the loss's backward", "a layer's backward", "end of backward", "the optimizer's step"),
             3: ("the loss's backward", "a layer's backward", "end of backward")}.get(
        len(est.memory_phases), ("end of forward", "end of backward"))
    return [(names[i] if i < len(names) else f"phase {i + 1}",
             always + [(k, est.memory_bytes.get(k, 0.0)) for k in group])
            for i, group in enumerate(est.memory_phases)]


def memory_chart(plan: Plan, fmt: str = "png") -> bytes:
    """Stacked bars per device of the plan's estimate by term (``memory_bars``), with the
    memory budget and the device's memory as lines."""
    plt = _plt()
    est = plan.estimate
    total = est.memory_total
    unit, div = _unit(max(total, plan.memory_budget or 0))
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    bars = memory_bars(plan)
    labelled = set()
    for label, terms in bars:
        bottom = 0.0
        for term, b in terms:
            ax.bar([label], [b / div], bottom=bottom, color=TERM_COLORS.get(term, "#999999"),
                   label=None if term in labelled else f"{term} {fmt_bytes(b)}", width=0.5)
            labelled.add(term)
            bottom += b / div
    if plan.memory_budget:
        ax.axhline(plan.memory_budget / div, color="#d62728", ls="--", lw=1.2,
                   label=f"budget {fmt_bytes(plan.memory_budget)}")
    dev = device_memory(plan)
    if dev and dev < 4 * max(total, 1):
        ax.axhline(dev / div, color="#333333", ls=":", lw=1.2, label=f"device {fmt_bytes(dev)}")
    ax.set_ylabel(f"{unit} per device")
    peak = " (peak of the phases)" if est.memory_phases else ""
    ax.set_title(f"memory per device: {fmt_bytes(total)} (estimate{peak})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    ax.set_xlim(-0.8, len(bars) - 0.2)
    return _save(fig, fmt)


def _unit(b: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return unit, float(size)
    return "bytes", 1.0


# ---- swimlane ----------------------------------------------------------------------------
@dataclass
class Swimlane:
    blocks: list[dict]            # {"rank", "start", "end", "kind", "label", "microbatch"}
    n_lanes: int
    lane_label: str
    title: str
    xlabel: str
    note: str
    bubble_fraction: float


def swimlane(plan: Plan | None = None, *, schedule: str | None = None, stages: int = 4,
             microbatches: int = 8, virtual: int = 1) -> Swimlane:
    """Timeline blocks for the chart: a pipeline schedule's simulation when ``schedule`` is
    given, else the plan's step as compute + communication on each rank."""
    if schedule is not None:
        actions = schedule_actions(schedule, stages, microbatches, virtual)
        split = any(a.kind in "IW" for acts in actions for a in acts)
        sim = simulate(actions, forward=1.0, backward=2.0, weight=1.0 if split else None)
        blocks = _blocks(sim)
        note = ("schedule simulated by autopar.pipeline in unit times (forward 1, backward 2"
                + (", of which weight-gradient 1" if split else "") + ")")
        if plan is not None:
            note += "; the plan itself has no pipeline stages"
        return Swimlane(blocks, stages, "pipeline rank",
                        f"{schedule}: {stages} stages x {microbatches} micro-batches"
                        + (f", {virtual} virtual" if virtual > 1 else "")
                        + f" - bubble {sim.bubble_fraction:.1%}",
                        "time (units of one micro-batch forward on one stage)", note,
                        sim.bubble_fraction)
    if plan is None:
        raise ArgumentError("swimlane needs a plan or a schedule (--schedule 1f1b --stages 4 "
                            "--microbatches 8)")
    if plan.pipeline_stages > 1:
        return _plan_schedule(plan)
    e = plan.estimate
    lanes = min(plan.world_size, MAX_LANES)
    blocks = []
    for r in range(lanes):
        blocks.append({"rank": r, "start": 0.0, "end": e.compute_s, "kind": "compute",
                       "label": f"compute {fmt_time(e.compute_s)}", "microbatch": 0})
        if e.comm_s > 0:
            blocks.append({"rank": r, "start": e.compute_s, "end": e.step_time_s, "kind": "comm",
                           "label": f"comm {fmt_time(e.comm_s)}", "microbatch": 0})
    shown = "" if lanes == plan.world_size else f" (ranks 0-{lanes - 1} of {plan.world_size})"
    note = ("no pipeline in this plan: every rank runs the same program; one block for the "
            "estimated compute and one for communication (drawn after compute, as the "
            "estimate adds them; the runtime overlaps gradient sync with backward)")
    return Swimlane(blocks, lanes, "rank", f"one training step, estimate{shown}: "
                    f"{fmt_time(e.step_time_s)}", "time (ms)", note, e.bubble_fraction)


def _blocks(sim) -> list[dict]:
    """The chart's blocks: one per action of a simulated schedule."""
    return [{"rank": t["rank"], "start": t["start"], "end": t["end"], "kind": t["kind"],
             "label": t["action"], "microbatch": t["microbatch"]} for t in sim.timeline]


def _plan_schedule(plan: Plan) -> Swimlane:
    """The pipeline plan's schedule on its ranks, timed by its predicted stage times."""
    p, m, v = plan.pipeline_stages, plan.n_microbatches, plan.virtual_stages
    actions = schedule_actions(plan.schedule, p, m, v)
    split = any(a.kind in "IW" for acts in actions for a in acts)
    times = tuple(getattr(plan.estimate, "stage_times_s", ()) or ())
    if len(times) == p * v:
        scale, unit = 1e3, "ms"
        stage = [t * scale for t in times]
        note = "the plan's schedule timed by its predicted stage times (forward + backward)"
    else:
        scale, unit = 1.0, "units of one micro-batch forward on one stage"
        stage = [3.0] * (p * v)
        note = "the plan's schedule in unit times (this plan file has no stage times)"
    fwd = [t / 3 for t in stage]
    sim = simulate(actions, forward=fwd, backward=[2 * f for f in fwd],
                   weight=fwd if split else None)
    blocks = _blocks(sim)
    return Swimlane(blocks, p, "pipeline rank",
                    f"{plan.schedule}: {p} stages x {m} micro-batches"
                    + (f", {v} virtual" if v > 1 else "")
                    + f" - bubble {sim.bubble_fraction:.1%}", f"time ({unit})", note,
                    sim.bubble_fraction)


def swimlane_chart(lane: Swimlane, fmt: str = "png") -> bytes:
    plt = _plt()
    n = lane.n_lanes
    fig, ax = plt.subplots(figsize=(10, 0.45 * n + 1.6))
    scale = 1e3 if lane.xlabel.endswith("(ms)") else 1.0
    cmap = plt.get_cmap("tab20")
    span = max((b["end"] for b in lane.blocks), default=1.0) * scale
    for b in lane.blocks:
        x0, w = b["start"] * scale, (b["end"] - b["start"]) * scale
        kind = b["kind"]
        if kind == "compute":
            color, hatch = "#4c72b0", None
        elif kind == "comm":
            color, hatch = "#c44e52", None
        else:
            color = cmap((b["microbatch"] * 2) % 20 + (1 if kind in "BIW" else 0))
            hatch = {"B": "//", "I": "//", "W": "xx"}.get(kind)
        ax.broken_barh([(x0, w)], (b["rank"] - 0.4, 0.8), facecolors=color, edgecolor="#333",
                       linewidth=0.5, hatch=hatch)
        if w > span * 0.009 * len(b["label"]):
            ax.text(x0 + w / 2, b["rank"], b["label"], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{lane.lane_label} {r}" for r in range(n)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(lane.xlabel)
    ax.set_title(lane.title, fontsize=10)
    fig.text(0.01, -0.02, lane.note, fontsize=7, wrap=True, va="top")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, fmt)
