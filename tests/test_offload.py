"""ZeRO-Offload (``offload="optimizer"``, Ren et al. 2021): each rank's optimizer shard (fp32
master copy and AdamW's moments) and the optimizer step on the host.

On 2 gloo ranks (``tests/offload_worker.py``, in ``tests/test_zero.py``'s torchrun spawn):
the small GPT trained 3 AdamW steps under ``data=2, zero=k, offload="optimizer"`` (k = 1,
3; 2 stepped by ``opt.step()`` instead of ``pm.step(opt)``; 2 under bf16, against bf16
autocast) matches one device, losses and weights, and the same plan without offload. In
each fp32 case every rank's device bytes (the programs' parameters, their gradients each
as it goes down) equal the plan's device terms, with no optimizer state there, and its host
bytes (masters, moments, gradient shards) the plan's ``host_memory_bytes``; and each step's
events come in the overlapped order (gradient copies down during backward, masters up
bucket by bucket between ZeRO-1/2's gathers). Single process: the pin's checks, the plan
file, the cost model's figures and its overlap rule, and the free search choosing offload
under a device budget ZeRO-3 alone does not fit.

``offload="disk"`` (ZeRO-Infinity's disk tier, ``autopar.runtime.disk_offload``), in the same
spawn (ZeRO-1 and 2 with several disk buckets, ZeRO-3): loss and every gradient against one device
within ``autopar.verify``'s tolerances, bit for bit the plan without offload, each weight
under autopar.verify's own SGD run; between steps every master and moment is a view of the
rank's files with none of its pages in memory, the files hold the plan's ``disk_bytes``; a
checkpoint round trip; the rank's directory removed with the module. Single process: the
pins, the disk's constants and this machine's measured disk, the price and the plan fields.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import autopar
from autopar.cost_models.gpus import A100_80GB, H100_80GB
from autopar.cost_models.hardware import parse_cluster
from autopar.cost_models.comm import DDP_BUCKET_BYTES
from autopar.cost_models.offload import (disk_link, disk_seconds, disk_times, exposed_share, host_link,
                                         measure_disk, offload_seconds, offload_times)
from autopar.verify import GRAD_RTOL, LOSS_RTOL, WEIGHT_RTOL
from autopar.errors import PinError
from autopar.plan import Plan, PlanError
from autopar.options import Options
from launch import case_result, register_cases, shared_cases

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-3
OFF = {"offload": "optimizer"}
BUCKET = 24_000     # bytes: the small GPT's 112 kB of fp32 gradients in 5 ZeRO-1/2 buckets
CASES = [
    {"id": "offload-zero1", "pins": {"data": 2, "zero": 1, **OFF}, "bucket_bytes": BUCKET},
    {"id": "offload-zero3", "pins": {"data": 2, "zero": 3, **OFF}},
    {"id": "offload-zero2-opt-step", "pins": {"data": 2, "zero": 2, **OFF}, "pm_step": False,
     "bucket_bytes": BUCKET},
    {"id": "offload-zero2-bf16", "pins": {"data": 2, "zero": 2, "precision": "bf16", **OFF}},
]
FP32 = [c["id"] for c in CASES if "precision" not in c["pins"]]
BF16_LOSS_TOL, BF16_WEIGHT_TOL = 3e-4, 0.1       # tests/test_precision.py's, against bf16 autocast
for _c in CASES:
    _c["offload_case"] = True
register_cases("zero_worker.py", 2, CASES)     # run in test_zero's spawn (launch.shared_cases)
DISK = {"offload": "disk"}
DISK_CASES = [     # offload="disk": the worker pins offload_dir= to a directory of its own
    {"id": "disk-zero1", "pins": {"data": 2, "zero": 1, **DISK}, "bucket_bytes": BUCKET, "offload_case": True},
    {"id": "disk-zero2", "pins": {"data": 2, "zero": 2, **DISK}, "bucket_bytes": BUCKET, "offload_case": True},
    {"id": "disk-zero3", "pins": {"data": 2, "zero": 3, **DISK}, "offload_case": True},
]
register_cases("zero_worker.py", 2, DISK_CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return shared_cases("zero_worker.py", 2, tmp_path_factory.mktemp("zero"), timeout=600, case_timeout=120)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_offload_matches_one_device(results, case_id):
    r = case_result(results, case_id)
    assert r["plan_pins"].get("offload") == "optimizer", r["plan_pins"]
    bf16 = case_id not in FP32
    assert r["loss_err"] < (BF16_LOSS_TOL if bf16 else LOSS_TOL), r
    assert r["weight_err"] < (BF16_WEIGHT_TOL if bf16 else WEIGHT_TOL), r
    # and the same plan without offload reaches the same weights (the step only moved)
    assert r["vs_plain"] < 1e-6, r


@pytest.mark.parametrize("case_id", FP32)
def test_memory_per_rank_equals_the_plan_estimate(results, case_id):
    r = case_result(results, case_id)
    dev, host, est, host_est = r["device"], r["host"], r["estimate"], r["host_estimate"]
    # the device holds what the programs read and the gradients until they go down
    assert dev["params"] == est["params"] and dev["grads"] == est["grads"], (dev, est)
    assert "optimizer" not in est, est                  # no optimizer state on the device
    assert host == host_est, (host, host_est)
    # the host: this rank's half of the fp32 master copy and of both moments, and of the gradient
    whole = 4 * r["numel"]
    assert host["optimizer"] == 3 * whole / 2 and host["grads"] == whole / 2, host
    stage = r["plan_pins"]["zero"]
    assert dev["params"] == (whole if stage <= 2 else whole / 2), dev
    assert dev["grads"] == (whole if stage == 1 else whole / 2), dev
    # the optimizer's state belongs to the host masters, which share no memory with the device's
    assert r["state_on_masters"] and r["masters_apart"], r


def _steps(events: list[str]) -> list[list[str]]:
    """The recorded events cut after each step's end (the last list: after the last step)."""
    out, cur = [], []
    for e in events:
        cur.append(e)
        if e == "end":
            out.append(cur)
            cur = []
    return out + [cur]


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c.get("bucket_bytes") or c["pins"]["zero"] == 3])
def test_copies_overlap_the_gradient_sync(results, case_id):
    """Each bucket's gradients go down as its reduction finishes: the first copy is made
    before the step's last reduction is launched (backward still running), not after the
    sync; the masters go up bucket by bucket, one after an all-gather has run."""
    r = case_result(results, case_id)
    steps = _steps(r["events"])
    assert len(steps) == 4, r["events"]
    for ev in steps[:3]:
        body = ev[ev.index("reduce"):]      # the step's backward (after the last one's gathers)
        copies = [j for j, e in enumerate(body) if e == "copy"]
        reduces = [j for j, e in enumerate(body) if e == "reduce"]
        assert len(copies) >= 2 and copies[0] < reduces[-1], ev
    if r["plan_pins"]["zero"] <= 2:   # ZeRO-1/2: each bucket's masters just before its gather
        for ev in steps[1:3]:         # after a step, before the next one's backward
            head = ev[:ev.index("reduce")]
            assert head.count("up") >= 2 and head.index("gather") < len(head) - 1 - head[::-1].index("up"), ev


