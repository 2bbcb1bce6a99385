"""Plans as text a person reads: the summary printed by ``plan.summary()`` and the CLI."""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING

from autopar.cost_models.hardware import ClusterError, parse_cluster
from autopar.cost_models.offload import disk_seconds, disk_times, exposed_share, offload_times
from autopar.placement import Shard

if TYPE_CHECKING:           # for annotations only: plan.py imports this module
    from autopar.plan import Plan


def fmt_bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_time(s: float) -> str:
    """Seconds in the unit that suits their size (a negative time too: the overlapped
    communication a plan's estimate subtracts)."""
    if abs(s) >= 1:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def _group_layers(names):
    """Fold names that differ only in a layer index: h.0.x, h.1.x -> h.{0..1}.x."""
    groups: "OrderedDict[str, list[int]]" = OrderedDict()
    for n in names:
        m = re.match(r"^(.*?)\.(\d+)\.(.*)$", n)
        key = f"{m.group(1)}.{{}}.{m.group(3)}" if m else n
        groups.setdefault(key, []).append(int(m.group(2)) if m else -1)
    out = []
    for key, idx in groups.items():
        if "{}" in key:
            label = f"{min(idx)}..{max(idx)}" if len(idx) > 1 else str(idx[0])
            out.append((key.replace("{}", "{" + label + "}") if len(idx) > 1 else key.replace("{}", label), key, idx))
        else:
            out.append((key, key, idx))
    return out


def accumulation_line(plan: Plan) -> str:
    """What a plan with gradient accumulation does in a step ("" without)."""
    k = plan.accumulate
    if k <= 1:
        return ""
    return (f"gradient accumulation: {k} micro-batches per step, each forward and backward "
            "(memory holds one micro-batch's activations); gradients synchronised once per "
            "step, in the last micro-batch's backward")


def memory_phases_note(estimate) -> str:
    """Which memory terms are never live at once ("" when all are: pipelines, accumulation)."""
    if not estimate.memory_phases:
        return ""
    groups = " or ".join("+".join(g) for g in estimate.memory_phases)
    return f" (the peak holds {groups}, one at a time, beside the rest)"


def offload_line(plan: Plan) -> str:
    """What ZeRO-Offload does in a plan's step, with its host bytes and the seconds the cost
    model gives its copies and host step ("" without offload)."""
    if getattr(plan, "offload", None) == "disk":
        return disk_offload_line(plan)
    if getattr(plan, "offload", None) != "optimizer":
        return ""
    host = plan.host_memory_bytes
    shard = host.get("grads", 0.0)
    timing = ""
    if shard:
        try:
            states = round(host.get("optimizer", 0.0) / shard) - 1
            copies, step = offload_times(shard, states, parse_cluster(plan.cluster).device,
                                         exposed_share(shard))
            timing = f"; per step: copies not hidden {fmt_time(copies)}, host step {fmt_time(step)} (in compute)"
        except ClusterError:
            pass
    return (f"ZeRO-Offload (offload='optimizer', zero={plan.options.zero}): optimizer state on "
            f"the host, {fmt_bytes(host.get('optimizer', 0.0) + shard)} per rank = master copy and moments "
            f"{fmt_bytes(host.get('optimizer', 0.0))}, gradient shard {fmt_bytes(shard)}; each bucket's "
            f"gradient shards go down as its reduction finishes, its updated shards up just before "
            f"its gather{timing}")


def disk_offload_line(plan: Plan) -> str:
    """``offload="disk"`` (ZeRO-Infinity's disk tier): the disk bytes and seconds."""
    shard = plan.host_memory_bytes.get("grads", 0.0)
    disk = plan.disk_bytes.get("optimizer", 0.0)
    timing = ""
    if shard:
        try:
            states = round(disk / shard) - 1
            dev = parse_cluster(plan.cluster).device
            copies, step = offload_times(shard, states, dev, exposed_share(shard))
            read, write = disk_times(shard, states, dev)
            timing = (f"; per step: copies not hidden {fmt_time(copies)}, host step {fmt_time(step)}, "
                      f"disk read {fmt_time(read)} + write {fmt_time(write)} beside it, "
                      f"{fmt_time(disk_seconds(shard, states, dev))} not hidden (in compute)")
        except ClusterError:
            pass
    return (f"ZeRO-Infinity disk tier (offload='disk', zero={plan.options.zero}): optimizer state "
            f"(master copy and moments) in files on local disk, {fmt_bytes(disk)} per rank, read "
            f"a bucket ahead of the host step and written back after it; host memory holds the "
            f"gradient shard {fmt_bytes(shard)}{timing}")


