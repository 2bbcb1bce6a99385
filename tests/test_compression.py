"""Lossy data parallelism: ``compress=`` (PowerSGD, top-k, bf16, int8) and ``local_sgd=``.

Runtime cases run on 2 gloo ranks in one torchrun launch (``tests/compression_worker.py``,
whose docstring says what each checks); the pins' errors and the cost model's choice run
here.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.errors import PinError  # noqa: E402
from autopar.verify import GRAD_RTOL, LOSS_RTOL, WEIGHT_RTOL  # noqa: E402
from launch import case_result, torchrun_cases  # noqa: E402

CASES = [
    {"id": "bf16", "check": "equal", "pins": {"compress": "bf16"}, "steps": 3},
    {"id": "powersgd-exact", "check": "equal", "pins": {"compress": "powersgd:4"}, "steps": 4},
    {"id": "powersgd-ef", "check": "error_feedback", "pins": {"compress": "powersgd:1"}, "steps": 4},
    {"id": "topk-all", "check": "equal", "pins": {"compress": "topk:1.0"}, "steps": 3},
    {"id": "topk-ef", "check": "error_feedback", "pins": {"compress": "topk:0.1"}, "steps": 3},
    {"id": "int8-reducer", "check": "int8_reducer", "pins": {}, "steps": 0},
    {"id": "int8", "check": "equal", "pins": {"compress": "int8"}, "steps": 3},
    {"id": "local_sgd-1", "check": "local_sgd", "pins": {"local_sgd": 1, "local_sgd_warmup": 0},
     "steps": 3},
    {"id": "local_sgd-2", "check": "local_sgd", "pins": {"local_sgd": 2, "local_sgd_warmup": 1},
     "steps": 4},
]
BF16_GRAD_TOL = 2 ** -7          # a gradient's relative error after one bf16 rounding and sum


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression") / "results.json"
    return torchrun_cases("compression_worker.py", 2, CASES, out, timeout=600, case_timeout=120)


@pytest.mark.parametrize("cid", ["powersgd-exact", "topk-all"])
def test_exact_cases_equal_one_device(results, cid):
    r = case_result(results, cid)
    assert not r["problems"], r
    assert r["loss_err"] < LOSS_RTOL and r["grad_err"] < GRAD_RTOL and r["weight_err"] < WEIGHT_RTOL, r
    if cid == "powersgd-exact":      # after torch's vanilla start, the weight went as P and Q
        assert r["wire_bytes"] < 0.6 * r["full_bytes"], r


def test_bf16_within_bf16_rounding(results):
    r = case_result(results, "bf16")
    assert not r["problems"], r
    assert r["grad_err"] < BF16_GRAD_TOL and r["weight_err"] < BF16_GRAD_TOL, r
    assert r["grad_err"] > GRAD_RTOL, r          # it did round
    assert r["wire_bytes"] == r["full_bytes"] // 2, r


@pytest.mark.parametrize("cid", ["powersgd-ef", "topk-ef"])
def test_error_feedback_carries_across_steps(results, cid):
    r = case_result(results, cid)
    assert r["last_step_err"] > 0.05, r          # lossy: a step's sum is not the gradient
    assert r["last_two_differ"] > 0.05, r        # the residual changed what was sent
    assert r["conserved_err"] < 1e-5, r          # sums + residuals = steps x gradient
    assert r["wire_bytes"] < 0.25 * r["full_bytes"], r


def test_int8_is_quantised_sum(results):
    r = case_result(results, "int8-reducer")
    assert r["vs_dequantized"] < 1e-6, r         # the sum of each rank's dequantised chunks
    assert r["beyond_half_step"] <= 0, r         # within half a step per rank of the true sum
    assert r["exact_err"] > 0, r                 # and lossy
    t = case_result(results, "int8")
    assert 0 < t["grad_err"] < 0.05 and t["weight_err"] < 0.05, t
    assert t["wire_bytes"] < 0.4 * t["full_bytes"], t


def test_local_sgd_period_one_equals_one_device(results):
    r = case_result(results, "local_sgd-1")
    assert r["loss_err"] < LOSS_RTOL and r["weight_err"] < WEIGHT_RTOL, r
    assert r["rank_spread"] == [0.0, 0.0, 0.0], r


def test_local_sgd_averages_every_h_steps_after_warmup(results):
    r = case_result(results, "local_sgd-2")
    # step 0: warm-up (gradients all-reduced); 1 and 3: averaged; 2: local only
    assert r["rank_spread"][0] == 0.0 and r["rank_spread"][1] == 0.0 and r["rank_spread"][3] == 0.0, r
    assert r["rank_spread"][2] > 1e-4, r
    assert r["wire_bytes"][2] == 0 and r["wire_bytes"][1] == r["full_bytes"], r
    assert r["loss_err"] > LOSS_RTOL, r          # not the one-device run


# ---- pins ------------------------------------------------------------------------------
@pytest.mark.parametrize("pins,words", [
    ({"compress": "powersgd:0"}, "powersgd:R"),
    ({"compress": "topk:1.5"}, "topk:F"),
    ({"compress": "gzip"}, "'bf16', 'int8'"),
    ({"local_sgd": 0}, "positive integer"),
    ({"local_sgd_warmup": 5}, "local_sgd= pinned too"),
    ({"compress": "int8", "local_sgd": 4}, "pin one of them"),
    ({"compress": "bf16", "zero": 1}, "drop zero="),
    ({"local_sgd": 2, "pipeline": 2, "micro_batch_size": 2}, "drop pipeline="),
])
def test_bad_pins_say_the_fix(pins, words):
    model = nn.Linear(4, 2)
    with pytest.raises(PinError, match=words.replace("(", r"\(").replace(")", r"\)")):
        autopar.plan(model, (torch.randn(4, 4),), F.cross_entropy, target=torch.tensor([0, 1, 0, 1]),
                     cluster="cpu:2", **pins)


# ---- the cost model's choice -----------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048))
    return model, (torch.randn(32, 2048),), torch.randint(0, 2048, (32,))


@pytest.mark.parametrize("cluster,pays", [("2x8xA100", True), ("16xA100", False)])
def test_auto_compresses_on_a_slow_inter_node_link_only(cluster, pays):
    """Data 2 x tensor 8: on two DGX nodes each data group has one GPU per node (one NIC's
    share of InfiniBand, 22 GB/s); on one 16-GPU NVLink node the same groups get 247 GB/s."""
    model, inputs, target = _mlp()
    auto = autopar.plan(model, inputs, F.cross_entropy, target=target, cluster=cluster,
                        data=2, tensor=8, compress="auto")
    exact = autopar.plan(model, inputs, F.cross_entropy, target=target, cluster=cluster,
                         data=2, tensor=8)
    assert "compress" not in exact.pins          # lossy only when allowed
    if pays:
        assert auto.pins.get("compress") is not None, auto.pins
        assert auto.estimate.step_time_s < exact.estimate.step_time_s
        assert auto.estimate.comm["all_reduce@data"] < 0.9 * exact.estimate.comm["all_reduce@data"]
    else:
        assert auto.pins.get("compress") is None, auto.pins
        assert auto.estimate.step_time_s == pytest.approx(exact.estimate.step_time_s)


def test_compressed_bytes_priced_per_scheme():
    """PowerSGD's P and Q, top-k's values and indices, int8's quarter: cheaper on the wire
    than the exact all-reduce of a 4096 x 512 gradient over a slow link, in that order."""
    from autopar.cost_models.comm import collective_time, compressed_reduce_time
    from autopar.cost_models.devices import Link
    from autopar.cost_models.gpus import A100_80GB
    slow = Link(bandwidth=1e7, latency=0.0)        # the compression's compute: under 5%
    exact = collective_time("all_reduce", 4096 * 512 * 4, 2, slow, skew=False)   # no latency
    t = {k: compressed_reduce_time(k, a, (4096, 512), 4, 2, slow, A100_80GB)
         for k, a in [("bf16", 0), ("int8", 0), ("topk", 0.01), ("powersgd", 4)]}
    assert t["bf16"] == pytest.approx(exact / 2, rel=0.01)
    assert t["int8"] == pytest.approx(exact / 4 * (1 + 8 / 512), rel=0.05)   # + its compute
    assert t["topk"] == pytest.approx(exact * 0.01 * 2, rel=0.05)
    assert t["powersgd"] == pytest.approx(exact * (4096 + 512) * 4 / (4096 * 512), rel=0.05)
    # a matrix rank 4 does not shrink by half goes exact
    assert compressed_reduce_time("powersgd", 4, (8, 8), 4, 2, slow, A100_80GB) == \
        pytest.approx(collective_time("all_reduce", 256, 2, slow, skew=False)
                      - collective_time("all_reduce", 1, 2, slow, skew=False))   # as bucketed