# ---- single process ------------------------------------------------------------------------
def test_pin_values():
    given = {"offload": "optimizer"}
    opts = Options.from_pins(given)
    assert opts.zero == 2 and opts.pipeline == 1      # DeepSpeed's pairing; no pipeline
    assert given == {"offload": "optimizer"}           # the user's pins are not changed
    assert Options.from_pins({"offload": "optimizer", "zero": 3}).zero == 3
    assert Options.from_pins({"offload": None}) == {} and Options.from_pins({"offload": "none"}) == {}
    for pins, words in [({"offload": "cpu"}, "offload='cpu': use 'optimizer'"),
                        ({"offload": "optimizer", "zero": 0}, "zero=0 keeps no shard"),
                        ({"offload": "optimizer", "pipeline": 2}, "pipeline=2 is not supported"),
                        ({"offload": "optimizer", "compress": "bf16"}, "compress='bf16' is not supported")]:
        with pytest.raises(PinError, match=words):
            Options.from_pins(dict(pins))


def test_host_link_constants():
    a100, h100 = host_link(A100_80GB), host_link(H100_80GB)
    assert 24e9 < a100.bandwidth < 26e9              # PCIe 4.0 x16 at 80% of 31.5 GB/s
    assert h100.bandwidth == pytest.approx(2 * a100.bandwidth)   # PCIe 5.0 doubles the lanes' rate
    cpu = parse_cluster("cpu:2").device
    assert host_link(cpu).bandwidth == cpu.mem_bandwidth / 2     # a memcpy reads and writes
    # 1 GB of fp32 shard with AdamW on an A100: 2 GB over PCIe, 7 GB of host memory traffic
    assert offload_seconds(1e9, 2, A100_80GB) == pytest.approx(2e9 / a100.bandwidth + 7e9 / a100.host_mem_bandwidth)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, (torch.randn(8, 64),), torch.randn(8, 64), nn.functional.mse_loss


