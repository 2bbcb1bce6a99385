"""``benchmarks/gpu_check.py --dry``: the first GPU run's script, exercised on the CPU so
that it cannot rot (issue 30). One subprocess run (tiny models, gloo, 2 steps); the report's
structure, and the equivalence it computed: autopar at world 1 against eager training, the
loss and parameter differences within the script's stated bf16 tolerances."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
SECTIONS = ("environment", "equivalence", "offload", "op_timing", "plan_shapes", "memory", "compile",
            "attention_backends", "fp8_gemms", "moe", "autopar_compile", "multi_gpu", "scale")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    # --multi-cpu: the two-rank section on 2 gloo CPU ranks (on a GPU both ranks share it)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--multi-cpu", "--out", str(out)],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.exists(), proc.stdout[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_says_it_is_a_dry_run(dry):
    report, stdout = dry
    assert "no CUDA GPU present: dry run on CPU" in stdout
    assert report["mode"] == "dry" and report["device"] == "cpu"
    assert "summary" in report and report["summary"]


def test_every_section_ran(dry):
    report, _ = dry
    s = report["sections"]
    assert set(SECTIONS) <= set(s)
    for name in SECTIONS:
        assert s[name]["status"] == "ok", (name, s[name].get("error"), s[name].get("traceback_tail"))


def test_two_rank_section_equals_one_device(dry):
    """The two-rank section (``--multi-cpu``: 2 gloo ranks on the CPU, where a GPU loan runs
    both on its one GPU): data=2, tensor=2 and ZeRO-3 of the GPT, each by ``train_step`` and
    by the ordinary loop, every step's loss within the section's tolerance of one device
    (recomputed here from the losses it recorded); each collective probed; all-reduce timed."""
    from gpu_check import LOSS_RTOL, rel
    mg = dry[0]["sections"]["multi_gpu"]
    assert mg["world"] == 2 and mg["backend"] == "gloo" and not mg["ranks_share_one_gpu"], mg
    assert set(mg["plans"]) == {"data=2", "tensor=2", "data=2 zero=3"}, mg["plans"]
    for label, loops in mg["plans"].items():
        assert set(loops) == {"train_step", "backward"}, (label, loops)
        for loop, r in loops.items():
            assert "losses" in r, (label, loop, r.get("error"), r.get("traceback_tail"))
            assert len(r["losses"]) == mg["steps"] and r["passed"], (label, loop, r)
            worst = max(rel(a, b) for a, b in zip(r["losses"], mg["one_device_losses"]))
            assert worst == pytest.approx(r["max_loss_rel_diff"]) and worst <= LOSS_RTOL, (label, loop, r)
    assert all(v == "ok" for v in mg["collectives"].values()), mg["collectives"]
    assert mg["all_reduce"] and all(b.get("seconds", 0) > 0 for b in mg["all_reduce"]), mg["all_reduce"]


def test_equivalence_within_tolerance(dry):
    """Recomputed from the losses and parameter differences the run recorded, against the
    tolerances the report states."""
    report, _ = dry
    eq = report["sections"]["equivalence"]
    tol = eq["tolerance"]
    assert 0 < tol["loss_rtol"] <= 0.05 and 0 < tol["param_rtol"] <= 0.05
    assert set(eq["models"]) == {"gpt", "llama"}
    for name, m in eq["models"].items():
        assert "error" not in m, (name, m.get("error"), m.get("traceback_tail"))
        assert len(m["losses"]) == len(m["ref_losses"]) == eq["steps"] >= 2
        assert all(math.isfinite(x) for x in m["losses"] + m["ref_losses"])
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(m["losses"], m["ref_losses"]))
        assert loss_err <= tol["loss_rtol"], (name, m["losses"], m["ref_losses"])
        assert m["param_rel_diff"] and not m["missing_params"]
        worst = max(m["param_rel_diff"].values())
        assert worst <= tol["param_rtol"], (name, m["worst_param"], worst)
        assert m["passed"] is True
        # on a CPU both runs take the same kernels: the weights agree to a small part of how
        # far they moved (a skipped or doubled update would be all of it)
        assert m["max_param_diff_rel_to_change"] <= 0.05, (name, m["max_param_diff_rel_to_change"])
        # the weights moved: a run that skipped its updates would not compare equal by chance
        assert m["losses"][-1] != m["losses"][0]
    assert eq["passed"] is True


def test_op_timing_tables(dry):
    report, _ = dry
    for name, m in report["sections"]["op_timing"]["models"].items():
        assert "error" not in m, (name, m.get("error"))
        assert m["timing_report"].startswith("predicted vs measured")
        rows = {r["row"]: r for r in m["families"]}
        assert {"step", "matmul", "optimizer"} <= set(rows)
        assert rows["optimizer"]["predicted"] > 0 and rows["matmul"]["measured"] > 0
        assert m["gemm_by_shape"] and m["attention"]
        # every GEMM node found its kernels, forward and backward (twice as many)
        for g in m["gemm_by_shape"]:
            assert g["calls_fwd"] > 0 and g["calls_bwd"] == 2 * g["calls_fwd"], g


def test_plan_shapes_and_data_file(dry):
    report, _ = dry
    ps = report["sections"]["plan_shapes"]
    assert len(ps["shapes"]) == 3
    for r in ps["shapes"]:
        assert "error" not in r, r
        assert r["measured_fwd_s"] > 0 and r["predicted_fwd_s"] > 0 and r["ratio_bwd"] > 0
        assert set(r["predicted_by_gpu"]) == {"a100", "h100", "h200"}
    data = json.loads((ROOT / "benchmarks" / "data" / "gpu_check_shapes.json").read_text())
    assert 10 <= len(data["shapes"]) <= 40
    assert {s["family"] for s in data["shapes"]} == {"matmul", "attention"}
    assert {r["row"] for r in data["rows"]} == set(range(17))
    assert set(data["plans"]["gpu"]) == {"h100", "h200"}


def test_prepared_plans_match_this_capture(dry):
    """The world-1 plans in the data file were made for the graph autopar captures now (a
    GPU machine without OR-Tools runs them); when this fails, re-run
    ``python benchmarks/gpu_check.py --prepare``."""
    report, _ = dry
    env = report["sections"]["environment"]
    data = json.loads((ROOT / "benchmarks" / "data" / "gpu_check_shapes.json").read_text())
    if env["torch"].split(".")[:2] != data["torch"].split(".")[:2]:
        pytest.skip(f"the plans were prepared on torch {data['torch']}, this is {env['torch']}")
    fresh = env["prepared_plans_fresh"]
    assert fresh == {"gpt": {"cpu": True}, "llama": {"cpu": True}}, fresh


def test_memory_and_compile(dry):
    report, _ = dry
    for name, m in report["sections"]["memory"]["models"].items():
        assert m["estimate_bytes"] > 0 and m["timing_report_peak_bytes"] > 0, (name, m)
    c = report["sections"]["compile"]
    assert c["eager_step_s"] > 0 and c["compiled_step_s"] > 0, c


def _equal_to_one_device(m: dict, tol: dict) -> None:
    """A run of ``train_and_compare`` against its eager reference, within the stated bf16
    tolerances and to a small part of how far the weights moved."""
    assert "error" not in m, (m.get("error"), m.get("traceback_tail"))
    assert len(m["losses"]) == len(m["ref_losses"]) >= 2 and not m["missing_params"]
    assert max(abs(a - b) / abs(b) for a, b in zip(m["losses"], m["ref_losses"])) <= tol["loss_rtol"]
    assert max(m["param_rel_diff"].values()) <= tol["param_rtol"]
    assert m["max_param_diff_rel_to_change"] <= 0.05, m["max_param_diff_rel_to_change"]
    assert m["losses"][-1] != m["losses"][0] and m["passed"] is True


def test_mixtral_trains_through_its_experts_op(dry):
    """transformers' Mixtral at world 1: each MoE layer one ``autopar::moe_experts`` op (the
    plan's summary names the experts), equal to eager training."""
    s = dry[0]["sections"]
    m = s["moe"]
    _equal_to_one_device(m, s["equivalence"]["tolerance"])
    assert m["experts"], m["summary"]


