"""The public API's promises: pins, plan files, memory budgets, optimizers, and errors that
name the cause and the fix."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.placement import Shard, parse_placements
from autopar.ops.comm import ThreadWorld
from autopar.runtime.thread_ranks import simulate
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import plan_captured
from equivalence import compare, parallel_run, reference_run
from examples.models import EXAMPLES


def test_unknown_pin_is_an_error(captured):
    ex, _ = captured("mlp")
    with pytest.raises(TypeError, match="unknown pin.*tensr"):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", tensr=2)


def test_batch_not_divisible_by_data_degree():
    ex = EXAMPLES["mlp"](batch=6)
    with pytest.raises(ValueError, match=r"batch dim \(dim 0, size 6\).*data-parallel axis of size 4"):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:4", data=4)


def test_mesh_shape_must_multiply_to_world(captured):
    ex, _ = captured("mlp")
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 3\) has 6 devices but the world has 4"):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:4",
                     mesh_shape=(2, 3))


def test_plan_for_another_world_size_is_refused(captured, tmp_path):
    ex, cap = captured("mlp")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2})
    comm = ThreadWorld((4,)).comm(0)
    with pytest.raises(autopar.PlanError, match="made for 2 devices.*this job has 4.*--nproc-per-node 2"):
        autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=plan, comm=comm)


def test_plan_for_another_model_is_refused(captured):
    ex, cap = captured("mlp")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2})
    other = EXAMPLES["mlp"](batch=16)
    comm = ThreadWorld((2,)).comm(0)
    with pytest.raises(autopar.PlanError, match="made for another graph"):
        autopar.parallelize(other.model, other.inputs, other.loss_fn, target=other.target,
                            plan=plan, comm=comm)


def test_model_export_cannot_capture():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            if x.sum().item() > 0:      # data-dependent Python branch
                return self.lin(x)
            return -self.lin(x)

    with pytest.raises(autopar.CaptureError, match=r"(?s)could not capture Branchy.*Fix: .*torch.where"):
        autopar.plan(Branchy(), (torch.randn(2, 4),), cluster="cpu:2")


def test_memory_budget_nothing_fits(captured):
    ex, cap = captured("gpt")
    with pytest.raises(InfeasibleError, match=r"(?s)fits the memory budget of 1.0 KiB.*smallest plan needs .*raise memory_budget to at least"):
        plan_captured(cap, parse_cluster("cpu:2"), 2, memory_budget=1024)


def test_memory_budget_makes_the_solver_shard(captured):
    """A budget below the replicated training state forces sharding; the plan's estimate and
    the measured parameter + gradient + optimizer bytes per rank fit it; numbers still match."""
    ex, cap = captured("gpt")
    free = plan_captured(cap, parse_cluster("cpu:4"), 4)
    state = lambda p: sum(p.estimate.memory_bytes.get(k, 0) for k in ("params", "grads", "optimizer"))  # noqa: E731
    n_params = sum(p.numel() for p in ex.model.parameters())
    replicated_state = n_params * 4 * 4             # fp32 params + grads + 2 AdamW moments
    assert state(free) == pytest.approx(replicated_state, rel=1e-6)  # tiny model: stays replicated
    budget = 0.9 * replicated_state    # below the replicated training state alone
    # on the 1-D mesh the budget's plan takes (ZeRO over data 4): the 2-D meshes' ILPs and
    # their recomputation probes under a budget were ~95 of this test's 100 s; a free mesh
    # search under a budget stays proven by tests/test_sweep.py's free-budget cases
    tight = plan_captured(cap, parse_cluster("cpu:4"), 4, memory_budget=budget, mesh_shape=(4,))
    assert tight.estimate.memory_total <= budget
    sharded = [n for n, ph in tight.params.items()
               if any(isinstance(p, Shard) for p in parse_placements(tight.nodes[ph].outputs[0]))]
    assert sharded, "the tight plan shards no parameter"

    def measure(pm, comm):
        got = parallel_run(pm, ex.inputs, ex.target)
        opt_bytes = 2 * sum(p.numel() * p.element_size() for p in pm.parameters())  # AdamW moments
        own = sum(p.numel() * p.element_size() for p in pm.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in pm.parameters() if p.grad is not None)
        return got, own + grads + opt_bytes

    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for rank, (got, state_bytes) in enumerate(simulate(cap, tight, ex.model, measure)):
        compare(ref, got, f"tight plan rank {rank}")
        assert state_bytes <= budget, f"rank {rank} holds {state_bytes} B of training state > {budget}"
        assert state_bytes < replicated_state


def test_plan_json_round_trip_runs_without_solving(captured, tmp_path, monkeypatch):
    ex, cap = captured("llama")
    plan = plan_captured(cap, parse_cluster("cpu:4"), 4, pins={"data": 2, "tensor": 2})
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan
    import autopar.solver.ilp as ilp
    monkeypatch.setattr(ilp, "solve", lambda *a, **k: pytest.fail("a loaded plan must not be solved again"))
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    world = ThreadWorld(loaded.mesh_shape)
    copies = [copy.deepcopy(ex.model) for _ in range(world.world)]

    def body(comm):
        pm = autopar.parallelize(copies[comm.rank], ex.inputs, ex.loss_fn, target=ex.target,
                                 plan=str(path), comm=comm)
        return parallel_run(pm, ex.inputs, ex.target)

    for rank, got in enumerate(world.run(body)):
        compare(ref, got, f"loaded plan rank {rank}")


def test_malformed_plan_file(tmp_path, captured):
    """Loading validates the file against the schema and names field, value and expectation."""
    import json
    ex, cap = captured("mlp")
    good = plan_captured(cap, parse_cluster("cpu:2"), 2).to_dict()
    node = next(iter(good["nodes"]))
    cases = [
        (lambda d: d["nodes"][node].update(outputs=["Q(3)"]), rf"nodes.{node}.outputs\[0\]: 'Q\(3\)' is not a placement"),
        (lambda d: d["nodes"][node].update(outputs=["RR"]), r"has 2 placements but the mesh has 1 axes"),
        (lambda d: d.pop("fingerprint"), r"plan field fingerprint: '<missing>' is required"),
        (lambda d: d.update(world_size="2"), r"plan field world_size: '2' has the wrong type \(expected integer\)"),
        (lambda d: d.update(version=9), r"plan field version: 9 is not supported \(this autopar reads versions 1 to 3\)"),
    ]
    for mutate, message in cases:
        d = json.loads(json.dumps(good))
        mutate(d)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(d))
        with pytest.raises(autopar.PlanError, match=message):
            autopar.Plan.load(path)
    path.write_text("not json")
    with pytest.raises(autopar.PlanError, match="not JSON"):
        autopar.Plan.load(path)


def test_adamw_steps_the_shards(captured):
    """AdamW on local shards equals AdamW on one device (MLP: no gradient is zero in exact
    arithmetic, so Adam's normalisation does not amplify rounding noise)."""
    ex, cap = captured("mlp")
    plan = plan_captured(cap, parse_cluster("cpu:4"), 4, pins={"data": 2, "tensor": 2})
    model = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        ex.loss_fn(model(*ex.inputs), ex.target).backward()
        opt.step()
    want = dict(model.named_parameters())

    def train(pm, comm):
        o = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for _ in range(3):
            o.zero_grad()
            pm.train_step(*ex.inputs, target=ex.target)
            o.step()
        return pm.full_state_dict()

    for rank, got in enumerate(simulate(cap, plan, ex.model, train)):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"AdamW weight {name} rank {rank}: {m}")