def _plan(mlp, **kw):
    model, inputs, target, loss_fn = mlp
    return autopar.plan(model, inputs, loss_fn, target=target, cluster="cpu:2", **kw)


def test_free_search_offloads_when_nothing_else_fits(mlp, tmp_path):
    z3 = _plan(mlp, data=2, zero=3)
    pinned = _plan(mlp, data=2, **OFF)
    assert pinned.pins["zero"] == 2 and pinned.offload == "optimizer"
    assert pinned.estimate.memory_total < z3.estimate.memory_total
    budget = (z3.estimate.memory_total + pinned.estimate.memory_total) / 2
    free = _plan(mlp, memory_budget=budget)
    assert free.offload == "optimizer" and free.pins["zero"] == 2 and "data" in free.mesh_axes, free.pins
    assert free.estimate.memory_total <= budget and "offload" in free.solver.phases
    # with room for ZeRO-3 the search does not offload (it costs time)
    roomy = _plan(mlp, memory_budget=z3.estimate.memory_total * 1.01)
    assert roomy.offload is None and "offload" not in roomy.solver.phases
    # the cost: each parameter's shard copied down and up and stepped on the host, in compute
    plain = _plan(mlp, data=2, zero=2)
    shard = pinned.host_memory_bytes["grads"]
    assert shard == 4 * sum(p.numel() for p in mlp[0].parameters()) / 2
    assert pinned.estimate.compute_s - plain.estimate.compute_s == pytest.approx(
        offload_seconds(shard, 2, parse_cluster("cpu:2").device), rel=1e-6)
    assert "optimizer" in plain.estimate.memory_bytes and "optimizer" not in pinned.estimate.memory_bytes
    assert "ZeRO-Offload (offload='optimizer', zero=2)" in pinned.summary()
    # the plan file keeps it; a file without the field (older autopar) loads without offload
    pinned.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == pinned
    d = json.loads((tmp_path / "p.json").read_text())
    for k in ("offload", "host_memory_bytes"):
        d.pop(k)
    old = Plan.from_dict(d)
    assert old.offload is None and old.host_memory_bytes == {}
    with pytest.raises(PlanError, match="plan field offload: 'gpu'"):
        Plan.from_dict({**d, "offload": "gpu"})


def test_copies_priced_as_overlapped_but_one_bucket_each_way():
    """The overlap rule (cost_models.offload): a shard over one bucket shows only one
    bucket's copies each way beside its whole host step; a smaller one all of them."""
    a100 = host_link(A100_80GB)
    assert exposed_share(1e6) == 1.0 and exposed_share(4 * DDP_BUCKET_BYTES) == 0.25
    copies, step = offload_times(4 * DDP_BUCKET_BYTES, 2, A100_80GB, exposed_share(4 * DDP_BUCKET_BYTES))
    assert copies == pytest.approx(2 * DDP_BUCKET_BYTES / a100.bandwidth)
    assert step == offload_times(4 * DDP_BUCKET_BYTES, 2, A100_80GB)[1]     # never hidden
    # a plan: one 4096x4096 layer, fp32 shard of 32 MiB per rank on 2 ranks (> 25 MiB)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096))
    kw = dict(cluster="cpu:2", data=2)
    args = (model, (torch.randn(4, 4096),), nn.functional.mse_loss)
    pinned = autopar.plan(*args, target=torch.randn(4, 4096), **kw, **OFF)
    plain = autopar.plan(*args, target=torch.randn(4, 4096), zero=2, **kw)
    shard = pinned.host_memory_bytes["grads"]
    assert shard > DDP_BUCKET_BYTES
    dev = parse_cluster("cpu:2").device
    added = pinned.estimate.compute_s - plain.estimate.compute_s
    assert added == pytest.approx(offload_seconds(shard, 2, dev, DDP_BUCKET_BYTES / shard), rel=1e-6)
    hidden = offload_times(shard, 2, dev)[0] * (1 - DDP_BUCKET_BYTES / shard)    # what overlap saves
    assert added == pytest.approx(offload_seconds(shard, 2, dev) - hidden, rel=1e-6) and hidden > 0
    assert "copies not hidden" in pinned.summary()


