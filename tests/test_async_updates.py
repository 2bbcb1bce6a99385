"""Issue 31's update schemes: ``staleness=``, ``param_server=``, ``learners=`` (Crossbow) and
Hogwild (``autopar.hogwild``).

The runtime cases run on 2 gloo ranks in one torchrun launch (``tests/async_worker.py``,
whose docstring says what each checks); Hogwild, the pins' errors and the prices run here.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.cost_models.step import step_time  # noqa: E402
from autopar.errors import ArgumentError, PinError  # noqa: E402
from autopar.verify import GRAD_RTOL, LOSS_RTOL, WEIGHT_RTOL  # noqa: E402
from launch import case_result, torchrun_cases  # noqa: E402

CASES = [
    {"id": "ps1", "check": "updates", "pins": {"param_server": 1}, "steps": 3},
    {"id": "ps2", "check": "updates", "pins": {"param_server": 2}, "steps": 3},
    {"id": "stale1", "check": "updates", "pins": {"staleness": 1}, "steps": 4},
    {"id": "stale2", "check": "updates", "pins": {"staleness": 2}, "steps": 5},
    {"id": "ps-stale1", "check": "updates", "pins": {"param_server": 2, "staleness": 1}, "steps": 4},
    {"id": "crossbow", "check": "crossbow", "pins": {"learners": 2}, "steps": 40},
    {"id": "ps_too_many", "check": "too_many", "pins": {}, "steps": 0},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("async") / "results.json"
    return torchrun_cases("async_worker.py", 2, CASES, out, timeout=600, case_timeout=120)


def _exact(r):
    assert not r["problems"], r
    assert r["loss_err"] < LOSS_RTOL and r["grad_err"] < GRAD_RTOL and r["weight_err"] < WEIGHT_RTOL, r


@pytest.mark.parametrize("cid", ["ps1", "ps2"])
def test_synchronous_param_server_equals_one_device(results, cid):
    r = case_result(results, cid)
    _exact(r)
    assert r["stepped"] == [True] * 3, r
    # each rank keeps optimizer state for the parameters it serves, and only those
    assert r["state_held"] == r["served"], r
    served = r["served_by_rank"]
    assert sorted(sum(served, [])) == sorted({n for s in served for n in s}), r   # disjoint
    if cid == "ps1":
        assert served[1] == [] and len(served[0]) == 4, r    # rank 1 is a worker only
        assert r["pull_bytes"] == r["full_bytes"], r          # the server sent everything once
    else:
        assert served[0] and served[1], r                     # both ranks serve


@pytest.mark.parametrize("cid,s", [("stale1", 1), ("stale2", 2), ("ps-stale1", 1)])
def test_staleness_applies_the_gradient_of_step_t_minus_s(results, cid, s):
    r = case_result(results, cid)
    _exact(r)
    assert r["stepped"] == [False] * s + [True] * (len(r["stepped"]) - s), r


def test_crossbow_sma_step_and_training(results):
    r = case_result(results, "crossbow")
    assert r["sma_err"] < 1e-5, r                   # the SMA step is the paper's formula
    assert r["forward_err"] < 1e-5, r               # cb(...) runs the central model
    assert r["learner_spread"] > 1e-4, r            # learners are distinct replicas
    assert r["n_params"] == 2 * 4 and r["K"] == 4, r
    assert r["end_loss"] < 0.7 * r["start_loss"], r     # the central model learned
    assert r["wire_bytes"] > 0, r


def test_param_server_more_servers_than_ranks(results):
    r = case_result(results, "ps_too_many")
    assert r["error_type"] == "ArgumentError" and "at most 2" in r["message"], r


# ---- Hogwild ---------------------------------------------------------------------------
def _data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(256, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    return model, x, y


def test_hogwild_one_process_is_sgd():
    model, x, y = _data()
    ref = [p.detach().clone() for p in model.parameters()]
    m2 = copy.deepcopy(model)
    opt = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.5)
    losses = []
    for t in range(6):
        idx = torch.arange(t * 8, t * 8 + 8)
        opt.zero_grad()
        loss = F.cross_entropy(m2(x[idx]), y[idx])
        loss.backward()
        losses.append(loss.item())
        opt.step()
    r = autopar.hogwild(model, (x,), F.cross_entropy, target=y, processes=1, steps=6,
                        batch_size=8, lr=0.1, momentum=0.5)
    assert r.losses[0].tolist() == pytest.approx(losses, rel=1e-6)
    for p, q, p0 in zip(model.parameters(), m2.parameters(), ref):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7) and not torch.equal(p, p0)


def test_hogwild_processes_share_and_train():
    model, x, y = _data()
    with torch.no_grad():
        start = float(F.cross_entropy(model(x), y))
    r = autopar.hogwild(model, (x,), F.cross_entropy, target=y, processes=2, steps=80,
                        batch_size=16, lr=0.1)
    assert r.losses.shape == (2, 80)
    assert (r.losses[:, 0] > 0).all() and (r.losses[:, -1] > 0).all()      # both processes ran
    assert r.losses[:, -10:].mean() < 0.6 * r.losses[:, :10].mean(), r.losses
    # both processes' updates landed in the caller's (shared) parameters
    with torch.no_grad():
        assert float(F.cross_entropy(model(x), y)) < 0.6 * start


def test_hogwild_refuses_devices_and_plans():
    model, x, y = _data()
    with pytest.raises(PinError, match="CPU shared memory"):
        autopar.hogwild(model.to("meta"), (x,), F.cross_entropy, target=y, processes=2)
    model, x, y = _data()
    with pytest.raises(ArgumentError, match=r"call autopar.hogwild\("):
        autopar.plan(model, (x,), F.cross_entropy, target=y, cluster="cpu:2", hogwild=2)
    with pytest.raises(PinError, match="number of processes"):
        autopar.hogwild(model, (x,), F.cross_entropy, target=y, processes=0)


# ---- pins ------------------------------------------------------------------------------
@pytest.mark.parametrize("pins,words", [
    ({"staleness": 0}, "delay s >= 1"),
    ({"param_server": 0}, "number of server ranks"),
    ({"learners": "2"}, "number of learners"),
    ({"hogwild": -1}, "processes"),
    ({"hogwild": 2, "data": 2}, "takes no other pin"),
    ({"learners": 2, "staleness": 1}, "drop one of the two pins"),
    ({"learners": 2, "tensor": 2}, "drop tensor="),
    ({"learners": 2, "accumulate": 2}, "drop one of the two pins"),
    ({"staleness": 1, "zero": 1}, "drop one of the two pins"),
    ({"param_server": 1, "compress": "bf16"}, "pin one of them"),
    ({"staleness": 2, "local_sgd": 4}, "pin one of them"),
    ({"staleness": 1, "precision": "fp16"}, "pin precision='bf16'"),
    ({"param_server": 1, "pipeline": 2, "micro_batch_size": 2}, "drop one of the two pins"),
])
def test_bad_pins_say_the_fix(pins, words):
    with pytest.raises(PinError, match=words.replace("(", r"\(").replace(")", r"\)")):
        autopar.Options.from_pins(pins)


# ---- prices ----------------------------------------------------------------------------
def _mlp():
    """Wide enough, and enough rows (256 a rank over data=16), that the device's step
    (about 5 ms of matmuls on an A100) binds, not the host's dispatch of its ~60 ATen calls
    (16.7 us each, about 1 ms: ``cost_models.host``): at 1024 x 1024 and 32 rows the host
    alone set every scheme's step, and what the schemes hide would not show. Built on the
    meta device: only shapes are priced."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 4096))
    return (model, (torch.empty(4096, 4096, device="meta"),),
            torch.empty(4096, dtype=torch.long, device="meta"))


