"""Pipeline planning: micro-batches and schedule chosen by predicted step, per-stage memory in
the estimate, and the free search that weighs pipelines against unpipelined plans.

Models are built on the meta device (nothing allocated) or are the tiny examples; every
case plans without processes."""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from autopar.cost_models.hardware import Link, parse_cluster

import autopar
from autopar.schedule import SCHEDULES
from autopar.solver.errors import PipelineInfeasibleError
from examples.models import EXAMPLES, gpt_factory


@functools.cache
def meta_gpt(batch: int, n_layer: int, n_embd: int, block_size: int, vocab_size: int = 512):
    with torch.device("meta"):
        return gpt_factory(batch=batch, n_layer=n_layer, n_embd=n_embd, n_head=8,
                           block_size=block_size, vocab_size=vocab_size)


def plan(ex, cluster, **kw):
    return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster, **kw)


# ---- micro-batches and schedule ---------------------------------------------------------------

# compute-bound on an A100 (hidden 1024, 256 tokens): four stages, a batch of 32
BUBBLY = {"batch": 32, "n_layer": 8, "n_embd": 1024, "block_size": 256}


def test_chosen_micro_batches_beat_the_least_default():
    """With pipeline=4 and nothing else pinned, the least micro-batch count (4) leaves the
    bubble at 3/7 of the step; the planner picks more micro-batches and a schedule by
    predicted step, and the plan it returns is predicted faster."""
    ex = meta_gpt(**BUBBLY)
    default = plan(ex, "4xA100", pipeline=4, micro_batch_size=8, schedule="1f1b")
    chosen = plan(ex, "4xA100", pipeline=4)
    assert default.n_microbatches == 4 and default.estimate.bubble_fraction > 0.35
    assert chosen.n_microbatches > 4
    assert chosen.estimate.bubble_fraction < default.estimate.bubble_fraction
    assert chosen.estimate.step_time_s < 0.9 * default.estimate.step_time_s
    assert chosen.pins == {"pipeline": 4}


def test_pins_fix_their_choice_and_leave_the_rest():
    ex = meta_gpt(**BUBBLY)
    gpipe = plan(ex, "4xA100", pipeline=4, schedule="gpipe")
    assert gpipe.schedule == "gpipe" and gpipe.n_microbatches > 4
    fixed_m = plan(ex, "4xA100", pipeline=4, micro_batch_size=4)
    assert fixed_m.n_microbatches == 8 and fixed_m.schedule in SCHEDULES


def test_pipeline_one_means_no_pipeline():
    ex = EXAMPLES["gpt"]()
    p = plan(ex, "cpu:2", pipeline=1)
    assert p.pipeline_stages == 1 and p.mesh_axes[0] != "pipeline" and p.pins == {"pipeline": 1}
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        plan(ex, "cpu:2", pipeline=1, schedule="gpipe")
    # micro_batch_size= without a pipeline is gradient accumulation (tests/test_accumulate.py)


# ---- the estimate --------------------------------------------------------------------------

# eight equal layers whose weights outweigh the embeddings
UNIFORM = {"batch": 16, "n_layer": 8, "n_embd": 64, "block_size": 32, "vocab_size": 64}


def test_gpipe_holds_more_activations_than_1f1b():
    """GPipe keeps all m micro-batches' activations until the backward starts, 1F1B at most
    p of them: with m = 8 > p = 4 the first stage holds twice as many under GPipe."""
    ex = meta_gpt(**UNIFORM)
    gpipe = plan(ex, "4xA100", pipeline=4, schedule="gpipe", micro_batch_size=2)
    one_f_one_b = plan(ex, "4xA100", pipeline=4, schedule="1f1b", micro_batch_size=2)
    assert gpipe.n_microbatches == one_f_one_b.n_microbatches == 8
    a, b = gpipe.estimate.memory_bytes["activations"], one_f_one_b.estimate.memory_bytes["activations"]
    assert a > 1.5 * b


def test_a_stage_holds_about_a_pth_of_the_parameters():
    ex = meta_gpt(**UNIFORM)
    whole = plan(ex, "1xA100")
    piped = plan(ex, "4xA100", pipeline=4, schedule="1f1b", micro_batch_size=2)
    assert set(piped.estimate.memory_bytes) >= {"params", "grads", "optimizer", "activations"}
    for term in ("params", "grads", "optimizer"):
        ratio = piped.estimate.memory_bytes[term] / whole.estimate.memory_bytes[term]
        assert 0.15 < ratio < 0.35, (term, ratio)
    assert piped.estimate.memory_total < 0.5 * whole.estimate.memory_total