# ---- offload="disk": ZeRO-Infinity's disk tier ----------------------------------------------
@pytest.mark.parametrize("case_id", [c["id"] for c in DISK_CASES])
def test_disk_offload_matches_one_device(results, case_id):
    """3 AdamW steps: the loss and every gradient at every step equal one device's within
    autopar.verify's tolerances, and losses, gradients and weights equal the same plan
    without offload bit for bit. AdamW's weights are compared with one device over all
    parameters (as the offload="optimizer" cases): per parameter, AdamW turns the rounding
    noise of a gradient that is zero in exact arithmetic (the key third of c_attn.bias:
    softmax ignores a shift of the keys) into whole steps, on the plan without offload too.
    Per parameter, autopar.verify's own run (SGD with momentum, linear in the gradients,
    stepped by a bare opt.step()) equals one device within its tolerances."""
    r = case_result(results, case_id)
    assert r["plan_pins"]["offload"] == "disk" and r["offload_dir"] == r["root"], r["plan_pins"]
    assert not r["problems"], r["problems"]
    assert r["loss_err"] < LOSS_RTOL, r
    assert r["grad_err"] < GRAD_RTOL, (r["grad_err"], r["grad_worst"])
    assert r["vs_plain"]["weights"] == 0.0 and r["vs_plain"]["grads"] == 0.0, r["vs_plain"]
    assert r["weight_err"] == r["vs_plain"]["weight_err"] and r["whole_err"] < WEIGHT_TOL, r
    sgd = r["sgd"]
    assert not sgd["problems"] and sgd["loss_err"] < LOSS_RTOL and sgd["grad_err"] < GRAD_RTOL, sgd
    assert sgd["weight_err"] < WEIGHT_RTOL, sgd
    assert sgd["disk"] == 2 * 4 * r["numel"] / 2, sgd      # masters and momentum, this rank's half


@pytest.mark.parametrize("case_id", [c["id"] for c in DISK_CASES])
def test_disk_offload_state_is_on_disk_between_steps(results, case_id):
    """After each pm.step the masters and AdamW's moments are views of the rank's files, none
    of their pages in memory (mincore), and the files hold this rank's half of the fp32
    master copy and both moments: the plan's disk_bytes. Host memory keeps the gradient
    shard alone, the device no optimizer state."""
    r = case_result(results, case_id)
    half = 4 * r["numel"] / 2
    assert r["plan_disk"] == {"optimizer": 3 * half} and r["plan_host"] == {"grads": half}, r
    assert "optimizer" not in r["estimate"], r["estimate"]
    for b in r["between"]:
        assert b["all_on_disk"] and b["in_directory"] and b["in_memory"] == 0, b
        assert b["disk"]["optimizer"] == r["plan_disk"]["optimizer"], b
        assert b["disk"]["optimizer"] <= b["disk"]["files"] < b["disk"]["optimizer"] + 4096 * 200, b
        assert b["resident"] == 0, b
    assert r["read_resident"] > 0       # reading the masters (full_state_dict) brings pages in
    assert "masters.bin" in r["files"] and any(f.startswith("state-") for f in r["files"]), r["files"]


@pytest.mark.parametrize("case_id", [c["id"] for c in DISK_CASES])
def test_disk_offload_checkpoint_round_trip(results, case_id):
    """save_checkpoint / load_checkpoint into a fresh module: it steps on to the same weights;
    the loaded moments are moved into its files (no more disk than before), the directory of
    each module is removed with it."""
    r = case_result(results, case_id)
    assert r["resumed"] == 0.0, r["resumed"]
    loaded = r["loaded"]
    assert loaded["all_on_disk"] and loaded["resident"] == 0 and loaded["in_memory"] == 0, loaded
    assert loaded["disk"]["optimizer"] == r["plan_disk"]["optimizer"], loaded
    assert r["removed"], "the rank's offload directory outlived its module"


def test_disk_pin_values(tmp_path):
    opts = Options.from_pins({"offload": "disk", "offload_dir": tmp_path})
    assert opts.zero == 2 and opts.pipeline == 1 and opts.offload_dir == str(tmp_path)
    assert Options.from_pins({"offload": "disk", "zero": 3}).zero == 3
    for pins, words in [({"offload": "nvme"}, "'disk' .the same state in files"),
                        ({"offload": "disk", "zero": 0}, "offload='disk' moves .* zero=0 keeps no shard"),
                        ({"offload": "disk", "pipeline": 2}, "offload='disk' with pipeline=2"),
                        ({"offload_dir": str(tmp_path)}, "pin offload='disk' too, or drop offload_dir="),
                        ({"offload": "optimizer", "offload_dir": str(tmp_path)}, "offload='optimizer' writes no files"),
                        ({"offload": "disk", "offload_dir": 3}, "offload_dir=3: give the path")]:
        with pytest.raises(PinError, match=words):
            Options.from_pins(dict(pins))
    from autopar.errors import ArgumentError
    from autopar.runtime.disk_offload import rank_directory
    with pytest.raises(ArgumentError, match="is not a directory: create it"):
        rank_directory(str(tmp_path / "missing"))
    made = rank_directory(str(tmp_path))
    assert os.path.dirname(made) == str(tmp_path) and "rank0" in os.path.basename(made)


