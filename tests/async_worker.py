"""Run by tests/test_async_updates.py under torchrun (2 gloo ranks, one launch): the update
schemes ``staleness=``, ``param_server=`` and ``learners=`` (Crossbow) on a tiny MLP, each
case checking what is exact:

- ``ps``: synchronous parameter servers equal one device after AdamW steps: the loss at
  every step, the gradient the servers hold after each push, the weights after the steps;
- ``stale``: with staleness s the loss at every step, the gradient applied and the weights
  after the steps equal a single-device AdamW run built here by hand that applies the
  gradient of step t - s at step t (and nothing in the first s steps);
  ``param_server=`` with ``staleness=`` has the same semantics (the servers apply each
  pushed gradient s steps late);
- ``crossbow``: one SMA step (plain SGD, so every term is known) against its formula
  computed here from every learner's weights and gradients; then training lowers the loss;
- ``ps_too_many``: more servers than data ranks is refused.

Rank 0 writes one JSON result per case.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.verify import Run, compare  # noqa: E402
from worker_loop import run_cases  # noqa: E402

LR = 1e-2


def example(rows: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(rows, 16)
    y = torch.randint(0, 4, (rows,))
    return model, (x,), y, F.cross_entropy


def stale_reference(model, inputs, target, loss_fn, steps: int, staleness: int) -> Run:
    """One device, AdamW, applying at step t the gradient computed at step t - staleness."""
    model = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    computed, losses, applied = [], [], []
    for t in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        computed.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if t >= staleness:
            for n, p in model.named_parameters():
                p.grad = computed[t - staleness][n].clone()
            opt.step()
            applied.append(computed[t - staleness])
        else:
            applied.append({n: torch.zeros_like(p) for n, p in model.named_parameters()})
    return Run(losses, applied, {n: p.detach().clone() for n, p in model.named_parameters()}, initial)


def server_grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as its server holds it (broadcast from the server)."""
    red = pm._grad_sync.reducer
    out = {}
    for attr, p in red.params.items():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.broadcast(g, dist.get_global_rank(red.group, red.owner[attr]), group=red.group)
        for name in pm._shards.aliases[attr]:
            out[name] = g
    return out


def updates(pins: dict, steps: int) -> dict:
    """``param_server=`` and/or ``staleness=`` against the stale (s = 0: plain) reference."""
    s = pins.get("staleness", 0)
    model, inputs, target, loss_fn = example()
    pm = autopar.parallelize(copy.deepcopy(model), inputs, loss_fn, target=target, data=2, **pins)
    ref = stale_reference(model, inputs, target, loss_fn, steps, s)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grads, stepped = [], [], []
    red = pm._grad_sync.reducer
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        grads.append(server_grads(pm) if "param_server" in pins else pm.full_grads())
        stepped.append(pm.step(opt))
    c = compare(ref, Run(losses, grads, pm.full_state_dict()))
    out = {"loss_err": c.loss_err, "grad_err": c.grad_err, "weight_err": c.weight_err,
           "problems": list(c.problems), "stepped": stepped, "wire_bytes": red.wire_bytes,
           "full_bytes": sum(p.numel() * p.element_size() for p in pm.parameters())}
    if "param_server" in pins:
        # optimizer state only for the parameters this rank serves
        held = [n for n, p in red.params.items() if p in opt.state]
        out |= {"state_held": sorted(held), "served": sorted(red.served()),
                "pull_bytes": red.pull_bytes}
        mine = [None] * dist.get_world_size()
        dist.all_gather_object(mine, sorted(red.served()))
        out["served_by_rank"] = mine
    return out


def crossbow(pins: dict, steps: int) -> dict:
    m = pins["learners"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    teacher = torch.randn(16, 4)
    xs = torch.randn(64 * m, 16)
    ys = (xs @ teacher).argmax(1)
    b = 8                       # one learner batch (global), m of them per step
    cb = autopar.parallelize(copy.deepcopy(model), (xs[:b],), F.cross_entropy, target=ys[:b],
                             data=2, **pins)
    opt = torch.optim.SGD(cb.parameters(), lr=0.1)
    K = m * dist.get_world_size()

    def batch(t):
        idx = torch.arange(t * m * b, (t + 1) * m * b) % xs.shape[0]
        return xs[idx], ys[idx]

    def every_learner(tensors_of_j):
        """[learner][param] over every rank's learners (rank-major)."""
        mine = torch.cat([torch.cat([t.reshape(-1) for t in tensors_of_j(j)]) for j in range(m)])
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine)
        return torch.cat(out).view(K, -1)

    # two steps, the second checked: its z and z_prev differ
    sma_err = None
    for t in range(2):
        opt.zero_grad()
        x, y = batch(t)
        cb.train_step(x, target=y)
        w = every_learner(lambda j: [p.detach() for p in cb._weights(j)])
        g = every_learner(lambda j: [p.grad for p in cb._weights(j)])
        z = torch.cat([t_.reshape(-1) for t_ in cb.z])
        zp = torch.cat([t_.reshape(-1) for t_ in cb.z_prev])
        cb.step(opt)
        if t == 1:
            alpha, mu = 1.0 / K, cb.momentum
            c = alpha * (w - z)
            w_new = w - 0.1 * g - c
            z_new = z + c.sum(0) + mu * (z - zp)
            got_w = every_learner(lambda j: [p.detach() for p in cb._weights(j)])
            got_z = torch.cat([t_.reshape(-1) for t_ in cb.z])
            sma_err = max(float((got_w - w_new).abs().max() / w_new.abs().max()),
                          float((got_z - z_new).abs().max() / z_new.abs().max()))
            spread = float((w[0] - w[-1]).abs().max())      # learners differ

    def central_loss():
        """The loss of ``cb(...)``: the central model's outputs."""
        with torch.no_grad():
            return float(F.cross_entropy(cb(xs[:b]), ys[:b]))
    # training: the central model's loss on all the data falls
    ref = copy.deepcopy(model)
    with torch.no_grad():
        start = float(F.cross_entropy(model(xs), ys))
    losses = []
    for t in range(2, steps):
        opt.zero_grad()
        x, y = batch(t)
        losses.append(float(cb.train_step(x, target=y)))
        cb.step(opt)
    ref.load_state_dict(cb.full_state_dict())
    with torch.no_grad():
        end = float(F.cross_entropy(ref(xs), ys))
        forward_err = abs(central_loss() - float(F.cross_entropy(ref(xs[:b]), ys[:b])))
    return {"sma_err": sma_err, "forward_err": forward_err, "learner_spread": spread,
            "start_loss": start, "end_loss": end, "first_losses": losses[:3], "last_losses": losses[-3:], "wire_bytes": cb.wire_bytes,
            "n_params": sum(1 for _ in cb.parameters()), "K": K}


def too_many() -> dict:
    model, inputs, target, loss_fn = example()
    try:
        autopar.parallelize(model, inputs, loss_fn, target=target, data=2, param_server=3)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error_type": type(e).__name__, "message": str(e)}
    return {"error_type": None, "message": ""}


def run_case(case: dict) -> dict:
    if case["check"] == "updates":
        return updates(case["pins"], case["steps"])
    if case["check"] == "crossbow":
        return crossbow(case["pins"], case["steps"])
    return too_many()


if __name__ == "__main__":
    run_cases(run_case)
