"""The frontier table (issue 40): each frontier model planned free against every published
or recommended configuration of it, pinned and priced by the same cost model, with the
wall seconds each planning took on this machine.

    python benchmarks/frontier.py --rows mixtral-8x7b            # one model, every config
    python benchmarks/frontier.py --rows llama3-70b,llama3-8b-262k --budget 600
    python benchmarks/frontier.py --table                        # the saved results again
    python benchmarks/frontier.py --list                         # the rows and configs

Each case (a row's free plan, or one of its pinned configurations) plans in its own
process, as ``autopar plan`` would: capture included, wall seconds from the process's start
of planning, killed (its whole process group, the search's forked workers too) at
``--budget`` seconds. A case killed at its budget records the last stage the search had
reported (``autopar: <stage> <s>s, best so far <step> s``, the free search's progress
line), so the table says which stage kept it from the goal. Results are kept, case by case,
in ``benchmarks/results/frontier.json`` (``--out``), so a long table can be run in parts.

What is compared: ``plan.estimate.step_time_s`` of each plan (operators, collectives,
bubble; the same terms for free and pinned), tokens per second per GPU from it, memory per
device, and the planning wall seconds. The published step is not the target here (that is
``benchmarks/published_runs.py``'s); the question is whether the free search finds a plan
at least as fast, by its own model, as what experts configured.

Goals (issue 40): the free plan predicted at least as fast as the best pinned configuration
in every row; each row planned in at most 30 s wall on this 2-core machine; Llama 3 405B on
16,384 GPUs in at most 5 s including capture.

How each configuration maps onto autopar's mesh: autopar's expert axis is its own mesh
axis beside data (``data x expert x tensor x pipeline x context = GPUs``; the expert ranks
split the batch too), so Megatron-Core's EP, which folds into TP x DP, is pinned as
``expert = EP / ETP-folded TP share`` with the rest data-parallel: ``EP 8`` under ``TP 1``
and data-parallel 16 is ``expert 8 x data 2``; ``EP 8`` folded over ``TP 2 x DP`` is
``tensor 2 x expert 4`` (as ``published_runs.py``'s Qwen3 row). DeepEP and all-to-all
dispatchers are both priced as autopar's all-to-all dispatch.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import published_runs as pr  # noqa: E402

OUT = os.path.join(HERE, "results", "frontier.json")
GOAL_PLAN_S = 30.0
MEGATRON_MOE = ("Megatron-LM megatron/core/transformer/moe/README.md, 'Reference Best "
                "Parallel Mapping' (MCore v0.8, 8xH100 nodes, InfiniBand 8x400 Gbit/s)")
MEGATRON_EP_TP = ("the same README, 'Tuning Guide' rule 4: 'In practice, EP8TP1 is better "
                  "than EP4TP2 for 8x7B'")
QWEN3_ZOO = "yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md (256 H100)"


@dataclass(frozen=True)
class Config:
    """One pinned configuration: ``changes`` to the row's :class:`published_runs.Run`
    (degrees, micro-batch, schedule, recomputation), pinned by ``published_runs.pins_of``."""
    label: str
    source: str
    changes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    name: str
    run: pr.Run          # the model, cluster, batch and sequence; its own degrees unused
    configs: tuple[Config, ...]
    goal_plan_s: float = GOAL_PLAN_S


def _mixtral(name: str, arch: str, gpus: int, layers: int, hidden: int, heads: int) -> pr.Run:
    return pr.Run(name, MEGATRON_MOE, arch, layers, hidden, heads, 32000, 4096, 256, gpus,
                  "h100", 1, 1, micro=1, recompute=False, held=True)


_RUNS = pr.RUNS
ROWS: dict[str, Row] = {r.name: r for r in (
    Row("deepseek-v3", _RUNS[17], (
        Config("published: PP 16 x EP 64 x DP 2", _RUNS[17].source),)),
    Row("qwen3-235b", _RUNS[18], (
        Config("A2A: TP 2 x EP 8 x PP 32 x VPP 3 x DP 4", QWEN3_ZOO + ", A2A row, 24.2 s"),
        Config("DeepEP cross-node: TP 2 x EP 32 x PP 8 x VPP 4", QWEN3_ZOO + ", 19.7 s",
               dict(tensor=2, pipeline=8, expert=16, virtual=4)),
        # autopar refuses zero= beside expert= (options.py), so FSDP is left out: the
        # state is not sharded over the data ranks, and the plan may not fit
        Config("DeepEP intra-node: TP 2 x EP 8 x DP 128 (FSDP not pinnable), MBS 4, full "
               "recompute", QWEN3_ZOO + ", 17.6 s",
               dict(tensor=2, pipeline=1, expert=4, micro=4, recompute=True, virtual=1,
                    schedule="1f1b")),
        Config("DeepEP: TP 4 x EP 8 x PP 8 x VPP 4 x DP 8", QWEN3_ZOO + ", 29.0 s",
               dict(tensor=4, pipeline=8, expert=2, virtual=4)),
    )),
    Row("mixtral-8x7b", _mixtral("Mixtral 8x7B", "hf:mixtral-8x7b", 64, 32, 4096, 32), (
        Config("reference: TP 1 x EP 8 x PP 4 x VP 8", MEGATRON_MOE,
               dict(tensor=1, pipeline=4, expert=8, virtual=8, schedule="interleaved-1f1b")),
        Config("guidance's slower: TP 2 x EP 4 x PP 4 x VP 8", MEGATRON_EP_TP,
               dict(tensor=2, pipeline=4, expert=4, virtual=8, schedule="interleaved-1f1b")),
    )),
    Row("mixtral-8x22b", _mixtral("Mixtral 8x22B", "hf:mixtral-8x22b", 128, 56, 6144, 48), (
        Config("reference: TP 4 x EP 2 x PP 8 x VP 7", MEGATRON_MOE,
               dict(tensor=4, pipeline=8, expert=2, virtual=7, schedule="interleaved-1f1b")),
        Config("EP 8 x TP 1 x PP 8 x VP 7", MEGATRON_EP_TP + " (the rule on 8x22B)",
               dict(tensor=1, pipeline=8, expert=8, virtual=7, schedule="interleaved-1f1b")),
        Config("EP 4 x TP 2 x PP 8 x VP 7", MEGATRON_EP_TP + " (the rule on 8x22B)",
               dict(tensor=2, pipeline=8, expert=4, virtual=7, schedule="interleaved-1f1b")),
    )),
    Row("llama3-405b", _RUNS[16], (
        Config("published: TP 8 x PP 16 x DP 128, interleaved", _RUNS[16].source),),
        goal_plan_s=5.0),
    Row("llama3-70b", replace(_RUNS[13], name="Llama3 70B (H100)", device="h100"), (
        Config("FSDP 64, full recompute", _RUNS[13].source + ", on H100"),
        # each tensor-parallel group takes the 8 sequences its 8 GPUs took under FSDP 64
        Config("FSDP 8 x TP 8, local batch 8, full recompute",
               "torchtitan's 2-D recipe (FSDP x TP inside a node)", dict(tensor=8, micro=8)),
    )),
    Row("llama3-8b-262k", replace(_RUNS[29], name="Llama3 8B 262k (32 H100)", gpus=32, batch=4),
        (Config("FSDP 4 x CP 8", _RUNS[29].source + ", data-parallel over 4 such groups"),
         Config("FSDP 1 x CP 32", "the sequence over every GPU", dict(context=32)))),
)}


# --- one case, in its own process -------------------------------------------------------
def _case_run(row: Row, index: int) -> pr.Run:
    return row.run if index < 0 else replace(row.run, **row.configs[index].changes)


def plan_case(row: Row, index: int, time_limit_s: float) -> dict:
    """Plan ``row``'s free plan (``index`` -1) or its configuration ``index``: one dict."""
    from autopar.solver.driver import solve

    run = _case_run(row, index)
    t0, c0 = time.perf_counter(), time.process_time()
    ex = pr.build(run, run.batch)
    cluster = pr.run_cluster(run)
    if index < 0:
        pins = {"precision": "bf16", "grad_reduce": run.grad_reduce}
    else:
        pins = pr.pins_of(run)
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                    pins=pins, time_limit_s=max(time_limit_s, run.time_limit_s))
    e = plan.estimate
    return {"step_s": e.step_time_s, "tokens_per_gpu_s": run.batch * run.seq / e.step_time_s / run.gpus,
            "memory_gib": e.memory_total / 2**30, "mesh": dict(zip(plan.mesh_axes, plan.mesh_shape)),
            "pipeline": (f"{plan.pipeline_stages} x m={plan.n_microbatches} {plan.schedule}"
                         if plan.pipeline_stages > 1 else ""),
            "bubble": e.bubble_fraction if plan.pipeline_stages > 1 else 0.0,
            "options": {k: v for k, v in plan.pins.items() if k not in ("precision", "grad_reduce")},
            "solver": plan.solver.status, "time_limit": plan.solver.time_limit,
            "skipped": plan.solver.skipped,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "phases": plan.solver.phases, "digest": plan.digest()}


