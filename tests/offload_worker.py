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

import torch
import torch.distributed as dist



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

