"""Run in tests/zero_worker.py's spawn (2 gloo ranks, tests/test_experts.py's case): a
transformers Mixtral under ``expert=2`` takes one AdamW step; this rank's training-state
bytes are measured from the live tensors (``zero_worker.state_bytes``: parameters, their
gradients, the optimizer's moments) next to the plan's estimate, with the expert stacks'
local and whole sizes."""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from examples import zoo


def run_case(case: dict, zero_worker) -> dict:
    b = zoo.build("mixtral")
    whole = sum(p.numel() for n, p in b.model.named_parameters() if ".experts." in n)
    pm = autopar.parallelize(b.model, b.inputs, loss_fn=b.loss_fn, target=b.target,
                             **case["pins"])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.train_step(*b.inputs, target=b.target)
    pm.step(opt)
    measured = zero_worker.state_bytes(pm, opt)
    est = pm.plan.estimate
    return {"rank": dist.get_rank(), "measured": measured,
            "estimate": {k: est.memory_bytes.get(k, 0.0) for k in measured},
            "stacks_local": sum(p.numel() for n, p in pm.named_parameters() if "experts" in n),
            "stacks_whole": whole, "mesh_axes": list(pm.plan.mesh_axes)}
