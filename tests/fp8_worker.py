"""Run by tests/test_fp8.py under torchrun (2 gloo ranks): the small GPT trained 3 AdamW
steps under ``precision="fp8"`` and a plan, against the same fp8 recipe on one device.

Every case runs ``parallelize(check=True)``: its first step is checked against one device
too (``autopar.first_step``, with the fp8 recipe), and would raise on a mismatch.

The reference (:func:`reference`): the model with each of its fp8 linears
(``autopar.analysis.fp8_layers``) calling ``autopar.ops.fp8.fp8_linear`` with no shards
(``use_fp8_linears``), under
``torch.autocast(bfloat16)``, stepping through the batch in ``slices`` equal row blocks per
step (gradients accumulated, each block's loss weighted 1/slices): the rows each rank's
program sees at once (a data-parallel rank's share, a pipeline's micro-batch), whose scales
the recipe computes per block (``autopar.ops.fp8``'s module docstring). Also the plain
bf16 autocast run on the whole batch, to show the run is really fp8 (it must be farther
from that than from the fp8 reference).

Measured per case (rank 0 writes one JSON result, ``tests/worker_loop.py``): the loss of
every step, relative; the gradients of the first step, ||g - g_ref|| / ||g_ref|| over every
parameter together; the weights after the steps as ||W - W_ref|| / ||W_ref - W_0|| (relative
to the update: they barely move in 3 steps). And the elements this rank sent through
all-gathers in the last step, by dtype (``GatherSpy``): ZeRO-3's fp8 weight gathers move
uint8 (``passes/fp8_gathers.py``).
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.analysis.fp8_layers import planned_fp8_linears, row_blocks  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.ops.comm import DistComm  # noqa: E402
from autopar.ops.fp8 import use_fp8_linears  # noqa: E402
from worker_loop import run_cases  # noqa: E402

STEPS, LR = 3, 1e-2


def gpt():
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()
    return ex.model, ex.inputs, ex.target, ex.loss_fn


def reference(model, inputs, target, loss_fn, weights, scaling, slices: int):
    """STEPS AdamW steps on one device under autocast bf16, the fp8 recipe (``scaling``;
    None: plain bf16) on ``slices`` row blocks of the batch a step: (losses, the first
    step's gradients, the weights after)."""
    m = copy.deepcopy(model)
    if scaling is not None:
        use_fp8_linears(m, weights, scaling)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    blocks = list(zip(*(t.chunk(slices, dim=0) for t in (*inputs, target))))
    losses, grads = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for blk in blocks:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(m(*blk[:-1]), blk[-1]) / slices
            loss.backward()
            total += loss.item()
        losses.append(total)
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in m.named_parameters()}
        opt.step()
    return losses, grads, {k: v.detach().clone() for k, v in m.named_parameters()}


def rel_norm(a: dict, ref: dict, base: dict | None = None) -> float:
    """||a - ref|| / ||ref - base|| over every entry together (base None: ||ref||)."""
    num = sum(((a[k].float() - ref[k]) ** 2).sum() for k in ref)
    den = sum(((ref[k] - (0 if base is None else base[k])) ** 2).sum() for k in ref)
    return float((num / den).sqrt())


def loss_dist(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


class GatherSpy:
    """Elements this rank sends through all-gathers, by dtype, while active: what ZeRO-3's
    weight gathers move (fp8 ones as uint8 bytes, ``ops.collectives.fp8_bytes``)."""

    def __init__(self):
        self.sent: dict[str, int] = {}

    def __enter__(self):
        self.real = DistComm.all_gather, DistComm.all_gather_start
        spy = self

        def count(real):
            def f(comm, t, axis, dim):
                spy.sent[str(t.dtype)] = spy.sent.get(str(t.dtype), 0) + t.numel()
                return real(comm, t, axis, dim)
            return f
        DistComm.all_gather, DistComm.all_gather_start = map(count, self.real)
        return self

    def __exit__(self, *exc):
        DistComm.all_gather, DistComm.all_gather_start = self.real


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = gpt()
    scaling = case.get("scaling", "tensorwise")
    # fp8_layers: "all", a list, or None (chosen by price: the plan's choice is the reference's)
    pins = dict(case["pins"], precision="fp8", fp8_scaling=scaling, fp8_layers=case.get("fp8_layers"))
    # check=True: the first step is also checked against one device (autopar.first_step)
    pm = autopar.parallelize(model, inputs, loss_fn, target=target, check=True, **pins)
    weights = set(planned_fp8_linears(capture(model, inputs, loss_fn, target=target),
                                      pm.plan.options).values())
    calls = pm.code("train").count("fp8_linear(")     # this rank's programs' fp8 GEMM calls
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        with GatherSpy() as spy:
            losses.append(pm.train_step(*inputs, target=target).item())
        if grads is None:
            grads = pm.full_grads()
        pm.step(opt)
    w = pm.full_state_dict()
    w = {k: w[k] for k in w0}
    ref_losses, ref_grads, ref_w = reference(model, inputs, target, loss_fn, weights, scaling,
                                             case["slices"])
    bf_losses, bf_grads, bf_w = reference(model, inputs, target, loss_fn, weights, None, 1)
    return {"rank": dist.get_rank(), "mesh": list(pm.plan.mesh_shape), "plan_pins": pm.plan.pins,
            "microbatches": pm.plan.n_microbatches, "fp8_weights": sorted(weights),
            "fp8_layers": pm.plan.options.fp8_layers,
            "row_blocks": row_blocks(pm.plan),
            "fp8_calls": calls, "losses": losses, "gathered_last_step": spy.sent,
            "fp8_weight_numel": sum(dict(model.named_parameters())[k].numel() for k in weights),
            "fp8_gathers": pm.plan.options.fp8_gathers, "ref_losses": ref_losses,
            "loss_err": loss_dist(losses, ref_losses),
            "grad_err": rel_norm({k: grads[k] for k in ref_grads}, ref_grads),
            "weight_err": rel_norm(w, ref_w, w0),
            "bf16_loss_dist": loss_dist(losses, bf_losses),
            "bf16_grad_dist": rel_norm({k: grads[k] for k in bf_grads}, bf_grads),
            "bf16_weight_dist": rel_norm(w, bf_w, w0),
            "ref_vs_bf16_grad": rel_norm(ref_grads, bf_grads)}


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
