"""ZeRO stages as the literature defines them (Rajbhandari et al. 2020), each equal to one
device, each rank's memory equal to the plan's estimate.

- stage 1 (``zero=1``): optimizer state sharded over the data axis; parameters and
  gradients whole (the gradients all-reduced); each rank steps its shard, then the
  parameters are all-gathered;
- stage 2: as 1, the gradients reduce-scattered (each rank keeps its block);
- stage 3: parameters sharded too, gathered per use in forward and again in backward.

On 2 gloo ranks (one torchrun spawn, ``tests/zero_worker.py``): the small GPT trained 3
AdamW steps under ``data=2, zero=k`` for k = 0..3 matches one device (losses and weights),
and the bytes of parameters, gradients and optimizer state measured from the live tensors
equal the plan's estimate term by term; stage 2 with tiny buckets (reduce-scatters
launched by the hooks during backward), stage 1 stepped by ``opt.step()`` instead of
``pm.step(opt)``, and a checkpoint saved under stage 1 and resumed under stage 2. On
simulated ranks: the 2x2 data x tensor mesh. Single process: what the cost model counts
for each stage.
"""
from __future__ import annotations

import copy

import pytest
import torch

from autopar.cost_models.hardware import parse_cluster
from autopar.runtime.thread_ranks import simulate
from autopar.options import Options
from autopar.solver.flat import plan_captured
from launch import case_result, register_cases, shared_cases

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-3
CASES = [{"id": f"zero{k}", "pins": {"data": 2, "zero": k}} for k in range(4)] + [
    {"id": "zero2-small-buckets", "pins": {"data": 2, "zero": 2}, "bucket_bytes": 2048},
    {"id": "zero1-opt-step", "pins": {"data": 2, "zero": 1}, "pm_step": False},
    {"id": "zero1-to-zero2-checkpoint", "pins": {"data": 2, "zero": 1},
     "resume_pins": {"data": 2, "zero": 2}},
]


