"""Lossy data parallelism: ``compress=`` (PowerSGD, top-k, bf16, int8, NUQSGD, Accordion),
``local_sgd=``, ``averaging=`` (BAGUA's decentralized and asynchronous model averaging) and
``workers=`` (Accordion's batch-size form: how many data ranks train).

Runtime cases run on 2 gloo ranks in one torchrun launch, and the ring of decentralized
averaging on 4 in a second (``tests/compression_worker.py``, whose docstring says what each
checks); NUQSGD's levels and unbiasedness, the pins' errors and the cost model run here.
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
    {"id": "nuq-reducer", "check": "nuq_reducer", "levels": 4, "pins": {}, "steps": 0},
    {"id": "accordion-switch", "check": "accordion_switch", "pins": {}, "steps": 0},
    {"id": "nuq-trains", "check": "trains", "pins": {"compress": "nuq:4"}, "steps": 30},
    {"id": "accordion-trains", "check": "trains", "pins": {"compress": "accordion:powersgd:1:4"},
     "steps": 30},
    {"id": "async-math", "check": "averaging_math", "pins": {"averaging": "async"}, "steps": 4},
    {"id": "async-trains", "check": "trains", "pins": {"averaging": "async"}, "steps": 30},
    {"id": "decentralized-pair", "check": "local_sgd", "pins": {"averaging": "decentralized"},
     "steps": 3},
    {"id": "workers-exact", "check": "equal", "pins": {"workers": "accordion:2:2"}, "steps": 3},
    {"id": "workers-critical", "check": "workers_critical", "pins": {"workers": "accordion:1:2"},
     "steps": 3},
    {"id": "workers-critical-constant", "check": "workers_critical",
     "pins": {"workers": "accordion:1:2", "workers_lr": "constant"}, "steps": 3},
    {"id": "workers-switch", "check": "workers_switch", "pins": {}, "steps": 0},
    {"id": "workers-checkpoint", "check": "workers_checkpoint", "pins": {"workers": "accordion:1:2"},
     "steps": 0},
    {"id": "workers-batchnorm", "check": "workers_batchnorm", "pins": {"workers": "accordion:1:2"},
     "steps": 0},
]
RING_CASES = [     # 4 ranks: each rank's two ring neighbours differ, and are not everyone
    {"id": "decentralized-math", "check": "averaging_math", "pins": {"averaging": "decentralized"},
     "steps": 4},
    {"id": "decentralized-trains", "check": "trains", "pins": {"averaging": "decentralized"},
     "steps": 30},
    {"id": "workers-critical-4", "check": "workers_critical", "pins": {"workers": "accordion:2:4"},
     "steps": 3},
    {"id": "workers-critical-tp", "check": "workers_critical",
     "pins": {"workers": "accordion:1:2", "data": 2, "tensor": 2}, "steps": 3},
]
BF16_GRAD_TOL = 2 ** -7          # a gradient's relative error after one bf16 rounding and sum


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression") / "results.json"
    return torchrun_cases("compression_worker.py", 2, CASES, out, timeout=600, case_timeout=120)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression4") / "results.json"
    return torchrun_cases("compression_worker.py", 4, RING_CASES, out, timeout=600, case_timeout=120)


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


# ---- NUQSGD ----------------------------------------------------------------------------
def test_nuq_levels_are_exponentially_spaced():
    from autopar.runtime.updates.compression import nuq_levels
    assert nuq_levels(4).tolist() == [0.0, 0.125, 0.25, 0.5, 1.0]
    lv = nuq_levels(9)
    assert lv[0] == 0 and lv[-1] == 1 and torch.equal(lv[2:] / lv[1:-1], torch.full((8,), 2.0))


@pytest.mark.parametrize("levels", [1, 4, 8])
def test_nuq_is_unbiased_and_on_the_two_nearest_levels(levels):
    """Each draw is one of the two levels around |x| / norm, and the mean of many is the
    vector: the sum over coordinates of the standardised errors (each coordinate's exact
    variance (hi - u)(u - lo) norm^2 / draws) is within 5 of its standard deviation, and
    each coordinate within 5 standard errors plus 4 draws' worth of a level step (the
    normal bound is loose for rare rounding). Rounding down instead fails the same test."""
    from autopar.runtime.updates.compression import nuq_dequantize, nuq_levels, nuq_pack, nuq_quantize, nuq_unpack
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.rand(1000, generator=g) ** 2
    x[:10] = 0.0
    draws = 2000
    total = torch.zeros(1000, dtype=torch.float64)
    for _ in range(draws):
        codes, norms = nuq_quantize(x, levels, g)
        assert torch.equal(nuq_unpack(nuq_pack(codes, levels), levels), codes)
        total += nuq_dequantize(codes, norms, levels).reshape(-1)[:1000].double()
    norm = norms.repeat_interleave(512)[:1000].double()
    table = nuq_levels(levels).double()
    u = x.abs().double() / norm
    lo = table[(table[None, :] <= u[:, None]).sum(1) - 1]
    hi = table[(table[None, :] < u[:, None]).sum(1).clamp_max(levels)]
    q = nuq_dequantize(codes, norms, levels).reshape(-1)[:1000].double().abs() / norm
    assert (((q - lo).abs() < 1e-6) | ((q - hi).abs() < 1e-6)).all()
    sigma = (((hi - u) * (u - lo)).clamp_min(0) * norm ** 2 / draws).sqrt()
    live = sigma > 0

    def fails(mean) -> tuple[bool, bool]:
        err = (mean - x.double()) * x.sign().double()        # along each coordinate's sign
        z = err[live] / sigma[live]
        return (bool(z.sum().abs() > 5 * live.sum().sqrt()),
                bool((err.abs() > 5 * sigma + 4 * (hi - lo) * norm / draws + 1e-6).any()))
    assert fails(total / draws) == (False, False)
    assert fails(lo * norm * x.sign().double())[0]            # E of rounding down: caught
    assert (total / draws - x.double()).abs().max() > 0       # random, not exact
    assert nuq_pack(codes, levels).numel() == codes.numel() // (2 if levels <= 7 else 1)


def test_nuq_reducer_sums_each_ranks_quantisation(results):
    r = case_result(results, "nuq-reducer")
    assert r["vs_quantized"] < 1e-5 and r["on_levels"], r
    assert r["exact_err"] > 0.1, r                            # lossy
    assert r["wire_bytes"] < 0.14 * r["full_bytes"], r        # 4 bits a value and a norm per 512


# ---- Accordion -------------------------------------------------------------------------
def test_accordion_switches_with_the_gradient_norm(results):
    """Checks every 2 steps: no earlier norm (critical), the same norm (compressed), the
    norm tripled (critical again)."""
    r = case_result(results, "accordion-switch")
    assert r["critical"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0], r
    dense, sparse = r["wire_bytes"][0], r["wire_bytes"][4]
    assert dense == 2 * r["full_bytes"] and sparse == dense // 2, r    # top-k 1.0 vs 0.5, with indices
    assert r["wire_bytes"][1] == dense + 4 and r["wire_bytes"][5] == sparse + 4, r   # the norm, every 2 steps


# ---- training runs of the lossy techniques ----------------------------------------------
@pytest.mark.parametrize("cid,ring", [("nuq-trains", False), ("accordion-trains", False),
                                      ("async-trains", False), ("decentralized-trains", True)])
def test_lossy_techniques_train(results, ring_results, cid, ring):
    """30 SGD steps on one batch: the loss falls as the one-device run's does."""
    r = case_result(ring_results if ring else results, cid)
    assert r["losses"][0] == pytest.approx(r["ref_losses"][0], rel=1e-5), r
    assert r["losses"][-1] < 0.01 * r["losses"][0], r
    assert r["losses"][-1] < 5 * r["ref_losses"][-1] + 1e-3, r
    if cid == "nuq-trains":
        assert max(r["wire_bytes"]) < 0.2 * r["full_bytes"], r
    if cid == "accordion-trains":      # starts at the vanilla all-reduce, then rank 4 (critical)
        assert r["wire_bytes"][0] == r["full_bytes"] and max(r["wire_bytes"][2:]) < 0.6 * r["full_bytes"], r
    if cid == "decentralized-trains":  # two neighbours' copies a step
        assert set(r["wire_bytes"]) == {2 * r["full_bytes"]}, r


