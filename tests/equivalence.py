"""Train a model on one device and under a plan, side by side, and compare the numbers.

Used by the equivalence tests (simulated ranks) and by the torchrun checks (real gloo
ranks). A gradient's error is measured against its own norm, with a floor of 1e-5 × the
whole gradient's norm: some gradients are zero in exact arithmetic (a key bias under
softmax) and hold only rounding noise. Weights are compared after SGD with momentum, which
is linear in the gradients.
"""
from __future__ import annotations

import copy
import math

import torch

LR, MOMENTUM = 0.05, 0.9
LOSS_RTOL, GRAD_RTOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-4


def reference_run(model, inputs, target, loss_fn, steps: int = 3):
    """(losses, gradients of step 0 by name, weights after ``steps`` SGD steps) on one device."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads0 = [], None
    for i in range(steps):
        opt.zero_grad()
        out = model(*inputs)
        loss = loss_fn(out, target) if loss_fn is not None else out
        loss.backward()
        losses.append(loss.item())
        if i == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads0, weights


def parallel_run(pm, inputs, target, steps: int = 3):
    """The same on a ParallelModule (called on every rank)."""
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads0 = [], None
    for i in range(steps):
        opt.zero_grad()
        loss = pm.train_step(*inputs, target=target)
        losses.append(loss.item())
        if i == 0:
            grads0 = pm.full_grads()
        opt.step()
    return losses, grads0, pm.full_state_dict()


def compare(ref, got, label: str = "") -> dict:
    """Raise AssertionError naming the first quantity that differs; return the worst errors."""
    ref_losses, ref_grads, ref_w = ref
    losses, grads, weights = got
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        err = abs(a - b) / max(abs(b), 1e-12)
        worst["loss"] = max(worst["loss"], err)
        assert err < LOSS_RTOL, f"{label}: loss of step {i} is {a!r}, one device gives {b!r} (rel err {err:.2e})"
    total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in ref_grads.values()))
    for name, g_ref in ref_grads.items():
        assert name in grads, f"{label}: no gradient for parameter {name!r}"
        err = float((grads[name].double() - g_ref.double()).norm()) / max(
            float(g_ref.double().norm()), 1e-5 * total, 1e-30)
        worst["grad"] = max(worst["grad"], err)
        assert err < GRAD_RTOL, f"{label}: gradient mismatch for {name}: rel err {err:.2e}"
    for name, w_ref in ref_w.items():
        assert name in weights, f"{label}: no weight for parameter {name!r}"
        err = float((weights[name].double() - w_ref.double()).norm()) / max(float(w_ref.double().norm()), 1e-12)
        worst["weight"] = max(worst["weight"], err)
        assert err < WEIGHT_RTOL, f"{label}: weight mismatch for {name} after {len(losses)} steps: rel err {err:.2e}"
    return worst
