"""The offload cases of tests/test_offload.py, run in ``tests/zero_worker.py``'s torchrun spawn
(2 gloo ranks; a case with ``"offload_case": true`` comes here, see ``launch.shared_cases``):
the small GPT trained 3 AdamW steps under ``data=2, zero=k, offload="optimizer"`` against the
same model on one device (``zero_worker``'s model, plans, reference and comparison).

Besides losses and weights, each case reports this rank's bytes from the live tensors, in
two places (a CPU rank's host and device are one memory, so the place is which tensors, not
which address): the *device* side is what the programs read (ZeRO-1/2's working parameters
and the shards that are views of them, ZeRO-3's parameter shards) and their gradients, each
taken as its bucket hands it down to the host (they are not all live at once; the estimate
holds them all); the *host* side is
``pm.parameters()`` (the master copies), their gradients, and the optimizer's state tensors.
Bytes are counted as ``zero_worker.state_bytes`` counts them: per storage, the union of the
byte ranges its tensors span. The events of each step (reductions launched, gradient copies
down, all-gathers, masters copied up) are reported in order (:func:`recorded`).
"""
from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import autopar



def span_bytes(tensors) -> int:
    """Bytes of the memory ``tensors`` cover, once."""
    spans: dict[int, list] = {}
    for t in tensors:
        if t is not None and t.numel():
            es = t.element_size()
            start = t.storage_offset() * es
            end = start + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * es
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((start, end))
    total = 0
    for ranges in spans.values():
        reach = 0
        for start, end in sorted(ranges):
            total += max(0, end - max(start, reach))
            reach = max(reach, end)
    return total


