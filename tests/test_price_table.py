"""One price table per (problem, cost model): the ILP, the stage DP's per-node costs,
``explain`` and the plan's estimate read the same prices.

- ``explain`` rebuilds the table from the plan's own settings (precision, ZeRO stage,
  recomputed layers), so its figure for a node's chosen option is what entered the plan's
  estimate: summed over every decision, the chosen rows give the estimate's compute,
  communication and memory; and the row of one node equals the solver's own table's.
- A solve builds its table once, and the pipeline planner's per-node costs read it.
"""
from __future__ import annotations

import pytest
from click.testing import CliRunner

import autopar
from autopar import cli as cli_mod
from autopar.cli import cli
from autopar.report import fmt_bytes, fmt_time
from autopar.solver import ilp, pipeline_costs
from autopar.pricing.prices import PriceTable
from autopar.pricing.prices import plan_prices
from autopar.viz.explain import explain
from conftest import example_and_capture

GPT = "examples.models:gpt_factory"
CLUSTER = "1x4xH100"
FP32 = {"data": 2, "tensor": 2}
BF16_ZERO3_RECOMPUTE = {"data": 2, "tensor": 2, "zero": 3, "precision": "bf16", "recompute": "full"}


class Built:
    """Every PriceTable built while in use (patched into ``PriceTable.__init__``)."""

    def __init__(self, monkeypatch):
        self.tables: list[PriceTable] = []
        init = PriceTable.__init__

        def counting(table, problem, cost):
            init(table, problem, cost)
            self.tables.append(table)
        monkeypatch.setattr(PriceTable, "__init__", counting)


@pytest.fixture(scope="module")
def gpt():
    return example_and_capture("gpt")


def solve(ex, monkeypatch, **pins):
    """The plan, and the one table its solve built."""
    built = Built(monkeypatch)
    p = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=CLUSTER, **pins)
    assert len(built.tables) == 1, "a solve of one mesh and recomputation builds one table"
    monkeypatch.undo()
    return p, built.tables[0]


def chosen_rows(cap, plan, table):
    """explain's chosen row of every decision of ``plan``, priced from ``table``."""
    rows = {}
    for rep in table.problem.vars:
        x = explain(cap, plan, rep, prices=table)
        assert x.chosen is not None and x.chosen.placement == str(plan.nodes[rep])
        rows[rep] = x.chosen
    return rows


@pytest.mark.parametrize("pins", [FP32, BF16_ZERO3_RECOMPUTE], ids=["fp32", "bf16-zero3-recompute"])
def test_explain_figures_are_the_estimates(gpt, pins, monkeypatch):
    ex, cap = gpt
    plan, solved_with = solve(ex, monkeypatch, **pins)
    assert plan.pins.get("precision") == pins.get("precision")
    assert bool(plan.recompute) == ("recompute" in pins)
    table = plan_prices(cap, plan)             # rebuilt from the plan, as `autopar explain` does
    rows = chosen_rows(cap, plan, table)
    est = plan.estimate
    # every decision's chosen compute and memory, and every edge once (into its consumer),
    # add up to the plan's estimate
    assert sum(r.compute_s for r in rows.values()) == pytest.approx(est.compute_s, rel=1e-9)
    assert sum(r.memory_bytes for r in rows.values()) == pytest.approx(sum(est.memory_bytes.values()), rel=1e-9)
    # the estimate's peak: the terms in no phase of the step plus its larger phase (the end
    # of forward's activations, the end of backward's gradients), less than all of them
    phases = est.memory_phases
    assert phases and {"activations", "grads"} <= {k for g in phases for k in g}
    always = sum(b for k, b in est.memory_bytes.items() if all(k not in g for g in phases))
    ends = [sum(est.memory_bytes.get(k, 0.0) for k in g) for g in phases]
    assert est.memory_total == pytest.approx(always + max(ends), rel=1e-12)
    assert est.memory_total < sum(est.memory_bytes.values())
    comm = sum(t for r in rows.values() for _, d, t in r.edges if d in ("in", "self"))
    comm += sum(t for r in rows.values() for nb, _, t in r.edges if nb == "loss must end replicated")
    # less what hides behind compute (cost_models/step.py's overlap rule; ZeRO-3's gathers
    # and reduce-scatters behind forward and backward): the estimate's own negative row,
    # never all of the data axis's collectives (the first block's gather stays exposed)
    hidden = -est.comm.get("overlapped", 0.0)
    assert hidden < sum(s for k, s in est.comm.items() if k.endswith("@data"))
    assert hidden > 0 if pins.get("zero") == 3 else hidden >= 0
    assert comm + est.comm.get("overlapped", 0.0) == pytest.approx(est.comm_s, rel=1e-9, abs=1e-15)
    # node by node, the rebuilt table prices the chosen option as the solver's own did
    for rep, r in rows.items():
        i = r.index
        assert r.compute_s == pytest.approx(solved_with.compute_s(rep, i), rel=1e-12)
        assert r.memory_bytes == pytest.approx(sum(solved_with.memory(rep, i).values()), rel=1e-12)
    # and explain without a table (what the CLI calls) gives the same row
    for node in ("linear_4", plan.params["transformer.h.0.attn.c_attn.weight"]):
        x = explain(cap, plan, node)
        rep = x.representative
        assert (x.chosen.compute_s, x.chosen.reshard_s, x.chosen.memory_bytes) == \
            (rows[rep].compute_s, rows[rep].reshard_s, rows[rep].memory_bytes)