def run_case(name: str, index: int, budget_s: float, time_limit_s: float) -> dict:
    """:func:`plan_case` in a child process killed, with its process group, at ``budget_s``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name, str(index),
           "--time-limit", str(time_limit_s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        stages = [ln for ln in err.splitlines() if ln.startswith("autopar: ")]
        return {"status": "budget", "wall_s": time.perf_counter() - t0,
                "last_stage": stages[-1][len("autopar: "):] if stages else "capture or first stage",
                "stages": [ln[len("autopar: "):] for ln in stages]}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {"status": "failed", "wall_s": time.perf_counter() - t0, "error": tail[0][:300]}
    return {"status": "planned", **json.loads(lines[-1])}


# --- the table ---------------------------------------------------------------------------
def _load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _key(index: int) -> str:
    return "free" if index < 0 else str(index)


def _cell(res: dict | None) -> str:
    if res is None:
        return "not run"
    if res["status"] == "budget":
        return f"not planned in {res['wall_s']:.0f} s (last: {res['last_stage']})"
    if res["status"] == "failed":
        return f"failed: {res['error'].split(': ', 1)[-1][:110]}"
    mesh = " x ".join(f"{k} {v}" for k, v in res["mesh"].items() if v > 1) or "1 rank"
    pipe = f", {res['pipeline']}" if res["pipeline"] else ""
    return (f"{res['step_s']:.3g} s, {res['tokens_per_gpu_s']:,.0f} tok/s/GPU, "
            f"{res['memory_gib']:.0f} GiB; {mesh}{pipe}; planned {res['wall_s']:.0f} s")


def verdict(row: Row, results: dict) -> str:
    """Whether the row meets issue 40's goals, or which part keeps it from them."""
    free = results.get("free")
    pinned = [results.get(str(i)) for i in range(len(row.configs))]
    steps = [r["step_s"] for r in pinned if r and r["status"] == "planned"]
    if free is None or not steps:
        return "incomplete"
    if free["status"] != "planned":
        return f"free plan not found within its budget ({free.get('last_stage', free.get('error', ''))})"
    notes = []
    best = min(steps)
    notes.append("free >= best pinned" if free["step_s"] <= best * 1.0005
                 else f"free {free['step_s'] / best:.2f}x the best pinned")
    notes.append(f"planned in {free['wall_s']:.0f} s "
                 + ("(goal met)" if free["wall_s"] <= row.goal_plan_s
                    else f"(goal {row.goal_plan_s:g} s; {slowest_stages(free)})"))
    return "; ".join(notes)


