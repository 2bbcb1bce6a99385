"""Recomputation: plans with recompute= train to the single-device numbers, keep fewer
activation bytes alive (measured), and the estimate prices one more forward."""
import copy

import pytest

import autopar
from autopar.capture import capture
from autopar.cost_models.profile import PeakMemory
from autopar.analysis.layers import RecomputeError, layer_members, select_layers
from autopar.passes.recompute import checkpoint_layers
from autopar.plan import Plan
from autopar.ops.comm import use_comm
from autopar.runtime.thread_ranks import simulate
from examples.models import gpt_factory
from tests.equivalence import compare, parallel_run, reference_run


def _plan(ex, world, **pins):
    return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                        cluster=f"cpu:{world}", **pins)


@pytest.mark.parametrize("name,pins,recompute", [
    ("gpt", {"data": 2}, "full"),
    ("gpt", {"data": 2, "tensor": 2}, "full"),
    ("gpt", {"data": 2, "zero": 3}, ["h.1"]),
    ("llama", {"tensor": 2}, ["layers.0"]),
])
def test_recomputed_plan_matches_one_device(captured, name, pins, recompute):
    ex, cap = captured(name)
    world = pins.get("data", 1) * pins.get("tensor", 1)
    plan = _plan(ex, world, recompute=recompute, **pins)
    assert plan.recompute
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)

    def run(pm, comm):
        assert "recompute_0" in pm.code("train")      # the pass ran
        return parallel_run(pm, ex.inputs, ex.target)

    for r, got in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"{name} {pins} recompute={recompute} rank {r}")


def _measure(cap, plan, ex):
    """Per rank: (live tensor bytes when forward ends = activations kept for backward,
    peak live bytes over forward + backward), both counted by PeakMemory."""
    def run(pm, comm):
        pm.train_step(*ex.inputs, target=ex.target)           # warm-up
        for p in pm.parameters():
            p.grad = None
        graph = pm.runner.programs["train"]
        with use_comm(pm.comm), PeakMemory() as mem:
            loss = graph(*ex.inputs, ex.target)
            after_forward = mem.current_bytes
            loss.backward()
        return after_forward, mem.peak_bytes

    return simulate(cap, plan, ex.model, run)


def test_recompute_lowers_measured_activation_memory():
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    for pins in ({"data": 2}, {"tensor": 2}):
        base = _plan(ex, 2, **pins)
        rec = _plan(ex, 2, recompute="full", **pins)
        (fwd0, peak0), _ = _measure(cap, base, ex)
        (fwd1, peak1), _ = _measure(cap, rec, ex)
        print(f"{pins}: kept after forward {fwd0} -> {fwd1} B, peak {peak0} -> {peak1} B")
        # four layers, all recomputed: their inputs stay, the rest is rebuilt in backward
        assert fwd1 < 0.5 * fwd0, (pins, fwd0, fwd1)
        assert peak1 < peak0, (pins, peak0, peak1)
        # the estimate says the same: fewer bytes kept, one more forward of the layers
        m0, m1 = base.estimate.memory_bytes, rec.estimate.memory_bytes
        assert m1["activations"] + m1["recompute"] < m0["activations"]
        assert rec.estimate.compute_s > base.estimate.compute_s


def test_estimate_prices_one_more_forward_per_recomputed_layer():
    ex = gpt_factory(batch=8, n_layer=4, n_embd=64)
    base = _plan(ex, 1)
    one = _plan(ex, 1, recompute=["h.0"])
    full = _plan(ex, 1, recompute="full")
    extra_one = one.estimate.compute_s - base.estimate.compute_s
    extra_full = full.estimate.compute_s - base.estimate.compute_s
    assert extra_one > 0
    assert extra_full == pytest.approx(4 * extra_one, rel=1e-6)   # four equal layers
    assert full.recompute == tuple(f"transformer.h.{i}" for i in range(4))


def test_pass_is_pure_and_plan_round_trips(captured, tmp_path):
    ex, cap = captured("gpt")
    plan = _plan(ex, 2, data=2, recompute="full")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).recompute == plan.recompute
    # the pass on the captured graph itself (its nodes are their own "source")
    gm = copy.deepcopy(cap.gm)
    for n in gm.graph.nodes:
        n.meta["source"] = n.name
    before = gm.code
    out = checkpoint_layers(gm, layer_members(gm, plan.recompute))
    assert gm.code == before
    assert [n.target for n in out.graph.nodes if n.op == "call_module"] == ["recompute_0", "recompute_1"]
    assert out.meta["recompute"] == plan.recompute


def test_bad_recompute_requests_are_errors(captured):
    ex, cap = captured("gpt")
    with pytest.raises(RecomputeError, match="matches no repeated layer"):
        _plan(ex, 2, data=2, recompute=["h.7"])
    with pytest.raises(ValueError, match="recompute=3"):
        _plan(ex, 2, data=2, recompute=3)
    with pytest.raises(RecomputeError, match="use 'full'"):
        select_layers(cap.gm, "h")
    rex, rcap = captured("resnet")
    with pytest.raises(RecomputeError, match="updates a tensor in place"):
        select_layers(rcap.gm, ["stem.1"])
    assert "stem.1" not in select_layers(rcap.gm, "full")


def test_a_module_called_again_is_a_layer_only_where_it_reads_parameters():
    """A module called more than once is a repeated layer (ALBERT's shared layer), but only
    where each call reads a parameter: Gemma 3's rotary embedding, called once for its
    sliding-window layers and once for its global ones, works its tables out of a buffer,
    and taken for a layer it went into ``recompute="full"`` / ``offload_activations="full"``
    and the pipeline's layer count (a DualPipeV offload refused: "layers 'model.layers.1'
    and 'model.rotary_emb.0' interleave")."""
    import torch
    from torch import nn

    from autopar.analysis.layers import repeated_layers

    class Table(nn.Module):          # no parameter: a function of a buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.arange(8.0))

        def forward(self, x, scale):
            t = self.freq * scale
            return torch.cos(t) + torch.sin(t) + 0 * x.sum()

    class Shared(nn.Module):         # a parameter: a layer each call
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.shared = Table(), Shared()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            x = x + self.table(x, 1.0) + self.table(x, 2.0)
            x = self.shared(self.shared(x))
            for b in self.blocks:
                x = torch.relu(b(x))
            return x

    x = torch.randn(4, 8)
    cap = capture(Net(), (x,), lambda out, y: ((out - y) ** 2).mean(), torch.zeros(4, 8))
    layers = repeated_layers(cap.gm)
    assert not any(name.startswith("table") for name in layers), list(layers)
    assert {"shared.0", "shared.1", "blocks.0", "blocks.1"} <= set(layers), list(layers)
    assert not any(lay.startswith("table") for lay in select_layers(cap.gm, "full"))