def test_offloaded_plans_equal_one_device_and_move_their_activations(dry):
    """``offload_activations="full"`` at world 1 (on a GPU: pinned host memory and a side
    stream): equal to eager training; the plan's estimate holds an ``offload`` term and fewer
    activation bytes than the same model's plan without offload."""
    s = dry[0]["sections"]
    for name, m in s["offload"]["models"].items():
        _equal_to_one_device(m, s["equivalence"]["tolerance"])
        assert m["offloaded"] == "full" and m["estimate_terms"]["offload"] > 0, m["estimate_terms"]
        assert m["estimate_saved_bytes"] > 0, (name, m["without_offload"], m["estimate_bytes"])
    assert set(s["offload"]["models"]) == {"gpt", "llama"}


def test_speed_lines_compare_autopar_with_torch(dry):
    """The summary's issue-42 ratios: autopar eager over torch eager, autopar compiled over
    torch.compile, from the steps the report recorded."""
    report = dry[0]
    line = next(x for x in report["summary"] if x.startswith("speed gpt:"))
    m = report["sections"]["equivalence"]["models"]["gpt"]
    assert f"autopar eager / torch eager {m['median_step_s'] / m['median_ref_step_s']:.2f}" in line
    assert "autopar compiled / torch.compile" in line


def test_autopar_compiled_gpt_equals_one_device(dry):
    """``parallelize(compile=True)`` at world 1 (Inductor's C++ on the CPU): equal to eager
    training, both programs compiled and their seconds reported."""
    s = dry[0]["sections"]
    m = s["autopar_compile"]["models"]["gpt"]
    _equal_to_one_device(m, s["equivalence"]["tolerance"])
    rep = m["compile_report"]
    assert rep["compile_s"] and all(v > 0 for v in rep["compile_s"].values()), rep
    assert m["autopar_eager_step_s"] > 0 and m["speedup_over_autopar_eager"] > 0
    # compile="reduce-overhead": compile=True's programs on the CPU (no CUDA graphs), equal
    # to one device, its host time priced as replays
    g = s["autopar_compile"]["models"]["gpt-graphs"]
    _equal_to_one_device(g, s["equivalence"]["tolerance"])
    assert g["speedup_over_compiled"] > 0 and g["predicted_host_s"] > 0