@pytest.mark.parametrize("pins", [{"tensor": 2}, {"tensor": 2, "recompute": "full"},
                                  {"data": 2, "zero": 3}])
def test_node_prices_add_up_to_the_solver_total(pins):
    """The per-node prices the cuts are made from are the solver's own: compute,
    resharding and gradient reduction add up to its estimate of the whole graph (with
    recomputation and ZeRO-3 regathers too)."""
    from autopar.solver.pipeline_price import price_plan as _price
    from autopar.solver.flat import MeshAsk
    from autopar.solver.pipeline_search import capture_microbatch, solve_intra
    ex = EXAMPLES["gpt"]()
    cl = parse_cluster("cpu:4")
    cap = capture_microbatch(ex.model, ex.inputs, ex.loss_fn, ex.target, 2)
    intra, solved = solve_intra(cap, MeshAsk(cl, 4, pins), 2)
    nc = _price(cap, intra, solved, cl, 4, 2, 2).nc
    assert nc.comm.sum() > 0
    total = nc.compute.sum() + nc.comm.sum() + nc.sync.sum()
    # less the estimate's row of communication hidden behind compute (ZeRO-3's gathers)
    total += intra.estimate.comm.get("overlapped", 0.0)
    assert total == pytest.approx(intra.estimate.step_time_s, rel=1e-6)


def test_recomputation_priced_from_a_plan_without_it():
    """The free search prices "every layer recomputed" from the plan without recomputation
    (no second solve): the same as the solver's price when the placements are the same."""
    from autopar.analysis.layers import select_layers

    from dataclasses import replace

    from autopar.solver.flat import Solved
    from autopar.solver.pipeline_price import price_plan as _price
    from autopar.solver.flat import MeshAsk
    from autopar.solver.pipeline_search import capture_microbatch, solve_intra
    ex = EXAMPLES["gpt"]()
    cl = parse_cluster("cpu:4")
    cap = capture_microbatch(ex.model, ex.inputs, ex.loss_fn, ex.target, 2)
    plain, solved_plain = solve_intra(cap, MeshAsk(cl, 4, {"data": 2}), 2)
    rec, solved_rec = solve_intra(cap, MeshAsk(cl, 4, {"data": 2, "recompute": "full"}), 2)
    assert rec.recompute and set(solved_rec.choice) == set(solved_plain.choice)
    # the same placements under both (the two ILPs may break a tie of equal prices apart):
    # the recomputing solver's problem and cost model, the plain plan's choices
    same = Solved(solved_rec.problem, solved_rec.cost, dict(solved_plain.choice))
    derived = _price(cap, plain, solved_plain, cl, 4, 2, 2).nc.with_recompute(
        cap, select_layers(cap.gm, "full"))
    solver = _price(cap, replace(rec, nodes=plain.nodes), same, cl, 4, 2, 2).nc
    for term in ("compute", "comm", "sync", "activations"):
        assert getattr(derived, term) == pytest.approx(getattr(solver, term)), term
    assert derived.recompute_bytes == pytest.approx(solver.recompute_bytes)
    assert derived.activations.sum() < _price(cap, plain, solved_plain, cl, 4, 2, 2).nc.activations.sum()