# ---- BAGUA's model averaging -----------------------------------------------------------
def test_decentralized_averaging_is_the_ring_mean(ring_results):
    r = case_result(ring_results, "decentralized-math")
    assert r["ring"] == [[[0, 1, 3], [1, 0, 2], [2, 1, 3], [3, 0, 2]]], r
    assert r["formula_err"] < 1e-4, r
    assert min(r["rank_spread"]) > 1e-3, r      # the ranks differ: not a global average


def test_decentralized_pair_equals_one_device(results):
    """Two ranks: the ring is the pair, and averaging after each momentum-SGD step (linear)
    equals summing the gradients."""
    r = case_result(results, "decentralized-pair")
    assert r["loss_err"] < LOSS_RTOL and r["weight_err"] < WEIGHT_RTOL, r
    assert r["rank_spread"] == [0.0, 0.0, 0.0] and r["wire_bytes"] == [r["full_bytes"]] * 3, r


def test_async_averaging_folds_in_the_last_average(results):
    r = case_result(results, "async-math")
    assert r["formula_err"] < 1e-4, r           # x_r <- mean_j(x_j of the step before) - lr g_r
    assert min(r["rank_spread"]) > 1e-3, r
    assert r["wire_bytes"] == [r["full_bytes"]] * 4, r


