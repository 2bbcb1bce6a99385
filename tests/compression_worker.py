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
- ``local_sgd-2`` (H=2, warm-up 1): the ranks' weights agree after the averaging steps and
  differ after the local step between them, which sent no gradient bytes.

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
from autopar.runtime.compression import Int8, dequantize_int8, quantize_int8  # noqa: E402
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
    pm = autopar.parallelize(copy.deepcopy(model), inputs, loss_fn, target=target, data=2, **pins)
    assert pm.plan.mesh_shape == (2,) and pm._grad_sync.reducer is not None, pm.plan
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


def run_case(case: dict) -> dict:
    if case["check"] == "int8_reducer":
        return int8_reducer()
    if case["check"] == "equal":
        return against_one_device(case["pins"], case["steps"])
    if case["check"] == "error_feedback":
        return error_feedback(case["pins"], case["steps"])
    return local_sgd(case["pins"], case["steps"])


if __name__ == "__main__":
    run_cases(run_case)