def test_attention_backends_are_timed(dry):
    rows = dry[0]["sections"]["attention_backends"]["shapes"]
    assert rows and all(r["backends"]["default"]["fwd_s"] > 0 and r["predicted_fwd_s"] > 0 for r in rows)


def test_fp8_gemms_are_timed(dry):
    """``gpu_check_fp8``: each recipe's linear timed and priced (on the CPU: this machine's
    measured fp8 rate), beside the bf16 linear."""
    rows = dry[0]["sections"]["fp8_gemms"]["shapes"]
    assert rows
    for r in rows:
        for recipe in ("bf16", "tensorwise", "rowwise"):
            assert r[recipe]["fwd_s"] > 0 and r[recipe]["predicted_fwd_s"] > 0, (recipe, r[recipe])


def test_scale_runs_one_rank_of_each_plan(dry):
    """The scale section (``benchmarks/gpu_check_scale.py``) at dry sizes: each case's rank-0
    program, built from its plan under the fake process group, trained a step: its compute
    by family, its peak memory and the plan's prediction recorded; its loss and gradients
    finite, every parameter the local shape the plan's placements give, and the module
    holding only its shards: the whole model's bytes over the rank's is the plan's degree
    for the dense cases (every weight matrix split over every mesh axis; only the norm
    vectors, 0.3% of the bytes, replicated), more than 1 for the experts (split) beside the
    replicated attention and embeddings."""
    from gpu_check_scale import DRY_CASES
    report, _ = dry
    cases = report["sections"]["scale"]["cases"]
    assert set(cases) == set(DRY_CASES)
    for name, c in cases.items():
        assert "error" not in c, (name, c.get("error"), c.get("traceback_tail"))
        assert c["world_size"] == math.prod(c["mesh"]) >= 2, name
        assert c["families"]["matmul"]["measured_s"] > 0, (name, c["families"])
        assert c["compute_measured_s"] > 0 and c["timing_report"].startswith("predicted vs measured")
        assert c["peak_bytes"] > 0 and c["predicted_memory_bytes"] > 0, name
        assert c["memory_ratio"] == c["peak_bytes"] / c["predicted_memory_bytes"]
        ch = c["checks"]
        assert ch["loss_finite"] and ch["grads_finite"], (name, ch)
        assert ch["n_params_without_grad"] == 0 and ch["n_wrong_local_shapes"] == 0, (name, ch)
        assert c["local_param_bytes"] < c["whole_model_param_bytes"], name
        om = c["op_memory"]                  # the step traced op by op: every phase seen
        assert "error" not in om, (name, om)
        assert set(om["phases"]) == {"forward", "backward", "optimizer"}, (name, om["phases"])
        assert om["top_ops"] and all(r["seconds"] > 0 for r in om["top_ops"]), name
    for name in ("llama3_8b_tp8", "llama3_70b_pp_stage"):
        c = cases[name]
        assert c["whole_over_local"] >= 0.99 * math.prod(c["mesh"]), (name, c["whole_over_local"], c["mesh"])
        assert c["compute_predicted_s"] > 0, name
    # the pipeline stage's receive buffers at their peak (one per micro-batch in flight),
    # within its rank's plan
    c = cases["llama3_70b_pp_stage"]
    assert 0 < c["receive_buffer_bytes"] <= c["predicted_rank0_memory_terms"]["pipeline_buffers"], c
    for name in ("llama3_8b_tp8", "deepseek_v3_moe_ep8"):     # the price table, by family
        assert cases[name]["families"]["matmul"]["predicted_s"] > 0, name
    assert cases["deepseek_v3_moe_ep8"]["mesh_axes"] == ["expert"]