def _plan(cluster, **pins):
    model, inputs, target = _mlp()
    return autopar.plan(model, inputs, F.cross_entropy, target=target, cluster=cluster, **pins)


def test_prices():
    """Staleness hides the gradient reduction behind the next step; a parameter server's
    pushes and pulls cross the servers' links (more servers, less time); Crossbow's learners
    cost memory; the planner never picks any of them unpinned."""
    cluster = "2x8xA100"        # data across nodes: a slow data-axis link
    exact = _plan(cluster, data=16)
    stale = _plan(cluster, data=16, staleness=1)
    ps1 = _plan(cluster, data=16, param_server=1)
    ps8 = _plan(cluster, data=16, param_server=8)
    cb = _plan(cluster, data=16, learners=4)
    for p in (exact, stale, ps1, ps8, cb):
        assert p.mesh_shape == (16,), p.summary()
    assert not any(k in exact.pins for k in ("staleness", "param_server", "learners", "hogwild"))
    e, st, p1, p8, c = (x.estimate for x in (exact, stale, ps1, ps8, cb))
    # every scheme dispatches the same calls (the host's term), and the device binds
    assert e.host_s > 0 and st.host_s == e.host_s and e.host_s < 0.5 * e.compute_s
    # staleness: the same all-reduce, hidden behind the next step's compute
    assert st.comm["all_reduce@data"] == pytest.approx(e.comm["all_reduce@data"])
    assert st.step_time_s == pytest.approx(step_time(
        e.compute_s + e.comm["all_reduce@data"] - min(e.comm["all_reduce@data"], e.compute_s),
        e.host_s))
    assert st.step_time_s < e.step_time_s
    assert st.memory_bytes["stale_grads"] == e.memory_bytes["grads"]
    # parameter servers: push and pull on the servers' links; 8 servers share the load
    assert p1.comm["push@data"] > 4 * p8.comm["push@data"]        # 8x the bytes, same latencies
    assert p1.comm["pull@data"] > 4 * p8.comm["pull@data"]
    assert p1.step_time_s > p8.step_time_s and p1.step_time_s > e.step_time_s
    assert p8.memory_bytes["optimizer"] == pytest.approx(e.memory_bytes["optimizer"] / 8)
    # Crossbow: 4 replicas' parameters, gradients and optimizer state plus the central model
    assert c.memory_total > 3 * e.memory_total
    assert c.compute_s == pytest.approx(4 * e.compute_s) and c.host_s == pytest.approx(4 * e.host_s)
    assert "all_reduce@data" not in c.comm and c.comm["sma_all_reduce@data"] > 0