SEARCH_STAGES = ("capture", "unpipelined", "branches", "context", "experts", "pipeline search",
                 "unpipelined, fewest layers", "accumulation", "offload")
"""The free search's stages as ``plan.solver.phases`` names them (``solver/free_search.py``);
the other entries are their parts (one mesh's programs, the problems' building)."""


def slowest_stages(res: dict, top: int = 3) -> str:
    """The search stages that kept a free plan from the time goal: the ``top`` longest, with
    their wall seconds and share of the planning, from the case's ``phases``."""
    phases = res.get("phases") or {}
    stages = sorted(((s, phases[s]) for s in SEARCH_STAGES if phases.get(s, 0.0) > 0.0),
                    key=lambda kv: -kv[1])[:top]
    if not stages:
        return "no stage times recorded"
    total = phases.get("total") or res["wall_s"]
    return "longest: " + ", ".join(f"{s} {t:.0f} s ({t / total:.0%})" for s, t in stages)


def print_table(results: dict, names) -> None:
    for name in names:
        row, res = ROWS[name], results.get(name, {})
        r = row.run
        print(f"\n{name}: {r.gpus} {r.device.upper()}, batch {r.batch} x {r.seq} tokens")
        print(f"  {'free':<58} {_cell(res.get('free'))}")
        for i, c in enumerate(row.configs):
            print(f"  {c.label:<58} {_cell(res.get(str(i)))}")
        print(f"  verdict: {verdict(row, res)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--budget", type=float, default=900.0, help="wall seconds per case")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit (s)")
    ap.add_argument("--out", default=OUT, help="results file (read, then updated case by case)")
    ap.add_argument("--only", choices=("free", "pinned"), default=None)
    ap.add_argument("--table", action="store_true", help="print the saved results and stop")
    ap.add_argument("--list", action="store_true", help="the rows and their configurations")
    ap.add_argument("--case", nargs=2, metavar=("ROW", "INDEX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(plan_case(ROWS[args.case[0]], int(args.case[1]), args.time_limit)),
              flush=True)
        return
    names = [n for n in args.rows.split(",") if n] or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; rows: {', '.join(ROWS)}")
    if args.list:
        for n in names:
            print(n + ": free, " + "; ".join(c.label for c in ROWS[n].configs))
        return
    results = _load(args.out)
    if not args.table:
        for name in names:
            cases = ([] if args.only == "pinned" else [-1]) + \
                    ([] if args.only == "free" else list(range(len(ROWS[name].configs))))
            for i in cases:
                label = "free" if i < 0 else ROWS[name].configs[i].label
                print(f"{name} / {label} ...", flush=True)
                res = run_case(name, i, args.budget, args.time_limit)
                res["load"] = os.getloadavg()[0]
                results.setdefault(name, {})[_key(i)] = res
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1, sort_keys=True)
                print(f"  {_cell(res)}", flush=True)
    print_table(results, names)


if __name__ == "__main__":
    main()
