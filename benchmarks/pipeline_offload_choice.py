"""What the free pipeline search chooses where memory binds: per layer it frees, recompute or
offload (``autopar/solver/pipeline_offload.py``). A GPT of hidden 16384, 8 layers, sequence
2048, batch 32 on the meta device, on 2 nodes of 8 H100s (data 8, ZeRO-3, bf16: pipelines of
2 stages on (8,) stage meshes), for each budget in GiB; ``--slow-link``: the H100's host link
16 times slower; ``--no-offload``: ``offload_activations="none"`` pinned (recomputation
alone, what the search chose before). One line per budget: the configuration, the layers
recomputed and offloaded, the predicted step, device and host memory per device, CPU s.

    PYTHONPATH=. python benchmarks/pipeline_offload_choice.py [--budgets 31,33.6,35,36]
"""
from __future__ import annotations

import argparse
import time

import torch

from autopar.capture import capture
from autopar.cost_models.gpus import H100_80GB
from autopar.cost_models.hardware import parse_cluster
from autopar.cost_models.offload import HOST_LINKS, HostLink
from autopar.options import as_options
from autopar.solver.pipeline_free import search_pipelines
from autopar.solver.spec import SearchSpec
from examples.models import gpt_factory


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="31,33.6,35,36", help="GiB per device, comma-separated")
    ap.add_argument("--slow-link", action="store_true")
    ap.add_argument("--no-offload", action="store_true")
    args = ap.parse_args()
    if args.slow_link:
        link = HOST_LINKS[H100_80GB.name]
        HOST_LINKS[H100_80GB.name] = HostLink(link.bandwidth / 16, link.host_mem_bandwidth)
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=8, n_embd=16384, n_head=128, block_size=2048,
                         vocab_size=512)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    cl = parse_cluster("2x8xH100")
    pins = {"data": 8, "zero": 3, "precision": "bf16"}
    if args.no_offload:
        pins["offload_activations"] = "none"
    for gib in (float(b) for b in args.budgets.split(",")):
        spec = SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target, cl, cl.world_size,
                          as_options(pins), memory_budget=gib * 2**30, time_limit_s=30.0)
        t0 = time.process_time()
        got = search_pipelines(spec, cap)
        if got is None:
            print(f"{gib:5.1f} GiB: nothing fits")
            continue
        plan = got[0]
        p, e = plan.pipeline, plan.estimate
        off = plan.options.offload_activations
        off = () if off in (None, "none") else off
        print(f"{gib:5.1f} GiB: {p.schedule} v={p.virtual_stages} m={p.n_microbatches}, recompute "
              f"{len(plan.recompute)}, offload {len(off)} layers, step {e.step_time_s:.4g} s, "
              f"{e.memory_total / 2**30:.2f} GiB a device, host "
              f"{plan.host_memory_bytes.get('activations', 0.0) / 2**30:.2f} GiB "
              f"({time.process_time() - t0:.1f} CPU s)", flush=True)


if __name__ == "__main__":
    main()