register_cases("zero_worker.py", 2, CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    # one spawn with tests/test_offload.py's cases too (launch.shared_cases)
    return shared_cases("zero_worker.py", 2, tmp, timeout=600, case_timeout=120)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_zero_stage_matches_one_device(results, case_id):
    r = case_result(results, case_id)
    assert r["loss_err"] < LOSS_TOL, r
    assert r["weight_err"] < WEIGHT_TOL, r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_rank_equals_the_plan_estimate(results, stage):
    r = case_result(results, f"zero{stage}")
    m, est, numel = r["measured"], r["estimate"], r["numel"]
    for term in ("params", "grads", "optimizer"):
        assert m[term] == est[term], (term, m, est)
    # and each stage holds what the literature says it holds (fp32, AdamW: 2 moments)
    whole = 4 * numel
    assert m["optimizer"] == (2 * whole if stage == 0 else whole), m      # moments / 2 from stage 1
    assert m["grads"] == (whole if stage <= 1 else whole / 2), m          # gradients / 2 from stage 2
    assert m["params"] == (whole if stage <= 2 else whole / 2), m         # parameters / 2 at stage 3
    # the optimizer steps shards from stage 1 on
    assert r["local_numel"] == (numel if stage == 0 else numel / 2), r


def test_stage2_small_buckets_keep_gradient_blocks_only(results):
    r = case_result(results, "zero2-small-buckets")
    assert r["measured"] == r["estimate"], r


@pytest.mark.parametrize("stage,has,lacks", [
    (1, ["all_reduce@data", "all_gather@data"], ["reduce_scatter@data"]),
    (2, ["reduce_scatter@data", "all_gather@data"], []),
    (3, ["reduce_scatter@data", "all_gather@data"], []),
])
def test_plan_counts_each_stages_collectives(results, stage, has, lacks):
    r = case_result(results, f"zero{stage}")
    for key in has:
        assert key in r["comm"], (stage, r["comm"])
    for key in lacks:
        assert key not in r["comm"], (stage, r["comm"])


def test_cost_model_prices_each_stages_communication(results):
    """Stage 1: gradients all-reduced (as data parallel) + parameters all-gathered once per
    step; stage 2: the all-reduce's bytes become a reduce-scatter; stage 3: the gathers run
    per use and again in backward, far more than stage 2's once per step."""
    comm = {k: case_result(results, f"zero{k}")["comm"] for k in range(4)}
    dp_reduce = comm[0]["all_reduce@data"]
    assert comm[1]["all_reduce@data"] == pytest.approx(dp_reduce)
    assert comm[1]["all_gather@data"] > 0
    assert comm[2]["all_reduce@data"] < dp_reduce       # only the loss's is left
    assert comm[2]["all_gather@data"] == pytest.approx(comm[1]["all_gather@data"])
    assert comm[3]["all_gather@data"] > 10 * comm[2]["all_gather@data"]


# ---- simulated ranks ----------------------------------------------------------------------
def test_two_by_two_mesh_matches_one_device(captured):
    """data 2 x tensor 2 on simulated ranks (the MLP): stage 2 (gradients reduce-scattered over
    the data axis, then summed over the tensor axis where a weight is replicated there)
    matches one device over 3 AdamW steps, and the optimizer's bytes equal the estimate."""
    ex, cap = captured("mlp")
    ref = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ex.loss_fn(ref(*ex.inputs), ex.target)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    w0 = dict(ex.model.named_parameters())
    for stage in (2,):
        plan = plan_captured(cap, parse_cluster("cpu:4"), 4, pins={"data": 2, "tensor": 2, "zero": stage})

        def run(pm, comm):
            o = torch.optim.AdamW(pm.parameters(), lr=1e-2)
            losses = []
            for _ in range(3):
                o.zero_grad()
                losses.append(pm.train_step(*ex.inputs, target=ex.target).item())
                pm.step(o)
            moments = sum(v.numel() * 4 for s in o.state.values() for v in s.values() if v.dim())
            return losses, pm.full_state_dict(), moments
        for rank, (losses, w, moments) in enumerate(simulate(cap, plan, ex.model, run)):
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < LOSS_TOL
            num = sum(((w[k] - p.detach()) ** 2).sum() for k, p in ref.named_parameters())
            den = sum(((p.detach() - w0[k].detach()) ** 2).sum() for k, p in ref.named_parameters())
            assert float((num / den).sqrt()) < WEIGHT_TOL, (stage, rank)
            assert moments == plan.estimate.memory_bytes["optimizer"], (stage, rank)
            numel = sum(p.numel() for p in w0.values())
            assert moments < 2 * 4 * numel / 2, "the data axis sharded no optimizer state"


def test_stage_1_and_2_parameter_collectives_run_once_per_step():
    """A parameter edge of a ZeRO-1/2 plan (stored S(0) on the data axis, read whole): the
    gather runs once per step (not again under recomputation; 1/m of it per micro-batch of
    a pipeline), the gradient is all-reduced whole (stage 1) or reduce-scattered (stage 2);
    stage 3 gathers per use and again in backward."""
    from autopar.placement import Replicate, Shard
    from autopar.sharding.registry import TensorMeta
    from autopar.pricing.costing import CostModel

    cl = parse_cluster("1xdgx-a100")
    meta = TensorMeta((4096, 4096), torch.float32)

    def by(zero, rerun=0.0, scale=1.0):
        model = CostModel(cl, (8,), Options(zero=zero), data_axis=0, grad_sync_scale=scale)
        return model.edge_time(meta, (Shard(0),), (Replicate(),), (True,), bucketed=True, rerun=rerun)[1]
    one, two, three = by(1), by(2), by(3)
    assert set(one) == {("all_gather", 0), ("all_reduce", 0)}
    assert set(two) == {("all_gather", 0), ("reduce_scatter", 0)}
    assert one[("all_gather", 0)] == pytest.approx(two[("all_gather", 0)])
    assert one[("all_reduce", 0)] > two[("reduce_scatter", 0)]
    for stage in (1, 2):
        assert by(stage, rerun=1.0) == pytest.approx(by(stage))
        half = by(stage, scale=0.5)
        assert all(half[k] == pytest.approx(by(stage)[k] / 2) for k in half)
    assert three[("all_gather", 0)] > 2 * two[("all_gather", 0)]
    assert by(3, rerun=1.0)[("all_gather", 0)] > three[("all_gather", 0)]


def test_free_search_picks_a_zero_stage_when_memory_binds(captured):
    """No zero= pin: under a budget that data parallelism (zero=0) cannot meet, the search
    weighs ZeRO 1-3 on the data axis and picks the fastest stage that fits; with room to
    spare it keeps zero=0."""
    from autopar.solver.ilp import InfeasibleError
    _, cap = captured("mlp")
    cl = parse_cluster("cpu:2")
    roomy = plan_captured(cap, cl, 2, pins={"data": 2})
    assert not roomy.pins.get("zero")
    budget = 0.85 * roomy.estimate.memory_total   # ZeRO-1 keeps whole gradients: 0.8 of it
    with pytest.raises(InfeasibleError):
        plan_captured(cap, cl, 2, pins={"data": 2, "zero": 0}, memory_budget=budget)
    tight = plan_captured(cap, cl, 2, pins={"data": 2}, memory_budget=budget)
    assert tight.pins.get("zero") in (1, 2, 3), tight.pins
    assert tight.estimate.memory_total <= budget
    stages = {k: plan_captured(cap, cl, 2, pins={"data": 2, "zero": k}, memory_budget=budget)
              for k in (1, 2, 3)}
    fastest = min(stages, key=lambda k: stages[k].estimate.step_time_s)
    assert tight.pins["zero"] == fastest


def test_zero3_gathers_and_reduces_by_block(captured, monkeypatch):
    """ZeRO-3 runs a collective per block, not per weight (``passes.prefetch``,
    ``ops.param_buckets``): the small GPT's weight gathers make 4 buckets (the embeddings,
    each of its 2 blocks, the final norm with the tied head), each started before the block
    before it begins (prefetch); a training step runs one all-gather per bucket in forward,
    at most one more per bucket in backward and one gradient reduce-scatter per bucket (per
    weight it was about 50 of each). Simulated ranks; test_equivalence's zero3 cases check
    these programs against one device, the gloo cases run the async collectives."""
    from autopar.ops import collectives
    from autopar.ops.comm import ThreadComm
    from autopar.ops.param_buckets import gather_bucket
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": 3})
    calls = {}
    for name in ("all_gather", "reduce_scatter"):
        def counted(self, *a, _f=getattr(ThreadComm, name), _name=name, **k):
            if self.rank == 0:
                calls[_name] = calls.get(_name, 0) + 1
            return _f(self, *a, **k)
        monkeypatch.setattr(ThreadComm, name, counted)

    def run(pm, comm):
        g = pm.runner.programs["train"].graph
        order = {n: i for i, n in enumerate(g.nodes)}
        plain = [n for n in g.nodes if n.target is collectives.all_gather and n.kwargs.get("regather")
                 and n.kwargs.get("bucket") is None]
        starts = [n for n in g.nodes if n.target is gather_bucket]
        first_read = {s: min(order[u] for u in s.users) for s in starts}
        pm.train_step(*ex.inputs, target=ex.target)
        return (plain, [first_read[s] for s in starts], [order[s] for s in starts],
                dict(calls) if comm.rank == 0 else None)
    for plain, reads, starts, step_calls in simulate(cap, plan, ex.model, run):
        assert not plain and len(starts) == 4, (plain, starts)
        for k in range(1, 4):        # bucket k travels while the block before it computes
            assert starts[k] < reads[k - 1] < reads[k], (starts, reads)
        if step_calls is not None:   # rank 0 counts
            assert 4 <= step_calls["all_gather"] <= 8 and step_calls["reduce_scatter"] == 4, step_calls


def test_a_bucket_gathers_and_reduces_as_the_per_weight_collectives():
    """One bucket of shards of dim 0, of dim 1 and strided ``S(0/3)`` (2 thread ranks): the
    flat all-gather gives each weight whole as ``all_gather`` does, backward's gather again
    (weights saved for backward packed away, ``RegatheredWeights``) gives them again, and the
    bucket's one reduce-scatter leaves each shard the gradient the per-weight reduce-scatter
    leaves (each rank's loss weighs the weights differently: partial gradients)."""
    from torch import nn

    from autopar.ops import collectives
    from autopar.ops.comm import ThreadWorld
    from autopar.ops.param_buckets import gather_bucket
    from autopar.passes.shard_parameters import shard_tensor
    from autopar.placement import Shard
    cases = [((6, 4), 0, 1), ((4, 6), 1, 1), ((12, 2), 0, 3)]      # whole shape, dim, groups

    def body(comm):
        # a generator of its own: the ranks are threads, the global RNG is shared between them
        gen = torch.Generator().manual_seed(0)
        wholes = [torch.randn(shape, generator=gen) for shape, _, _ in cases]
        weights = [torch.randn(shape, generator=gen) * (comm.rank + 1) for shape, _, _ in cases]
        out = {}
        for way in ("per weight", "bucket"):
            shards = [nn.Parameter(shard_tensor(w, (Shard(d, g),), comm.coord, (2,)))
                      for w, (_, d, g) in zip(wholes, cases)]
            bucket = gather_bucket(shards, 0, [d for _, d, _ in cases], [g for _, _, g in cases])
            reg = collectives.regathered_weights()
            with reg.hooks():
                fulls = [collectives.all_gather(s, 0, d, grad_partial=True, regather=True, groups=g,
                                                **({"bucket": bucket, "index": i} if way == "bucket" else {}))
                         for i, (s, (_, d, g)) in enumerate(zip(shards, cases))]
                loss = sum((f * f * c).sum() for f, c in zip(fulls, weights))
            loss.backward()
            reg.clear()
            out[way] = ([f.detach() for f in fulls], [s.grad for s in shards])
        return out
    for out in ThreadWorld((2,)).run(body):
        gen = torch.Generator().manual_seed(0)
        wholes = [torch.randn(shape, generator=gen) for shape, _, _ in cases]
        for way in ("per weight", "bucket"):
            for got, whole in zip(out[way][0], wholes):
                assert torch.equal(got, whole), way
        for a, b in zip(*(out[w][1] for w in ("per weight", "bucket"))):
            assert a is not None and b is not None and torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_fused_optimizer_step_is_gathered(captured):
    """Stages 1 and 2 stepped by a fused AdamW's ``opt.step()`` on simulated ranks: torch's
    ``_fused_adamw_`` updates the shards in place without bumping their version counters
    (torch 2.13, CPU), so before the shards' step hook the next step ran on the working
    parameters of the step before (the second loss was off by 8% on the MLP; torchtitan's
    trainer steps fused by default). Each step now matches one device's fused AdamW."""
    ex, cap = captured("mlp")
    ref = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ref_losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = ex.loss_fn(ref(*ex.inputs), ex.target)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for stage in (1, 2):
        plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "zero": stage})

        def run(pm, comm):
            o = torch.optim.AdamW(pm.parameters(), lr=1e-2, fused=True)
            losses = []
            for _ in range(3):
                o.zero_grad()
                losses.append(pm.train_step(*ex.inputs, target=ex.target).item())
                o.step()
            return losses
        for rank, losses in enumerate(simulate(cap, plan, ex.model, run)):
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            assert err < LOSS_TOL, (stage, rank, losses, ref_losses)