def test_param_server_time_is_the_servers_links():
    from autopar.cost_models.comm import collective_time, param_server_time
    from autopar.cost_models.devices import Link
    link = Link(bandwidth=1e9, latency=1e-5)
    # 4 ranks, 1 server: 3 peers' full 1 GB on its link; 4 servers: a quarter each
    assert param_server_time(1e9, 4, 1, link) == pytest.approx(3 * (1.0 + 1e-5))
    assert param_server_time(1e9, 4, 4, link) == pytest.approx(3 * (0.25 + 1e-5))
    assert param_server_time(1e9, 1, 1, link) == 0.0
    # every rank a server: push + pull move about the ring all-reduce's bytes
    ring = collective_time("all_reduce", 1e9, 4, link, skew=False)
    assert 2 * param_server_time(1e9, 4, 4, link) == pytest.approx(ring, rel=0.05)


@pytest.mark.parametrize("pin", [{"staleness": 1}, {"param_server": 1}, {"learners": 2}])
def test_first_step_check_is_refused(pin):
    model, x, y = _data()
    with pytest.raises(ArgumentError, match="pass check=False"):
        autopar.parallelize(model, (x[:8],), F.cross_entropy, target=y[:8], check=True, **pin)


def test_learners_over_the_budget_is_refused():
    with pytest.raises(PinError, match="learners=64 keeps 64 replicas.*pin fewer"):
        _plan("2x8xA100", data=16, learners=64, memory_budget=2**30)   # the exact plan: 0.6 GiB
