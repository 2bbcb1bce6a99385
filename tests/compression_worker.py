"""Run by tests/test_compression.py under torchrun (2 gloo ranks, one launch): the lossy
data-parallel pins (``compress=``, ``local_sgd=``; ``autopar.runtime.updates.compression``) on a
tiny MLP, each case checking what can be checked exactly:

- ``bf16``: close to one device within bf16's rounding, not equal to it;
- ``powersgd-exact``: rank 4 >= the rank of the first layer's gradient (batch 4): equal to
  one device, and the steps after torch's vanilla start sent fewer bytes;
- ``powersgd-ef`` / ``topk-ef`` (parameters held fixed, so every step has the same gradient
  G): lossy (a step's sum is not G) and error feedback carries across steps: the sums of the
  steps plus the ranks' residual errors are exactly ``steps x G``;
- ``topk-all`` (fraction 1.0): equal to one device;
- ``int8``: the reducer's sum of known per-rank tensors is exactly the sum of their
  quantise-dequantise, within half a quantisation step per rank of the true sum; a training
  run is close to one device but not equal;
- ``local_sgd-1`` (H=1, no warm-up, SGD with momentum: averaging after each local step is
  linear): equal to one device (loss, weights);
- ``decentralized-pair`` (averaging="decentralized" on 2 ranks: the ring is the pair) runs as
  ``local_sgd-1`` and is equal to one device;
- ``local_sgd-2`` (H=2, warm-up 1): the ranks' weights agree after the averaging steps and
  differ after the local step between them, which sent no gradient bytes.

- ``nuq-reducer``: the NUQSGD reducer's sum of known per-rank tensors is exactly the sum of
  each rank's quantisation (redrawn from the rank's seed), every value on one of the two
  levels around it; ``accordion-switch`` (top-k 0.5 / 1.0, a check every 2 steps, a known
  gradient G that becomes 3G): critical (exact) at the start, compressed once the norm
  stays, critical again when it triples, with the bytes of each setting;
- ``trains`` (nuq, accordion, decentralized, async): 30 SGD steps against the one-device run
  over the same data: the loss falls as the exact run's does, the bytes sent per step;
- ``averaging-math`` (plain SGD, period 1): every rank's parameters after each step equal
  the formula computed here from every rank's parameters and gradients: the ring mean of
  ``x_j - lr g_j`` over ``j`` in ``{r - 1, r, r + 1}`` (decentralized; 4 ranks), and
  ``mean_j(x_j) - lr g_r`` (async: the last step's average folded in).

- ``workers-exact`` (``workers="accordion:2:2"``: W1 == W2 == the data degree): equal to one
  device on the whole batch (loss, gradients, weights);
- ``workers-critical`` (``workers="accordion:1:2"``, the first 10 steps critical, so only data
  rank 0 trains): loss, gradients and weights (momentum SGD through ``pm.step``, the learning
  rate halved by the linear rule; ``workers_lr="constant"``: not) equal one device over
  rank 0's half of the batch alone, and rank 1 ran no forward after the first (watched) step
  (``workers-critical-4``: ``"accordion:2:4"`` on 4 ranks, ranks 0 and 1's rows;
  ``workers-critical-tp``: ``"accordion:1:2"`` on data 2 x tensor 2, where both tensor ranks
  of data rank 1 idle together);
- ``workers-switch``: the reducer on known per-rank gradients, checking every 2 steps: the
  sum over the data axis divided by the ranks that trained, and the regime from the whole
  gradient's norm (critical at the start, W2 once it stays, critical again when it triples);
- ``workers-checkpoint``: the schedule's state (regime, last norm, steps) saved with
  ``save_checkpoint`` and restored by ``load_checkpoint`` into a fresh module;
- ``workers-batchnorm``: a BatchNorm model (batch statistics all-gathered over the data axis
  in forward) is refused on every rank after the first step, naming the op.

Rank 0 writes one JSON result per case.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from autopar.errors import ArgumentError  # noqa: E402
from autopar.runtime.updates.averaging import ring_neighbours  # noqa: E402
from autopar.runtime.updates.workers import ActiveWorkers  # noqa: E402
from autopar.runtime.updates.compression import (NUQ_SEED, Accordion, Int8, Nuq, dequantize_int8,  # noqa: E402
                                         nuq_dequantize, nuq_levels, nuq_quantize, quantize_int8)
from autopar.verify import LR, MOMENTUM, Run, compare, parallel_run, reference_run  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def example():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(4, 16)
    y = torch.randint(0, 4, (4,))
    return model, (x,), y, F.cross_entropy


def build(pins: dict):
    model, inputs, target, loss_fn = example()
    n = dist.get_world_size()
    pm = autopar.parallelize(copy.deepcopy(model), inputs, loss_fn, target=target, **{"data": n, **pins})
    assert pm.plan.mesh_shape in ((n,), (pins.get("data"), pins.get("tensor"))), pm.plan
    assert pm.update_rule.axis is not None, pm.plan      # a scheme on the data axis, not the exact all-reduce
    return model, inputs, target, loss_fn, pm


def grad_bytes(pm) -> int:
    return sum(p.numel() * p.element_size() for p in pm.parameters())


def errors(ref: Run, got: Run) -> dict:
    c = compare(ref, got)
    return {"loss_err": c.loss_err, "grad_err": c.grad_err, "weight_err": c.weight_err,
            "problems": list(c.problems)}


def against_one_device(pins: dict, steps: int) -> dict:
    model, inputs, target, loss_fn, pm = build(pins)
    ref = reference_run(model, inputs, target, loss_fn, steps)
    got = parallel_run(pm, inputs, target, steps)
    return errors(ref, got) | {"wire_bytes": pm._grad_sync.reducer.wire_bytes,
                               "full_bytes": grad_bytes(pm)}


def error_feedback(pins: dict, steps: int) -> dict:
    """Parameters fixed (no optimizer step): the sum each step applies, and the residuals."""
    model, inputs, target, loss_fn, pm = build(pins)
    loss_fn(model(*inputs), target).backward()
    g = {n: p.grad for n, p in model.named_parameters()}
    sums = []
    for _ in range(steps):
        for p in pm.parameters():
            p.grad = None
        pm.train_step(*inputs, target=target)
        sums.append({n: t.clone() for n, t in pm.full_grads().items()})
    red = pm._grad_sync.reducer
    resid = {n: torch.zeros_like(t) for n, t in g.items()}
    params = dict(pm.module.named_parameters())
    for names in red._index:
        e = red.local_error(names)
        off = 0
        for n in names:
            k = params[n].numel()
            resid[n] += e[off: off + k].view_as(params[n])
            off += k
    for t in resid.values():
        dist.all_reduce(t)
    scale = max(float(t.abs().max()) for t in g.values())
    conserved = max(float((sum(s[n] for s in sums) + resid[n] - steps * g[n]).abs().max())
                    for n in g) / scale
    last_lossy = max(float((sums[-1][n] - g[n]).abs().max()) for n in g) / scale
    carried = max(float((sums[-1][n] - sums[-2][n]).abs().max()) for n in g) / scale
    return {"conserved_err": conserved, "last_step_err": last_lossy, "last_two_differ": carried,
            "wire_bytes": red.wire_bytes, "full_bytes": grad_bytes(pm)}


def int8_reducer() -> dict:
    """The Int8 reducer on known tensors: rank r's is ``x_r``, every rank can compute all."""
    group = dist.group.WORLD
    n = dist.get_world_size()
    xs = [torch.randn(1500, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(n)]
    mine = xs[dist.get_rank()]
    red = Int8(group, 0)
    got = torch.zeros_like(mine)
    red.start(("x",), [got.copy_(mine)]).wait()
    expect = sum(dequantize_int8(*quantize_int8(x)).reshape(-1)[:1500] for x in xs)
    half_step = sum(quantize_int8(x)[1][:, 1].repeat_interleave(512)[:1500] / 2 for x in xs)
    return {"vs_dequantized": float((got - expect).abs().max()),
            "beyond_half_step": float(((got - sum(xs)).abs() - half_step * 1.0001).max()),
            "exact_err": float((got - sum(xs)).abs().max())}


def local_sgd(pins: dict, steps: int) -> dict:
    """SGD with momentum through ``pm.step``; the weights of each rank after each step."""
    model, inputs, target, loss_fn, pm = build(pins)
    ref = reference_run(model, inputs, target, loss_fn, steps)
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    losses, spread, wire = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        pm.step(opt)
        flat = torch.cat([p.detach().reshape(-1) for p in pm.parameters()])
        both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(both, flat)
        spread.append(float((both[0] - both[1]).abs().max()))
        wire.append(pm._grad_sync.reducer.wire_bytes)
    weights = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses))
    weight_err = max(float((weights[n] - ref.weights[n]).norm() / (ref.weights[n] - ref.initial[n]).norm())
                     for n in weights)
    return {"loss_err": loss_err, "weight_err": weight_err, "rank_spread": spread,
            "wire_bytes": wire, "full_bytes": grad_bytes(pm)}


