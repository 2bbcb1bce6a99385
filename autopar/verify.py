"""Check a plan on real ranks: train the model on one device and under the plan, side by
side, and compare the loss and every gradient at every step, and the weights after a few
SGD steps.

The comparison is the equivalence tests' (tests/equivalence.py), returning the errors
instead of raising:

- a loss is compared relative to its size;
- a gradient, at every step, is measured against its own norm with a floor of 1e-5 × that
  step's whole gradient norm (gradients that are zero in exact arithmetic hold only
  rounding noise);
- a weight after the steps is measured against how far it moved from its initial value,
  not against its size (a weight of norm 6 that moved by 1e-3 must agree to 1e-3 × the
  tolerance, or a skipped update passes unseen): it passes when
  ``|w - w_ref| <= WEIGHT_RTOL * |w_ref - w_init| + WEIGHT_ATOL * sqrt(numel)`` (norms
  over the tensor; the floor is a few float32 rounding steps of weights of size about 1).

Weights are compared after SGD with momentum, which is linear in the gradients.
:func:`launch` runs ``autopar.verify_worker`` under torchrun and collects what every rank
wrote.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

LR, MOMENTUM, STEPS = 0.05, 0.9, 3
ADAMW_LR = 1e-3
LOSS_RTOL, GRAD_RTOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-4
# the absolute floor, root mean square per element: four float32 rounding steps of a weight
# of size 1 (a LayerNorm weight that moved by 3e-5 may differ by one rounding step)
WEIGHT_ATOL = 4 * torch.finfo(torch.float32).eps


class Run(NamedTuple):
    """What a training run is compared by."""
    losses: list[float]                        # by step
    grads: list[dict[str, torch.Tensor]]       # by step: whole gradients by parameter name
    weights: dict[str, torch.Tensor]           # after the steps, by name
    initial: dict[str, torch.Tensor] | None = None   # before them (the reference run's)


def _optimizer(params, optimizer: str):
    """The optimizer the runs compare under: ``"sgd"`` (SGD with momentum) or ``"adamw"``."""
    if optimizer == "adamw":      # SGD's rate would move AdamW's weights by 0.05 each a step
        return torch.optim.AdamW(params, lr=ADAMW_LR)
    if optimizer != "sgd":
        raise ValueError(f"optimizer={optimizer!r}: use 'sgd' or 'adamw'")
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def reference_run(model, inputs, target, loss_fn, steps: int = STEPS,
                  micro_batches: int = 1, optimizer: str = "sgd") -> Run:
    """``steps`` SGD-with-momentum steps on one device (a copy of ``model``). With
    ``micro_batches`` > 1 the batch is split into that many equal parts whose mean-loss
    gradients are accumulated: the single-device model of a pipeline's micro-batches when
    per-batch statistics (BatchNorm) make the whole batch a different model."""
    model = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _optimizer(model.parameters(), optimizer)
    xs = [x.tensor_split(micro_batches) for x in inputs]
    ys = target.tensor_split(micro_batches) if micro_batches > 1 else [target]
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for k in range(micro_batches):
            out = model(*(x[k] for x in xs))
            loss = loss_fn(out, ys[k]) if loss_fn is not None else out
            loss = loss / micro_batches if micro_batches > 1 else loss
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return Run(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, initial)


def parallel_run(pm, inputs, target, steps: int = STEPS, optimizer: str = "sgd") -> Run:
    """The same on a ParallelModule (called on every rank). A pipeline rank whose stages hold
    no parameter (a stage of the loss alone) steps no optimizer."""
    params = list(pm.parameters())
    opt = _optimizer(params, optimizer) if params else None
    losses, grads = [], []
    for _ in range(steps):
        if opt is not None:
            opt.zero_grad()
        loss = pm.train_step(*inputs, target=target)
        losses.append(loss.item())
        grads.append(pm.full_grads())
        if opt is not None:
            opt.step()
    return Run(losses, grads, pm.full_state_dict())


def backward_run(pm, inputs, target, loss_fn, steps: int = STEPS, optimizer: str = "sgd",
                 micro_batches: int = 1, in_graph: bool = False, rank_slice=None) -> Run:
    """The same through the loop people already have: ``loss_fn(pm(x), y).backward()``,
    ``opt.step()`` (``in_graph``: ``pm(x, target=y).backward()``, the loss the plan
    computes). With ``micro_batches`` = k > 1 the plan is one micro-batch's (``pm`` was
    planned for ``1/k`` of ``inputs``): each step accumulates k backward passes, all but
    the last under ``pm.no_sync()``, each loss divided by k (:func:`reference_run`'s model
    of accumulation, on one device over the whole batch). ``rank_slice(t)``: what this rank
    passes of a batch tensor (``batch="per_rank"``)."""
    if rank_slice is not None:
        inputs, target = tuple(rank_slice(x) for x in inputs), rank_slice(target)
    params = list(pm.parameters())
    opt = _optimizer(params, optimizer)
    xs = [x.tensor_split(micro_batches) for x in inputs]
    ys = target.tensor_split(micro_batches) if target is not None else [None] * micro_batches
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for k in range(micro_batches):
            with pm.no_sync() if k < micro_batches - 1 else contextlib.nullcontext():
                if in_graph:
                    loss = pm(*(x[k] for x in xs), target=ys[k])
                else:
                    out = pm(*(x[k] for x in xs))
                    loss = loss_fn(out, ys[k]) if loss_fn is not None else out
                loss = loss / micro_batches if micro_batches > 1 else loss
                loss.backward()
            total += loss.item()
        if rank_slice is not None and not in_graph:     # each rank's loss is its slice's
            total = _mean_over_ranks(total)
        losses.append(total)
        grads.append(pm.full_grads())
        opt.step()
    return Run(losses, grads, pm.full_state_dict())


def _mean_over_ranks(x: float) -> float:
    """The mean of ``x`` over every rank of the default group (the global batch's mean loss
    from the ranks' means over equal slices)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


@dataclass
class Check:
    loss_err: float = 0.0          # worst relative loss error over the steps
    grad_err: float = 0.0          # worst gradient error over the steps (module docstring)
    grad_worst: str = ""           # the parameter it belongs to
    grad_step: int = 0             # and the step
    weight_err: float = 0.0        # worst weight error after the steps, relative to the change
    weight_worst: str = ""
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return (not self.problems and self.loss_err < LOSS_RTOL and self.grad_err < GRAD_RTOL
                and self.weight_err < WEIGHT_RTOL)


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def compare(ref: Run, got: Run) -> Check:
    """The worst errors of run ``got`` against the single-device run ``ref``."""
    c, problems = Check(), []
    if len(got.losses) != len(ref.losses) or len(got.grads) != len(ref.grads):
        problems.append(f"{len(got.losses)} steps against {len(ref.losses)} on one device")
    for a, b in zip(got.losses, ref.losses):
        c.loss_err = max(c.loss_err, abs(a - b) / max(abs(b), 1e-12))
    if any(not math.isfinite(x) for x in got.losses):
        problems.append(f"non-finite loss {got.losses}")
    for step, (ref_grads, grads) in enumerate(zip(ref.grads, got.grads)):
        total = math.sqrt(sum(_norm(g) ** 2 for g in ref_grads.values()))
        for name, g_ref in ref_grads.items():
            if name not in grads:
                problems.append(f"no gradient for {name} at step {step}")
                continue
            err = _norm(grads[name].double() - g_ref.double()) / max(_norm(g_ref), 1e-5 * total, 1e-30)
            if err > c.grad_err or not math.isfinite(err):
                c.grad_err, c.grad_worst, c.grad_step = err, name, step
    for name, w_ref in ref.weights.items():
        if name not in got.weights:
            problems.append(f"no weight for {name}")
            continue
        moved = _norm(w_ref - ref.initial[name]) if ref.initial is not None else _norm(w_ref)
        floor = WEIGHT_ATOL / WEIGHT_RTOL * math.sqrt(w_ref.numel())
        err = _norm(got.weights[name].double() - w_ref.double()) / max(moved + floor, 1e-30)
        if err > c.weight_err or not math.isfinite(err):
            c.weight_err, c.weight_worst = err, name
    c.problems = tuple(problems)
    return c


# ---- launching ---------------------------------------------------------------------------
@dataclass
class RankResult:
    rank: int
    check: Check | None
    error: str = ""
    mesh_shape: tuple = ()
    mesh_axes: tuple = ()
    coord: tuple = ()
    loss: float = float("nan")
    timing: dict | None = None      # rank 0 with timing=: a runtime.timing.TimingReport as a dict

    @property
    def ok(self) -> bool:
        return self.check is not None and self.check.ok and not self.error


@dataclass
class Launch:
    results: list[RankResult]
    nproc: int
    returncode: int
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return (self.returncode == 0 and len(self.results) == self.nproc
                and all(r.ok for r in self.results))


def launch(factory: str, factory_args: dict, nproc: int, *, plan: str | None = None,
           pins: dict | None = None, setup: str | None = None, timeout_s: float = 600.0,
           timing: int = 0) -> Launch:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc autopar.verify_worker``.
    ``setup``: ``MODULE:FUNCTION`` called with each rank's ParallelModule before training
    (instrumentation: a gradient hook, a planted fault that must make the check fail).
    ``timing``: that many steps more, predicted against measured (rank 0's ``timing``)."""
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        spec = {"factory": factory, "factory_args": factory_args, "plan": plan,
                "pins": pins or {}, "setup": setup, "out": tmp, "timing": timing}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "autopar.verify_worker", str(Path(tmp) / "spec.json")]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = 124, f"torchrun timed out after {timeout_s:.0f} s\n{e.stderr or ''}"
        results = []
        for r in range(nproc):
            f = Path(tmp) / f"rank{r}.json"
            if not f.exists():
                continue
            d = json.loads(f.read_text())
            check = Check(**{k: (tuple(v) if k == "problems" else v)
                             for k, v in d["check"].items()}) if d.get("check") else None
            results.append(RankResult(r, check, d.get("error", ""), tuple(d.get("mesh_shape", ())),
                                      tuple(d.get("mesh_axes", ())), tuple(d.get("coord", ())),
                                      d.get("loss", float("nan")), d.get("timing")))
    tail = "\n".join(line for line in (err or "").splitlines()
                     if "OMP_NUM_THREADS" not in line and not line.startswith("*****"))[-3000:]
    return Launch(results, nproc, rc, tail)