def branch_lines(plan: Plan) -> list[str]:
    """Branch parallelism: each branch set and what each group on the "branch" axis runs
    (its branches named by the modules of their parameters)."""
    lines = []
    param_of = {}
    for name, ph in plan.params.items():
        param_of.setdefault(ph, name)
    for i, b in enumerate(plan.branches):
        lines.append(f"branches {i}: fork {b.fork} -> join {b.join}, {len(b.groups)} groups on "
                     f"mesh axis 'branch':")
        for g, nodes in enumerate(b.groups):
            mods = list(dict.fromkeys(param_of[n].rsplit(".", 1)[0] for n in nodes if n in param_of))
            ops = sum(1 for n in nodes if n not in param_of)
            lines.append(f"  group {g}: {ops} ops, parameters of {', '.join(mods) or 'none'}")
    return lines


EXPERTS_OP_NAME = "autopar.moe_experts.default"


def expert_lines(plan: Plan) -> list[str]:
    """How the plan runs each mixture-of-experts layer (``autopar::moe_experts`` node):
    experts split over which axes and how tokens reach them, or replicated; layers with the
    same choice on one line."""
    by_choice: "OrderedDict[str, list[str]]" = OrderedDict()
    for name, op in plan.node_ops.items():
        if op != EXPERTS_OP_NAME or name not in plan.nodes:
            continue
        by_choice.setdefault(expert_choice(plan, name), []).append(name)
    if not by_choice:
        return []
    n = sum(len(v) for v in by_choice.values())
    lines = [f"mixture of experts ({n} expert layer{'s' * (n != 1)}):"]
    for choice, names in by_choice.items():
        lines.append(f"  {', '.join(names[:3]) + (' ...' if len(names) > 3 else '')}: {choice}")
    return lines


def expert_choice(plan: Plan, name: str) -> str:
    """One experts node's choice in words."""
    node = plan.nodes[name]
    hidden, stack = node.input(0), node.input(3)
    axes = [(a, plan.mesh_axes[a], plan.mesh_shape[a]) for a in range(len(plan.mesh_shape))
            if plan.mesh_shape[a] > 1 and plan.mesh_axes[a] != "pipeline"]
    split = [(ax, n, "all-to-all" if isinstance(hidden[a], Shard) else "all-gather + reduce")
             for a, ax, n in axes if stack[a] == Shard(0)]
    inner = [f"{n}-way over {ax!r}" for a, ax, n in axes
             if isinstance(stack[a], Shard) and stack[a] != Shard(0)]
    tokens = [f"{ax!r}" for a, ax, n in axes if isinstance(hidden[a], Shard) and stack[a] != Shard(0)]
    words = ("experts split " + ", ".join(f"{n}-way over {ax!r} (tokens by {how})" for ax, n, how in split)
             if split else "experts replicated" if not inner else "")
    if inner:
        words += ("; " if words else "") + "each expert split " + ", ".join(inner) + \
            " (tensor-sharded experts, summed by a reduce)"
    return words + (f"; tokens split over {', '.join(tokens)}" if tokens else "")


def context_lines(plan: Plan) -> list[str]:
    """Context parallelism: the axis, how attention crosses it, the layout, and what the
    search predicted without it."""
    if "context" not in plan.mesh_axes:
        return []
    c = plan.mesh_shape[plan.mesh_axes.index("context")]
    form = plan.options.context_attention or "ring"
    how = ("K/V blocks passed around the ring, each sent while the last is computed" if form == "ring"
           else "K/V all-gathered, their gradients reduce-scattered")
    lines = [f"context parallelism: the sequence split {c} ways over 'context', causally balanced "
             f"(rank r holds chunks r and {2 * c - 1}-r of {2 * c}); attention: {how}"]
    without = plan.alternatives_s.get("without a context axis")
    if without is not None:
        lines.append(f"  the best plan without a context axis: {fmt_time(without)} a step "
                     f"({without / plan.estimate.step_time_s:.2f}x this plan's)")
    return lines


