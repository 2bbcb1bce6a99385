"""Run by tests/test_zero.py under torchrun (2 gloo ranks): the small GPT (tied embedding and
head, layer norms, attention) trained 3 AdamW steps under ``data=2, zero=k`` against the same
model on one device; rank 0 writes one JSON result per case (``tests/worker_loop.py``).

Each case reports the losses and the relative weight error (||W - W_ref|| / ||W_ref - W_0||
over every parameter together: relative to the update, which 3 steps keep small), and this
rank's training-state bytes measured from the live tensors next to the plan's estimate:

- params: every parameter tensor the rank holds (``pm.parameters()``, and under ZeRO-1/2 the
  working parameters the programs read; a shard is a view of its working tensor);
- grads: their ``.grad`` tensors after the last step (before ``zero_grad``);
- optimizer: the optimizer's state tensors of one or more dims (AdamW's moments; its 0-d
  ``step`` counts are not training-state memory the plan counts).

Bytes are those of the memory the tensors cover, once: per storage, the union of the byte
ranges its tensors span (a stage-1 shard's gradient is a view of the whole gradient; stage
2's gradient blocks are views of the buffers the reduce-scatters received).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.cost_models.hardware import parse_cluster  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.runtime import build  # noqa: E402
from autopar.solver.flat import plan_captured  # noqa: E402
from worker_loop import run_cases  # noqa: E402

STEPS, LR = 3, 1e-2


def gpt():
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()
    return ex.model, ex.inputs, ex.target, ex.loss_fn


_CACHE: dict = {}


def parallel(model, inputs, target, loss_fn, pins: dict):
    """``autopar.parallelize(model, ..., **pins)``, with the capture and each plan made once
    per process (rank 0 plans; every rank runs its plan)."""
    if "cap" not in _CACHE:
        _CACHE["cap"] = capture(model, inputs, loss_fn, target)
    cap = _CACHE["cap"]
    key = json.dumps(pins, sort_keys=True)
    if key not in _CACHE:
        box = [plan_captured(cap, parse_cluster("cpu:2"), 2, pins=dict(pins)).to_json()
               if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        _CACHE[key] = Plan.from_dict(json.loads(box[0]))
    return build(cap, _CACHE[key], copy.deepcopy(model))


def reference(model, inputs, target, loss_fn):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(m(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}


def state_bytes(pm, opt) -> dict[str, int]:
    """This rank's params / grads / optimizer bytes, from the live tensors (module docstring)."""
    spans: dict[tuple, list] = {}

    def add(kind, t):
        if t is not None and t.numel():
            es = t.element_size()
            start = t.storage_offset() * es
            end = start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * es
            spans.setdefault((kind, t.untyped_storage().data_ptr()), []).append((start, end))

    params = list(pm.parameters()) + (list(pm._zero.working.values()) if pm._zero else [])
    for p in params:
        add("params", p)
        add("grads", p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                add("optimizer", v)
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for (kind, _), ranges in spans.items():
        reach = 0
        for start, end in sorted(ranges):
            out[kind] += max(0, end - max(start, reach))
            reach = max(reach, end)
    return out


def train(pm, inputs, target, steps, use_pm_step=True, opt=None):
    opt = opt or torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        if use_pm_step:
            pm.step(opt)
        else:
            opt.step()
    return opt, losses


def weight_err(w: dict, ref: dict, w0: dict) -> float:
    num = sum(((w[k] - ref[k]) ** 2).sum() for k in ref)
    den = sum(((ref[k] - w0[k]) ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def run_case(case: dict) -> dict:
    if case.get("shared_conversion_case"):   # tests/test_shared_conversions.py's case too
        import shared_conversion_worker
        return shared_conversion_worker.run_case(case)
    if case.get("experts_case"):     # tests/test_experts.py's memory case too
        import experts_memory_worker
        return experts_memory_worker.run_case(case, sys.modules[__name__])
    if case.get("offload_case"):     # tests/test_offload.py's cases share this spawn
        import offload_worker
        return offload_worker.run_case(case, sys.modules[__name__])
    model, inputs, target, loss_fn = gpt()
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref_losses, ref_w = reference(model, inputs, target, loss_fn)
    pm = parallel(model, inputs, target, loss_fn, case["pins"])
    if case.get("bucket_bytes"):     # many small buckets: launched by the hooks during backward
        pm._grad_sync.bucket_bytes = case["bucket_bytes"]
        if pm._zero is not None:
            pm._zero.bucket_bytes = case["bucket_bytes"]
    if case.get("resume_pins"):
        # 2 steps, a checkpoint, then the last step under another plan, loaded from it
        opt, losses = train(pm, inputs, target, STEPS - 1)
        path = os.path.join(tempfile.gettempdir(), f"autopar_zero_ckpt_{case['id']}_{os.environ['MASTER_PORT']}")
        autopar.save_checkpoint(path, pm, opt)
        pm = parallel(model, inputs, target, loss_fn, case["resume_pins"])
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        autopar.load_checkpoint(path, pm, opt)
        opt, more = train(pm, inputs, target, 1, opt=opt)
        losses += more
    else:
        opt, losses = train(pm, inputs, target, STEPS, use_pm_step=case.get("pm_step", True))
    measured = state_bytes(pm, opt)
    w = pm.full_state_dict()
    w = {k: w[k] for k in w0}
    local = sum(p.numel() for p in pm.parameters())
    est = pm.plan.estimate
    return {"rank": dist.get_rank(), "plan_pins": pm.plan.pins, "mesh_axes": list(pm.plan.mesh_axes),
            "losses": losses, "ref_losses": ref_losses,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "weight_err": weight_err(w, ref_w, w0), "measured": measured,
            "estimate": {k: est.memory_bytes.get(k, 0.0) for k in measured},
            "comm": dict(est.comm), "local_numel": local,
            "numel": sum(v.numel() for v in w0.values())}


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
