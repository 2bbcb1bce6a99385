"""Elastic across every model axis (issue 43, item 4): a job pinned ``context=2``,
``expert=2``, ``tensor=2`` or ``pipeline=2`` loses half its ranks and resumes to one
device's numbers.

One gloo launch of 4 ranks (``tests/elastic_axes_worker.py``), every case in it: 4 ranks
train (``elastic=True, data=2, <axis>=2``, ZeRO-3 beside context and tensor, AdamW, a
checkpoint every 2 steps) 5 steps, the 5th after checkpoint 4 and lost with the ranks;
ranks 2 and 3 then leave, and ranks 0 and 1 start a new 2-rank world (a fresh process group
and store) in which, with the same pins, each case re-plans (``autopar.elastic.elastic_pins``:
the axis kept, ``data`` 1, ``accumulate`` 2, or under the pipeline twice the micro-batches
of half the rows), loads checkpoint 4 saved under the 4-rank mesh (``autopar.elastic.resume``)
and trains steps 4 to 6. The loss of every step, the lost step's included, and the weights
after the last equal one device's run of the same global batches (``GlobalBatchSampler``),
within ``autopar.verify``'s loss and weight tolerances, and differ from a run that lost the
data position. The torchrun elastic agent itself (a lost node, a rendezvous, fresh worker
processes) is tests/test_elastic.py's.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from autopar.verify import Run, compare, LOSS_RTOL, WEIGHT_RTOL  # noqa: E402
from elastic_axes_worker import CASES, LOST_AT, STEPS, one_device  # noqa: E402
from launch import case_result, torchrun_cases  # noqa: E402

AXES = list(CASES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic-axes")
    cases = [{"id": f"{phase}-{a}", "axis": a, "phase": phase, "dir": str(tmp / a)}
             for phase in ("save", "resume") for a in AXES]
    got = torchrun_cases("elastic_axes_worker.py", 4, cases, tmp / "results.json",
                         timeout=600, case_timeout=240)
    return tmp, got


@pytest.mark.parametrize("axis", AXES)
def test_a_job_pinned_an_axis_loses_half_its_ranks_and_resumes_to_one_device(runs, axis):
    tmp, got = runs
    a, b = case_result(got, f"save-{axis}"), case_result(got, f"resume-{axis}")
    # the axis is kept and data takes the rest: 2 x 2 on 4 ranks, 1 x 2 on 2
    for r, world, data in ((a, 4, 2), (b, 2, 1)):
        assert r["world"] == world and r["mesh"].get(axis) == 2, r
        assert r["mesh"].get("data", 1) == data, r
        if axis != "pipeline":     # the mode happened: parameters split on the axis (ZeRO-3's
            assert r["split_on_axis"], r      # on the context axis, the experts', tensor's)
    if axis == "pipeline":      # its own micro-batches: one row each, twice as many on 2 ranks
        assert (a["pipeline_stages"], a["microbatches"], b["microbatches"]) == (2, 4, 8), (a, b)
    else:                        # no larger a micro-batch per rank: 2 of them on 2 ranks
        assert (a["accumulate"], b["accumulate"]) == (1, 2), (a, b)
    assert (a["resumed_from"], a["steps"], b["resumed_from"], b["steps"]) == (0, LOST_AT, 4, STEPS)
    init, ref, ref_losses = one_device(CASES[axis][0], STEPS)
    final = torch.load(tmp / axis / "final.pt", weights_only=True)
    # steps 0-3 on 4 ranks (step 4 too, lost with the ranks), 4-6 on 2 ranks after the reload
    losses = a["losses"][:4] + b["losses"]
    c = compare(Run(ref_losses, [], ref, init), Run(losses, [], final))
    print(f"\n{axis}: loss err {c.loss_err:.1e}, weight err {c.weight_err:.1e} ({c.weight_worst}); "
          f"re-plan {b['plan_seconds']:.1f} s, reload {b['reload_seconds']:.2f} s")
    assert not c.problems, c.problems
    lost_step = abs(a["losses"][4] - ref_losses[4]) / abs(ref_losses[4])    # done again after
    assert lost_step < LOSS_RTOL, (a["losses"], ref_losses)
    assert c.loss_err < LOSS_RTOL, (losses, ref_losses)
    assert c.weight_err < WEIGHT_RTOL, f"{c.weight_worst} off by {c.weight_err:.2e} of its change"
    # the comparison sees a resume that lost the data position (steps 0-2 read again)
    _, lost, lost_losses = one_device(CASES[axis][0], [0, 1, 2, 3, 0, 1, 2])
    wrong = compare(Run(lost_losses, [], lost, init), Run(losses, [], final))
    assert wrong.weight_err > 100 * WEIGHT_RTOL and wrong.loss_err > 100 * LOSS_RTOL, wrong
