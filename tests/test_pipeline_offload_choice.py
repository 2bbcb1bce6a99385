"""The free pipeline search weighs activation offload against recomputation (issue 44 item 2,
``solver.pipeline_offload``): where a pipeline configuration fits only by freeing layers,
each freed layer is recomputed or offloaded, whichever the flat search's chooser
(``solver.offload_choice``) prices cheaper, and the split replaces the recomputing plan when
it fits and is faster. Plans on the meta device (a GPT of hidden 16384, 8 layers, sequence
2048, batch 32, on 2 nodes of 8 H100s: data 8, ZeRO-3, bf16; the search weighs pipelines of
2 stages)."""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.gpus import H100_80GB
from autopar.cost_models.hardware import parse_cluster
from autopar.cost_models.offload import HOST_LINKS as host_links, HostLink
from autopar.options import as_options
from autopar.report import fold_indexed
from autopar.solver import pipeline_offload, pipeline_search
from autopar.solver.errors import PipelineInfeasibleError
from autopar.solver.flat import MeshAsk
from autopar.solver.pipeline_free import search_pipelines
from autopar.solver.spec import SearchSpec, Settings
from examples.models import gpt_factory

CLUSTER = "2x8xH100"
PINS = {"data": 8, "zero": 3, "precision": "bf16"}


@functools.cache
def _gpt():
    with torch.device("meta"):
        ex = gpt_factory(batch=32, n_layer=8, n_embd=16384, n_head=128, block_size=2048,
                         vocab_size=512)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _search(budget=None, pins=None):
    ex, cap = _gpt()
    cl = parse_cluster(CLUSTER)
    spec = SearchSpec(ex.model, ex.inputs, ex.loss_fn, ex.target, cl, cl.world_size,
                      as_options({**PINS, **(pins or {})}), memory_budget=budget, time_limit_s=30.0)
    return search_pipelines(spec, cap)


@pytest.fixture
def weighed(monkeypatch):
    """The configurations ``pipeline_offload.with_offload`` was asked about."""
    seen = []
    real = pipeline_offload.with_offload

    def spy(cutter, fitted):
        seen.append(cutter.config)
        return real(cutter, fitted)
    # (not raising: without the choice the tests fail on what they plan, not here)
    monkeypatch.setattr(pipeline_search, "with_offload", spy, raising=False)
    return seen


@functools.cache
def _budget():
    """The parameters, gradients, optimizer state and the pipeline runtime's receive
    buffers the search's plan without a budget holds per device (it frees no layer) and 45%
    of its activations: every plan must free layers to fit."""
    plan, _ = _search()
    assert not plan.recompute and plan.options.offload_activations is None
    held = plan.estimate.memory_bytes
    return sum(held.get(k, 0.0) for k in ("params", "grads", "optimizer", "pipeline_buffers")) \
        + 0.45 * held["activations"]


def _unoffloaded(plan, mcap, budget, offload):
    """``plan``'s configuration and stage mesh planned again with ``offload`` pinned and
    nothing recomputed (``pipeline_search.plan_pipeline``)."""
    cl = parse_cluster(CLUSTER)
    p = plan.pipeline
    ask = MeshAsk(cl, cl.world_size, {**PINS, "recompute": "none", "offload_activations": offload},
                  Settings(budget))
    config = (p.stages, p.virtual_stages, p.n_microbatches, p.schedule)
    return pipeline_search.plan_pipeline(mcap, ask, config, extra_pins={"tensor": 1})


def test_search_offloads_where_the_host_link_hides_the_copies(weighed):
    """PCIe 5.0 behind a hidden-16384 layer's compute: the layers the search frees are
    offloaded, the plan fits and is faster than every recomputing plan; the same
    configuration without the offload does not fit, with it (pinned) it does."""
    budget = _budget()
    plan, mcap = _search(budget)
    off = plan.options.offload_activations
    assert off and len(off) > len(plan.recompute), (off, plan.recompute)
    assert weighed
    e = plan.estimate
    assert e.memory_total <= budget and e.memory_bytes["offload"] > 0
    assert plan.host_memory_bytes["activations"] > 0
    head = plan.summary().splitlines()[0]
    assert f"'offload_activations': {fold_indexed(list(off))}" in head, head
    recomputing, _ = _search(budget, {"offload_activations": "none"})
    assert recomputing.recompute and recomputing.options.offload_activations == "none"
    assert e.step_time_s < recomputing.estimate.step_time_s, (e.step_time_s, recomputing.estimate.step_time_s)
    with pytest.raises(PipelineInfeasibleError):
        _unoffloaded(plan, mcap, budget, "none")
    pinned = _unoffloaded(plan, mcap, budget, off)
    assert pinned.estimate.memory_total <= budget


def test_search_recomputes_where_the_host_link_is_slow(weighed, monkeypatch):
    """A host link 16 times slower (PCIe 5.0 x16 at 80% / 16): the copies are not hidden,
    every freed layer is recomputed (the chooser was asked)."""
    budget = _budget()
    link = host_links[H100_80GB.name]
    monkeypatch.setitem(host_links, H100_80GB.name, HostLink(link.bandwidth / 16, link.host_mem_bandwidth))
    plan, _ = _search(budget)
    assert weighed
    assert plan.recompute and plan.options.offload_activations is None, plan.options
    assert plan.estimate.memory_total <= budget


def test_nothing_freed_nothing_offloaded(weighed):
    """Without a budget the model fits as it is: no configuration frees a layer, so the
    chooser is never asked and the plan neither recomputes nor offloads."""
    plan, _ = _search()
    assert not weighed
    assert not plan.recompute and plan.options.offload_activations is None
    assert not plan.host_memory_bytes and "offload" not in plan.estimate.memory_bytes
