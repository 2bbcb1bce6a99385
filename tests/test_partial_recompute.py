"""Partial recomputation as a solver choice: under a memory budget between a model's needs
without recomputation and with every layer recomputed, the solver recomputes a strict,
non-empty subset of the layers (the fewest that fit), its estimate fits the budget and is
predicted faster than recomputing every layer; in a pipeline an earlier stage, holding more
micro-batches in flight, recomputes at least as many layers as a later one
(``autopar.solver.partial_recompute``; the runtime side: tests/test_pipeline_runtime.py
``test_partial_recompute_list_under_a_pipeline``)."""
import os
import sys

import pytest

import autopar
from autopar.cost_models.hardware import parse_cluster
from capture_reuse import same_model
from autopar.analysis.layers import repeated_layers
from autopar.solver.pipeline_search import capture_microbatch
from examples.models import gpt_factory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from step_terms import step_terms  # noqa: E402  (a plan's step by term, priced again)

LAYERS = 8


@pytest.fixture(scope="module")
def ex():
    # activations outweigh the training state (a sequence of 64): recomputing pays
    return gpt_factory(batch=8, n_layer=LAYERS, n_embd=32, block_size=64)


def _plan(ex, **pins):
    with same_model("gpt-8-layers"):        # one capture per batch shape for every plan here
        return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **pins)


def _between(ex, **pins):
    """(plan without recomputation, plan recomputing every layer, the budget half-way)."""
    none = _plan(ex, recompute="none", **pins)
    full = _plan(ex, recompute="full", **pins)
    low, high = full.estimate.memory_total, none.estimate.memory_total
    assert low < 0.8 * high, (low, high)            # recomputing saves memory here
    return none, full, int((low + high) / 2)


def test_unpipelined_plan_recomputes_the_fewest_layers_that_fit(ex):
    # the whole batch (accumulate=1): micro-batches are the other way to fit, and which of
    # the two is faster on this machine's measured core turns on its load
    pins = dict(cluster="cpu:1", accumulate=1)
    none, full, budget = _between(ex, **pins)
    plan = _plan(ex, memory_budget=budget, **pins)
    k = len(plan.recompute)
    assert 0 < k < LAYERS, plan.recompute
    # a CPU rank's host memory is its memory: offloading would free none of it, so the free
    # search never offers it (where the memcpy was priced below a forward, it had offloaded)
    assert not plan.options.offload_activations, plan.options.offload_activations
    assert plan.estimate.memory_total <= budget
    assert none.estimate.step_time_s < plan.estimate.step_time_s < full.estimate.step_time_s
    # the fewest: with one layer fewer the plan needs more than the budget
    fewer = _plan(ex, recompute=list(plan.recompute[:-1]), **pins)
    assert fewer.estimate.memory_total > budget


def test_pipeline_recomputes_more_layers_on_earlier_stages(ex):
    pins = dict(cluster="cpu:2", pipeline=2, schedule="1f1b", micro_batch_size=1)
    none, full, budget = _between(ex, **pins)
    plan = _plan(ex, memory_budget=budget, **pins)
    assert 0 < len(plan.recompute) < LAYERS, plan.recompute
    assert plan.estimate.memory_total <= budget
    assert plan.estimate.step_time_s < full.estimate.step_time_s
    # the stage of each layer: after how many cuts its first node comes (in graph order)
    with same_model("gpt-8-layers"):        # the graph the plan was made on
        cap = capture_microbatch(ex.model, ex.inputs, ex.loss_fn, ex.target, plan.n_microbatches)
    order = {n.name: i for i, n in enumerate(cap.gm.graph.nodes)}
    cuts = [order[c] for c in plan.pipeline.stage_cuts]
    per_stage = [0] * (len(cuts) + 1)
    for layer, names in repeated_layers(cap.gm).items():
        if layer in plan.recompute:
            per_stage[sum(order[names[0]] >= c for c in cuts)] += 1
    # the estimate's compute holds the recomputation of that list (benchmarks/step_terms.py
    # prices the plan again from its placements and recompute list; the critical rank's)
    terms = step_terms(cap, plan, parse_cluster("cpu:2"))
    full_terms = step_terms(cap, full, parse_cluster("cpu:2"))
    assert 0 < terms["recompute"] < full_terms["recompute"]
    assert terms["compute"] + terms["recompute"] == pytest.approx(plan.estimate.compute_s, rel=1e-9)
    print(f"layers recomputed per stage: {per_stage}, step {plan.estimate.step_time_s:.4g} s "
          f"(every layer {full.estimate.step_time_s:.4g} s, none {none.estimate.step_time_s:.4g} s)")
    assert per_stage[0] > 0 and per_stage == sorted(per_stage, reverse=True), per_stage