def test_cli_explain_shows_the_plans_prices(gpt, tmp_path, monkeypatch):
    ex, cap = gpt
    plan, solved_with = solve(ex, monkeypatch, **BF16_ZERO3_RECOMPUTE)
    path = tmp_path / "plan.json"
    plan.save(path)
    cli_mod._CAPTURED[(GPT, (), False)] = (ex, cap)
    res = CliRunner().invoke(cli, ["explain", str(path), "linear_4", "--factory", GPT, "--all"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.startswith("* "))
    rep = solved_with.problem.rep.get("linear_4", "linear_4")
    i = next(o.index for o in explain(cap, plan, "linear_4", prices=solved_with).options if o.chosen)
    assert fmt_time(solved_with.compute_s(rep, i)) in row
    assert fmt_bytes(sum(solved_with.memory(rep, i).values())) in row


def test_one_table_per_solve(gpt, monkeypatch):
    ex, _ = gpt
    built = Built(monkeypatch)
    solves, costed = [], []
    tabulate, node_costs_init = ilp.tabulate, pipeline_costs._Acc.__init__

    def tabulate_(problem, cost):
        solves.append((problem, cost))
        return tabulate(problem, cost)

    def acc_(acc, cap, pt, *args):
        costed.append(pt)
        node_costs_init(acc, cap, pt, *args)
    monkeypatch.setattr(ilp, "tabulate", tabulate_)
    monkeypatch.setattr(pipeline_costs._Acc, "__init__", acc_)
    autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=CLUSTER, pipeline=2,
                 schedule="1f1b", micro_batch_size=2)
    assert solves and costed
    # one table per (problem, cost model) the ILP solved; the stage DP's per-node costs read
    # those tables and build none of their own
    pairs = {(id(p), id(c)) for p, c in solves}
    assert len(built.tables) == len(pairs)
    assert all(any(pt is t for t in built.tables) for pt in costed)


def test_a_value_no_parameter_reaches_costs_no_gradient_collective():
    """Llama's rotary tables (buffer slices) multiply batch-sharded q and k replicated: no
    gradient comes back to them, so the edge costs nothing in backward (it cost an
    all-reduce over the data axis per micro-batch: 0.8 s of Llama 3 405B's step)."""
    from autopar.cost_models.hardware import parse_cluster
    from autopar.placement import Replicate
    from autopar.pricing.costing import CostModel
    from autopar.mesh_roles import MeshRoles
    from autopar.pricing.problem import build_problem
    ex, cap = example_and_capture("llama")
    problem = build_problem(cap, (2,), MeshRoles(data=0))
    cost = CostModel.for_pins(parse_cluster("1x2xA100"), (2,), {}, data_axis=0)
    table = PriceTable(problem, cost)
    buffers = set(cap.buffers)
    from_buffer = [k for k, e in enumerate(problem.edges)
                   if not e.needs_grad and e.meta.dtype.is_floating_point
                   and problem.vars[e.dst].kind == "op"]
    from_param = [k for k, e in enumerate(problem.edges) if problem.vars[e.src].kind == "param"]
    assert buffers and from_buffer and from_param
    assert all(problem.edges[k].needs_grad for k in from_param)
    rep, partial = (Replicate(),), (True,)
    for k in from_buffer:
        assert table.edge(k, rep, rep, partial).steps == (), problem.edges[k]
    # a parameter read replicated by a sharded op gets its gradient all-reduced
    k = from_param[0]
    assert table.edge(k, rep, rep, partial).steps