def test_gradient_reduction_is_once_per_step():
    """Data parallelism inside the stages reduces gradients once per step (they accumulate
    over micro-batches): the reduction priced per node is the same whatever the
    micro-batch, the solver weighs it 1/m per micro-batch, and the estimate counts it once."""
    from autopar.solver.pipeline_price import price_plan as _price
    from autopar.pricing.costing import StepView
    from autopar.solver.flat import MeshAsk
    from autopar.solver.pipeline_search import capture_microbatch, solve_intra
    ex = EXAMPLES["gpt"]()
    cl = parse_cluster("cpu:4")
    syncs, per_mb = [], []
    for m in (1, 2, 4):
        cap = capture_microbatch(ex.model, ex.inputs, ex.loss_fn, ex.target, m)
        intra, solved = solve_intra(cap, MeshAsk(cl, 4, {"data": 2}, view=StepView(grad_sync_scale=1 / m)), 2)
        nc = _price(cap, intra, solved, cl, 4, 2, 2).nc
        syncs.append(nc.sync.sum())
        per_mb.append(nc.comm.sum())
        # the solver's total for one micro-batch holds 1/m of the step's reduction
        assert intra.estimate.comm_s == pytest.approx(nc.comm.sum() + nc.sync.sum() / m)
    assert syncs[0] > 0 and syncs == pytest.approx([syncs[0]] * 3)
    piped = plan(ex, cl, pipeline=2, data=2, schedule="gpipe", micro_batch_size=2)
    # m = 4 micro-batches of resharding on the busiest rank, one reduction of its gradients
    assert piped.estimate.comm["all_reduce@data"] < 4 * per_mb[2] + syncs[2]


# ---- the free search ------------------------------------------------------------------------

DEEP = {"batch": 32, "n_layer": 8, "n_embd": 1024, "block_size": 128}


def slow_two_nodes(bandwidth=0.25e9):
    cl = parse_cluster("2x2xA100")
    return replace(cl, name="2x2xA100-slow", inter=Link(bandwidth=bandwidth, latency=cl.inter.latency))


# DEEP at twice the batch and tokens: at DEEP's own size the pipeline's 16 micro-batches
# would dispatch ~134 ms of ATen calls a rank (cost_models/host.py: half the graph's ~1,000
# calls x 16 x 16.7 us), over the unpipelined plan's 124 ms step, so host time, not the
# link, would decide
SLOW_LINK = {**DEEP, "batch": 64, "block_size": 256}


def test_two_nodes_on_a_slow_link_pipeline():
    """Two nodes of two A100s joined by 0.25 GB/s: whatever crosses the link every step
    (gradients, activations of tensor parallelism) is slow; a pipeline with one stage per
    node sends only the activations at the cut, and is predicted faster."""
    ex = meta_gpt(**SLOW_LINK)
    cl = slow_two_nodes()
    free = plan(ex, cl)
    flat = plan(ex, cl, pipeline=1)
    assert flat.pipeline_stages == 1
    assert free.pipeline_stages == 2 and free.mesh_axes[0] == "pipeline"
    assert free.estimate.step_time_s < 0.9 * flat.estimate.step_time_s
    assert "pipeline" not in free.pins


def test_one_node_keeps_the_unpipelined_plan():
    ex = meta_gpt(**DEEP)
    assert plan(ex, "4xA100").pipeline_stages == 1


def test_pipeline_when_nothing_unpipelined_fits():
    """On one node pipelines are searched only when no unpipelined plan fits: at 128 MiB
    per device two stages of small micro-batches fit where the whole graph does not.
    (``accumulate=1``: the whole batch a step; micro-batches without a pipeline are the
    other way to fit, ``tests/test_accumulate.py``.)"""
    from autopar.solver.errors import InfeasibleError
    ex = meta_gpt(batch=64, n_layer=4, n_embd=256, block_size=256, vocab_size=256)
    budget = 128 * 2**20
    with pytest.raises(InfeasibleError):
        plan(ex, "2xA100", memory_budget=budget, pipeline=1, accumulate=1)
    p = plan(ex, "2xA100", memory_budget=budget, accumulate=1)
    assert p.pipeline_stages == 2
    assert p.estimate.memory_total <= budget


def test_cut_points_of_a_large_graph_are_layer_boundaries():
    """Past MAX_UNITS op nodes the DP considers the cheapest crossings only, spread over the
    whole graph (not the first layers' only)."""
    from autopar.solver.pipeline_price import MAX_UNITS, cut_points as _cut_points
    layer = [5.0] * 9 + [1.0]              # ten positions per layer, the last one cheap
    cross = np.array(layer * 100 + [5.0] * 9, dtype=float)
    points = _cut_points(cross, 4)
    assert len(points) <= MAX_UNITS
    assert points == [10 * (k + 1) for k in range(100)]
    # a prologue crossing fewer bytes than any layer boundary (token ids, rotary tables)
    # does not take every point: the layers keep cut points all along (Llama 3 405B's
    # p=16 found only prologue cuts, its last stage held all 126 layers)
    cross = np.array([0.5] * 300 + layer * 100, dtype=float)
    points = _cut_points(cross, 16)
    assert len(points) <= MAX_UNITS
    layers = [q for q in points if q > 300]
    assert len(layers) >= 32 and max(layers) > 1200
    assert all((q - 300) % 10 == 0 for q in layers)


