"""Check a plan on real ranks: train the model on one device and under the plan, side by
side, and compare the loss, every gradient and the weights after a few SGD steps.

The comparison is the equivalence tests' (tests/equivalence.py), returning the errors
instead of raising: a gradient's error is measured against its own norm with a floor of
1e-5 × the whole gradient's norm (gradients that are zero in exact arithmetic hold only
rounding noise); weights are compared after SGD with momentum, which is linear in the
gradients. :func:`launch` runs ``autopar.verify_worker`` under torchrun and collects what
every rank wrote.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

LR, MOMENTUM, STEPS = 0.05, 0.9, 3
LOSS_RTOL, GRAD_RTOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-4


def reference_run(model, inputs, target, loss_fn, steps: int = STEPS):
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
    return losses, grads0, {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel_run(pm, inputs, target, steps: int = STEPS):
    """The same on a ParallelModule (called on every rank). A pipeline rank whose stages hold
    no parameter (a stage of the loss alone) steps no optimizer."""
    params = list(pm.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM) if params else None
    losses, grads0 = [], None
    for i in range(steps):
        if opt is not None:
            opt.zero_grad()
        loss = pm.train_step(*inputs, target=target)
        losses.append(loss.item())
        if i == 0:
            grads0 = pm.full_grads()
        if opt is not None:
            opt.step()
    return losses, grads0, pm.full_state_dict()


@dataclass
class Check:
    loss_err: float = 0.0          # worst relative loss error over the steps
    grad_err: float = 0.0          # worst gradient error (see module docstring)
    grad_worst: str = ""           # the parameter it belongs to
    weight_err: float = 0.0        # worst relative weight error after the steps
    weight_worst: str = ""
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return (not self.problems and self.loss_err < LOSS_RTOL and self.grad_err < GRAD_RTOL
                and self.weight_err < WEIGHT_RTOL)


def compare(ref, got) -> Check:
    ref_losses, ref_grads, ref_w = ref
    losses, grads, weights = got
    c, problems = Check(), []
    for a, b in zip(losses, ref_losses):
        c.loss_err = max(c.loss_err, abs(a - b) / max(abs(b), 1e-12))
    if any(not math.isfinite(x) for x in losses):
        problems.append(f"non-finite loss {losses}")
    total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in ref_grads.values()))
    for name, g_ref in ref_grads.items():
        if name not in grads:
            problems.append(f"no gradient for {name}")
            continue
        err = float((grads[name].double() - g_ref.double()).norm()) / max(
            float(g_ref.double().norm()), 1e-5 * total, 1e-30)
        if err > c.grad_err or not math.isfinite(err):
            c.grad_err, c.grad_worst = err, name
    for name, w_ref in ref_w.items():
        if name not in weights:
            problems.append(f"no weight for {name}")
            continue
        err = float((weights[name].double() - w_ref.double()).norm()) / max(
            float(w_ref.double().norm()), 1e-12)
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
           pins: dict | None = None, timeout_s: float = 600.0) -> Launch:
    """Run ``python -m torch.distributed.run --nproc-per-node nproc autopar.verify_worker``."""
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        spec = {"factory": factory, "factory_args": factory_args, "plan": plan,
                "pins": pins or {}, "out": tmp}
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
                                      d.get("loss", float("nan"))))
    tail = "\n".join(line for line in (err or "").splitlines()
                     if "OMP_NUM_THREADS" not in line and not line.startswith("*****"))[-3000:]
    return Launch(results, nproc, rc, tail)
