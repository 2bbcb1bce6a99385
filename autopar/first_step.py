"""``parallelize(..., check=True)``: the first training step, checked against one device.

``autopar verify`` checks a model factory's plan in a job of its own; users run
``parallelize`` inside their own scripts. With ``check=True`` (or the environment variable
``AUTOPAR_CHECK=1``) the module's first ``train_step`` is also computed on one device, on a
copy of the model taken before ``parallelize`` touched it (same weights, same global batch),
and the loss and every gradient are compared with ``autopar.verify.compare``: a difference
raises :class:`FirstStepMismatch` on every rank, naming the worst parameter, its error and
the plan. Later steps run unchecked, at full speed.

Costs: one more copy of the model on each rank's device, one single-device forward and
backward, and ``full_grads()`` (every gradient gathered whole) on the first step only; so
only for a model that fits one device. The step must be deterministic: dropout draws other
numbers on the ranks than on one device (set its probability to 0 for the checked step).
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.analysis.fp8_layers import planned_fp8_experts, planned_fp8_linears, row_blocks
from autopar.errors import ArgumentError
from autopar.ops.fp8 import use_fp8_linears
from autopar.ops.fp8_experts import use_fp8_experts
from autopar.verify import GRAD_RTOL, LOSS_RTOL, Run, compare

ENV = "AUTOPAR_CHECK"
# 16-bit compute: both sides round to 8 (bf16) or 11 (fp16) mantissa bits, in other orders
LOW_PRECISION_RTOL = {"loss": 2e-2, "grad": 1e-1}
# fp8 against the same recipe on one device: equal arithmetic except where the plan sums
# bf16 partials (tensor parallel), whose u = 2^-8 differences move fp8 roundings by their
# spacing (2^-2 in e5m2, the gradients' format): one spacing per parameter (tests/test_fp8.py)
FP8_RTOL = {"loss": 2e-2, "grad": 2.0 ** -2}


class FirstStepMismatch(RuntimeError):
    """The first step of a parallelized module differs from the same step on one device."""


def wanted(check: bool | None) -> bool:
    """``check`` as passed, else the environment variable ``AUTOPAR_CHECK`` (``1``/``true``)."""
    if check is not None:
        if not isinstance(check, bool):
            raise ArgumentError(f"check= takes True or False, not {check!r}")
        return check
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def reference_copy(model: nn.Module) -> nn.Module:
    """The single-device model the first step is checked against, copied before the plan
    shards ``model``."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ArgumentError("check=True computes the first step on one device too, so the model "
                            "must hold its weights: a model on the meta device (weights=) cannot "
                            "be checked; run `autopar verify` on a smaller configuration instead")
    return copy.deepcopy(model)


class FirstStepCheck:
    """The check of ``pm``'s first ``train_step`` against ``reference`` on one device:
    ``ParallelModule.train_step`` calls it once, after that step (``autopar.runtime.build``
    arms it as ``pm.first_step_check``)."""

    def __init__(self, pm, reference: nn.Module, loss_fn, precision: str | None):
        self.pm, self.loss_fn, self.precision = pm, loss_fn, precision
        self.reference = reference.to(pm.device)
        self.blocks = 1
        if precision == "fp8":         # the same recipe, on the rows each rank scales alone
            weights = set(planned_fp8_linears(pm._cap, pm.plan.options).values())
            scaling = pm.plan.options.fp8_scaling or "tensorwise"
            use_fp8_linears(self.reference, weights, scaling)
            experts = set(planned_fp8_experts(pm._cap, pm.plan.options).values())
            use_fp8_experts(self.reference, experts, scaling)
            self.blocks = row_blocks(pm.plan)

    def __call__(self, inputs: tuple, target, loss: torch.Tensor) -> None:
        """Compare the step that took ``inputs`` and ``target`` (as given to ``train_step``)
        and returned ``loss``; FirstStepMismatch when they differ."""
        try:
            self._check(inputs, target, loss)
        finally:
            self.reference = None

    def _check(self, inputs, target, loss) -> None:
        pm = self.pm
        xs = tuple(x.to(pm.device) if isinstance(x, torch.Tensor) else x for x in inputs)
        y = target.to(pm.device) if isinstance(target, torch.Tensor) else target
        xs, y = pm.rank_data.global_batch(xs, y)       # per_rank: the slices made whole
        ref = self.reference
        ref_loss = 0.0
        for bx, by in self._blocks(xs, y):
            with self._autocast():
                out = ref(*bx)
                part = (self.loss_fn(out, by) if self.loss_fn is not None
                        else pytree.tree_leaves(out)[0]) / self.blocks  # a model that returns its loss
            part.backward()
            ref_loss = ref_loss + part.detach()
        ref_grads = {n: p.grad.detach() for n, p in ref.named_parameters() if p.grad is not None}
        grads = pm.full_grads()
        if pm.scaler is not None:                    # fp16: gradients of the scaled loss
            grads = {n: g / pm.scaler.scale for n, g in grads.items()}
        c = compare(Run([float(ref_loss)], [ref_grads], {}), Run([float(loss)], [grads], {}))
        rtol = FP8_RTOL if self.precision == "fp8" else LOW_PRECISION_RTOL
        loss_tol, grad_tol = (rtol["loss"], rtol["grad"]) if self.precision else (LOSS_RTOL, GRAD_RTOL)
        if c.problems or c.loss_err >= loss_tol or c.grad_err >= grad_tol:
            raise FirstStepMismatch(self._message(c, float(loss), float(ref_loss), grad_tol, loss_tol))

    def _blocks(self, xs: tuple, y):
        """The batch in :attr:`blocks` row blocks (one, but under fp8: ``row_blocks``)."""
        if self.blocks == 1:
            return [(xs, y)]
        cut = lambda t: (t.chunk(self.blocks, 0) if isinstance(t, torch.Tensor)  # noqa: E731
                         else [t] * self.blocks)
        return list(zip(zip(*(cut(x) for x in xs)), cut(y)))

    def _autocast(self):
        if not self.precision:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.pm.device.type, dtype=dtype)

    def _message(self, c, loss: float, ref_loss: float, grad_tol: float, loss_tol: float) -> str:
        plan = self.pm.plan.summary().splitlines()[0]
        lines = [f"check=True: the first step of the parallelized model differs from one device "
                 f"({plan})"]
        lines += [f"  {p}" for p in c.problems]
        if c.grad_err >= grad_tol:
            lines.append(f"  worst gradient: {c.grad_worst!r}, relative error {c.grad_err:.2e} "
                         f"(tolerance {grad_tol:.0e})")
        if c.loss_err >= loss_tol:
            lines.append(f"  loss {loss:.6g} against {ref_loss:.6g} on one device (relative "
                         f"error {c.loss_err:.2e}, tolerance {loss_tol:.0e})")
        dropout = [n for n, m in self.reference.named_modules()
                   if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training]
        if dropout:
            lines.append(f"  the model has active dropout ({dropout[0]}, ...): its random numbers "
                         "differ between the ranks and one device; set p=0 for the checked step")
        else:
            lines.append("  this is a bug in autopar: please report it with this message and the "
                         "plan (pm.plan.save('plan.json'))")
        return "\n".join(lines)
