"""plan_quality's checks of a free plan's gain over a published configuration (``caveats``):
each says what in the gain the cost model may not bear out, and only when the plans show it."""
from types import SimpleNamespace as NS

import torch

from benchmarks.plan_quality import caveats
from benchmarks.step_terms import TERMS

GiB = 2**30
CL = NS(device=NS(memory_bytes=80 * GiB))


def _plan(recompute, schedule, memory, nodes=None, stages=4):
    return NS(recompute=recompute, schedule=schedule, pipeline_stages=stages,
              estimate=NS(memory_total=memory), nodes=nodes or {})


def _cap(*nodes):
    return NS(gm=NS(graph=NS(nodes=list(nodes))))


def _terms(**kw):
    return {k: kw.get(k.split()[0].replace("-", "_"), 0.0) for k in TERMS}


def test_caveats_name_what_the_gain_rests_on():
    split = NS(name="split", target=torch.ops.aten.split.Tensor)
    base = (_plan(True, "1f1b", 40 * GiB, {"split": NS(inputs=("RS(0)P",))}), _cap(split))
    free = (_plan(False, "zero-bubble", 78 * GiB), _cap())
    tb = _terms(compute=8.0, recompute=3.0, tensor_parallel=3.0, pipeline=1.0)
    tf = _terms(compute=8.0, tensor_parallel=1.0, pipeline=0.1)
    tb["pipeline bubble"], tf["pipeline bubble"] = 1.5, 0.2
    tb["pipeline p2p"], tf["pipeline p2p"] = 0.01, 0.05
    got = " | ".join(caveats(base, free, tb, tf, CL))
    assert "not recomputing" in got and "Korthikanti" in got
    assert "NOT CERTAIN" in got and "78.0 of 80 GiB" in got
    assert "zero-bubble" in got
    assert "PARTLY PRICED HIGH" in got and "2.000 s tensor-parallel saving" in got
    assert "0.040 s of sends" in got


def test_no_caveat_without_its_cause():
    base = (_plan(False, "1f1b", 40 * GiB), _cap())     # nothing split as a partial sum
    free = (_plan(False, "1f1b", 60 * GiB), _cap())     # 75% of memory, same schedule
    tb = _terms(compute=8.0, tensor_parallel=3.0)
    tf = _terms(compute=7.0, tensor_parallel=1.0)
    assert caveats(base, free, tb, tf, CL) == []