# ---- workers= (Accordion's batch-size form) ----------------------------------------------
def test_workers_equal_to_the_data_degree_is_plain_data_parallelism(results):
    r = case_result(results, "workers-exact")
    assert not r["problems"], r
    assert r["loss_err"] < LOSS_RTOL and r["grad_err"] < GRAD_RTOL and r["weight_err"] < WEIGHT_RTOL, r


@pytest.mark.parametrize("cid,ring,w1,training", [
    ("workers-critical", False, 1, [1, 0]), ("workers-critical-constant", False, 1, [1, 0]),
    ("workers-critical-4", True, 2, [1, 1, 0, 0]),
    ("workers-critical-tp", True, 1, [1, 1, 0, 0])])      # data 2 x tensor 2: ranks 0, 1 are data rank 0
def test_workers_critical_regime_trains_on_the_first_w1_ranks_only(results, ring_results, cid, ring,
                                                                    w1, training):
    """Critical (the start): the gradient is the mean over data ranks 0 .. W1-1's batches,
    equal to one device over just those rows; the other ranks ran no forward after the
    first step (which every rank runs, watched)."""
    r = case_result(ring_results if ring else results, cid)
    assert r["loss_err"] < LOSS_RTOL and r["grad_err"] < GRAD_RTOL and r["weight_err"] < WEIGHT_RTOL, r
    assert r["counts"] == [w1] * 3, r
    assert r["forwards"][0] == [1] * len(training) and r["forwards"][1:] == [training] * 2, r
    assert r["lr_after"] == pytest.approx(0.05), r          # the optimizer's rate put back


def test_workers_regime_switches_with_the_whole_gradient_norm(results):
    """Checks every 2 steps: no earlier norm (critical, W1), the same norm (W2), tripled
    (critical again); the averaged gradient is G whichever ranks trained."""
    r = case_result(results, "workers-switch")
    assert r["critical"] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0], r
    assert r["counts"] == [1, 1, 1, 1, 2, 2, 1, 1], r
    assert r["mean_err"] < 1e-6, r
    assert r["lr_scale"] == 0.5, r


def test_workers_schedule_survives_a_checkpoint(results):
    r = case_result(results, "workers-checkpoint")
    assert r["saved"]["detector"]["critical"] == {"model": False}, r
    assert r["loaded"] == r["saved"], r
    assert r["workers_before"] == 1 and r["workers_after"] == 2, r