def nuq_reducer(levels: int) -> dict:
    """The Nuq reducer on known tensors; each rank's draw is redrawn from its seed."""
    n, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(1500, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(n)]
    red = Nuq(dist.group.WORLD, 0, levels)
    got = xs[rank].clone()
    red.start(("x",), [got]).wait()
    parts, on_levels = [], True
    table = nuq_levels(levels)
    for r, x in enumerate(xs):
        codes, norms = nuq_quantize(x, levels, torch.Generator().manual_seed(NUQ_SEED + r))
        q = nuq_dequantize(codes, norms, levels).reshape(-1)[:1500]
        parts.append(q)
        u = (q.abs() / norms.repeat_interleave(512)[:1500])     # the level each value took
        true = x.abs() / norms.repeat_interleave(512)[:1500]
        near = (table[None, :] - u[:, None]).abs().min(1).values
        below = table[(table[None, :] <= true[:, None] + 1e-7).sum(1) - 1]
        above = table[((table[None, :] < true[:, None] - 1e-7).sum(1)).clamp_max(levels)]
        on_levels &= bool((near < 1e-6).all()) and bool(((u >= below - 1e-6) & (u <= above + 1e-6)).all())
    return {"vs_quantized": float((got - sum(parts)).abs().max()), "on_levels": on_levels,
            "exact_err": float((got - sum(xs)).abs().max()), "wire_bytes": red._step_bytes,
            "full_bytes": 1500 * 4}