def test_disk_constants_and_measured_disk():
    a100, h100 = disk_link(A100_80GB), disk_link(H100_80GB)
    # DeepNVMe's ds_io per node: 4 Gen4 SSDs 10 / 5 GB/s, 8 Gen5 48 / 26 GB/s; a GPU's 1/8
    assert (a100.read, a100.write) == (10e9 / 8, 5e9 / 8)
    assert (h100.read, h100.write) == (48e9 / 8, 26e9 / 8)
    cpu2 = parse_cluster("cpu:2").device
    here = measure_disk()
    assert 1e6 < here.read < 1e12 and 1e6 < here.write < 1e12, here
    assert disk_link(cpu2).read == here.read / 2       # two ranks share this machine's disk
    # 1 GB fp32 shard with AdamW on an A100: 3 GB read and written, 7 GB of host memory traffic
    read, write = disk_times(1e9, 2, A100_80GB)
    assert read == pytest.approx(3e9 / a100.read) and write == pytest.approx(3e9 / a100.write)
    step = offload_times(1e9, 2, A100_80GB)[1]
    assert disk_seconds(1e9, 2, A100_80GB) == pytest.approx(read + write - step) and read + write > step


def test_disk_offload_priced_and_reported(mlp, tmp_path):
    off = _plan(mlp, data=2, **OFF)
    disk = _plan(mlp, data=2, **DISK)
    assert disk.offload == "disk" and disk.pins["zero"] == 2
    shard = 4 * sum(p.numel() for p in mlp[0].parameters()) / 2
    assert disk.disk_bytes == {"optimizer": 3 * shard} and disk.host_memory_bytes == {"grads": shard}
    assert disk.estimate.memory_bytes == off.estimate.memory_bytes     # the device: as offload
    dev = parse_cluster("cpu:2").device
    assert disk.estimate.compute_s - off.estimate.compute_s == pytest.approx(
        disk_seconds(shard, 2, dev), rel=1e-6, abs=1e-12)
    assert "ZeRO-Infinity disk tier (offload='disk', zero=2)" in disk.summary()
    disk.save(tmp_path / "d.json")
    assert Plan.load(tmp_path / "d.json").disk_bytes == disk.disk_bytes
    # only on request: the free search under a budget offload fits picks offload='optimizer'
    z3 = _plan(mlp, data=2, zero=3)
    free = _plan(mlp, memory_budget=(z3.estimate.memory_total + off.estimate.memory_total) / 2)
    assert free.offload == "optimizer", free.pins


@pytest.mark.parametrize("zero", [2, 3])
def test_a_fused_optimizer_steps_the_offloaded_model(zero):
    """ZeRO-Offload stepped by a fused AdamW (``fused=True``, by ``pm.step`` and by
    ``opt.step()``) on 2 simulated ranks: torch's ``_fused_adamw_`` updates the host masters
    in place without bumping their version counters (torch 2.13, CPU), so before the masters'
    step hook they were never copied up and every step's loss was the first's. Each step now
    matches one device's fused AdamW."""
    import copy
    from examples.models import EXAMPLES
    from autopar.capture import capture
    from autopar.runtime.thread_ranks import simulate
    from autopar.solver.flat import plan_captured
    ex = EXAMPLES["mlp"](batch=8, seed=0)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)
    ref = copy.deepcopy(ex.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = ex.loss_fn(ref(*ex.inputs), ex.target)
        loss.backward()
        opt.step()
        want.append(loss.item())
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"data": 2, "offload": "optimizer", "zero": zero})
    for how in ("pm.step", "opt.step"):
        def run(pm, comm):
            o = torch.optim.AdamW(pm.parameters(), lr=1e-2, fused=True)
            losses = []
            for _ in range(3):
                o.zero_grad()
                losses.append(pm.train_step(*ex.inputs, target=ex.target).item())
                pm.step(o) if how == "pm.step" else o.step()
            return losses
        for rank, losses in enumerate(simulate(cap, plan, ex.model, run)):
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
            assert err < LOSS_RTOL, (how, rank, losses, want)
