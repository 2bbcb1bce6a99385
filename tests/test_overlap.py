"""DualPipeV's forward/backward pairs run at once where a stage's experts dispatch by
all-to-all (``autopar.runtime.overlap``, issue 44 item 4), and priced so
(``solver.pipeline_price.pair_hidden``).

Here without processes: the price of a pair (the closed form, then a planned Mixtral
pipeline 2 x expert 2 under DualPipeV with the overlap and without), where the runtime
applies it, the pins, and the pair function's failures on stand-in stages. The run on gloo
ranks (equal to one device, the pairs really run at once) is a case of
``tests/test_pipeline_runtime.py``'s 4-rank launch.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs transformers")

import autopar  # noqa: E402
from autopar.errors import PinError  # noqa: E402
from autopar.options import Options  # noqa: E402
from autopar.runtime.overlap import OverlapPairs, expert_all_to_all_axes, overlap_applies  # noqa: E402
from autopar.schedule import Action, overlap_pairs  # noqa: E402
from autopar.solver.pipeline_price import pair_hidden  # noqa: E402
from capture_reuse import same_model  # noqa: E402
from examples import zoo  # noqa: E402

PINS = {"pipeline": 2, "expert": 2, "schedule": "dualpipev", "micro_batch_size": 2}


# ---- the price of a pair -----------------------------------------------------------------

@pytest.mark.parametrize("fc,fa,bc,ba", list(itertools.product((0.0, 1.0, 3.0), repeat=4)))
def test_pair_takes_the_longest_of_what_cannot_overlap(fc, fa, bc, ba):
    """F + B - hidden = max(Fc + Bc, Fa + Ba, Fc + Fa, Bc + Ba): the two computes share the
    device, the two all-to-alls the link, and each half runs in order; so never below the
    pair's compute, and nothing hidden without an all-to-all."""
    f, b = Action(0, "F", 1), Action(1, "B", 0)
    hidden = pair_hidden([[(f, b)]], np.array([fc, 0.0]), np.array([0.0, bc]),
                         np.array([[fa, 0.0], [0.0, ba]]))
    h = hidden.get(b, 0.0)
    assert fc + fa + bc + ba - h == pytest.approx(max(fc + bc, fa + ba, fc + fa, bc + ba))
    assert fc + fa + bc + ba - h >= fc + bc
    assert h <= bc + ba                  # at most the backward it comes off
    if fa == ba == 0:
        assert hidden == {}


@pytest.fixture(scope="module")
def plans():
    """Mixtral (2 layers of 4 experts, batch 8) planned for pipeline 2 x expert 2 under
    DualPipeV on 4 CPU ranks, with the overlap (the default) and with it pinned off; one
    capture for both."""
    b = zoo.build("mixtral", batch=8)
    with same_model("mixtral-8"):
        return {on: autopar.plan(b.model, b.inputs, b.loss_fn, target=b.target, cluster="cpu:4",
                                 dualpipev_overlap=on, **PINS) for on in (None, False)}


def test_dualpipev_with_experts_is_priced_faster_by_the_hidden_all_to_all(plans):
    """The same plan priced with its pairs at once is faster than without by at most the
    all-to-all it hides (the ``overlapped`` row less the gradient sync's share, which both
    have), and never below the busiest rank's compute; the experts' all-to-all is a row of
    the communication table either way."""
    on, off = plans[None].estimate, plans[False].estimate
    assert plans[None].stage_cuts == plans[False].stage_cuts
    assert on.comm["all_to_all@expert"] == pytest.approx(off.comm["all_to_all@expert"])
    assert on.comm["all_to_all@expert"] > 0
    hidden = off.comm.get("overlapped", 0.0) - on.comm["overlapped"]
    assert hidden > 0
    assert on.step_time_s < off.step_time_s
    assert off.step_time_s - on.step_time_s <= hidden * (1 + 1e-9)
    assert on.step_time_s >= on.compute_s
    assert on.compute_s == pytest.approx(off.compute_s)


def test_where_the_runtime_overlaps(plans):
    """On for DualPipeV with an expert all-to-all inside the stages; off when pinned off,
    under another schedule, under compile or ZeRO-3, beside a context axis, or with no
    experts op split by all-to-all."""
    plan = plans[None]
    assert expert_all_to_all_axes(plan) == [plan.mesh_axes.index("expert")]
    assert overlap_applies(plan)
    assert not overlap_applies(plans[False])
    assert not overlap_applies(replace(plan, pipeline=replace(plan.pipeline, schedule="1f1b")))
    for pins in ({"compile": True}, {"zero": 3}):
        assert not overlap_applies(replace(plan, options=replace(plan.options, **pins)))
    assert not overlap_applies(replace(plan, mesh_axes=("pipeline", "context")))
    assert not overlap_applies(replace(plan, node_ops={}))


def test_overlap_pins():
    assert Options.from_pins(dualpipev_overlap=False).dualpipev_overlaps is False
    assert Options.from_pins(pipeline=2, schedule="dualpipev").dualpipev_overlaps
    with pytest.raises(PinError, match="dualpipev_overlap='yes': use True, False"):
        Options.from_pins(dualpipev_overlap="yes")
    with pytest.raises(PinError, match="schedule='1f1b' has none: pin schedule='dualpipev'"):
        Options.from_pins(pipeline=2, schedule="1f1b", dualpipev_overlap=True)


# ---- the pair function on stand-in stages ------------------------------------------------