def accordion_switch() -> dict:
    """Accordion over top-k (0.5 outside critical regimes, 1.0 in them), checking every 2
    steps; the gradient G for 4 steps, then 3G."""
    red = Accordion(dist.group.WORLD, 0, ("topk", 0.5, 1.0), interval=2)
    g = torch.randn(2000, generator=torch.Generator().manual_seed(dist.get_rank()))
    wire = []
    for step in range(8):
        buf = g * (3.0 if step >= 4 else 1.0)
        red.start(("x",), [buf]).wait()
        red.end_step()
        wire.append(red.wire_bytes)
    return {"critical": red.history, "wire_bytes": wire, "full_bytes": 2000 * 4}


def trains(pins: dict, steps: int) -> dict:
    """SGD with momentum through ``pm.step`` against one device over the same batch."""
    model, inputs, target, loss_fn, pm = build(pins)
    ref = reference_run(model, inputs, target, loss_fn, steps)
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    red = pm._grad_sync.reducer
    losses, wire = [], []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pm.train_step(*inputs, target=target).item())
        pm.step(opt)
        wire.append(red.wire_bytes)
    return {"losses": losses, "ref_losses": ref.losses, "wire_bytes": wire,
            "full_bytes": grad_bytes(pm), "critical": getattr(red, "history", None)}


def _gather_flat(tensors) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return torch.stack(out)


def averaging_math(pins: dict, steps: int) -> dict:
    """Plain SGD, period 1: each rank's parameters after a step against the formula."""
    _, inputs, target, _, pm = build(pins)
    n, lr = dist.get_world_size(), LR
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    params = list(pm.parameters())
    err, spread, wire, ring = 0.0, [], [], []
    for _ in range(steps):
        before = _gather_flat(params)
        opt.zero_grad()
        pm.train_step(*inputs, target=target)
        grads = _gather_flat(p.grad for p in params)
        pm.step(opt)
        after = _gather_flat(params)
        stepped = before - lr * grads
        if pins["averaging"] == "decentralized":
            expect = torch.stack([stepped[[r, *ring_neighbours(r, n)]].mean(0) for r in range(n)])
            ring.append([[r, *ring_neighbours(r, n)] for r in range(n)])
        else:
            expect = before.mean(0, keepdim=True) - lr * grads
        err = max(err, float((after - expect).abs().max() / (stepped - before).abs().max()))
        spread.append(float((after - after.mean(0)).abs().max()))
        wire.append(pm._grad_sync.reducer.wire_bytes)
    return {"formula_err": err, "rank_spread": spread, "wire_bytes": wire,
            "full_bytes": grad_bytes(pm), "ring": ring[:1]}


