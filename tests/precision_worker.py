"""Run by tests/test_precision.py under torchrun (2 gloo ranks): mixed-precision training of
the small GPT (layer norms, attention, tied embedding and head, cross-entropy) under a plan,
against the same model on one device, 3 AdamW steps.

bf16 cases compare with ``torch.autocast(dtype=torch.bfloat16)`` on one device AND with the
fp32 run, so the test can check the run is nearer the first. fp16 cases compare with
autocast fp16 + ``torch.amp.GradScaler`` (``pm.step(opt)`` does the scaling). Rank 0 writes
one JSON result per case (``tests/worker_loop.py``).

Measures (``rel``): the loss of every step, relative; the weights after the steps as
||W - W_ref|| / ||W_ref - W_0|| over every parameter together (relative to the update, since
the weights themselves barely move in 3 steps).
"""
from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from worker_loop import on_rank0, run_cases  # noqa: E402

STEPS, LR = 3, 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def gpt():
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()
    return ex.model, ex.inputs, ex.target, ex.loss_fn


def reference(model, inputs, target, loss_fn, precision: str, init_scale: float,
              growth_interval: int = 2000):
    """3 AdamW steps on one device under autocast in ``precision`` (fp16: with GradScaler)."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    dtype = DTYPES[precision]
    scaler = (torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
              if precision == "fp16" else None)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(m(*inputs), target)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    extra = {"scale": scaler.get_scale()} if scaler is not None else {}
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}, extra


def weight_dist(w: dict, ref: dict, w0: dict) -> float:
    num = sum(((w[k].float() - ref[k]) ** 2).sum() for k in ref)
    den = sum(((ref[k] - w0[k]) ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def loss_dist(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = gpt()
    precision = case["precision"]
    init_scale = case.get("init_scale", 2.0 ** 16)
    growth_interval = case.get("growth_interval", 2000)
    pins = dict(case["pins"], precision=precision)
    if case.get("plan_file"):
        # a saved plan's precision is honoured: parallelize(plan=path) with no pins
        planned = on_rank0(lambda: autopar.plan(model, inputs, loss_fn, target=target,
                                                cluster="cpu:2", **pins))
        path = os.path.join(tempfile.gettempdir(), f"autopar_precision_plan_{os.getpid()}.json")
        planned.save(path)
        pm = autopar.parallelize(model, inputs, loss_fn, target=target, plan=path)
    else:
        pm = autopar.parallelize(model, inputs, loss_fn, target=target, **pins)
    if pm.scaler is not None:
        pm.scaler.scale, pm.scaler.growth_interval = init_scale, growth_interval
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, stepped = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        stepped.append(pm.step(opt))
    master_dtypes = sorted({str(p.dtype) for p in pm.parameters()})
    w = pm.full_state_dict()
    w = {k: w[k] for k in w0}
    ref_losses, ref_w, extra = reference(model, inputs, target, loss_fn, precision, init_scale,
                                         growth_interval)
    local = torch.tensor([float(sum(p.numel() for p in pm.parameters()))])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    info = {"rank": dist.get_rank(), "mesh": list(pm.plan.mesh_shape), "plan_pins": pm.plan.pins,
            "microbatches": pm.plan.n_microbatches, "local_numel_max": float(local),
            "numel": sum(v.numel() for v in w0.values()),
            "master_dtypes": master_dtypes, "losses": losses, "ref_losses": ref_losses,
            "loss_err": loss_dist(losses, ref_losses), "weight_err": weight_dist(w, ref_w, w0),
            "stepped": stepped, "moved": max(float((w[k] - w0[k]).abs().max()) for k in w0)}
    if pm.scaler is not None:
        info["scale"], info["ref_scale"] = pm.scaler.scale, extra["scale"]
    if case.get("resume_pins"):
        info["scaler_state"], info["resumed_scaler"] = resume(pm, opt, model, inputs, loss_fn, target,
                                                              dict(case["resume_pins"], precision=precision))
    if precision in ("bf16", "fp16"):
        fp_losses, fp_w, _ = reference(model, inputs, target, loss_fn, "fp32", init_scale)
        info["fp32_loss_dist"] = loss_dist(losses, fp_losses)
        info["fp32_weight_dist"] = weight_dist(w, fp_w, w0)
        info["ref_vs_fp32_weight"] = weight_dist(ref_w, fp_w, w0)
    return info


def resume(pm, opt, model, inputs, loss_fn, target, pins: dict) -> tuple[dict, dict]:
    """Save ``pm`` and ``opt`` with ``autopar.save_checkpoint``, load them into a new module
    under ``pins``: (the loss scaler's state saved, the new module's after loading)."""
    box = [tempfile.mkdtemp(prefix="autopar_precision_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    try:
        autopar.save_checkpoint(box[0], pm, opt)
        pm2 = autopar.parallelize(model, inputs, loss_fn, target=target, **pins)
        fresh = pm2.scaler.state_dict()
        autopar.load_checkpoint(box[0], pm2, torch.optim.AdamW(pm2.parameters(), lr=LR))
        assert fresh != pm.scaler.state_dict(), "the test needs a scale other than a new module's"
        return pm.scaler.state_dict(), pm2.scaler.state_dict()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