def test_pipeline_prices_each_recomputed_layer_apart():
    """A pipeline's per-node prices of a plan recomputing one of two layers (its repeated
    layers share one decision per node, whose price averages recomputation over them) say
    which layer recomputes: its nodes pay their forward and forward collectives (tensor
    parallel) again, the other layer's nothing; the same as pricing the plan without
    recomputation and adding that layer's (what ``partial_recompute`` chooses with)."""
    from dataclasses import replace

    from autopar.solver.flat import Solved
    from autopar.solver.pipeline_price import price_plan
    from autopar.solver.flat import MeshAsk
    from autopar.solver.pipeline_search import solve_intra
    small = gpt_factory(batch=8, n_layer=2, n_embd=32)
    cl = parse_cluster("cpu:4")
    with same_model("gpt-2-layers"):
        cap = capture_microbatch(small.model, small.inputs, small.loss_fn, small.target, 2)
    plain, solved_plain = solve_intra(cap, MeshAsk(cl, 4, {"tensor": 2, "recompute": "none"}), 2)
    rec, solved_rec = solve_intra(cap, MeshAsk(cl, 4, {"tensor": 2, "recompute": ["h.0"]}), 2)
    assert rec.recompute == ("transformer.h.0",)
    same = Solved(solved_rec.problem, solved_rec.cost, dict(solved_plain.choice))
    bare = price_plan(cap, plain, solved_plain, cl, 4, 2, 2).nc
    derived = bare.with_recompute(cap, rec.recompute)
    solver = price_plan(cap, replace(rec, nodes=plain.nodes), same, cl, 4, 2, 2).nc
    for term in ("compute", "sync", "activations"):
        assert getattr(derived, term) == pytest.approx(getattr(solver, term)), term
    # (outside the layers a conversion the plain plan shares with a reader in h.0 is paid
    # apart under recomputation: ln_f's all-reduce, which ``with_recompute`` leaves out)
    layers = repeated_layers(cap.gm)
    inside = [i for i, u in enumerate(solver.units) if any(u in names for names in layers.values())]
    assert derived.comm[inside] == pytest.approx(solver.comm[inside])
    h0 = [i for i in inside if solver.units[i] in layers["transformer.h.0"]]
    rerun = solver.comm[inside] - bare.comm[inside]     # forward collectives again: h.0 only
    assert (solver.comm - bare.comm)[h0].sum() > 0 and rerun.sum() == pytest.approx(
        (solver.comm - bare.comm)[h0].sum())


def test_zero_bubble_prices_a_recomputing_later_stage_without_its_weight_half(ex, monkeypatch):
    """Under zero bubble a stage after the first that holds recomputed layers runs its whole
    backward at I and nothing at W (``runtime.pipeline_runner.split_backward_safe`` is False
    for its checkpointed regions): the estimate times its W as the action alone, while the
    first stage keeps the split."""
    from autopar.solver import pipeline_price
    seen = []
    real = pipeline_price.simulate

    def spy(actions, forward, backward, weight=None, p2p=0.0, **kw):
        seen.append(weight)
        return real(actions, forward, backward, weight, p2p, **kw)

    monkeypatch.setattr(pipeline_price, "simulate", spy)
    plan = _plan(ex, pipeline=2, schedule="zero-bubble", micro_batch_size=2,
                 recompute=[f"h.{LAYERS - 1}"])
    assert plan.pipeline.schedule == "zero-bubble" and plan.recompute
    rec = seen[-1]
    plain = _plan(ex, pipeline=2, schedule="zero-bubble", micro_batch_size=2, recompute="none")
    assert plain.pipeline.schedule == "zero-bubble" and not plain.recompute
    split = seen[-1]
    action = rec[1]                    # the recomputing stage's W: the action's cost alone
    assert split[1] - action > 0.5 * (split[0] - action) > 0   # without it, its weight half
    assert rec[0] == pytest.approx(split[0], rel=0.2)          # the first stage keeps its split