def workers_critical(pins: dict, steps: int) -> dict:
    """``workers="accordion:W1:W2"`` for ``steps`` (< 10) steps, all critical: against one
    device over data ranks 0 .. W1-1's rows of the batch, the learning rate times W1 / W2
    under the linear rule; each rank's forward calls per step."""
    model, inputs, target, loss_fn, pm = build(pins)
    red = pm._grad_sync.reducer
    half = inputs[0].shape[0] * red.low // red.size
    lr = LR * (red.low / red.high if pins.get("workers_lr", "linear") == "linear" else 1.0)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lr, momentum=MOMENTUM)
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    calls = [0]
    run_loss = pm.runner._loss

    def counted(*a, **kw):
        calls[0] += 1
        return run_loss(*a, **kw)
    pm.runner._loss = counted
    loss_err = grad_err = 0.0
    forwards = []
    for _ in range(steps):
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref_model(inputs[0][:half]), target[:half])
        ref_loss.backward()
        opt.zero_grad()
        calls[0] = 0
        loss = pm.train_step(*inputs, target=target)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, calls[0])
        forwards.append(every)
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        got = pm.full_grads()
        for n, p in ref_model.named_parameters():
            grad_err = max(grad_err, float((got[n] - p.grad).norm() / p.grad.norm()))
        pm.step(opt)
        ref_opt.step()
    state = pm.full_state_dict()
    weight_err = max(float((state[n] - p.detach()).norm() / (p.detach() - dict(model.named_parameters())[n].detach()).norm())
                     for n, p in ref_model.named_parameters())
    return {"loss_err": loss_err, "grad_err": grad_err, "weight_err": weight_err,
            "forwards": forwards, "counts": red.counts, "lr_after": opt.param_groups[0]["lr"]}


def workers_switch() -> dict:
    """The reducer alone, a check every 2 steps: rank r hands its term of the mean, G / n
    (zeros when it does not train), for 4 steps, then 3 G / n."""
    n, rank = dist.get_world_size(), dist.get_rank()
    red = ActiveWorkers(dist.group.WORLD, 0, 1, n, interval=2)
    g = torch.randn(3000, generator=torch.Generator().manual_seed(7))
    err = 0.0
    for step in range(8):
        want = g * (3.0 if step >= 4 else 1.0)
        buf = want / n if red.trains else torch.zeros_like(g)
        red.start(("x",), [buf]).wait()
        red.end_step()
        err = max(err, float((buf - want).abs().max() / want.abs().max()))
    return {"critical": red.history, "counts": red.counts, "mean_err": err,
            "lr_scale": red.lr_scale}


def workers_checkpoint(pins: dict) -> dict:
    """Train with the parameters fixed (the same gradient each step: the norm stays), a check
    every 2 steps, until the regime is not critical; save; load into a fresh module."""
    _, inputs, target, _, pm = build(pins)
    pm._grad_sync.reducer.detector.interval = 2
    for _ in range(4):
        for p in pm.parameters():
            p.grad = None
        pm.train_step(*inputs, target=target)
    saved = pm._grad_sync.reducer.state_dict()
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    save_checkpoint(os.path.join(where[0], "ck"), pm)
    _, _, _, _, fresh = build(pins)
    before = fresh._grad_sync.reducer.workers
    load_checkpoint(os.path.join(where[0], "ck"), fresh)
    red = fresh._grad_sync.reducer
    return {"saved": saved, "loaded": red.state_dict(), "workers_before": before,
            "workers_after": red.workers}


def workers_batchnorm(pins: dict) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    pm = autopar.parallelize(model, (x,), F.cross_entropy, target=y, data=dist.get_world_size(), **pins)
    try:
        pm.train_step(x, target=y)
    except ArgumentError as e:
        return {"refused": str(e)}
    return {"refused": ""}


def run_case(case: dict) -> dict:
    if case["check"] == "workers_critical":
        return workers_critical(case["pins"], case["steps"])
    if case["check"] == "workers_switch":
        return workers_switch()
    if case["check"] == "workers_checkpoint":
        return workers_checkpoint(case["pins"])
    if case["check"] == "workers_batchnorm":
        return workers_batchnorm(case["pins"])
    if case["check"] == "nuq_reducer":
        return nuq_reducer(case["levels"])
    if case["check"] == "accordion_switch":
        return accordion_switch()
    if case["check"] == "trains":
        return trains(case["pins"], case["steps"])
    if case["check"] == "averaging_math":
        return averaging_math(case["pins"], case["steps"])
    if case["check"] == "int8_reducer":
        return int8_reducer()
    if case["check"] == "equal":
        return against_one_device(case["pins"], case["steps"])
    if case["check"] == "error_feedback":
        return error_feedback(case["pins"], case["steps"])
    return local_sgd(case["pins"], case["steps"])


if __name__ == "__main__":
    run_cases(run_case)