def reference_bf16(model, inputs, target, loss_fn, steps: int, lr: float):
    """``steps`` AdamW steps on one device under ``torch.autocast`` in bf16 (as
    tests/precision_worker.py's reference)."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16):
            loss = loss_fn(m(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.named_parameters()}


def trained(pm, inputs, target, steps: int, lr: float, pm_step: bool = True):
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        if pm_step:
            pm.step(opt)
        else:
            opt.step()
    return opt, losses


def device_tensors(pm) -> list:
    return list(pm._offload.device_params.values()) + (list(pm._zero.working.values()) if pm._zero else [])


def recorded(pm, zero1: bool) -> tuple[list, dict]:
    """Record, in order, the step's reduction launches ("reduce"), the gradient copies down
    ("copy", when a bucket hands its gradients over), the step's end ("end"), and after the
    step the all-gathers ("gather") and the masters copied up ("up", those changed). Also
    the device gradient bytes a step hands down (each parameter's gradient once, ZeRO-1's
    whole working gradient for its shard's view): their most over the steps."""
    ev, bytes_ = [], {"step": {}, "most": 0}
    off, comm = pm._offload, pm._stage_comm
    for name in ("reduce_scatter_start", "all_reduce_coalesced", "all_gather"):
        f = getattr(comm, name)
        kind = "gather" if name == "all_gather" else "reduce"
        setattr(comm, name, lambda *a, f=f, kind=kind, **k: (ev.append(kind), f(*a, **k))[1])
    reduced, down, up = off.reduced, off.grads_down, off.up

    def on_reduced(tensors):
        tensors = list(tensors)
        mine = [p for p in tensors if p.grad is not None and id(p) in off._attr]
        if mine:
            ev.append("copy")
        for p in mine:        # a tied weight's bucket may finish twice: its gradient counts once
            g = p.grad._base if zero1 and p.grad._base is not None else p.grad
            bytes_["step"][off._attr[id(p)]] = span_bytes([g])
        reduced(tensors)

    def on_down():
        down()
        ev.append("end")
        bytes_["most"], bytes_["step"] = max(bytes_["most"], sum(bytes_["step"].values())), {}

    def on_up(tensors):
        tensors = list(tensors)
        if any(off.masters[off._attr[id(p)]]._version != off._versions[off._attr[id(p)]]
               for p in tensors if id(p) in off._attr):
            ev.append("up")
        up(tensors)
    off.reduced, off.grads_down, off.up = on_reduced, on_down, on_up
    return ev, bytes_


def run_case(case: dict, zw) -> dict:
    """One case, with ``zw`` the ``zero_worker`` module running the spawn (its capture and
    plans are made once per process)."""
    if case["pins"].get("offload") == "disk":
        return run_disk_case(case, zw)
    model, inputs, target, loss_fn = zw.gpt()
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    bf16 = case["pins"].get("precision") == "bf16"
    ref_losses, ref_w = (reference_bf16(model, inputs, target, loss_fn, zw.STEPS, zw.LR) if bf16
                         else zw.reference(model, inputs, target, loss_fn))
    pm = zw.parallel(model, inputs, target, loss_fn, case["pins"])
    assert pm._offload is not None, f"plan {pm.plan.pins} does not offload"
    if case.get("bucket_bytes"):     # several ZeRO-1/2 buckets (ZeRO-3's are its blocks)
        pm._grad_sync.bucket_bytes = pm._zero.bucket_bytes = case["bucket_bytes"]
    events, down_bytes = recorded(pm, case["pins"].get("zero") == 1)
    opt, losses = trained(pm, inputs, target, zw.STEPS, zw.LR, case.get("pm_step", True))
    masters = {id(p) for p in pm.parameters()}
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    w = pm.full_state_dict()
    w = {k: w[k] for k in w0}
    # the same plan without offload: the host step is the device's, so the weights agree
    plain = zw.parallel(model, inputs, target, loss_fn, {k: v for k, v in case["pins"].items() if k != "offload"})
    trained(plain, inputs, target, zw.STEPS, zw.LR)
    wp = plain.full_state_dict()
    vs_plain = max(float((w[k] - wp[k]).abs().max()) for k in w0)
    return {"vs_plain": vs_plain, "rank": dist.get_rank(), "plan_pins": pm.plan.pins,
            "losses": losses, "ref_losses": ref_losses,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "weight_err": zw.weight_err(w, ref_w, w0),
            "device": {"params": span_bytes(device_tensors(pm)), "grads": down_bytes["most"],
                       "optimizer": 0},
            "host": {"optimizer": span_bytes(list(pm.parameters()) + state),
                     "grads": span_bytes(p.grad for p in pm.parameters())},
            "state_on_masters": all(id(p) in masters for p in opt.state),
            "masters_apart": not any(p.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
                                     for p in pm.parameters() for d in device_tensors(pm)),
            "estimate": dict(pm.plan.estimate.memory_bytes), "host_estimate": dict(pm.plan.host_memory_bytes),
            "numel": sum(v.numel() for v in w0.values()), "events": events}



# ---- offload="disk" (ZeRO-Infinity's disk tier) ----------------------------------------------
def reference_adamw(model, inputs, target, loss_fn, steps: int, lr: float):
    """``autopar.verify.reference_run`` with AdamW: losses, every gradient by step, weights."""
    from autopar.verify import Run
    m = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(m(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None})
        opt.step()
    return Run(losses, grads, {n: p.detach().clone() for n, p in m.named_parameters()}, initial)


def disk_state(pm, opt) -> dict:
    """Where this rank's optimizer state is: its bytes in the files, in memory now, and
    whether every master and state tensor is a view of a file in the rank's directory."""
    off = pm._offload
    off.drain()
    tensors = list(pm.parameters()) + [v for st in opt.state.values() for v in st.values()
                                       if torch.is_tensor(v) and v.dim() > 0]
    files = [t.untyped_storage().filename for t in tensors]
    return {"disk": off.disk_bytes(), "resident": off.resident_bytes(),
            "all_on_disk": all(off.on_disk(t) for t in tensors),
            "in_directory": all(f is not None and f.startswith(off.directory + os.sep) for f in files),
            "in_memory": span_bytes(t for t in tensors if not off.on_disk(t))}


def run_disk_case(case: dict, zw) -> dict:
    """``offload="disk"``: the loss, every gradient and the weights after 3 AdamW steps
    against one device (``autopar.verify.compare``); where the state is between steps; a
    checkpoint saved and loaded into a fresh module, which steps on equal to the first; the
    rank's directory removed with the module."""
    from autopar.verify import Run, compare, parallel_run, reference_run
    model, inputs, target, loss_fn = zw.gpt()
    ref = reference_adamw(model, inputs, target, loss_fn, zw.STEPS, zw.LR)
    root = os.path.join(tempfile.gettempdir(), f"autopar_disk_{os.environ['MASTER_PORT']}")
    os.makedirs(root, exist_ok=True)
    pins = {**case["pins"], "offload_dir": root}
    pm = zw.parallel(model, inputs, target, loss_fn, pins)
    if case.get("bucket_bytes"):     # several ZeRO-1/2 buckets, and several disk buckets
        pm._grad_sync.bucket_bytes = pm._zero.bucket_bytes = case["bucket_bytes"]
        pm._offload.bucket_bytes = case["bucket_bytes"]
    opt = torch.optim.AdamW(pm.parameters(), lr=zw.LR)
    losses, grads, between = [], [], []
    for _ in range(zw.STEPS):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        grads.append(pm.full_grads())
        pm.step(opt)
        between.append(disk_state(pm, opt))
    check = compare(ref, Run(losses, grads, pm.full_state_dict()))
    # the same plan without offload: the same numbers, bit for bit (the step only moved)
    plain = zw.parallel(model, inputs, target, loss_fn, {k: v for k, v in case["pins"].items() if k != "offload"})
    opt_p = torch.optim.AdamW(plain.parameters(), lr=zw.LR)
    grads_p = []
    for _ in range(zw.STEPS):
        opt_p.zero_grad()
        plain.train_step(*inputs, target=target)
        grads_p.append(plain.full_grads())
        plain.step(opt_p)
    w, wp = pm.full_state_dict(), plain.full_state_dict()
    vs_plain = {"weights": max(float((w[k] - wp[k]).abs().max()) for k in wp),
                "grads": max(float((a[k] - b[k]).abs().max()) for a, b in zip(grads, grads_p) for k in b),
                "weight_err": compare(ref, Run(losses, grads_p, wp)).weight_err}
    whole_err = zw.weight_err(w, ref.weights, ref.initial)     # over all parameters together
    # autopar.verify's own run (SGD with momentum, a bare opt.step(): the post-hook's path)
    sgd = zw.parallel(model, inputs, target, loss_fn, pins)
    sgd_check = compare(reference_run(model, inputs, target, loss_fn), parallel_run(sgd, inputs, target))
    sgd_opt_state = sgd._offload.disk_bytes()["optimizer"]
    del sgd
    after = disk_state(pm, opt)           # full_state_dict read the masters: some in memory
    read = after["resident"]
    pm._offload.write_back(list(pm._offload.masters))
    # a checkpoint round trip: a fresh module loads it and steps on equal to this one
    path = os.path.join(root, f"ckpt_{case['id']}")
    autopar.save_checkpoint(path, pm, opt)
    pm2 = zw.parallel(model, inputs, target, loss_fn, pins)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=zw.LR)
    autopar.load_checkpoint(path, pm2, opt2)
    for m, o in ((pm, opt), (pm2, opt2)):
        o.zero_grad()
        m.train_step(*inputs, target=target)
        m.step(o)
    loaded = disk_state(pm2, opt2)
    w, w2 = pm.full_state_dict(), pm2.full_state_dict()
    resumed = max(float((w[k] - w2[k]).abs().max()) for k in w)
    files_before = sorted(os.listdir(pm._offload.directory))
    directory, plan = pm._offload.directory, pm.plan
    del pm, pm2, opt, opt2
    gc.collect()
    removed = not os.path.exists(directory)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)       # the checkpoint too
    return {"rank": dist.get_rank(), "plan_pins": plan.pins, "offload_dir": plan.options.offload_dir,
            "loss_err": check.loss_err, "grad_err": check.grad_err, "weight_err": check.weight_err,
            "grad_worst": check.grad_worst, "weight_worst": check.weight_worst,
            "problems": list(check.problems), "vs_plain": vs_plain, "whole_err": whole_err, "between": between,
            "sgd": {"loss_err": sgd_check.loss_err, "grad_err": sgd_check.grad_err,
                    "weight_err": sgd_check.weight_err, "weight_worst": sgd_check.weight_worst,
                    "problems": list(sgd_check.problems), "disk": sgd_opt_state}, "read_resident": read,
            "resumed": resumed, "loaded": loaded, "files": files_before,
            "removed": removed, "root": root,
            "numel": sum(p.numel() for p in model.parameters()),
            "plan_disk": dict(plan.disk_bytes), "plan_host": dict(plan.host_memory_bytes),
            "estimate": dict(plan.estimate.memory_bytes)}