def test_free_virtual_stages_are_priced_with_cut_points_for_the_most_stages(monkeypatch):
    """The prices the virtual-stage count is chosen on offer cut points for the largest
    count tried (8 per rank), as pinning that count does: priced for 4 per rank, Llama 3
    405B's 128 virtual stages had only layer boundaries to cut at and v=8 simulated 16.1 s
    against 14.3 s pinned, so the search kept v=4."""
    import autopar.solver.pipeline_search as ps
    from autopar.solver.stage_dp import DEFAULT_VIRTUAL
    seen = []
    real = ps.price_plan

    def spy(cap, intra, solved, cl, world, p, n_stages, *rest):
        seen.append(n_stages)
        return real(cap, intra, solved, cl, world, p, n_stages, *rest)

    monkeypatch.setattr(ps, "price_plan", spy)
    # 32 blocks: room for 4 ranks x 8 virtual stages of a block each (``stage_limit``)
    ex = meta_gpt(batch=8, n_layer=32, n_embd=256, block_size=64)
    got = plan(ex, "4xA100", pipeline=4, micro_batch_size=1, schedule="interleaved-1f1b")
    assert max(seen) == 4 * max(DEFAULT_VIRTUAL)
    pinned = plan(ex, "4xA100", pipeline=4, micro_batch_size=1, schedule="interleaved-1f1b",
                  virtual_stages=got.pipeline.virtual_stages)
    assert got.estimate.step_time_s == pytest.approx(pinned.estimate.step_time_s, rel=1e-9)
    assert ps.most_stages({"pipeline": 4, "schedule": "1f1b"}, 4) == 4
    assert ps.most_stages({"pipeline": 4, "schedule": "interleaved-1f1b", "virtual_stages": 3}, 4) == 12


def test_free_virtual_stages_give_each_stage_a_block(monkeypatch):
    """Left free, the virtual-stage counts stop at one block a stage (and one more at each
    end: ``stage_limit``): 8 blocks on 4 ranks try v = 2 only (10 stages at most), and their
    prices offer cut points for 8 stages, not 32; a pinned count is not limited."""
    import autopar.solver.pipeline_search as ps
    seen, tried, limits = [], [], []
    real_price, real_stages = ps.price_plan, ps.plan_stages

    def spy(cap, intra, solved, cl, world, p, n_stages, *rest):
        seen.append(n_stages)
        limits.append(ps.stage_limit(cap))
        return real_price(cap, intra, solved, cl, world, p, n_stages, *rest)

    def spy_stages(*a, **kw):
        tried.append(kw["virtual_stages"])
        return real_stages(*a, **kw)

    monkeypatch.setattr(ps, "price_plan", spy)
    monkeypatch.setattr(ps, "plan_stages", spy_stages)
    ex = meta_gpt(batch=8, n_layer=8, n_embd=256, block_size=64)
    got = plan(ex, "4xA100", pipeline=4, micro_batch_size=1, schedule="interleaved-1f1b")
    assert set(limits) == {10}
    assert max(seen) == 8 and set(tried) == {2}
    assert got.pipeline.virtual_stages == 2
    pinned = plan(ex, "4xA100", pipeline=4, micro_batch_size=1, schedule="interleaved-1f1b",
                  virtual_stages=4)
    assert pinned.pipeline.virtual_stages == 4


