"""Run by tests/test_checkpoint.py under torchrun: sharded checkpoints across plans.

Case kinds (``case["kind"]``):

- ``save``: the example model (seed 0) under plan A, 2 AdamW steps, ``save_checkpoint`` to
  ``case["dir"]`` with an ``extra`` dict; rank 0 then exports it (``export_checkpoint``) and
  checks that a fresh model's ``load_state_dict`` (strict) of the file equals
  ``pm.full_state_dict()``.
- ``load``: the example model with other weights (seed 1) under plan B (another world
  size), an AdamW with another learning rate, ``load_checkpoint``, 2 more steps; every
  parameter and buffer must equal 4 uninterrupted single-device AdamW steps.
  Under ``precision="bf16"`` (fp32 master weights and moments, 16-bit compute) the loaded
  weights and moments are checked as above; the error after the 2 bf16 steps is reported only.
- ``import``: rank 0 writes a seed-5 model's plain state dict as a checkpoint
  (``import_state_dict``); every rank loads it under the case's plan; the full state dict
  must equal it.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.checkpoint import export_checkpoint, import_state_dict  # noqa: E402
from capture_reuse import same_model  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import on_rank0, run_cases  # noqa: E402

LR, EPS = 1e-2, 1e-6
# worst |got - ref| / (max |ref - initial| of that tensor), over every tensor: AdamW divides
# by sqrt(v), so gradients that are zero in exact arithmetic (a key bias) and ~1e-9 in floats
# move by up to lr / (1e-9 + eps); eps 1e-6 keeps that near 1e-3 of an lr-sized change
TOL = 5e-3
STATE_TOL = 1e-4  # optimizer moments after loading vs one device's after 2 steps


def adamw(named, lr=LR, weight_decay=(0.1, 0.0)):
    """AdamW with two param groups, as GPTs are trained: matrices decay, vectors do not."""
    named = list(named)
    return torch.optim.AdamW([
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay[0]},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": weight_decay[1]},
    ], lr=lr, eps=EPS)


def example(case: dict, seed: int):
    return EXAMPLES[case["model"]](batch=8, seed=seed)


def seeded_rng_state() -> torch.Tensor:
    """The CPU generator's state after seed 123 (what the save cases put in ``extra``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        torch.rand(3)
        return torch.get_rng_state()


def batch(ex, step: int):
    """The batch of step ``step`` (the same on every rank): the example's inputs, rolled."""
    return tuple(torch.roll(x, step, 0) for x in ex.inputs), torch.roll(ex.target, step, 0)


def train(pm, opt, ex, steps) -> None:
    for k in steps:
        inputs, target = batch(ex, k)
        pm.train_step(*inputs, target=target)
        opt.step()
        opt.zero_grad()


