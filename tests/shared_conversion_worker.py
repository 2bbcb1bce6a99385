"""tests/test_shared_conversions.py's case, run in tests/zero_worker.py's spawn (2 gloo ranks):
the tiny Llama, tensor=2, planned under a memory budget below Megatron's layout so the
solver shards the sequence between the tensor-parallel regions (the normed hidden state
gathered for wq, wk, wv and again for w1, w3); 3 training steps against one device, and the
collectives of the per-rank training program."""
from __future__ import annotations

import collections
import copy
import json

import torch.distributed as dist

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.ops import collectives
from autopar.plan import Plan
from autopar.runtime import build
from autopar.solver.flat import plan_captured
from equivalence import compare, parallel_run, reference_run
from examples.models import EXAMPLES

_MOVES = {collectives.all_gather, collectives.all_reduce, collectives.grad_all_reduce,
          collectives.scatter, collectives.reduce_scatter, collectives.all_to_all,
          collectives.to_partial, collectives.shard_to_partial}


def run_case(case: dict) -> dict:
    ex = EXAMPLES[case["model"]]()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    cluster, world = parse_cluster(f"cpu:{dist.get_world_size()}"), dist.get_world_size()
    box = [None, None]
    if dist.get_rank() == 0:     # rank 0 plans, every rank runs the plan (as parallelize does)
        megatron = plan_captured(cap, cluster, world, pins=dict(case["pins"]))
        budget = case["budget"] * megatron.estimate.memory_total
        box = [megatron.estimate.memory_total,
               plan_captured(cap, cluster, world, pins=dict(case["pins"]), memory_budget=budget).to_json()]
    dist.broadcast_object_list(box, src=0)
    pm = build(cap, Plan.from_dict(json.loads(box[1])), copy.deepcopy(ex.model))
    gm = pm.runner.programs["train"]
    moves = collections.Counter()
    gathers = []          # (the value it reads, its dim, how many ops read the gathered tensor)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _MOVES:
            moves[f"{n.target.__name__}({n.args[0].name}, {sorted(n.kwargs.items())})"] += 1
            if n.target is collectives.all_gather:
                gathers.append((n.args[0].name, n.kwargs.get("dim"), len(n.users)))
    worst = compare(reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn),
                    parallel_run(pm, ex.inputs, ex.target), f"{case} rank {dist.get_rank()}")
    return {"worst": worst, "moves": dict(moves), "gathers": gathers,
            "memory": pm.plan.estimate.memory_total, "megatron_memory": box[0]}
