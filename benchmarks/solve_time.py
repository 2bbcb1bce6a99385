"""Capture and solve time: the examples on this machine's ranks, and GPT models of growing
depth on the meta device planned for a 2x4 mesh of A100s.

    python benchmarks/solve_time.py            # prints a table; goal: 24 layers under 10 s

Repeated layers share one solution, so solve time should grow much slower than the layer
count; the last columns show the graph size and the number of decisions the ILP makes.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.capture import capture  # noqa: E402
from autopar.cost_models.hardware import parse_cluster  # noqa: E402
from autopar.solver.driver import plan_search  # noqa: E402
from examples.models import EXAMPLES, gpt_factory  # noqa: E402


def row(label, build, cluster, world, pins=None, phases=False, **kw):
    c0 = time.process_time()
    t0 = time.perf_counter()
    ex = build()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    # what autopar.plan does after capturing: the unpipelined plan and, on more than one
    # node, the pipeline search (its micro-batch capture counts as solve time here)
    plan = plan_search(cap, ex.model, ex.inputs, ex.loss_fn, ex.target, parse_cluster(cluster),
                       world, pins=pins or {}, **kw)
    t_plan = time.perf_counter() - t0
    cpu = time.process_time() - c0
    s = plan.solver
    mem = plan.estimate.memory_total / 2**30
    print(f"{label:<28} {cluster:<10} {str(plan.mesh_shape):<8} {t_capture:>8.2f} {t_plan:>8.2f} "
          f"{t_capture + t_plan:>8.2f} {s.n_graph_nodes:>7} {s.n_decisions:>9} {s.status:>9} "
          f"{mem:>8.2f}" + (f"  pipeline {plan.pipeline_stages}, {plan.schedule}, "
                            f"m={plan.n_microbatches}" if plan.pipeline_stages > 1 else "")
          + f"  cpu {cpu:.2f}s", flush=True)
    if phases:     # each planning phase's wall seconds (plan.solver.phases)
        print("    phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in s.phases.items()), flush=True)
        print(f"    plan: mesh {plan.mesh_shape}, pins {plan.pins}, objective {plan.estimate.step_time_s:.6g} s",
              flush=True)
    return t_capture + t_plan


def main() -> None:
    print(f"{'model':<28} {'cluster':<10} {'mesh':<8} {'capture':>8} {'solve':>8} {'total':>8} "
          f"{'nodes':>7} {'decisions':>9} {'status':>9} {'GiB/dev':>8}")
    for name in EXAMPLES:
        row(f"{name} (examples)", lambda: EXAMPLES[name](), "cpu:4", 4)
    for layers in (6, 12, 24, 48):
        def build(layers=layers):
            with torch.device("meta"):
                return gpt_factory(batch=16, config="gpt-24layer", n_layer=layers)
        row(f"gpt {layers} layers h1024 (meta)", build, "8xA100", 8, mesh_shape=(2, 4))

    def gpt175b():
        with torch.device("meta"):
            return gpt_factory(batch=1536, config="gpt-175b")
    # 96 layers, hidden 12288, sequence 2048, global batch 1536; free search over meshes,
    # recomputation and pipelines, bf16 pinned (goal: under 60 s; memory within 80 GB)
    t = row("gpt-175b (meta), bf16", gpt175b, "128xdgx-a100", 1024, pins={"precision": "bf16"},
            phases=True)
    print(f"175B on 1024 A100s planned in {t:.1f} s")


if __name__ == "__main__":
    main()
