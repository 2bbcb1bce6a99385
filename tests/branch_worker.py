"""Run by tests/test_branches.py under torchrun (2 or 4 gloo ranks): the Inception-style
example (``examples/inception.py``) trained 3 AdamW steps under a branch-parallel plan
against the same model on one device; rank 0 writes one JSON result per case
(``tests/worker_loop.py``).

Rank 0 plans (``autopar.plan`` with the case's pins) and saves the plan to a file; every
rank runs the plan read back from that file (``autopar.parallelize(..., plan=path)``).
Each case reports every rank's losses, its largest parameter difference from one device
(whole parameters, ``pm.full_state_dict()``), the bytes of the parameters it stores and
of its optimizer state, the names of the parameters it stores, and how far its forward
output (``pm(x)``, after the steps) is from the trained one-device model's.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples.inception import inception_factory  # noqa: E402
from worker_loop import run_cases  # noqa: E402

STEPS, LR = 3, 1e-2


def reference(ex):
    m = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ex.loss_fn(m(*ex.inputs), ex.target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        out = m(*ex.inputs)
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}, out


def run_case(case: dict) -> dict:
    ex = inception_factory(batch=8, branches=case["branches"])
    world = dist.get_world_size()
    path = os.path.join(tempfile.gettempdir(), f"autopar_branch_{case['id']}_{os.environ['MASTER_PORT']}.json")
    if dist.get_rank() == 0:
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=f"cpu:{world}",
                     **case["pins"]).save(path)
    dist.barrier()
    pm = autopar.parallelize(copy.deepcopy(ex.model), ex.inputs, ex.loss_fn, target=ex.target,
                             plan=path)
    ref_losses, ref_w, ref_out = reference(ex)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(*ex.inputs, target=ex.target).item())
        pm.step(opt)
    whole = pm.full_state_dict()
    with torch.no_grad():
        out = pm(*ex.inputs)          # the forward program: every rank the whole output
    mine = {
        "output_err": (out - ref_out).abs().max().item(),
        "losses": losses,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_err": {k: (whole[k] - ref_w[k]).abs().max().item() for k in ref_w},
        "param_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
        "optimizer_bytes": sum(v.numel() * v.element_size() for st in opt.state.values()
                               for v in st.values() if torch.is_tensor(v) and v.dim() > 0),
        "params": sorted(n for n, _ in pm.module.named_parameters()),
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    plan = pm.plan
    return {"ranks": ranks, "ref_losses": ref_losses, "mesh_axes": list(plan.mesh_axes),
            "mesh_shape": list(plan.mesh_shape), "groups": [list(g) for g in plan.branches[0].groups],
            "full_bytes": sum(v.numel() * v.element_size() for v in ref_w.values()),
            "estimate_params": plan.estimate.memory_bytes.get("params", 0.0)}


if __name__ == "__main__":
    run_cases(run_case)
