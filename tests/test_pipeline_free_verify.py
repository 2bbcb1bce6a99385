"""The free pipeline search plans its best-predicted configuration for real; when the real
step falls short of the prediction, the next configurations whose predictions beat it are
planned too, and the fastest real plan wins (``pipeline_free.search_pipelines``). Found on
BLOOM 176B on Omni-Path nodes: ZeRO-3 over 64 ranks predicted 82 s per step, planned 167 s,
returned over tensor 4 x pipeline 12 (predicted 84 s, planned 88 s)."""
from types import SimpleNamespace as NS

import torch

from autopar.options import Options
from autopar.solver import pipeline_free
from autopar.solver.spec import SearchSpec

# p -> (predicted step, real step of its plan)
STEPS = {3: (80.0, 166.0), 12: (84.0, 88.0), 24: (89.0, 90.0)}


class _Search:
    def __init__(self, *a, **k):
        pass

    def best(self, p):
        return STEPS[p][0], p, NS(virtual_stages=1, micro_batches=4, schedule="1f1b"), {}

    def unpruned(self):
        return {}


def _plan(mcap, ask, config, **kw):
    planned.append(config[0])
    return NS(estimate=NS(step_time_s=STEPS[config[0]][1]), p=config[0], recompute=(), options=Options())


planned = []


def test_a_plan_short_of_its_prediction_does_not_end_the_search(monkeypatch):
    monkeypatch.setattr(pipeline_free, "pipeline_degrees", lambda cap, cl, world: sorted(STEPS))
    monkeypatch.setattr(pipeline_free, "_DegreeSearch", _Search)
    monkeypatch.setattr(pipeline_free, "capture_microbatch", lambda *a: "mcap")
    monkeypatch.setattr(pipeline_free, "plan_pipeline", _plan)
    planned.clear()
    spec = SearchSpec(None, (torch.zeros(8, 2),), None, None, NS(device=NS(memory_bytes=1.0)), 8,
                      Options())
    plan, _ = pipeline_free.search_pipelines(spec, None)
    assert plan.p == 12 and plan.estimate.step_time_s == 88.0
    assert planned == [3, 12]       # 24 predicted at 89 s cannot beat 12 planned at 88 s
