"""Run by tests/test_compression.py under torchrun (2 gloo ranks, one launch): the lossy
data-parallel pins (``compress=``, ``local_sgd=``; ``autopar.runtime.compression``) on a
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
from autopar.runtime.averaging import ring_neighbours  # noqa: E402
from autopar.runtime.compression import (NUQ_SEED, Accordion, Int8, Nuq, dequantize_int8,  # noqa: E402
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
    pm = autopar.parallelize(copy.deepcopy(model), inputs, loss_fn, target=target, data=n, **pins)
    assert pm.plan.mesh_shape == (n,) and pm._grad_sync.reducer is not None, pm.plan
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


def run_case(case: dict) -> dict:
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