def shown_pins(plan: Plan) -> dict:
    """The plan's pins as the summary's first line shows them: a list of fp8 layers as its
    count (:func:`fp8_lines` names them), any other list of module names folded by layer
    index (:func:`fold_indexed`: ``offload_activations``' 72 layers, ``['model.layers.{0..71}']``)."""
    pins = dict(plan.pins)
    if isinstance(pins.get("fp8_layers"), list):
        pins["fp8_layers"] = f"{len(pins['fp8_layers'])} layers"
    for key, value in pins.items():
        if isinstance(value, list) and len(value) > 2 and all(isinstance(v, str) for v in value):
            pins[key] = fold_indexed(value)
    return pins


def fold_indexed(names: list[str]) -> list[str]:
    """Names that differ only in one layer index, folded into runs of consecutive indices
    (``model.layers.0`` .. ``model.layers.71`` -> ``model.layers.{0..71}``; ``h.0.mlp``,
    ``h.1.mlp``, ``h.3.mlp`` -> ``h.{0..1}.mlp``, ``h.3.mlp``), first appearance first."""
    groups: "OrderedDict[tuple, list[int]]" = OrderedDict()
    for n in names:
        m = re.match(r"^(.*?\.)(\d+)((?:\..*)?)$", n)
        key = (m.group(1), m.group(3)) if m else (n, None)
        groups.setdefault(key, []).append(int(m.group(2)) if m else -1)
    out = []
    for (head, tail), idx in groups.items():
        if tail is None:
            out.append(head)
            continue
        idx = sorted(set(idx))
        start = prev = idx[0]
        for i in idx[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            out.append(f"{head}{{{start}..{prev}}}{tail}" if prev > start else f"{head}{start}{tail}")
            if i is not None:
                start = prev = i
    return out


def fp8_lines(plan: Plan) -> list[str]:
    """Under ``precision="fp8"``: which linear layers (and experts modules) run in fp8 (the
    plan's ``fp8_layers``: chosen by price, pinned, or "all"), folded by layer index."""
    o = plan.options
    if o.precision != "fp8":
        return []
    recipe = o.fp8_scaling or "tensorwise"
    gather = ["fp8: ZeRO-3 gathers their weights in fp8 (fp8_all_gather)"] if o.fp8_gathers else []
    if o.fp8_layers is None or o.fp8_layers == "all":
        return [f"fp8 ({recipe}): every linear layer but the head, and the experts' GEMMs"] + gather
    names = list(o.fp8_layers)
    rows = [label for label, _, _ in _group_layers(names)]
    return [f"fp8 ({recipe}): {len(names)} linear layers or experts modules (the others, and the head, bf16): "
            + (", ".join(rows) if rows else "none")] + gather


def rank_memory_line(e) -> list[str]:
    """A pipeline plan's spread of memory over its ranks (``Estimate.rank_memory_bytes``;
    the memory line above is the fullest rank's), or nothing."""
    totals = [sum(r.values()) for r in e.rank_memory_bytes]
    if len(totals) < 2:
        return []
    fullest = max(range(len(totals)), key=totals.__getitem__)
    return [f"pipeline ranks hold {fmt_bytes(min(totals))} to {fmt_bytes(max(totals))} a device "
            f"(the line above is rank {fullest}'s, the fullest)"]


def precision_lines(plan: Plan) -> list[str]:
    """Where a GPU plan has no ``precision=`` pin: it computes in the model's own dtypes
    (fp32 for a model built in fp32, the default), its matmuls at the vector units' rate, a
    tenth or less of the tensor cores' bf16 one on Hopper and Ampere. One line saying so
    and how to train in bf16, as GPU runs mostly do (a user planning Llama-3-8B on 16 H100
    otherwise reads 9.4 s a step, ZeRO-3 and offload, with no word of why)."""
    if plan.options.precision is not None or plan.cluster.split(":")[0].strip().lower() in ("cpu", "local"):
        return []             # (a CPU cluster: not parsed, which may measure this machine)
    try:
        dev = parse_cluster(plan.cluster).device
    except ClusterError:         # a cluster named for a sub-mesh ("8x8xH100[stage of 8]")
        return []
    fp32, bf16 = dev.peak_flops.get("fp32"), dev.peak_flops.get("bf16")
    if not dev.sms or not fp32 or not bf16 or bf16 < 4 * fp32:     # sms: a GPU's (0 on CPUs)
        return []
    return [f"precision: the model's own dtypes (no precision= pin): fp32 matmuls at {dev.name}'s "
            f"fp32 rate, {bf16 / fp32:.0f}x below its bf16 one; pin precision=bf16 (autocast, "
            "fp32 weights and optimizer) to plan mixed precision"]


def plan_summary(plan: Plan) -> str:
    e, s = plan.estimate, plan.solver
    lines = [
        f"autopar plan: mesh {tuple(plan.mesh_shape)} axes {tuple(plan.mesh_axes)} on "
        f"{plan.cluster}, world {plan.world_size}" + (f", pins {shown_pins(plan)}" if plan.pins else ""),
        f"estimate: step {fmt_time(e.step_time_s)} (compute {fmt_time(e.compute_s)}, "
        f"communication {fmt_time(e.comm_s)}"
        + (f", host {fmt_time(e.host_s)}: step = max(device, host)" if e.host_s else "")
        + f"), bubble {e.bubble_fraction:.1%}",
    ] + precision_lines(plan) + ([accumulation_line(plan)] if plan.accumulate > 1 else []) + branch_lines(plan) + (
        [offload_line(plan)] if plan.offload else []) + [
        f"memory per device: {fmt_bytes(e.memory_total)} " + ("at the peak; " if e.memory_phases else "= ")
        + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(e.memory_bytes.items(), key=lambda kv: -kv[1]))
        + memory_phases_note(e),
    ] + rank_memory_line(e)
    if plan.memory_budget:
        lines.append(f"memory budget: {fmt_bytes(plan.memory_budget)} per device")
    if e.comm:
        lines.append("communication: " + ", ".join(f"{k} {fmt_time(v)}" for k, v in e.comm.items()))
    lines += expert_lines(plan)
    lines += context_lines(plan)
    lines += fp8_lines(plan)
    lines.append(f"solver: {s.status} in {s.solve_time_s:.2f} s, gap {s.gap:.2%}; "
                 f"{s.n_graph_nodes} graph nodes -> {s.n_decisions} decisions "
                 f"({s.n_variables} variables); capture {s.capture_time_s:.2f} s"
                 + capture_cache_note(s)
                 + (f"; {s.time_limit}" if s.time_limit else ""))
    if s.skipped:
        lines.append(f"not tried: {s.skipped}")
    lines.append("")
    lines.append("parameters (placement per mesh axis):")
    rows = []
    for label, key, idx in _group_layers(list(plan.params)):
        first = key.replace("{}", str(idx[0])) if "{}" in key else key
        ph = plan.params[first]
        shape = plan.param_shapes.get(first, [])
        rows.append((label, str(list(shape)), plan.nodes[ph].outputs[0]))
    lines += _table(("name", "shape", "placement"), rows)
    lines.append("")
    sharded = [(n, p) for n, p in plan.nodes.items()
               if n in plan.node_ops and any(c in "SP" for c in str(p))]
    groups: "OrderedDict[tuple[str, str], list[str]]" = OrderedDict()
    for n, p in sharded:
        groups.setdefault((plan.node_ops[n].replace("aten.", ""), str(p)), []).append(n)
    lines.append(f"sharded ops ({len(sharded)} of {len(plan.node_ops)} nodes, grouped by op and "
                 "placement; the rest run replicated):")
    rows = [(op, place, len(nodes), ", ".join(nodes[:3]) + (" ..." if len(nodes) > 3 else ""))
            for (op, place), nodes in groups.items()]
    lines += _table(("op", "inputs -> outputs", "nodes", "e.g."), rows)
    return "\n".join(lines)


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def capture_cache_note(s) -> str:
    """" (from the cache)" after the capture seconds when the capture cache gave the graph
    (``SolverReport.capture_cache``: "hit", or "k of n from the cache")."""
    got = getattr(s, "capture_cache", "")
    if got == "hit":
        return " (from the cache)"
    return f" ({got})" if got.endswith("from the cache") else ""
