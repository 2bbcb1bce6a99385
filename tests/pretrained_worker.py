"""Run by tests/test_pretrained.py under torchrun: pretrained weights into a model built on
the meta device, each rank reading only its shards.

Every case (``case["source"]`` names where its weights are, written by the test: the
example model of seed 0) builds the model without weights (``torch.device("meta")``, or
``autopar.meta_parameters()`` with ``case["build"] == "meta_parameters"``: parameters on
meta, buffers computed by the init) and parallelizes it with ``weights=``, then checks:

- the plan shards: this rank's parameter bytes are below the model's;
- each local shard equals, bitwise, that of the same plan built from the materialised
  seed-0 model;
- 2 AdamW steps equal 2 single-device steps of the seed-0 model, parameter by parameter
  (relative to how much each parameter moved);
- with ``case["save"]``: the module, as loaded, is saved with ``autopar.save_checkpoint``
  to that directory (a later case reads it back as its weights under another plan).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.runtime import build  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import run_cases  # noqa: E402

LR, EPS, TOL = 1e-2, 1e-6, 5e-3      # as tests/checkpoint_worker.py


def example(case: dict, how: str | None = None):
    ctx = {"meta": torch.device("meta"), "meta_parameters": autopar.meta_parameters()}.get(
        how, contextlib.nullcontext())
    with ctx:
        return EXAMPLES[case["model"]](batch=8, seed=0)


def batch(ex, step: int):
    return tuple(torch.roll(x, step, 0) for x in ex.inputs), torch.roll(ex.target, step, 0)


def reference(steps: int, ex) -> tuple[dict, dict]:
    """(initial, final) state of ``steps`` single-device AdamW steps of ``ex.model``."""
    model = ex.model
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for k in range(steps):
        inputs, target = batch(ex, k)
        ex.loss_fn(model(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach() for k, v in model.state_dict().items()}


def local_tensors(pm) -> dict[str, torch.Tensor]:
    return dict(pm.module.named_parameters()) | dict(pm.module.named_buffers())


def run_case(case: dict) -> dict:
    real = example(case)
    meta = example(case, case["build"])
    assert any(p.is_meta for p in meta.model.parameters())
    pm = autopar.parallelize(meta.model, real.inputs, real.loss_fn, target=real.target,
                             weights=case["source"], **case["pins"])
    local = sum(p.numel() * p.element_size() for p in pm.module.parameters())
    full = sum(p.numel() * p.element_size() for p in real.model.parameters())
    assert local < full, f"the plan does not shard: {local} local bytes of {full}"
    if case.get("save"):
        autopar.save_checkpoint(case["save"], pm)

    # the same plan on the same graph (the meta capture is the CPU model's: same fingerprint)
    # built from the materialised model
    same = build(pm._cap, pm.plan, real.model)
    got, want = local_tensors(pm), local_tensors(same)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, t in want.items():
        assert got[name].shape == t.shape and torch.equal(got[name], t), \
            f"{name}: the shard read from the weights differs from the materialised model's"
    del same

    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    for k in range(2):
        inputs, target = batch(real, k)
        pm.train_step(*inputs, target=target)
        pm.step(opt)
        opt.zero_grad()
    trained = pm.full_state_dict()
    init, final = reference(2, example(case))
    err, where = 0.0, ""
    for name, ref in final.items():
        scale = max(float((ref - init[name]).abs().max()), 1e-6) if ref.is_floating_point() else 1.0
        e = float((trained[name].float() - ref.float()).abs().max()) / scale
        if e > err:
            err, where = e, name
    assert err < TOL, f"after 2 steps {where} is off by {err:.2e} of its change"
    return {"local_bytes": local, "full_bytes": full, "err": err, "worst": where}


if __name__ == "__main__":
    run_cases(run_case)