def test_bytes_crossing_a_layer_boundary_do_not_grow_along_the_layers():
    """Every layer boundary of a Llama crosses the same bytes: a value read by a check that
    returns nothing (``aten._assert_tensor_metadata``, from ``.to(dtype)``) is not live to the
    graph's end (it was, and Llama 3 405B's last cuts priced 16 GB a micro-batch)."""
    from autopar.analysis.stages import chain, crossing_bytes
    from conftest import meta_llama_capture
    cap = meta_llama_capture(n_layer=4, seq=16, vocab=256, hidden_dim=64)
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    units = chain(cap)
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default
               for n in cap.gm.graph.nodes)      # what the test is about is in the graph
    cross = crossing_bytes(cap, lambda n: float(n.meta["val"].numel() * n.meta["val"].element_size()))

    def first_of(layer):   # the first chain node inside layers.<layer>
        return next(i for i, u in enumerate(units)
                    if any(path in (f"model.layers.{layer}", f"layers.{layer}")
                           for path, _ in nodes[u].meta.get("nn_module_stack", {}).values()))

    at = [cross[first_of(k) - 1] for k in range(1, 4)]
    activation = 2 * 16 * 32 * 4
    assert at[0] == at[1] == at[2], at
    assert at[0] <= 2 * activation, (at[0], activation)


def test_zero3_gathers_are_a_fixed_cost_of_each_micro_batch():
    """The search prices a stage per sample from the full batch's plan, plus what does not
    shrink with the micro-batch (``NodeCosts.fixed``): ZeRO-3's parameter gathers are among
    the latter, so the full batch's communication, scaled to a micro-batch of a quarter,
    is that micro-batch's own (the gathers once each, not a quarter of them). (Compute is
    not compared: its fixed part, three launches an op, is a rougher rule.)"""
    from autopar.solver.flat import MeshAsk
    from autopar.solver.pipeline_price import price_plan as _price
    from autopar.solver.pipeline_search import capture_microbatch, solve_intra
    ex = meta_gpt(16, 2, 512, 128)
    cl = parse_cluster("1x4xA100")
    ncs = {}
    for m in (1, 4):
        cap = capture_microbatch(ex.model, ex.inputs, ex.loss_fn, ex.target, m)
        intra, solved = solve_intra(cap, MeshAsk(cl, 4, {"data": 2, "zero": 3}), 2)
        assert intra.options.zero == 3
        ncs[m] = _price(cap, intra, solved, cl, 4, 2, 2).nc
    whole, quarter = ncs[1], ncs[4]
    gathers = sum(v for by in whole.comm_by for k, v in by.items() if k.startswith("all_gather"))
    assert gathers > 0.5 * whole.comm.sum(), "the case must gather parameters"
    fixed = np.minimum(whole.comm, whole.comm_latency + whole.fixed_comm).sum()
    assert fixed >= gathers
    scaled = (whole.comm.sum() - fixed) / 4 + fixed
    assert scaled == pytest.approx(quarter.comm.sum(), rel=1e-3)


def test_a_pipeline_that_does_not_fit_names_its_receive_buffers(monkeypatch):
    """8 stages of a width-64 GPT under GPipe, 8 micro-batches of 6 of 48 sequences, 10 MiB
    a device: the refusal names the stage, what it needs and the share of the buffers the
    runtime receives into (``runtime.receive_buffers``: under GPipe every micro-batch's
    values at a stage's first cut, two micro-batches' gradients at its last), in bytes the
    user can read; at 12 MiB the plan fits and carries them as a memory term, per rank."""
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "0")
    with torch.device("meta"):
        ex = gpt_factory(batch=48, n_layer=8, n_embd=64, n_head=16, block_size=128, vocab_size=256)
    pins = dict(cluster="1x8xA100", pipeline=8, micro_batch_size=6, schedule="gpipe")
    with pytest.raises(PipelineInfeasibleError, match=r"MiB on stage 7 .*, [0-9.]+ MiB of it the "
                                                      r"buffers torch's PipelineStage receives into"):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, memory_budget=10 * 2**20, **pins)
    plan = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, memory_budget=12 * 2**20, **pins)
    # the first stage: 2 micro-batches of gradients of its output (the 6 x 128 x 64 fp32
    # residual) back; the last: 8 of that residual in (the cuts between fall mid-block)
    one = 6 * 128 * 64 * 4
    buffers = [r["pipeline_buffers"] for r in plan.estimate.rank_memory_bytes]
    assert (buffers[0], buffers[-1]) == (2 * one, 8 * one), buffers
    # the summary gives the spread over the 8 ranks and which one its memory line is
    totals = [sum(r.values()) for r in plan.estimate.rank_memory_bytes]
    assert len(totals) == 8 and sum(plan.estimate.memory_bytes.values()) == max(totals)
    assert f"(the line above is rank {totals.index(max(totals))}'s, the fullest)" in plan.summary()
