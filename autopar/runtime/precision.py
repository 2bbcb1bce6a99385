"""Mixed precision in the runtime: a plan's ``precision`` pin, honoured when it runs.

- ``precision="bf16"`` / ``"fp16"``: parameters (``pm.parameters()``) and the optimizer stay
  fp32 (master weights); each per-rank program's forward runs under
  ``torch.autocast(<rank device type>, dtype)``. The captured graph is ATen before
  decomposition (``aten.linear``, ``aten.conv2d``, ``aten.scaled_dot_product_attention``,
  ``aten.cross_entropy_loss``, ``aten.layer_norm`` ...), so the dispatcher casts each op
  exactly as autocast casts the eager model: matmul, conv and attention in 16 bits, norms,
  softmax and losses as autocast's fp32 lists say. Collectives between ops then carry the
  16-bit activations where ops produce them. Backward runs outside autocast (as torch
  recommends); the cast ops' backward returns fp32 gradients to the fp32 parameters.
- ``precision="fp8"``: as bf16, and the model's linear layers (not the head) run their
  GEMMs in float8 (``autopar.ops.fp8``, ``passes/fp8_linears.py``, recipe ``fp8_scaling``).
- Gradient reduction (the data-parallel all-reduce of ``GradSync`` and ZeRO's
  reduce-scatter) is fp32 unless the pin ``grad_reduce="bf16"`` asks for bf16.
- ZeRO-3 gathers weights in the compute dtype: the fp32 shard is cast before the all-gather
  (the same rounding autocast applies to the whole weight); the gathered weight's gradient
  is reduced back to the fp32 shard (in fp32 unless ``grad_reduce="bf16"``).
- Pipelines: a stage's floating outputs are sent in fp32 (the pipeline's buffers are
  declared by the fp32 capture); the upcast is exact, but the next stage's first
  elementwise op then computes in fp32 where one device would compute it in 16 bits.
- ``precision="fp16"`` adds dynamic loss scaling (:class:`LossScaler`, ``torch.amp.GradScaler``
  semantics): ``train_step`` back-propagates ``loss * scale`` (a pipeline: each micro-batch's
  loss, in the last stage's ``loss_fn``) and returns the unscaled loss; ``pm.step(opt)``
  unscales the gradients, skips the step and shrinks the scale when any rank's gradients
  (of any stage) hold inf/nan, and grows it after ``growth_interval`` good steps.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from autopar.options import Options

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The autocast dtype of each precision; fp8's is bf16, around its fp8 linears (``ops.fp8``)."""


def compute_dtype(options: Options) -> torch.dtype | None:
    """The autocast dtype a plan's options ask for; None for fp32."""
    return DTYPES.get(options.precision or "fp32")


def grad_reduce_dtype(options: Options) -> torch.dtype | None:
    """The dtype gradients are summed in; None for fp32 (the default)."""
    return DTYPES.get(options.grad_reduce or "fp32")


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device``'s type in ``dtype`` (nothing when ``dtype`` is None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def cast_once_per_step(device: torch.device, dtype: torch.dtype | None):
    """Around a pipeline step: autocast's cache of 16-bit weight casts lives until the step
    ends, so each weight is cast once per step, as on one device, and every micro-batch in
    flight saves that one copy for backward instead of a copy of its own. An outer
    ``torch.autocast(enabled=False)``: it only holds the nesting level up (the cache is
    cleared when the outermost region exits); backward between the stages' forwards still
    runs outside autocast."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=False)


class AutocastStage(nn.Module):
    """A pipeline stage program run under autocast; its 16-bit floating outputs go out as
    fp32, the dtype the pipeline's buffers were declared with."""

    def __init__(self, gm: nn.Module, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.gm, self._device, self._dtype = gm, device, dtype

    @property
    def code(self) -> str:
        return self.gm.code

    def forward(self, *args):
        with autocast(self._device, self._dtype):
            out = self.gm(*args)
        up = (lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16)
              else t)
        return type(out)(up(t) for t in out) if isinstance(out, (tuple, list)) else up(out)


class LossScaler:
    """Dynamic loss scaling across every rank of a mesh (``torch.amp.GradScaler``'s defaults).

    ``scale`` multiplies the loss before backward; :meth:`step` divides the gradients by it,
    steps the optimizer unless some rank's gradients are not finite (then it skips the step
    and multiplies the scale by ``backoff_factor``), and multiplies the scale by
    ``growth_factor`` after ``growth_interval`` consecutive good steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped = 0

    def state_dict(self) -> dict:
        """What resuming needs (``GradScaler.state_dict``'s fields); the same on every rank.
        ``autopar.save_checkpoint`` saves it, ``load_checkpoint`` restores it."""
        return {"scale": self.scale, "growth_tracker": self._good, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self._good = float(sd["scale"]), int(sd["growth_tracker"])
        self.growth_factor = float(sd.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(sd.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(sd.get("growth_interval", self.growth_interval))

    def step(self, optimizer, params, comm) -> bool:
        """Unscale ``params``' gradients, then step ``optimizer`` or skip; True if it stepped.
        Collective over the whole world: the found-inf flag is summed along every axis of
        ``comm``'s mesh (a pipeline's too), so every rank skips or steps together, and the
        scales stay equal on every rank."""
        grads = [p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        found = torch.zeros((), dtype=torch.float32, device=comm.device)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv)
                found = torch.maximum(found, (~torch.isfinite(g)).any().float().to(found.device))
            found = found_anywhere(found, comm)
        if found.item() > 0:
            self.scale *= self.backoff_factor
            self._good = 0
            self.skipped += 1
            return False
        optimizer.step()
        self._good += 1
        if self._good == self.growth_interval:
            self.scale *= self.growth_factor
            self._good = 0
        return True


def found_anywhere(flag: torch.Tensor, comm) -> torch.Tensor:
    """``flag`` summed over every rank of ``comm``'s mesh: one all-reduce per mesh axis, each
    over the partial sums of the axes before it, reaches every rank of the world."""
    for axis in range(len(comm.mesh_shape)):
        flag = comm.all_reduce(flag, axis)
    return flag