class _Stage:
    def __init__(self, k, n, fail=None, log=None, gate=None):
        self.stage_index, self.is_first, self.is_last = k, k == 0, k == n - 1
        self.fail, self.log, self.gate = fail, log, gate

    def forward_one_chunk(self, mb, args, kwargs, save_forward_output=False):
        self.log.append(("F", self.stage_index, mb, threading.current_thread().name))
        self.gate[0].set()               # each half waits for the other to have started
        self.gate[1].wait(5)
        if self.fail == "F":
            raise ValueError("forward broke")
        return mb

    def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
        self.log.append(("B", self.stage_index, mb, threading.current_thread().name))
        self.gate[1].set()
        self.gate[0].wait(5)
        if self.fail == "B":
            raise ValueError("backward broke")

    def set_local_fwd_input(self, output, mb):
        pass

    def set_local_bwd_input(self, grad, mb):
        pass

    def get_local_bwd_output(self, mb):
        return None


def _pair(fail=None):
    """A 2-stage rank's pair F(0, 3) with B(1, 1), stage ``fail`` of them raising."""
    log, gate = [], (threading.Event(), threading.Event())
    stages = [_Stage(0, 2, fail if fail == "F" else None, log, gate),
              _Stage(1, 2, fail if fail == "B" else None, log, gate)]
    sched = SimpleNamespace(_stages=stages, fwd_recv_ops={}, bwd_recv_ops={}, backward_counter=Counter(),
                            _internal_losses=[],
                            _n_microbatches=4, _maybe_compute_loss=lambda *a: None,
                            _maybe_get_loss=lambda st, mb: None)
    ctx = SimpleNamespace(schedule_ref=sched, arg_mbs=[()] * 4, kwarg_mbs=[{}] * 4, target_mbs=None)
    sub = (SimpleNamespace(stage_index=0, microbatch_index=3, computation_type=FORWARD),
           SimpleNamespace(stage_index=1, microbatch_index=1, computation_type=FULL_BACKWARD))
    posted = []
    pairs = OverlapPairs(SimpleNamespace(one_per_process=False, rank=5), torch.device("cpu"), None,
                         posted.append)
    return pairs, SimpleNamespace(sub_actions=sub), ctx, log, posted


def test_pair_runs_its_forward_on_the_second_thread_at_once():
    pairs, action, ctx, log, posted = _pair()
    pairs(action, ctx)
    pairs.close()
    threads = {kind: name for kind, _, _, name in log}
    assert threads["F"] == "autopar-overlap" and threads["B"] == threading.current_thread().name
    assert (pairs.pairs, pairs.concurrent) == (1, 1) and not posted
    assert ctx.schedule_ref.backward_counter[1] == 1


@pytest.mark.parametrize("fail", ["F", "B"])
def test_a_failing_half_names_the_pair_and_tells_the_peers(fail):
    """Either half raising: its own error, with a note naming the stage and micro-batch of
    both halves, raised after the other half ended (it ran), and a fault posted to the
    module's ranks, naming this rank."""
    pairs, action, ctx, log, posted = _pair(fail)
    with pytest.raises(ValueError, match=f"{'forward' if fail == 'F' else 'backward'} broke") as e:
        pairs(action, ctx)
    pairs.close()
    note = "\n".join(e.value.__notes__)
    what = ("stage 0 forward of micro-batch 3 failed (run at once with the stage 1 backward of "
            "micro-batch 1" if fail == "F" else
            "stage 1 backward of micro-batch 1 failed (run at once with the stage 0 forward of "
            "micro-batch 3")
    assert what in note and "dualpipev_overlap=False" in note
    assert {k for k, *_ in log} == {"F", "B"}          # both halves ran to their end
    assert len(posted) == 1 and posted[0].startswith("rank 5: ")
    assert pairs.pairs == 0


@pytest.mark.parametrize("cluster", ["cpu:4", "1x4xH100"])
def test_skip_values_on_nccl_leave_the_pairs_unhidden(monkeypatch, cluster):
    """The runtime does not run the pairs at once on CUDA where values skip stages (both
    threads would send them point to point, and NCCL matches messages by the order they
    were issued: ``device.p2p_matched_by_tag``); the price follows it
    (``Device.p2p_by_tag``, ``analysis.stages.values_skip_stages``): with skips, an H100
    cluster's plan is priced as with the overlap off, a CPU cluster's still hides the
    all-to-all; without skips both hide it."""
    from autopar.solver import pipeline_price
    b = zoo.build("mixtral", batch=8)
    steps = {}
    with same_model("mixtral-8"):
        for skips in (True, False):
            monkeypatch.setattr(pipeline_price, "values_skip_stages", lambda cap, cuts, s=skips: s)
            for on in (None, False):
                steps[skips, on] = autopar.plan(b.model, b.inputs, b.loss_fn, target=b.target,
                                                cluster=cluster, dualpipev_overlap=on,
                                                **PINS).estimate.step_time_s
    assert steps[False, None] < steps[False, False]                 # no skips: hidden
    if cluster.startswith("cpu"):
        assert steps[True, None] < steps[True, False]               # gloo: by tag, hidden
    else:
        assert steps[True, None] == pytest.approx(steps[True, False])  # NCCL: run apart


def test_values_skip_stages_reads_the_spans():
    """A value read two stages on is a skip; one read by the next stage alone is not."""
    from autopar.analysis import stages
    from autopar.capture import capture

    class Skip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            h0 = self.l[0](x)
            h = self.l[3](self.l[2](self.l[1](h0)))
            return h + h0

    cap = capture(Skip(), (torch.randn(2, 4),), lambda y, t: (y * t).sum(), torch.randn(2, 4))
    chain = stages._facts(cap).chain
    at = {name: i for i, name in enumerate(chain)}
    lin = [n for n in chain if n.startswith("linear")]
    assert len(lin) == 4
    # stages start at the 2nd and 4th linear: h0 (made before both) is read after both
    assert stages.values_skip_stages(cap, (at[lin[1]], at[lin[3]]))
    assert not stages.values_skip_stages(cap, (at[lin[1]],))
