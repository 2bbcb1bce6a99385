"""The free pipeline search's programs solved ahead by forked workers
(``autopar.solver.speculate``) give the plan the search finds alone, also when a worker
dies; an infeasible mesh's explanation (one more ILP) is worked out only when no mesh fits.
Plans without processes beyond the workers."""
from __future__ import annotations

import functools
import os

import pytest
import torch

from autopar.capture import capture
from autopar.errors import ArgumentError
from autopar.mesh_roles import MeshRoles
from autopar.options import Options
from autopar.pricing.costing import StepView
from autopar.solver import flat, ilp, pipeline_free, speculate
from autopar.solver.driver import solve
from examples.hf_llama import hf_llama_meta
from examples.models import gpt_factory

CLUSTER = "4x2xA100"        # several nodes: the free search weighs pipelines (degrees 2, 4)


@functools.cache
def six_layers():
    with torch.device("meta"):
        ex = gpt_factory(batch=16, n_layer=6, n_embd=64, n_head=4, block_size=64, vocab_size=256)
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _chosen(plan) -> dict:
    """Everything the plan chose, without the solver's report (its timings)."""
    return {k: v for k, v in plan.to_dict().items() if k != "solver"}


def _plan(monkeypatch, workers: int, budget=None):
    ex, cap = six_layers()
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", str(workers))
    seen = []
    real_close = speculate.Speculation.close
    monkeypatch.setattr(speculate.Speculation, "close",
                        lambda self: seen.append((len(self.items), set(self.read))) or real_close(self))
    plan, _ = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=CLUSTER,
                    memory_budget=budget, captured=cap)
    return plan, seen


def test_workers_solve_the_pipeline_search_ahead_to_the_same_plan(monkeypatch):
    alone, none = _plan(monkeypatch, 0)
    assert none == []                          # no worker: no speculation
    ahead, seen = _plan(monkeypatch, 1)
    n_meshes, read = seen[0]
    # (2, 4 stages) x (tensor 1, 2), the probes, the unpipelined plan's programs: meshes
    # (8,) and (4, 2), without and with every layer recomputed; a worker's read
    assert n_meshes == 4 + 1 + 2 * 2 and read
    assert _chosen(ahead) == _chosen(alone)
    assert speculate.active() is None


def test_a_hugging_face_llama_plans_alike_with_a_worker(monkeypatch):
    """transformers' LlamaForCausalLM (4 layers): the worker solves the unpipelined plan's
    programs (one job per mesh and recomputation choice) beside the search, which reads
    them or solves the rest; the plan is the single process's."""
    pytest.importorskip("transformers")
    ex = hf_llama_meta(16, 32, vocab_size=128, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64)
    model, (tokens,), loss_fn = ex.model, ex.inputs, ex.loss_fn
    cap = capture(model, (tokens,), loss_fn, tokens)
    plans, reads = [], []
    real_close = speculate.Speculation.close
    for workers in (0, 1):
        monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", str(workers))
        seen = []
        monkeypatch.setattr(speculate.Speculation, "close",
                            lambda self: seen.append([self.items[i] for i in self.read])
                            or real_close(self))
        plans.append(solve(model, (tokens,), loss_fn, target=tokens, cluster=CLUSTER,
                           captured=cap)[0])
        reads.append(seen)
    assert reads[0] == [] and reads[1]
    # what the worker solved and the search read includes the unpipelined plan's programs
    flat_jobs = flat.mesh_jobs(cap, _cluster(), 8)
    assert flat_jobs and any(item in flat_jobs for item in reads[1][0])
    assert _chosen(plans[1]) == _chosen(plans[0])


def _cluster():
    from autopar.cost_models.hardware import parse_cluster
    return parse_cluster(CLUSTER)


def test_a_worker_that_dies_leaves_its_meshes_to_the_search(monkeypatch):
    alone, _ = _plan(monkeypatch, 0)
    monkeypatch.setattr(pipeline_free._DegreeSearch, "solve_ahead", lambda self, mesh: os._exit(3))
    ahead, seen = _plan(monkeypatch, 1)
    assert seen and seen[0][1] == set()        # nothing came back: the search solved it all
    assert _chosen(ahead) == _chosen(alone)


def test_outcomes_are_read_only_for_the_program_that_was_solved(monkeypatch):
    """A worker's outcome is keyed by everything its program is made of: another budget,
    ZeRO stage or recomputation is another program."""
    _, cap = six_layers()
    from autopar.cost_models.hardware import parse_cluster
    cl = parse_cluster(CLUSTER)
    job = dict(shape=(4, 2), roles=MeshRoles(data=0, tensor=1),
               pins=Options.from_pins({"data": 4, "tensor": 2}), n_states=2, rec=None,
               budget=1e9, time_limit_s=60.0)
    view = dict(memory_weights={"activations": 0.5}, grad_sync_scale=1.0)

    def key(job_change=None, view_change=None):
        return flat._ilp_key(cap, cl, flat.MeshJob(**{**job, **(job_change or {})}),
                             StepView(**{**view, **(view_change or {})}))
    for change in ({"budget": 2e9}, {"pins": Options.from_pins({"data": 4, "tensor": 2, "zero": 3})},
                   {"rec": ["h.0"]}, {"shape": (8,)}, {"roles": MeshRoles(data=1, tensor=0)},
                   {"roles": MeshRoles(data=0, tensor=1, dispatch="all-gather")}):
        assert key(job_change=change) != key(), change
    for change in ({"memory_weights": {"activations": 0.25}}, {"grad_sync_scale": 0.5}):
        assert key(view_change=change) != key(), change
    assert key() == key()


def test_plan_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "two")
    with pytest.raises(ArgumentError, match="AUTOPAR_PLAN_WORKERS='two'"):
        speculate.workers_for(10_000)
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "3")
    assert speculate.workers_for(10) == 3
    assert speculate.workers_for(10, profiler=object()) == 0
    monkeypatch.delenv("AUTOPAR_PLAN_WORKERS")
    assert speculate.workers_for(speculate.MIN_NODES - 1) == 0


def test_an_infeasible_mesh_is_explained_only_when_no_mesh_fits(monkeypatch):
    """``flat._search`` leaves a mesh that does not fit unexplained (the least-memory plan
    is one more ILP) until ``solve_captured`` finds that no mesh fits."""
    ex, cap = six_layers()
    from autopar.cost_models.hardware import parse_cluster
    cl = parse_cluster("1x6xA100")     # 16 samples do not split 6 ways: the 1-D mesh holds more
    explained = []
    real = ilp.explain_infeasible

    def counted(problem, *a):
        explained.append(problem.mesh_shape)
        return real(problem, *a)
    monkeypatch.setattr(flat, "explain_infeasible", counted)
    monkeypatch.setattr(ilp, "explain_infeasible", counted)
    with pytest.raises(flat.InfeasibleError) as nothing:
        flat.solve_captured(cap, cl, 6, memory_budget=1.0, pins={"recompute": "none"})
    meshes = [r for r in nothing.value.meshes if r["family"] != "data only"]
    assert len(meshes) > 1 and sorted(explained) == sorted(tuple(r["mesh"]) for r in meshes)
    needs = {tuple(r["mesh"]): r["need"] for r in meshes}
    # a budget the leanest mesh fits and the fullest does not
    budget = (min(needs.values()) + max(needs.values())) / 2
    explained.clear()
    plan, _ = flat.solve_captured(cap, cl, 6, memory_budget=budget, pins={"recompute": "none"})
    assert plan.estimate.memory_total <= budget and explained == []