def test_workers_refuses_a_step_that_crosses_the_data_axis(results):
    r = case_result(results, "workers-batchnorm")
    assert "crosses the data axis (all_gather" in r["refused"] and "drop workers=" in r["refused"], r


def test_elastic_caps_workers_at_the_data_degree():
    from autopar.elastic import elastic_pins
    from autopar.options import Options
    with pytest.warns(UserWarning, match="accordion:2:2"):
        pins, info = elastic_pins(Options.from_pins({"workers": "accordion:2:4", "data": 4}), 2, 8)
    assert pins.workers == "accordion:2:2" and info.data == 2
    pins, _ = elastic_pins(Options.from_pins({"workers": "accordion:1:2"}), 4, 8)
    assert pins.workers == "accordion:1:2" and pins.data == 4


def test_workers_priced_as_the_exact_step_with_its_reduction_exposed():
    """The exact plan's compute (W2 workers, an upper bound), the data axis's all-reduce no
    longer hidden behind backward, and two gradient-sized buffers."""
    model, inputs, target = _mlp()
    kw = dict(target=target, cluster="2x8xA100", data=2, tensor=8)
    exact = autopar.plan(model, inputs, F.cross_entropy, **kw)
    got = autopar.plan(model, inputs, F.cross_entropy, **kw, workers="accordion:1:2")
    assert got.estimate.compute_s == pytest.approx(exact.estimate.compute_s)
    assert got.estimate.comm["all_reduce@data"] == pytest.approx(exact.estimate.comm["all_reduce@data"])
    assert "overlapped" not in " ".join(got.estimate.comm), got.estimate.comm
    assert got.estimate.step_time_s >= exact.estimate.step_time_s
    assert got.estimate.memory_bytes["workers_buffers"] == pytest.approx(2 * exact.estimate.memory_bytes["grads"])


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
    ({"compress": "nuq:0"}, "'nuq:S'"),
    ({"compress": "nuq:128"}, "S = 1..127"),
    ({"compress": "accordion:powersgd:4:1"}, "increasing order, e.g. 'accordion:powersgd:1:4'"),
    ({"compress": "accordion:topk:0.1:0.1"}, "pin compress='topk:0.1'"),
    ({"compress": "accordion:int8:1:2"}, "'accordion:topk:F1:F2'"),
    ({"compress": "accordion:topk:0.1:2"}, "each fraction F 0 < F <= 1"),
    ({"compress": "nuq:4", "zero": 1}, "drop zero="),
    ({"averaging": "ring"}, "use 'decentralized'"),
    ({"averaging_period": 2}, "with averaging='decentralized' or 'async' pinned too"),
    ({"averaging": "async", "averaging_period": 0}, "a positive integer"),
    ({"averaging": "async", "compress": "int8"}, "pin one of them"),
    ({"averaging": "decentralized", "local_sgd": 2}, "pin one of them"),
    ({"averaging": "async", "zero": 2}, "drop one of the two pins"),
    ({"averaging": "async", "precision": "fp16"}, "pin precision='bf16'"),
    ({"averaging": "decentralized", "precision": "bf16", "grad_reduce": "bf16"}, "drop grad_reduce="),
    ({"workers": "accordion:2:1"}, "workers='accordion:1:2'"),
    ({"workers": "accordion:0:2"}, "'accordion:W1:W2'"),
    ({"workers": "2:4"}, "'accordion:W1:W2'"),
    ({"workers": "accordion:1:4", "data": 2}, "pin data= >= 4"),
    ({"workers_lr": "linear"}, "with workers='accordion:W1:W2' pinned too"),
    ({"workers": "accordion:1:2", "workers_lr": "sqrt"}, "'linear'"),
    ({"workers": "accordion:1:2", "compress": "int8"}, "pin one of them"),
    ({"workers": "accordion:1:2", "averaging": "async"}, "pin one of them"),
    ({"workers": "accordion:1:2", "staleness": 1}, "pin one of them"),
    ({"workers": "accordion:1:2", "zero": 2}, "drop one of the two pins"),
    ({"workers": "accordion:1:2", "pipeline": 2, "micro_batch_size": 2}, "drop one of the two pins"),
    ({"workers": "accordion:1:2", "precision": "bf16", "grad_reduce": "bf16"}, "drop grad_reduce="),
])
def test_bad_pins_say_the_fix(pins, words):
    model = nn.Linear(4, 2)
    with pytest.raises(PinError, match=words.replace("(", r"\(").replace(")", r"\)")):
        autopar.plan(model, (torch.randn(4, 4),), F.cross_entropy, target=torch.tensor([0, 1, 0, 1]),
                     cluster="cpu:2", **pins)