def test_forward_equals_model_and_state_round_trip(captured):
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:4"), 4, pins={"data": 2, "tensor": 2})
    want = ex.model(*ex.inputs)
    sd = {k: v + 0.01 for k, v in ex.model.state_dict().items()}

    def body(pm, comm):
        out = pm(*ex.inputs)
        pm.load_full_state_dict(sd)
        return out, pm.full_state_dict()

    for rank, (out, back) in enumerate(simulate(cap, plan, ex.model, body)):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        for k, v in sd.items():
            torch.testing.assert_close(back[k], v, msg=lambda m: f"{k}: {m}")


def test_forward_of_a_model_trained_with_mse_reads_no_target():
    """``mse_loss`` broadcasts the output with the target; export returned that broadcast as
    the model's output, so ``pm(x)`` asked for the target (forward() missing 'args_1')."""
    ex = EXAMPLES["mlp"](batch=8, seed=0)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": 3})
    want = ex.model(*ex.inputs)
    for out in simulate(cap, plan, ex.model, lambda pm, comm: pm(*ex.inputs)):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_coverage_report_names_missing_ops():
    class UsesTrace(torch.nn.Module):
        def forward(self, x):
            return torch.trace(x * 2)

    cov = autopar.coverage(UsesTrace(), (torch.randn(4, 4),))
    assert "aten.trace.default" in cov.missing and "aten.mul.Tensor" in cov.covered
    assert "run replicated" in str(cov)
    ex = EXAMPLES["gpt"]()
    assert autopar.coverage(ex.model, ex.inputs, ex.loss_fn, target=ex.target).ok


def test_zero3_gathers_weights_again_in_backward(captured, monkeypatch):
    """ZeRO-3 keeps no gathered weight for backward: whatever autograd would save of one is
    packed as a reference to the shard and gathered again; the numbers still match."""
    from autopar.ops.collectives import RegatheredWeights
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": 3})
    packed = []
    original = RegatheredWeights._pack

    def counting_pack(self, t):
        out = original(self, t)
        if isinstance(out, tuple):
            packed.append(t.numel())
        return out

    monkeypatch.setattr(RegatheredWeights, "_pack", counting_pack)
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for rank, got in enumerate(simulate(cap, plan, ex.model, lambda pm, c: parallel_run(pm, ex.inputs, ex.target))):
        compare(ref, got, f"zero=3 rank {rank}")
    weight_numel = sum(p.numel() for p in ex.model.parameters() if p.ndim == 2)
    # every linear weight is saved once per step and rank (3 steps, 2 ranks)
    assert packed and sum(packed) >= weight_numel, f"only {sum(packed)} weight elements re-gathered"
