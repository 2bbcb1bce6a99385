"""Capture and solve time: the examples on this machine's ranks, GPT models of growing depth
on the meta device planned for a 2x4 mesh of A100s, and two large models planned as
``autopar.plan`` plans them (capture, free search, the winner's micro-batch capture):

- ``175b``: GPT-175B (96 layers, hidden 12288, sequence 2048, global batch 1536) on 1,024
  A100s (128 DGX nodes), bf16 pinned, everything else free (goal: 20 s);
- ``405b``: a Llama-3-shaped 405B (``examples/llama.py``: 126 layers, hidden 16,384,
  grouped-query attention 128 heads / 8 kv heads, SwiGLU 53,248, vocabulary 128,256,
  sequence 8,192, global batch 2,048 = 16M tokens) on 16,384 H100s (2,048 DGX nodes), bf16
  pinned (goal: 60 s); ``405b-pinned``: the same with Meta's Llama 3 degrees pinned
  (tensor 8, pipeline 16, data 128);
- ``hf-llama-7b``: transformers' ``LlamaForCausalLM`` at Llama-2-7B's shape, batch 256 x
  4,096, on 128 A100s (16 DGX nodes), bf16 pinned: a Hugging Face model whose unpipelined
  sharding programs (2-D meshes, 5-13 s of CBC each) are most of its planning;
- ``deepseek-v3``: transformers' DeepSeek-V3 (``hf:deepseek-v3``: 671B, 61 layers, 256
  routed experts, top-8) at 15,360 x 4,096 tokens on 2,048 H800s (256 nodes), bf16 pinned,
  everything else free (goal: 60 s); ``deepseek-v3-pinned``: its published degrees
  (pipeline 16, expert 64, data 2, micro-batches of 128 sequences; 1F1B standing in for
  DualPipe);
- ``hf-llama3-8b-262k``: transformers' ``LlamaForCausalLM`` at Llama 3 8B's shape, one
  sequence of 262,144 tokens, on 32 H100s (4 DGX nodes), bf16 pinned, everything else free
  (goal: 30 s; issue 29): the free search's context stage against the unpipelined plan.
  Measured 2026-11-28 (session 20, ``PYTHONHASHSEED=0``): 24.7 s wall on a quiet machine
  (context 4 x tensor 8, 4.36552 s, against 7.76607 s without a context axis); then, with
  context-parallel attention priced at the rate its pairs were measured at on an H200
  (``Device.context_attention_efficiency``), 28.6 s (load 2.8; 28.5 s of CPU here, 27.7 s
  in the worker), context 4 x tensor 8, 7.01885 s, digest 19f4245a52d4, against 8.34835 s
  without a context axis. It took 31.9 s while the ZeRO stages were solved again on the
  context stage's meshes, which have no data axis.
- ``frontier-mixtral-8x7b``, ``frontier-mixtral-8x22b``, ``frontier-qwen3-235b``,
  ``frontier-llama3-70b``: the frontier table's other models (``benchmarks/frontier.py``,
  issue 40), planned free as its free rows are (its model, batch and cluster, bf16 and the
  run's gradient reduction pinned; goal 30 s each), here in this process with the phases.

Measured 2026-11-27 (session 17, ``PYTHONHASHSEED=0``, beside a test run):
``deepseek-v3-pinned`` 12.2 s (capture 9.6 s: its three dense layers and 58 MoE layers are
not alike, so capture exports all 61 rather than stamping; the ILP 1.1 s over 354 decisions,
each kind of layer sharing one), objective 36.9116 s, digest 2a5bc89bfc5d. ``deepseek-v3``
free did not finish: after 23 minutes it was still in the unpipelined phase (29 meshes of
the whole graph, 1-67 s of CBC each) and its accumulation probes, and had not reached the
pipelines. Goal (60 s) not met. The free search needs bounds that do not yet exist:
pruning meshes whose parameters cannot fit, and starting from the pipelined degrees at
this scale.

Measured 2026-11-27 22:50-23:50 (session 18, ``PYTHONHASHSEED=0``, 1 worker, load 3-12,
the row's ``solve`` call with ``verbose=True``, as ``python benchmarks/solve_time.py --rows
deepseek-v3`` makes it; other sessions were editing the cost model meanwhile, so the two
runs' objectives differ by their edits): ``deepseek-v3`` free does finish, in 2,129 s wall
/ 1,062 CPU s before and 1,674 s / 995 CPU s after this session's bounds. The unpipelined
phase was not the cost: nothing fits the full batch, and 100 of its 113 s were the
least-memory ILPs that only explain why (now solved only if no other stage finds a plan:
``explain="later"``), 0.5 s after. The pipeline search (122-138 s) finds p=2 only (78.9 s
predicted; its stage meshes are data x tensor, no expert axis). The cost is gradient
accumulation (1,834 -> 1,525 s), and it is the winner: k=2 micro-batches on mesh (256, 8),
all 61 layers recomputed, 57.77 s (59.97 s before the cost-model edits), 79.9 GiB per
device, against the published degrees' 36.9 s, which the free search cannot reach without
expert parallelism. It captures k = 2, 3, 4, 5 (``accumulate.MAX_TRIES``; k=3-5 predict
60.5-62.4 s) and solves on each the meshes with every layer recomputed (50-125 s of CBC
each, some ending at the 60 s limit as FEASIBLE) and 3 fewest-layers probes. A bound that
holds cannot skip the winner: the compute floor (``prices.compute_floor``) of its meshes
is 21-22 s against 58 s; it skips the meshes that cannot beat the best of their own search
((1024, 2) with every layer recomputed at k=2, floor 1,555 s, and at k=4: 2 of ~12 ILPs).
Goal (60 s) not met; left: expert degrees in the free search (then a pipelined incumbent
near 36.9 s, against which an LP bound might prune accumulation), and the accumulation's
CBC seconds.

    python benchmarks/solve_time.py                      # every row
    python benchmarks/solve_time.py --rows 175b,405b     # some rows

Repeated layers share one solution, so solve time should grow much slower than the layer
count; the columns show the graph size, the number of decisions the ILP makes and the
plan's predicted step (the objective: a faster search must not make it worse). Every
row prints its wall and CPU seconds (``time.process_time``: the comparable figure on a
machine others load too); the large rows also each planning phase's wall seconds
(``plan.solver.phases``) and the plan with its predicted step (the objective).

Measured 2026-11-22, 19:00-19:50 UTC, on the loaded 2-core machine (load 5-12; CPU seconds,
before -> after the exact speed-ups of commits 5641dd8 and c3defd5, same objectives):
``175b`` 92.4 -> 81.9 s (another run 76.5 s; wall 215-276 s), objective 18.5593 s;
``405b`` 217.8 -> 224.2 s (no gain within the noise), objective 9.06496 s;
``405b-pinned`` 49.9 -> 49.7 s, objective 9.06496 s; the ``depth`` rows' objectives unchanged
(the ``examples`` rows' cluster, ``cpu:4``, is measured in each process, so their objectives
move a little between runs either way). Where the 175B's CPU seconds go (after): two
captures ~27 s, the sharding ILPs of 29 meshes ~21 s (edge pricing most of it), ranking
pipeline schedules ~13 s (stage DP ~6, simulation ~5), problems ~4 s, garbage collection
~6 s spread over all of it. Goals (20 s, 60 s) not met.

Measured 2026-11-22, 22:30-23:30 UTC (each "before" ran beside its "after", at the same
time, both on HEAD's tree of the time; before -> after capture without per-node stacks,
the bounded pipeline search and the collector's threshold raised while planning, 167ee4f +
22c2421; CPU seconds; the row's objective in both): ``175b`` at load 10-20: 143.8 -> 134.2
and 117.1 -> 115.0 s; at load ~1: 96.5 -> 95.7 and 102.7 -> 101.1 s, objective 17.6155 s
(the cost model's commits since the figures above moved it from 18.5593);
``405b-pinned`` 60.0 -> 53.2 and 49.7 -> 41.5 s, objective 14.1489 s (was 9.06496 s before
those commits); ``405b`` not measured. On 175B the collector's seconds fall from 7.8-11.4
to 2.8-3.1 (peak memory 0.77 -> 0.79 GB; with the collector off it was 2.1 GB) and one
capture from 20.1 to 17.3-19.0 s, but the row gains only 1-7%: its pipeline search (75 of
~100 s at load ~1, the second capture inside) prunes little. Goals not met.

Measured 2026-11-23, 01:25-02:15 UTC at load 2-5, each pair side by side at the same
time, ``python benchmarks/solve_time.py --rows R`` in each tree, CPU seconds, before ->
after this session's speed-ups (68e240e..9a976d4: a schedule's dependency structure
compiled once and timed along one order, the DP's masks per distinct table, a pruned
mesh's intra solution kept for ``unpruned`` (GPT-175B: 6 ILPs not solved again), one
capture per micro-batch count). Clean pairs (before: HEAD 7af26b8 with those commits
reverted; ``PYTHONHASHSEED=0``): ``175b`` 92.4 -> 85.2 and 94.2 -> 87.2 s (-8%),
objective 17.6147 s, same plan (digest 98b372c469c6). Earlier pairs, whose "before" also
lacked 23433b3 (pipeline_free prices cut for ``most_stages``; same plans): ``175b`` 101.2
-> 93.5 and 112.3 -> 103.6 s (digest 98b372c469c6 both); ``405b-pinned`` 37.6 -> 37.4
and 37.0 -> 36.6 s, objective 8.70026 s (random hash seeds) and 8.22169 s (seed 0, digest
efc62bf97895 both); ``405b`` 232.7 -> 235.5 and 204.3 -> 205.2 s (no gain within the
noise), objective 8.15252 and 8.15126 s (two random hash seeds), 8.14388 s at seed 0
(digest da6475347b4f both). The rows' objectives depended on the process's hash seed until
7b05c82 (below) (405b-pinned on one tree: 8.22169 s at ``PYTHONHASHSEED=0`` in two processes, 8.26802 at
1, 8.20155 at 2, 8.27203 and 8.70026 unseeded): compare before and after at one
``PYTHONHASHSEED``.
Where the CPU goes now: on 175B the three captures (full batch, m=96, m=192; 9-11 CPU-s
each) ~30%, the ILPs and their pricing most of the rest (cProfile: edge prices and the
frozen placements' hashing), the pipeline DP and its simulations ~10%; on 405B pinned one
capture (126 layers at the micro-batch) 27 of 40 s. Goals not met: what is left is
torch.export's trace per capture and the ILPs' edge pricing.

Measured 2026-11-23, 04:00-04:20 UTC at load 2-6, two pairs, each side by side at the
same time, ``PYTHONHASHSEED=0 python benchmarks/solve_time.py --rows 175b,405b-pinned`` in
each tree (before: cb601e7; after: b07c446, the same plus capture by shallow export and
stamping, ``autopar/capture/stamp.py``; each run importing its own tree's
``cost_models`` and ``passes``, which the editable install maps to the main checkout's),
CPU seconds: ``175b`` 87.1 -> 59.3 and 85.6 ->
59.0 s (-32%; the capture phase 10.1 -> 1.4 s wall; three captures), objective 17.6147 s,
digest 98b372c469c6 in all four; ``405b-pinned`` 39.0 -> 16.7 and 34.3 -> 16.4 s (-55%),
objective 8.22169 s, digest efc62bf97895 in all four. One
capture, stamped against whole (CPU s; the graphs equal node by node, code, namespace
and fingerprint): GPT-175B full batch 1.45 vs 10.16, at m=96 1.50 vs 10.04; the 405B at
the full batch 3.16 vs 24.58, at m=16 2.95 vs 24.17. The 175B row's goal (20 s) is not
met: its pipeline search and ILPs are what is left.

Plans no longer depend on the hash seed (7b05c82: which layers a pipeline rank recomputes
turned on sums in a set's order): ``405b-pinned`` 8.27234 s, digest d2ddcca4bc85 at
``PYTHONHASHSEED`` 0, 1 and 2; ``175b`` digest 98b372c469c6 at 0 and 1. The edge pricing's
exact speed-ups (ae37bde, 7577fa4, 15566ba; side by side, same digest): ``175b`` 65.0 ->
58.4 and 69.0 -> 62.9 CPU s. The 405B free row's other costs (me, cProfile): the branch
analysis walked the graph's ancestors for every add (13.6 of 256 s; 8c241b4), the
unpipelined plan's probes for the fewest recomputed layers (~4 ILPs of ~12 s, for a plan
at 17.6 s against pipelines at 6.9 s; now deferred until it could win, e7e4e82),
``repeated_layers`` read ~100 times a plan (kept per graph).

At the end of 2026-11-23 (05:00-05:05 UTC, at 8b2748f, load ~1, ``PYTHONHASHSEED=0
python benchmarks/solve_time.py --rows 175b,405b,405b-pinned``), CPU seconds: ``175b``
54.0 s (objective 17.6147 s, digest 98b372c469c6; the free search now also weighs the
unpipelined plan's fewest recomputed layers and gradient accumulation there, 16 s of it,
changing nothing); ``405b`` 92.0 s (objective 6.93198 s, digest 41e2c7f5e0bd; was 221.5 s
at cb601e7 the same morning, objective 6.91059 s before the hash-seed fix); ``405b-pinned``
11.0 s (goal 60 s: met). Goals not met: 175B 20 s, 405B free 60 s; left: the pipeline
search's intra-stage ILPs (27 on the 405B) and the re-plan of a recomputing winner.

Measured 2026-11-23, 06:56-07:10 UTC at load 5-7, each pair side by side at the same time,
``PYTHONHASHSEED=0 python benchmarks/solve_time.py --rows R`` (before: 36e4285; after: the
same plus the pipeline pricing's exact speed-ups 4a13048, fc356d3, d74ceb0: the graph
facts of ``analysis/stages`` kept per graph, ``local_bytes`` per plan, one solution's
per-node prices kept for its repeated pricing, rank memory and state as arrays), CPU
seconds: ``405b`` 111.1 -> 98.5 s (-11%), digest 41e2c7f5e0bd both; ``175b`` 67.3 -> 64.8 s
(-4%), digest 98b372c469c6 both; ``405b-pinned`` 13.6 -> 9.4 s, digest d2ddcca4bc85 both;
bf17efb on top (``layer_terms``' stages in one search, collective latencies kept):
``405b`` 95.9 -> 95.2 s (within the noise), same digest.
No pipeline-search ILP is solved twice with the same inputs on either free row (405B: 27
intra-stage solves, 175B: 26, all distinct; the re-plan of a recomputing winner solves
without the recompute pin or with ZeRO-2, which the search did not), so none is reused.
What is left of the pipeline search outside its ILPs on the 405B (per-function CPU s,
at 06:55): the stage DP's tables and DP ~7 s over 210 ``plan_stages``, the per-node prices
2.4 s, the fewest recomputed layers 2.5 s; the intra-stage ILPs ~49 s.

Measured 2026-11-23, 07:04-07:27 UTC at load 3-8, the sharding ILP's exact speed-ups
(aa9c4ba, 65f9d16, da5d4be, aaaeb2c, ecc4bfe, 55a2d88: pair prices by numbers, one graph
walk per graph, cheaper redistribution steps and local shapes, the ILP's rows through
pywraplp's calls, op calls made once, parsed placements kept), each row in both trees at
the same time (before: 36e4285; after: 36e4285 with those commits' files),
``PYTHONHASHSEED=0``, CPU seconds, two pairs: ``175b`` 67.8 -> 60.2 and 62.6 -> 56.5 s
(-10%), digest 98b372c469c6 in all four; ``405b`` 112.1 -> 96.9 and 107.9 -> 92.9 s
(-14%), digest 41e2c7f5e0bd in all four; ``405b-pinned`` 13.8 -> 12.1 s, digest
d2ddcca4bc85. Every ILP's objective, choice and breakdown equal on 175B (72) and 405B (49).
Left: OR-Tools' CBC solve itself (the 405B's 2048 x 8 mesh, 31,716 variables and 10,302
rows, 5.6 s of which 4 nodes and 389 iterations; CBC takes no options through pywraplp,
and parallel edges that could be merged carry 2% of the e-variables).

Measured 2026-11-23, 07:27-07:52 UTC at load 3-8, the stage DP's and schedule simulation's
exact speed-ups (7da17a1: a schedule's topological order by sweeps over the ranks;
5ff2d14: the DP's tables from one count of fitting in-flight counts per entry, no memory
or tiebreak stack; 1b821f8: each candidate's plan kept by a digest of its costs), each
row in both trees at the same time (before: 4461fba; after: 4461fba with those commits'
files), ``PYTHONHASHSEED=0``, CPU seconds: ``175b`` 53.3 -> 45.8 and 55.5 -> 47.7 s
(-14%), digest 98b372c469c6 in all four; ``405b`` 80.4 -> 79.2 s (within the noise),
digest 41e2c7f5e0bd both; ``405b-pinned`` 7.9 -> 7.9 s (10 ``plan_stages`` calls, 0.2 s),
digest d2ddcca4bc85 both. Replaying the 175B row's 191 captured ``plan_stages`` calls
alone: 10.0 -> 5.6 CPU s, every StagePlan equal. Goals not met (175B 20 s, 405B 60 s).

End of that session (2026-11-23 07:52-07:56, at 6aea126, ``PYTHONHASHSEED=0 python
benchmarks/solve_time.py --rows 175b,405b,405b-pinned``, beside a test run using one core):
``175b`` 45.4 CPU s (54.0 that morning at load ~1; the deferred probes now resume the
unpipelined search, 9b875a8, instead of solving its meshes again: 63.5 -> 59.0 side by
side), objective 17.6147 s, digest 98b372c469c6; ``405b`` 78.4 s (92.0), 6.93198 s,
41e2c7f5e0bd; ``405b-pinned`` 7.0 s (11.0), 8.27234 s, d2ddcca4bc85. Phases (wall) of the
175B: pipeline search 28.4 s, the unpipelined plan's fewest-layers probes 8.1 s and
accumulation 7.3 s (neither changes the plan), unpipelined 5.0 s, capture 1.4 s; of the
405B: pipeline search 84.2 s, unpipelined 27.0 s. Goals (20 s, 60 s free) not met.

Session 13 (2026-11-23 16:35-17:00, ``PYTHONHASHSEED=0``): the cost model now prices
ZeRO-3's copy-out, and gradient reductions in fp32 under mixed precision (the runtime's
``grad_reduce`` default; they were priced at 16 bits), which makes ZeRO-2 a time gain as
well; the pipeline degree search plans its stage meshes with ZeRO-2 under fp32 reductions
(``pipeline_free._DegreeSearch._solve``; without it the 405B free plan fell to 8.53 s, the
published degrees with ZeRO-2 7.07 s). New plans: ``175b`` (16, 32, 2) ZeRO-2, objective
17.1378 s (was 17.6147, priced at 16-bit reductions), digest cc2e3189a4a8, 11.9 s with a
worker, 14.2 s in one process; ``405b`` (16, 128, 8) interleaved ZeRO-2, 7.06824 s (was
6.93198), be0be54bf359, 19.5 s / 26.6 s; ``405b-pinned`` now ZeRO-2 too, 7.06824 s,
2a3ad7734011, 3.3 s; ``hf-llama-7b`` (128,) ZeRO-3, 1.9267 s, dbf10cf61c9b, 36.8 s with a
worker. The machine's fixed loop took 0.28-0.46 s (0.25 s in session 12). Goals met.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.solver.driver import solve  # noqa: E402
from examples.hf_llama import hf_llama_meta  # noqa: E402
from examples.llama import LlamaConfig, llama_factory  # noqa: E402
from examples.models import EXAMPLES, gpt_factory  # noqa: E402

FRONTIER = ("mixtral-8x7b", "mixtral-8x22b", "qwen3-235b", "llama3-70b")
"""The frontier table's models (``benchmarks/frontier.py``) without a row of their own above,
planned free as its free rows are: ``frontier-NAME``."""
ROWS = ("examples", "depth", "175b", "405b", "405b-pinned", "hf-llama-7b", "deepseek-v3",
        "deepseek-v3-pinned", "hf-llama3-8b-262k") + tuple(f"frontier-{n}" for n in FRONTIER)


def row(label, build, cluster, world, pins=None, phases=False, **kw):
    """Plan ``build()``'s example as ``autopar.plan`` does; print one line (and the phases)."""
    ex = build()
    c0, t0, w0 = time.process_time(), time.perf_counter(), _workers_cpu()
    plan = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                 world_size=world, pins=pins or {}, **kw).plan
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    workers = _workers_cpu() - w0
    s = plan.solver
    t_capture = s.phases.get("capture", s.capture_time_s)
    mem = plan.estimate.memory_total / 2**30
    print(f"{label:<28} {str(cluster):<13} {str(plan.mesh_shape):<14} {t_capture:>8.2f} "
          f"{wall - t_capture:>8.2f} {wall:>8.2f} {cpu:>8.2f} {s.n_graph_nodes:>7} "
          f"{s.n_decisions:>9} {s.status:>9} {mem:>8.2f} {plan.estimate.step_time_s:>12.6g}"
          + (f"  pipeline {plan.pipeline_stages}, {plan.schedule}, m={plan.n_microbatches}"
             if plan.pipeline_stages > 1 else ""), flush=True)
    if phases:     # each planning phase's wall seconds (plan.solver.phases)
        print("    phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in s.phases.items()), flush=True)
        print(f"    plan: mesh {plan.mesh_shape} {plan.mesh_axes}, options {plan.pins}, "
              f"objective {plan.estimate.step_time_s:.6g} s, digest {plan_digest(plan)}"
              + "".join(f"; {k}: {v:.6g} s" for k, v in plan.alternatives_s.items()), flush=True)
    return wall, f"{cpu:.1f} s of CPU" + (f" here, {workers:.1f} s in workers" if workers else "")


def _workers_cpu() -> float:
    """CPU seconds of this process's finished children (``autopar.solver.speculate``'s
    workers, which solve the pipeline search's programs ahead on the other cores)."""
    t = os.times()
    return t.children_user + t.children_system


def machine() -> str:
    """What these seconds were measured on: the CPU, the cores this process may use, the
    load, and the wall seconds of a fixed pure-Python loop (planning is mostly Python, so
    runs on two machines compare by it: the same tree planned GPT-175B in 43 s on session
    11's 2-core machine and 14 s on the next day's)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    load = f", load {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    t0 = time.perf_counter()
    acc = 0
    for i in range(10_000_000):
        acc += i % 7
    return (f"{model}, {cores} cores usable{load}; a fixed pure-Python loop (10M iterations) "
            f"in {time.perf_counter() - t0:.3f} s")


def plan_digest(plan) -> str:
    """A hash of everything the plan chose (placements, mesh, pipeline cuts, options,
    estimate), without the solver's report (its timings) and the file's version: equal
    digests, the same plan. (Before plan schema 3 the options were "pins", and the version
    was hashed: digests from then differ for the same plan.)"""
    chosen = {k: v for k, v in plan.to_dict().items() if k not in ("solver", "version")}
    chosen["estimate"].pop("host_s", None)   # a figure, not a choice: the step holds it where it binds
    return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:12]


def gpt175b():
    with torch.device("meta"):
        return gpt_factory(batch=1536, config="gpt-175b")


def llama405b():
    config = LlamaConfig(vocab_size=128256, max_seq_len=8192, n_layer=126, n_head=128,
                         n_kv_head=8, dim=16384, hidden_dim=53248, rope_theta=500000.0)
    with torch.device("meta"):
        return llama_factory(batch=2048, config=config)


def hf_llama7b():
    """transformers' LlamaForCausalLM, Llama-2-7B's shape (32 layers, hidden 4096, MLP
    11,008, vocabulary 32,000), batch 256 x 4096 tokens, on the meta device."""
    return hf_llama_meta(256, 4096, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                         max_position_embeddings=4096)


def hf_llama3_8b_262k():
    """transformers' LlamaForCausalLM at Llama 3 8B's shape (32 layers, hidden 4096, MLP
    14,336, 32 heads / 8 key-value heads, vocabulary 128,256, rotary base 500,000), one
    sequence of 262,144 tokens, on the meta device."""
    return hf_llama_meta(1, 262144, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=262144, rope_theta=500000.0)


def deepseek_v3():
    """transformers' DeepSeek-V3 (``hf:deepseek-v3``: 671B, 61 layers, 256 routed experts,
    top-8) at DeepSeek's pre-training batch, 15,360 x 4,096 tokens, on the meta device."""
    from autopar.hf_models import build
    from examples.base import Example
    with torch.device("meta"):
        model, inputs, loss_fn, target = build("deepseek-v3", batch=15360, seq=4096)
    return Example(model, inputs, target, loss_fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    print(f"machine: {machine()}")
    print(f"{'model':<28} {'cluster':<13} {'mesh':<14} {'capture':>8} {'solve':>8} {'total':>8} "
          f"{'cpu':>8} {'nodes':>7} {'decisions':>9} {'status':>9} {'GiB/dev':>8} {'objective s':>12}")
    if "examples" in rows:
        for name in EXAMPLES:
            row(f"{name} (examples)", lambda: EXAMPLES[name](), "cpu:4", 4)
    if "depth" in rows:
        for layers in (6, 12, 24, 48):
            def build(layers=layers):
                with torch.device("meta"):
                    return gpt_factory(batch=16, config="gpt-24layer", n_layer=layers)
            row(f"gpt {layers} layers h1024 (meta)", build, "8xA100", 8, mesh_shape=(2, 4))
    if "175b" in rows:
        wall, cpu = row("gpt-175b (meta), bf16", gpt175b, "128xdgx-a100", 1024,
                        pins={"precision": "bf16"}, phases=True)
        print(f"175B on 1024 A100s planned in {wall:.1f} s ({cpu}; goal 20 s)")
    if "405b" in rows:
        wall, cpu = row("llama3-405b (meta), bf16", llama405b, "2048xdgx-h100", 16384,
                        pins={"precision": "bf16"}, phases=True)
        print(f"405B on 16,384 H100s planned in {wall:.1f} s ({cpu}; goal 60 s)")
    if "405b-pinned" in rows:
        wall, cpu = row("llama3-405b t8 p16 d128", llama405b, "2048xdgx-h100", 16384,
                        pins={"precision": "bf16", "tensor": 8, "pipeline": 16, "data": 128},
                        phases=True)
        print(f"405B pinned (tensor 8, pipeline 16, data 128) planned in {wall:.1f} s "
              f"({cpu}; goal 60 s)")
    if "hf-llama-7b" in rows:
        wall, cpu = row("hf llama-7b (meta), bf16", hf_llama7b, "16xdgx-a100", 128,
                        pins={"precision": "bf16"}, phases=True)
        print(f"transformers Llama-7B on 128 A100s planned in {wall:.1f} s ({cpu})")
    if "deepseek-v3" in rows:
        wall, cpu = row("deepseek-v3 (meta), bf16", deepseek_v3, "256xdgx-h800", 2048,
                        pins={"precision": "bf16"}, phases=True)
        print(f"DeepSeek-V3 on 2,048 H800s planned free in {wall:.1f} s ({cpu}; goal 60 s)")
    if "deepseek-v3-pinned" in rows:
        wall, cpu = row("deepseek-v3 p16 e64 d2", deepseek_v3, "256xdgx-h800", 2048,
                        pins={"precision": "bf16", "pipeline": 16, "expert": 64, "data": 2,
                              "micro_batch_size": 128, "schedule": "1f1b"}, phases=True)
        print(f"DeepSeek-V3 as published (pipeline 16, expert 64, data 2; 1F1B for its "
              f"DualPipe) planned in {wall:.1f} s ({cpu})")
    if "hf-llama3-8b-262k" in rows:
        wall, cpu = row("hf llama3-8b 262k (meta), bf16", hf_llama3_8b_262k, "4xdgx-h100", 32,
                        pins={"precision": "bf16"}, phases=True)
        print(f"transformers Llama-3-8B at 262,144 tokens on 32 H100s planned free in "
              f"{wall:.1f} s ({cpu}; goal 30 s)")
    for name in FRONTIER:
        if f"frontier-{name}" in rows:
            frontier_row(name)


def frontier_row(name: str) -> None:
    """One of ``benchmarks/frontier.py``'s models planned free, as its free row plans it (its
    model, batch and cluster; bf16 and the run's gradient reduction pinned)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import frontier
    import published_runs as pr
    run = frontier.ROWS[name].run
    cluster = pr.run_cluster(run)
    wall, cpu = row(f"{name} (meta), bf16", lambda: pr.build(run, run.batch), cluster, run.gpus,
                    pins={"precision": "bf16", "grad_reduce": run.grad_reduce}, phases=True)
    print(f"{name} on {run.gpus} {run.device.upper()} planned free in {wall:.1f} s ({cpu}; "
          f"goal {frontier.ROWS[name].goal_plan_s:g} s)")


if __name__ == "__main__":
    main()