# ---- the cost model's choice -----------------------------------------------------------
def _mlp():
    """Wide enough (8192: 8.4M parameters a rank under tensor=8) that the device's step, the
    data axis's gradient reduction above all, binds on two nodes, not the host's dispatch of
    its ~60 ATen calls (16.7 us each, about 1 ms: ``cost_models.host``); at 2048 the host
    alone set both plans' steps. Built on the meta device: only shapes are priced."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.Tanh(), nn.Linear(8192, 8192))
    return (model, (torch.empty(256, 8192, device="meta"),),
            torch.empty(256, dtype=torch.long, device="meta"))


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
        assert auto.estimate.host_s < auto.estimate.step_time_s     # the device binds
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
    nuq = compressed_reduce_time("nuq", 4, (4096, 512), 4, 2, slow, A100_80GB)
    assert nuq == pytest.approx(exact / 8 * (1 + 8 / 512), rel=0.05)         # 4 bits + a norm per 512
    acc = compressed_reduce_time("accordion", ("powersgd", 1, 4), (4096, 512), 4, 2, slow, A100_80GB)
    assert t["powersgd"] < acc < t["powersgd"] * 1.05      # priced at its critical setting, rank 4
    # a matrix rank 4 does not shrink by half goes exact
    assert compressed_reduce_time("powersgd", 4, (8, 8), 4, 2, slow, A100_80GB) == \
        pytest.approx(collective_time("all_reduce", 256, 2, slow, skew=False)
                      - collective_time("all_reduce", 1, 2, slow, skew=False))   # as bucketed


def test_averaging_priced_per_kind():
    """Decentralized: one send of the parameter to each ring neighbour (1 with 2 ranks, the
    all-reduce's bytes; 2 with 4, more than its 1.5); async: the all-reduce, 1/period."""
    from autopar.cost_models.comm import averaging_time, collective_time
    from autopar.cost_models.devices import Link
    link = Link(bandwidth=1e9, latency=0.0)
    s = 4e6
    ar = {n: collective_time("all_reduce", s, n, link, skew=False) for n in (2, 4)}
    assert averaging_time("decentralized", s, 2, link) == pytest.approx(ar[2], rel=1e-6)
    assert averaging_time("decentralized", s, 4, link) == pytest.approx(2 * s / 1e9, rel=1e-6)
    assert averaging_time("decentralized", s, 4, link) > ar[4]
    assert averaging_time("async", s, 4, link, period=4) == pytest.approx(ar[4] / 4, rel=1e-6)


def test_averaging_buffers_priced_as_optimizer_memory():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    kw = dict(target=torch.randint(0, 4, (8,)), cluster="cpu:4", data=4)
    x = (torch.randn(8, 64),)
    plain = autopar.plan(model, x, F.cross_entropy, **kw).estimate.memory_bytes
    params = plain["params"]
    for pins, copies in [({"averaging": "async"}, 2), ({"averaging": "decentralized"}, 3),
                         ({"compress": "accordion:topk:0.01:0.1"}, 1)]:
        got = autopar.plan(model, x, F.cross_entropy, **kw, **pins).estimate.memory_bytes
        assert got["optimizer"] - plain["optimizer"] == pytest.approx(copies * params), pins