def test_free_search_probes_the_fewest_layers_once_the_unpipelined_plan_could_win(monkeypatch):
    """On two nodes the free search also searches pipelines, and it defers the probes for
    the unpipelined plan's fewest recomputed layers until that plan could win (GPT, hidden
    1024, 4 layers, on 2 DGX A100s, data 8, under a budget between every layer recomputed
    and none). With no pipeline found (``search_pipelines`` stubbed) the plan recomputes 2
    of the 4 layers, as the unpipelined search alone chooses, and the probes resume that
    search (no sharding ILP solved twice); with a pipeline far faster the probes are
    skipped."""
    import dataclasses

    import torch

    import autopar.solver.flat as flat
    import autopar.solver.free_search as free_search
    from autopar.solver.ilp import solve as solve_ilp
    with torch.device("meta"):
        gpt = gpt_factory(batch=32, n_layer=4, n_embd=1024, n_head=8, block_size=512,
                          vocab_size=512)

    def plan(**pins):
        return autopar.plan(gpt.model, gpt.inputs, gpt.loss_fn, target=gpt.target,
                            cluster="2xdgx-a100", data=8, zero=0, accumulate=1,
                            offload_activations="none", **pins)    # recomputation alone
    full, none = plan(recompute="full"), plan(recompute="none")
    budget = full.estimate.memory_total + 0.4 * (none.estimate.memory_total - full.estimate.memory_total)
    monkeypatch.setattr(free_search, "search_pipelines", lambda *a, **k: None)
    solved = []       # (mesh, ZeRO stage, recomputed nodes) of every sharding ILP

    def counted(problem, cost, *a, **k):
        solved.append((problem.mesh_shape, cost.zero, cost.recompute))
        return solve_ilp(problem, cost, *a, **k)
    monkeypatch.setattr(flat, "solve_ilp", counted)
    chosen = plan(memory_budget=budget)
    assert len(chosen.recompute) == 2 and chosen.estimate.memory_total <= budget, chosen.recompute
    assert full.estimate.step_time_s > chosen.estimate.step_time_s
    assert "unpipelined, fewest layers" in chosen.solver.phases
    # the probes resume the unpipelined search: no ILP of it is solved again
    assert len(solved) == len(set(solved)), solved
    fast = dataclasses.replace(full, estimate=dataclasses.replace(full.estimate, step_time_s=1e-3))
    monkeypatch.setattr(free_search, "search_pipelines", lambda *a, **k: (fast, None))
    chosen = plan(memory_budget=budget)
    assert chosen.estimate.step_time_s == 1e-3
    assert "unpipelined, fewest layers" not in chosen.solver.phases


def test_the_first_probe_grows_only_the_phases_that_hold_activations():
    """``flat.activation_room``: where the peak is the gradients' phase (with their
    buffers), the activations may grow by the room of their own phase, not by the budget
    less the peak (the bound that sent Llama 3 70B's probes on 8x8xH100 from 79 layers
    down by 1, 2, 4: the gradients' phase held the peak, 30 GiB above the activations');
    grown by exactly that room the terms meet the budget, by more they pass it."""
    from autopar.solver.flat import activation_room
    from cost_models.memory import peak_bytes, step_phases
    terms = {"params": 15.0, "optimizer": 31.0, "activations": 6.0, "recompute": 1.5,
             "loss_grads": 2.0, "grads": 15.0, "grad_buffers": 12.0, "optimizer_step": 15.0}
    phases, budget = step_phases(), 80.0
    room = activation_room(terms, phases, budget)
    assert room > budget - peak_bytes(terms, phases)          # 26 GiB, not 4
    grown = lambda extra: peak_bytes({**terms, "activations": terms["activations"] + extra}, phases)
    assert grown(room) == pytest.approx(budget)
    assert grown(room + 0.5) > budget
    # without phases every term is live at once: the budget less the whole
    assert activation_room(terms, (), budget) == pytest.approx(budget - sum(terms.values()))