def reference(case: dict, steps: int = 4, moments: bool = False):
    """(initial, final) state dicts of ``steps`` single-device AdamW steps from seed 0 (and
    the optimizer's state by parameter name, with ``moments``)."""
    ex = example(case, 0)
    model = ex.model
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = adamw(model.named_parameters())
    for k in range(steps):
        inputs, target = batch(ex, k)
        ex.loss_fn(model(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
    final = {k: v.detach() for k, v in model.state_dict().items()}
    if moments:
        return init, final, {n: opt.state[p] for n, p in model.named_parameters()}
    return init, final


def check_moments(pm, opt, ref_state: dict) -> float:
    """Worst relative error of this rank's optimizer state against its shard of one
    device's (and the step counts exactly)."""
    from autopar.passes.shard_parameters import shard_tensor
    attrs = {id(p): a for a, p in pm.module.named_parameters()}
    coord, mesh = pm._stage_comm.coord, pm._stage_mesh
    out = 0.0
    for group in opt.param_groups:
        for p in group["params"]:
            attr = attrs[id(p)]
            ref = ref_state[attr]
            got = opt.state[p]
            assert set(got) == set(ref), (attr, set(got), set(ref))
            assert float(got["step"]) == float(ref["step"]), (attr, got["step"], ref["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                want = shard_tensor(ref[key], pm._shards.placements[attr], coord, mesh)
                err = float((got[key] - want).abs().max()) / max(float(want.abs().max()), 1e-12)
                assert err < STATE_TOL, f"{key} of {attr}: rel err {err:.2e}"
                out = max(out, err)
    return out


def worst(got: dict, ref: dict, init: dict) -> tuple[float, str]:
    assert set(got) >= set(ref), f"missing {sorted(set(ref) - set(got))[:5]}"
    out, where = 0.0, ""
    for k, r in ref.items():
        scale = max(float((r - init[k]).abs().max()), 1e-6) if r.is_floating_point() else 1.0
        err = float((got[k].float() - r.float()).abs().max()) / scale
        if err > out:
            out, where = err, k
    return out, where


def strided_plan(ex):
    """tensor=2 with GPT's fused c_attn projection held as a strided shard S(0/3) (each rank
    its block of q, of k and of v), edited by hand as in tests/test_equivalence.py."""
    import dataclasses

    from autopar.api import plan_captured
    from autopar.capture import capture
    from autopar.cost_models.hardware import parse_cluster
    from autopar.plan import NodePlacement
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"tensor": 2})
    nodes = dict(plan.nodes)
    for ph in [ph for name, ph in plan.params.items() if "c_attn" in name]:
        nodes[ph] = NodePlacement((), ("S(0/3)",))
        for lin in [u for u in cap.node(ph).users if "linear" in str(u.target)]:
            nodes[lin.name] = NodePlacement(("R", "S(0/3)", "S(0/3)"), ("S(2/3)",))
            for split in lin.users:
                nodes[split.name] = NodePlacement(("S(2/3)",), ("S(2)",) * 3)
    return dataclasses.replace(plan, nodes=nodes)


def run_case(case: dict) -> dict:
    with same_model(case["model"]):      # one capture of the model per spawn (capture_reuse)
        return _run_case(case)


def _run_case(case: dict) -> dict:
    ex = example(case, 0)          # the data of every step; the weights of seed 0 ...
    model = ex.model if case["kind"] == "save" else example(case, 1).model    # ... or others
    if case.get("strided"):
        pm = autopar.parallelize(model, ex.inputs, ex.loss_fn, target=ex.target,
                                 plan=on_rank0(lambda: strided_plan(ex)))
        strided = [a for a, p in pm._shards.placements.items() if any(getattr(x, "groups", 1) > 1 for x in p)]
        assert strided, "the hand-made plan holds no strided shard"
    else:
        pm = autopar.parallelize(model, ex.inputs, ex.loss_fn, target=ex.target, **case["pins"])
    info = {"mesh": list(pm.plan.mesh_shape), "axes": list(pm.plan.mesh_axes)}
    rank = dist.get_rank()
    if case["kind"] == "import":
        src = EXAMPLES[case["model"]](batch=8, seed=5).model.state_dict()
        if rank == 0:
            import_state_dict(src, case["dir"])
        dist.barrier()
        extra = autopar.load_checkpoint(case["dir"], pm)
        assert extra is None, extra
        err, where = worst(pm.full_state_dict(), src, {k: torch.zeros_like(v) for k, v in src.items()})
        assert err < TOL, f"imported {where}: {err:.2e}"
        info["err"] = err
        return info
    if case["kind"] == "save":
        opt = adamw(pm.module.named_parameters())
        train(pm, opt, ex, range(2))
        extra = {"step": 2, "loader": {"position": 16}, "rng": seeded_rng_state()}
        autopar.save_checkpoint(case["dir"], pm, opt, extra=extra)
        full = pm.full_state_dict()
        dist.barrier()
        if rank == 0:
            out = os.path.join(case["dir"] + ".pt")
            export_checkpoint(case["dir"], out)
            fresh = example(case, 3).model
            fresh.load_state_dict(torch.load(out, weights_only=True))   # strict
            err, where = worst(fresh.state_dict(), full, {k: torch.zeros_like(v) for k, v in full.items()})
            assert err == 0.0, f"export: {where} differs by {err:.2e}"
        dist.barrier()
        init, ref2 = reference(case, 2)
        info["err_after_2"], info["worst_after_2"] = worst(full, ref2, init)
        assert info["err_after_2"] < TOL, f"before saving: {info['worst_after_2']} {info['err_after_2']:.2e}"
        return info
    # load under plan B, 2 more steps
    # the checkpoint's hyperparameters must win, group by group
    opt = adamw(pm.module.named_parameters(), lr=LR * 7, weight_decay=(0.5, 0.5))
    extra = autopar.load_checkpoint(case["dir"], pm, opt)
    # what was saved comes back exactly (the export of plan A's weights) ...
    saved = torch.load(case["dir"] + ".pt", weights_only=True)
    loaded = pm.full_state_dict()
    bad = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not bad, f"loaded weights differ from the saved ones: {bad[:5]}"
    # ... and the moments are one device's after 2 steps
    _, _, ref_state = reference(case, 2, moments=True)
    info["moment_err"] = check_moments(pm, opt, ref_state)
    assert extra["step"] == 2 and extra["loader"] == {"position": 16}, extra
    assert torch.equal(extra["rng"], seeded_rng_state()), "the RNG state in extra differs"
    got = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert got == [(LR, 0.1), (LR, 0.0)], got
    train(pm, opt, ex, range(2, 4))
    init, ref = reference(case, 4)
    err, where = worst(pm.full_state_dict(), ref, init)
    info["err"], info["worst_param"] = err, where
    if case["pins"].get("precision") == "bf16":
        return info     # 16-bit compute: the last 2 steps are not one fp32 device's; reported only
    assert err < TOL, f"after load + 2 steps: {where} off by {err:.2e} of its change"
    return info


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