def test_loopback_writes_what_a_fake_group_may_leave_unwritten():
    """torch 2.11's fake process group (the GPU machine's torch) returns from a collective
    without writing its output: the scale section's loss was NaN there and its token
    counts 10^18. ``Loopback`` writes every output as if each peer sent what this rank
    sends, whatever the group under it did: checked here over a stand-in that writes
    nothing (the output starts as NaN)."""
    import torch
    from gpu_check_scale import Loopback

    class Silent:                          # torch 2.11's fake group: returns, writes nothing
        def get_world_size(self, group=None):
            return 4

        def get_rank(self, group=None):
            return 1

        def __getattr__(self, name):
            return lambda *a, **k: None
    lo = Loopback(Silent())
    t = torch.arange(6.0).reshape(3, 2)
    out = torch.full((12, 2), float("nan"))
    lo.all_gather_into_tensor(out, t)
    assert torch.equal(out, t.repeat(4, 1))
    parts = [torch.full((3, 2), float("nan")) for _ in range(4)]
    lo.all_gather(parts, t)
    assert all(torch.equal(p, t) for p in parts)
    big = torch.arange(24.0).reshape(12, 2)
    out = torch.full((3, 2), float("nan"))
    lo.reduce_scatter_tensor(out, big)
    assert torch.equal(out, big[3:6])                   # rank 1's chunk of its own input
    counts = torch.tensor([5, 0, 7, 1])
    got = torch.full((4,), -1)
    lo.all_to_all_single(got, counts)                   # the counts' exchange: equal splits
    assert torch.equal(got, counts)
    toks = torch.arange(26.0).reshape(13, 2)
    out = torch.full((13, 2), float("nan"))
    lo.all_to_all_single(out, toks, [5, 0, 7, 1], [5, 0, 7, 1])
    assert torch.equal(out, toks)
    out = torch.full((20, 2), float("nan"))             # counts it did not send: finite rows
    lo.all_to_all_single(out, toks, [10, 0, 9, 1], [5, 0, 7, 1])
    assert torch.isfinite(out).all() and torch.equal(out[:13], toks)


def test_without_peers_zeroes_every_receive_buffer(monkeypatch):
    """A fake receive writes nothing: the scale section's stages must read zeros, not
    uninitialised memory (CI once read NaNs in ``llama3_70b_pp_stage``'s gradients when only
    torch's set-up buffers were zeroed and not the runtime's fresh one per receive). The
    allocator here fills with NaN, so a buffer ``without_peers`` misses fails."""
    import types
    import torch
    from torch.distributed.pipelining import stage as pp_stage
    from autopar.runtime import receive_buffers
    from gpu_check_scale import without_peers

    def nans(meta, device):
        return torch.full(meta.shape, float("nan"), dtype=meta.dtype, device=device)
    monkeypatch.setattr(pp_stage, "_make_tensor_from_meta", nans)
    monkeypatch.setattr(receive_buffers, "_make_tensor_from_meta", nans)
    meta = types.SimpleNamespace(shape=(2, 3), dtype=torch.float32)
    info = types.SimpleNamespace(is_root_arg=False, tensor_meta=meta, buffer=None)
    stage = types.SimpleNamespace(device=torch.device("cpu"), meter=None)
    with without_peers():
        receive_buffers.InFlightBuffers._fresh(stage, [info])
        assert torch.equal(info.buffer, torch.zeros(2, 3))
        assert torch.equal(pp_stage._make_tensor_from_meta(meta, "cpu"), torch.zeros(2, 3))
    assert receive_buffers._make_tensor_from_meta is nans     # restored on exit


def test_without_a_gpu_it_refuses(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no CUDA GPU present" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_context_block_benchmark_runs_dry(tmp_path):
    """``benchmarks/gpu_context_block.py --dry``: its CPU path at a tiny shape (fp32), the
    numbers of context attention at one rank against SDPA's (the GPU run's check)."""
    out = tmp_path / "block.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_context_block.py"), "--dry",
                           "--repeats", "1", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["err_out"] < 1e-5 and max(r["err_grads"]) < 1e-5 for r in rows), rows
