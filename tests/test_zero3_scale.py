"""ZeRO-3 on a data degree that divides no dim of the weights (benchmarks/ranking.py's
n21-t2-530b rows: 529.6B, h 20,480 = 2^12 x 5, on 1,120 = 2^5 x 5 x 7 GPUs), planning only,
on a meta-device model of four 40 x 40 layers over 14 = 2 x 7 data ranks, which shows the
same two defects in seconds:

- with no micro-batch pin the free search fell back to gradient accumulation, tried a
  micro-batch of one row over 14 data ranks and let its ``PinError`` ("batch dim ... size
  1") escape, hiding why the full batch did not fit; it now tries only micro-batches the
  pinned data degree splits, and the memory error stands;
- autopar shards a ZeRO parameter along one dim in equal blocks, so no 40 x 40 weight is
  sharded over 14 ranks: every parameter stays whole (its optimizer state too, "under
  zero=3"). The infeasibility message now says so, names the largest such parameter and a
  data degree that would shard them (``solver.zero_whole``).

The control: the same model at h 42 (a multiple of 14) fits the same budget, its optimizer
state 1/14 of the model's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import PinError
from autopar.solver.errors import InfeasibleError
from autopar.solver.zero_whole import dividing_degree

BATCH, LAYERS, DATA, CLUSTER = 28, 4, 14, "7x2xa100"
BUDGET = 20_000
"""Bytes per device: above the fp32 training state sharded 14 ways (6,400 elements x 16 B
/ 14 = 7.3 KB at h 40; 8.1 KB at h 42) plus a micro-batch's activations, below it whole
(102 KB)."""


class Stack(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _plan(hidden: int, **pins):
    with torch.device("meta"):
        model = Stack(hidden)
        x, y = torch.randn(BATCH, hidden), torch.randn(BATCH, hidden)
    pins = {"data": DATA, "zero": 3, **pins}
    return autopar.plan(model, (x,), nn.functional.mse_loss, target=y, cluster=CLUSTER,
                        memory_budget=BUDGET, **{k: v for k, v in pins.items() if v is not None})


@pytest.mark.parametrize("pins", [{}, {"micro_batch_size": BATCH}, {"zero": None}],
                         ids=["free micro-batch", "micro_batch_size pinned",
                              "zero free: the search's ZeRO-3 row"])
def test_unshardable_weights_name_the_cause_not_a_one_row_batch(pins):
    try:
        _plan(40, **pins)
    except PinError as e:             # the accumulation fallback's one-row micro-batch
        pytest.fail(f"PinError hides the memory error: {e}")
    except InfeasibleError as e:
        msg = str(e)
        assert "zero=3 leaves 4 parameter(s) whole on every data rank" in msg, msg
        assert "6,400 of the model's 6,400 elements (100%)" in msg, msg
        assert "data degree 14" in msg and "'layers.0.weight' [40, 40]" in msg, msg
        assert "of 14's divisors, 2 does" in msg, msg
    else:
        pytest.fail("40 x 40 weights whole on every rank fit a budget below their state")


def test_a_dividing_degree_shards_them_and_fits():
    plan = _plan(42)
    numel = LAYERS * 42 * 42
    # AdamW's two fp32 moments, 1/14 of each weight per rank
    assert plan.estimate.memory_bytes["optimizer"] == pytest.approx(numel * 8 / DATA)
    assert plan.estimate.memory_total <= BUDGET


def test_dividing_degree_of_the_530b_rows():
    # GPT 529.6B's weight shapes (h 20,480, vocabulary 51,200, sequence 2,048)
    def gpt(h):
        return [(51200, h), (2048, h), (3 * h, h), (h, h), (4 * h, h), (h, 4 * h), (h,), (3 * h,)]
    assert dividing_degree(gpt(20480), 1120) == 160   # 2^5 x 5: every divisor with 7 fails
    assert dividing_degree(gpt(20480), 2240) == 320
    assert dividing_degree(gpt(12288), 768) == 768    # 174.6B (h 12,288): its degrees divide
