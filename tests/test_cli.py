"""The ``autopar`` command: every subcommand on the examples, its printed numbers checked
against the Plan object; bad input exits 2 with one clear line; a failed check exits 1.

In-process through click's CliRunner, except what must be a process of its own: torchrun
(``verify`` with 2 ranks, and ``demo``, whose verify runs 4). Those two start as soon as the
module starts and are collected by the last tests, so they overlap with the rest.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autopar import cli as cli_mod
from autopar.cli import cli
from autopar.plan import Plan
from autopar.report import _group_layers, fmt_bytes, fmt_time
from conftest import example_and_capture

GPT = "examples.models:gpt_factory"
MLP = "examples.models:mlp_factory"
ROOT = Path(__file__).resolve().parents[1]


def run(*args, code=0):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == code, f"exit {res.exit_code} != {code}\n{res.output}"
    assert "Traceback" not in res.output
    return res


def _spawn(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.Popen([sys.executable, "-m", "autopar", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def mlp_plan(workdir):
    """A 2-rank data-parallel MLP plan (made through the CLI) for the torchrun verify."""
    path = workdir / "mlp.json"
    run("plan", MLP, "--cluster", "cpu:2", "--pin", "data=2", "-o", path)
    return path


@pytest.fixture(scope="module")
def background(workdir, mlp_plan):
    """torchrun jobs, started early: verify 2 ranks with a plan file; the demo (4 ranks)."""
    jobs = {"verify2": _spawn(["verify", MLP, "--plan", mlp_plan, "--nproc", 2], ROOT),
            "demo": _spawn(["demo", "--config", "gpt2-124m", "-o", workdir / "demo_plan.json"], ROOT)}
    yield jobs
    for p in jobs.values():
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def tiny(workdir, background):
    """The tiny GPT on a 2x2 mesh (data=2, tensor=2), planned through the CLI."""
    path = workdir / "tiny.json"
    res = run("plan", GPT, "--cluster", "cpu:4", "--pin", "data=2", "--pin", "tensor=2", "-o", path)
    return path, Plan.load(path), res.stdout


@pytest.fixture(scope="module")
def dp(workdir, tiny):
    path = workdir / "dp.json"
    run("plan", GPT, "--cluster", "cpu:4", "--pin", "data=4", "-o", path)
    return path, Plan.load(path)


@pytest.fixture(autouse=True, scope="module")
def _share_capture():
    """Let the CLI reuse the session's capture of the tiny GPT (conftest's cache: same graph,
    same fingerprint as the factory with no arguments)."""
    cli_mod._CAPTURED[(GPT, (), False)] = example_and_capture("gpt")


def assert_summary_matches(text: str, p: Plan) -> None:
    """Every number of the summary is in the text, as the Plan has it."""
    e = p.estimate
    assert f"mesh {tuple(p.mesh_shape)} axes {tuple(p.mesh_axes)}" in text
    assert f"world {p.world_size}" in text and p.cluster in text
    assert f"step {fmt_time(e.step_time_s)}" in text
    assert f"compute {fmt_time(e.compute_s)}" in text
    assert f"communication {fmt_time(e.comm_s)}" in text
    assert f"memory per device: {fmt_bytes(e.memory_total)}" in text
    for term, b in e.memory_bytes.items():
        assert f"{term}" in text and fmt_bytes(b) in text, term
    for coll, s in e.comm.items():
        line = next(line for line in text.splitlines() if line.startswith(coll + " "))
        assert fmt_time(s) in line, (coll, line)
    for label, key, idx in _group_layers(list(p.params)):
        first = key.replace("{}", str(idx[0])) if "{}" in key else key
        line = next(line for line in text.splitlines() if line.startswith(label + " "))
        assert line.split()[-1] == p.nodes[p.params[first]].outputs[0], line
    assert f"{p.solver.n_graph_nodes} graph nodes -> {p.solver.n_decisions} decisions" in text


# ---- plan / show -----------------------------------------------------------------------------
def test_plan_for_a_gpu_cluster_this_machine_does_not_have(workdir):
    path = workdir / "h100.json"
    res = run("plan", GPT, "--meta", "--factory-args", "config=gpt2-124m,n_layer=2,batch=8",
              "--cluster", "4xdgx-h100", "--budget", "40GB", "--pin", "tensor=8", "-o", path)
    p = Plan.load(path)
    assert p.world_size == 32 and p.mesh_shape == (4, 8) and p.mesh_axes == ("data", "tensor")
    assert p.memory_budget == 40e9 and p.estimate.memory_total <= 40e9
    assert p.pins == {"tensor": 8}
    assert_summary_matches(res.stdout, p)
    assert f"budget {fmt_bytes(40e9)}" in res.stdout
    # the big matrices are sharded over the tensor axis
    assert p.nodes[p.params["transformer.h.0.mlp.c_fc.weight"]].outputs[0] != "RR"


def test_plan_summary_and_show_agree_with_the_plan(tiny):
    path, p, printed = tiny
    assert_summary_matches(printed, p)
    shown = run("show", path).stdout
    assert_summary_matches(shown, p)
    every = run("show", path, "--all-nodes").stdout
    sharded = [n for n in p.node_ops if any(c in "SP" for c in str(p.nodes[n]))]
    for n in sharded:
        assert any(line.split()[:1] == [n] and str(p.nodes[n]) in line for line in every.splitlines()), n


def test_show_json_round_trips(tiny):
    path, p, _ = tiny
    out = run("show", path, "--json").stdout
    assert Plan.from_dict(json.loads(out)) == p


def test_show_code_prints_the_rank_program(tiny):
    path, p, _ = tiny
    out = run("show", path, "--code", "--rank", 3, "--factory", GPT).stdout
    assert out.startswith("# rank 3 at mesh coordinate (1, 1) of (2, 2) ('data', 'tensor')")
    assert "def forward(" in out
    # the batch is sharded over the data axis (S(0) on axis 0): the program scatters it
    assert p.nodes["args_0"].outputs[0].startswith("S(0)")
    assert "collectives_scatter(args_0, axis = 0, dim = 0)" in out
    # tensor-parallel layers reduce across the tensor axis
    assert "axis = 1" in out
    run("show", path, "--code", "--rank", 4, "--factory", GPT, code=2)


# ---- explain ---------------------------------------------------------------------------------
def test_explain_lists_every_option_with_its_costs(tiny, captured):
    from autopar.viz.explain import explain
    path, p, _ = tiny
    _, cap = captured("gpt")
    x = explain(cap, p, "linear_4")
    out = run("explain", path, "linear_4", "--factory", GPT, "--all").stdout
    assert f"linear_4 (aten.linear.default) chose {p.nodes['linear_4']}" in out
    assert f"{len(x.options)} options" in out
    chosen = x.chosen
    assert chosen is not None and chosen.placement == str(p.nodes["linear_4"])
    rows = [line for line in out.splitlines() if line.startswith("* ")]
    assert len(rows) == 1 and chosen.placement in rows[0]
    assert fmt_time(chosen.compute_s) in rows[0] and fmt_time(chosen.total_s) in rows[0]
    assert abs(chosen.reshard_s - sum(t for *_, t in chosen.edges)) < 1e-15
    for o in x.options:                      # every alternative with its numbers
        line = next(line for line in out.splitlines()
                    if line[:1] in ("*", " ") and f" {o.placement} " in line)
        assert fmt_time(o.compute_s) in line
    # the neighbours in the chosen option's breakdown are the node's graph neighbours
    names = {nb for nb, _, _ in chosen.edges}
    assert "layer_norm" in names and "split" in names


def test_explain_takes_a_parameter_name(tiny):
    path, p, _ = tiny
    out = run("explain", path, "transformer.h.0.attn.c_attn.weight", "--factory", GPT).stdout
    ph = p.params["transformer.h.0.attn.c_attn.weight"]
    assert f"{ph} (param) chose {p.nodes[ph]}" in out
    assert "2 nodes of repeated layers share this choice" in out


# ---- diff ------------------------------------------------------------------------------------
def test_diff_reports_the_changes_and_their_costs(tiny, dp):
    (a_path, a), (b_path, b) = dp, tiny[:2]
    out = run("diff", a_path, b_path).stdout
    assert f"mesh_shape  {a.mesh_shape}" in out and str(b.mesh_shape) in out
    line = next(line for line in out.splitlines() if line.startswith("step_time_s"))
    delta = b.estimate.step_time_s - a.estimate.step_time_s
    assert fmt_time(a.estimate.step_time_s) in line and fmt_time(b.estimate.step_time_s) in line
    assert ("+" if delta >= 0 else "-") + fmt_time(abs(delta)) in line
    changed = [n for n in a.nodes if str(a.nodes[n]) != str(b.nodes[n])]
    assert f"placement changes: {len(changed)} nodes" in out
    line = next(line for line in out.splitlines() if line.startswith("memory total"))
    assert fmt_bytes(a.estimate.memory_total) in line and fmt_bytes(b.estimate.memory_total) in line
    assert "the plans are the same" in run("diff", a_path, a_path).stdout


# ---- errors: exit 2, one line, no traceback --------------------------------------------------
@pytest.fixture(scope="module")
def bad_files(workdir, tiny):
    d = {}
    d["not_json"] = workdir / "not.json"
    d["not_json"].write_text("{ nope")
    d["version"] = workdir / "v99.json"
    d["version"].write_text(json.dumps({**json.loads(tiny[0].read_text()), "version": 99}))
    d["missing"] = workdir / "missing.json"
    doc = json.loads(tiny[0].read_text())
    del doc["estimate"]
    d["missing"].write_text(json.dumps(doc))
    d["placement"] = workdir / "placement.json"
    doc = json.loads(tiny[0].read_text())
    doc["nodes"]["linear"]["inputs"][0] = "Q(7)"
    d["placement"].write_text(json.dumps(doc))
    return d


@pytest.mark.parametrize("args, says", [
    (["plan", GPT, "--pin", "tensr=2"], "unknown pin(s) ['tensr']"),
    (["plan", GPT, "--cluster", "3xdgx-z900"], "unknown cluster spec"),
    (["plan", "examples.models"], "is not MODULE:FACTORY"),
    (["plan", "no_such_module:f"], "cannot import 'no_such_module'"),
    (["plan", "examples.models:nope"], "has no callable 'nope'"),
    (["plan", GPT, "--factory-args", "n_layr=3"], "failed: TypeError"),
    (["plan", GPT, "--factory-args", "batch"], "is not key=value"),
    (["plan", GPT, "--budget", "lots"], "cannot read the memory budget"),
    (["plan", MLP, "--cluster", "cpu:2", "--budget", "1KB"], "fits the memory budget"),
    (["plan", MLP, "--cluster", "cpu:4", "--pin", "data=3"], "do not multiply to the world size 4"),
    (["show", "nowhere.json"], "no plan file"),
    (["viz", "-o", "x.png"], "give a PLAN file"),
])
def test_bad_input_exits_2_with_one_line(args, says):
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert says in res.output, res.output
    assert "Traceback" not in res.output
    err = [line for line in res.output.splitlines() if line.startswith("autopar: error:")]
    assert len(err) == 1 or "Usage:" in res.output


@pytest.mark.parametrize("which, says", [("not_json", "not JSON"),
                                         ("version", "plan field version: 99 is not supported (this autopar reads versions 1 to 3)"),
                                         ("missing", "plan field estimate: '<missing>' is required"),
                                         ("placement", "'Q(7)' is not a placement")])
def test_malformed_plan_files_exit_2(bad_files, which, says):
    res = CliRunner().invoke(cli, ["show", str(bad_files[which])], catch_exceptions=False)
    assert res.exit_code == 2 and says in res.output, res.output
    assert "make a new one with `autopar plan`" in res.output


def test_usage_errors_exit_2(tiny):
    path = tiny[0]
    for args, says in [(["explain", path, "lnear", "--factory", GPT], "did you mean linear"),
                       (["explain", path, "linear"], "Missing option '--factory'"),
                       (["show", path, "--code"], "--code needs the model"),
                       (["show", path, "--code", "--factory", MLP], "made for another graph"),
                       (["verify", GPT, "--plan", path, "--nproc", 2], "use --nproc 4"),
                       (["frobnicate"], "No such command")]:
        res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert res.exit_code == 2 and says in res.output, (args, res.output)


def test_the_entry_point_returns_the_exit_code(bad_files, capsys):
    """``autopar`` / ``python -m autopar`` call ``main``, whose return is the process's code
    (the torchrun tests below run ``python -m autopar`` as a process)."""
    assert cli_mod.main(["show", str(bad_files["version"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error:") and "Traceback" not in err
    assert cli_mod.main(["--help"]) == 0


def test_a_failed_check_exits_1(monkeypatch):
    from autopar import verify
    bad = verify.Check(loss_err=3e-3, grad_err=0.5, grad_worst="fc1.weight", weight_err=1e-2)
    good = verify.Check()
    fake = verify.Launch([verify.RankResult(0, good, coord=(0,), loss=1.0),
                          verify.RankResult(1, bad, coord=(1,), loss=1.003)], 2, 0, "")
    monkeypatch.setattr(verify, "launch", lambda *a, **k: fake)
    res = CliRunner().invoke(cli, ["verify", MLP, "--nproc", "2"], catch_exceptions=False)
    assert res.exit_code == 1, res.output
    rows = {line.split()[0]: line for line in res.output.splitlines() if line[:1] in "01"}
    assert "pass" in rows["0"] and "FAIL" in rows["1"] and "5.00e-01" in rows["1"]
    assert "verify failed on 1 of 2 ranks" in res.output


# ---- torchrun: verify (2 ranks) and the demo (4 ranks) ---------------------------------------
def test_verify_two_ranks_with_a_plan_file(background, mlp_plan):
    out, err = background["verify2"].communicate(timeout=300)
    assert background["verify2"].returncode == 0, out + err
    p = Plan.load(mlp_plan)
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert len(rows) == 2 and all(r[-1] == "pass" for r in rows), out
    assert f"mesh {p.mesh_shape} {p.mesh_axes}" in out
    for r in rows:
        loss_err, grad_err, weight_err = float(r[3]), float(r[4]), float(r[6])
        assert loss_err < 1e-5 and grad_err < 1e-4 and weight_err < 1e-4


def test_demo_plans_a_gpu_cluster_and_verifies_four_ranks(background, workdir):
    out, err = background["demo"].communicate(timeout=600)
    assert background["demo"].returncode == 0, out + err
    p = Plan.load(workdir / "demo_plan.json")
    assert p.cluster == "2xdgx-a100" and p.world_size == 16
    assert_summary_matches(out, p)
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")]
    assert len(rows) == 4 and all(r[-1] == "pass" for r in rows), out
    assert "mesh (2, 2) ('data', 'tensor')" in out
    assert "all 4 ranks match the single-device model" in out
