"""The static SPMD type check of every rank's programs (``autopar.runtime.spmd_check``,
``autopar.runtime.static_verify``, ``autopar verify --static``; issue 43, item 1).

Planted faults, one per kind, each edited into rank 0's rewritten train program of a tiny
GPT under data=2, tensor=2, zero=3 and each caught, with the node it names; then real plans
(free, data, tensor, ZeRO-3, pipeline, expert) pass on every simulated rank, and a program
whose ranks issue their collectives in different orders is refused. No process is started.
"""
from __future__ import annotations

import functools
import operator

import pytest
import torch

from autopar.errors import StaticCheckError
from autopar.ops import collectives as C
from autopar.options import Options
from autopar.runtime import static_verify as sv
from autopar.runtime.spmd_check import check_program
from autopar.solver.driver import solve
from cost_models.local_devices import local_cluster
from examples.models import EXAMPLES


@functools.lru_cache(maxsize=None)
def planned(name: str, world: int, pins: tuple):
    """(example, plan, the graph it runs on) of ``EXAMPLES[name]`` on ``world`` ranks."""
    ex = EXAMPLES[name]()
    got = solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=local_cluster(world),
                world_size=world, pins=Options.from_pins(dict(pins)))
    return ex, got.plan, got.captured


ZERO3 = ("gpt", 4, (("data", 2), ("tensor", 2), ("zero", 3)))


def rank0_train():
    """Rank 0's train program of the ZeRO-3 plan (a fresh build: the tests edit it) and the
    context its check reads."""
    ex, plan, cap = planned(*ZERO3)
    programs, ctx = sv.Builder(cap, plan, ex.model).build((0, 0))
    return programs["train"], ctx["train"]


def calls(gm, fn, **kw):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn
            and all(n.kwargs.get(k) == v for k, v in kw.items())]


def caught(gm, ctx, *words) -> str:
    gm.graph.lint()
    gm.recompile()
    with pytest.raises(StaticCheckError) as e:
        check_program(gm, ctx)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    assert "report it with the plan file" in msg, msg
    return msg


def test_the_unedited_program_checks():
    """The control of every planted fault below: the same program, unedited, passes."""
    gm, ctx = rank0_train()
    sizes = check_program(gm, ctx)
    assert sizes and calls(gm, C.all_reduce, axis=1) and calls(gm, C.all_gather, axis=0)


def test_a_missing_all_reduce_is_caught():
    gm, ctx = rank0_train()
    ar = calls(gm, C.all_reduce, axis=1)[0]
    user = next(iter(ar.users))
    ar.replace_all_uses_with(ar.args[0])
    gm.graph.erase_node(ar)
    caught(gm, ctx, repr(user.name), "P there", "as R on mesh axis 1 (tensor")


def test_an_extra_all_reduce_is_caught():
    gm, ctx = rank0_train()
    ar = calls(gm, C.all_reduce, axis=1)[0]
    with gm.graph.inserting_after(ar):
        extra = gm.graph.call_function(C.all_reduce, (ar,), {"axis": 1})
    ar.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    caught(gm, ctx, repr(extra.name), "takes a P value", "is R there")


def test_an_all_gather_on_the_wrong_dim_is_caught():
    gm, ctx = rank0_train()
    ag = next(n for n in calls(gm, C.all_gather, axis=0) if n.kwargs["dim"] == 1)
    ag.kwargs = {**ag.kwargs, "dim": 0}
    caught(gm, ctx, repr(ag.name), "takes a S(0) value", "is S(1) there")


def test_a_reduce_scatter_where_an_all_reduce_belongs_is_caught():
    gm, ctx = rank0_train()
    ar = calls(gm, C.all_reduce, axis=1)[0]
    user = next(iter(ar.users))
    ar.target, ar.kwargs = C.reduce_scatter, {"axis": 1, "dim": 0}
    caught(gm, ctx, repr(user.name), "S(0) there")


def test_a_gradient_reduced_twice_is_caught():
    """A gradient all-reduce on the data axis after a ZeRO-3 gather whose backward already
    reduce-scatters the weight's gradient there: the forward types still check (R -> R); the
    gradient walk (passes.check_grad_sync) finds the second reduction."""
    gm, ctx = rank0_train()
    ag = calls(gm, C.all_gather, axis=0, grad_partial=True)[0]
    with gm.graph.inserting_after(ag):
        twice = gm.graph.call_function(C.grad_all_reduce, (ag,), {"axis": 0})
    ag.replace_all_uses_with(twice, delete_user_cb=lambda u: u is not twice)
    for user in twice.users:       # the op reads the reduced value as its input
        user.meta = {**user.meta, "inputs": tuple(twice if i is ag else i
                                                   for i in user.meta.get("inputs", ()))}
    caught(gm, ctx, "gradient of", "on mesh axis 0", "receives a whole gradient but its backward "
           "expects a partial one")


def test_a_shape_constant_left_global_is_caught():
    """A reshape whose target shape the rewrite made local, set back to the captured
    (global) one."""
    gm, ctx = rank0_train()
    cap = ctx.cap
    node = next(n for n in gm.graph.nodes if n.target is torch.reshape and n.meta.get("source")
                and list(n.args[1]) != list(cap.node(n.meta["source"]).args[1]))
    node.args = (node.args[0], list(cap.node(node.meta["source"]).args[1]))
    caught(gm, ctx, repr(node.name), "shape constant")


def test_a_strategy_its_rule_does_not_offer_is_caught():
    """The plan read by the check runs a GELU as P -> P on the tensor axis (a partial sum
    through a nonlinear op: no rule offers it)."""
    from dataclasses import replace
    from autopar.placement import P, parse_placements, placements_str
    from autopar.plan import NodePlacement
    gm, ctx = rank0_train()
    gelu = next(n for n in gm.graph.nodes if n.meta.get("source", "").startswith("gelu"))
    src = gelu.meta["source"]
    old = ctx.plan.nodes[src]

    def partial_on_tensor(text):
        p = list(parse_placements(text))
        p[1] = P
        return placements_str(p)
    nodes = {**ctx.plan.nodes, src: NodePlacement(tuple(map(partial_on_tensor, old.inputs)),
                                                  tuple(map(partial_on_tensor, old.outputs)))}
    caught(gm, replace(ctx, plan=replace(ctx.plan, nodes=nodes)), repr(gelu.name),
           "P->P on mesh axis 1 (tensor", "its sharding rule does not offer")


# --- real plans pass on every simulated rank ------------------------------------------------

REAL = {
    "free": ("gpt", 2, ()),
    "data": ("gpt", 2, (("data", 2),)),
    "tensor": ("gpt", 2, (("tensor", 2),)),
    "zero3": ZERO3,
    "pipeline": ("gpt", 2, (("pipeline", 2),)),
    "pipeline-data": ("llama", 4, (("pipeline", 2), ("data", 2))),
}


@pytest.mark.parametrize("kind", list(REAL))
def test_real_plans_check_on_every_rank(kind):
    ex, plan, cap = planned(*REAL[kind])
    results = sv.static_verify(cap, plan, ex.model)
    assert len(results) == plan.world_size * (2 if cap.has_loss else 1)
    assert {r.rank for r in results} == set(range(plan.world_size))
    assert all(r.ok for r in results), sv.first_error(results)
    if kind in ("tensor", "zero3"):      # (data parallel sums in the step, outside the program)
        assert any(r.collectives for r in results), "no collective listed: nothing compared"


def test_an_expert_parallel_plan_checks():
    """A tiny mixture of experts (transformers' Mixtral, examples/zoo) with its experts split
    over 2 ranks (all-to-all dispatch)."""
    pytest.importorskip("transformers")
    import benchmarks.sweep_cases as sc
    case = sc.make_case("mixtral", "expert", 2, "mean", {"expert": 2, "expert_dispatch": "all-to-all"})
    b = sc.model_inputs(case)
    plan, cap = sc.plan_case(case, b)
    assert any(op == "autopar.moe_experts.default" for op in plan.node_ops.values())
    results = sv.static_verify(cap, plan, b.model)
    assert results and all(r.ok for r in results), sv.first_error(results)


def test_a_mixed_precision_zero3_plan_checks_under_autocast():
    """``nn.TransformerEncoder`` under bf16 and ZeRO-3 (data=2): its weights are gathered in
    bf16 (``passes.low_precision_gathers``) and meet fp32 activations in ``aten.linear``,
    which the rank runs under autocast; the check ran the op without it and reported "expected
    scalar type torch.float32 but found torch.bfloat16" on a plan that trains as one device
    does (the sweep's torch-encoder:fp8:548178)."""
    pytest.importorskip("transformers")
    import benchmarks.sweep_cases as sc
    case = sc.make_case("torch-encoder", "bf16", 2, "sum", {"data": 2, "zero": 3, "precision": "bf16"})
    b = sc.model_inputs(case)
    plan, cap = sc.plan_case(case, b)
    results = sv.static_verify(cap, plan, b.model)
    assert results and all(r.ok for r in results), sv.first_error(results)


def swap_two_collectives(gm) -> None:
    """Move the first communicating collective that can go one earlier on its axis (its
    inputs made before the one it passes) before that one."""
    talk = (C.all_gather, C.all_reduce, C.reduce_scatter, C.all_to_all)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seq = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in talk]
    for i, a in enumerate(seq):
        b = next((n for n in seq[i + 1:] if n.kwargs["axis"] == a.kwargs["axis"]), None)
        if b is not None and all(order[x] < order[a] for x in b.all_input_nodes):
            a.prepend(b)
            gm.recompile()
            return
    raise AssertionError("no two collectives of one axis can be swapped")


def test_ranks_that_issue_collectives_in_different_orders_are_refused(monkeypatch):
    """Rank 1's program issues two of its ZeRO-3 gathers swapped (each still type-checks):
    the cross-rank comparison names the group and the first collective that differs."""
    ex, plan, cap = planned(*ZERO3)
    build = sv.Builder.build

    def swapped(self, coord):
        programs, ctx = build(self, coord)
        if coord == (0, 1):
            swap_two_collectives(programs["train"])
        return programs, ctx
    monkeypatch.setattr(sv.Builder, "build", swapped)
    results = sv.static_verify(cap, plan, ex.model)
    bad = [r for r in results if not r.ok]
    assert bad and all(r.which == "train" for r in bad), [r.error for r in bad]
    assert "collective order" in bad[0].error and "would issue different collectives" in bad[0].error
    assert "rank 1" in bad[0].error or "rank 0" in bad[0].error


def test_static_check_errors_are_not_input_errors():
    from autopar.errors import AutoparInputError
    assert not issubclass(StaticCheckError, AutoparInputError)
    assert operator.truth(StaticCheckError.__doc__)


# --- the command ----------------------------------------------------------------------------

def _cli(*args):
    from click.testing import CliRunner
    from autopar.cli import cli
    return CliRunner().invoke(cli, ["verify", "--static", *args], catch_exceptions=False)


def test_verify_static_prints_one_line_per_rank_and_program():
    res = _cli("examples.models:gpt_factory", "--nproc", "2", "--pin", "tensor=2", "--meta")
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 4 and all(ln.endswith(": ok") for ln in lines), res.output
    assert "all 2 ranks' programs check" in res.output


def test_verify_static_reads_a_plan_file(tmp_path):
    """--plan: the file's plan, checked on the ranks it was made for (a wrong --nproc is a
    usage error)."""
    ex, plan, _ = planned("gpt", 2, (("tensor", 2),))
    path = tmp_path / "plan.json"
    plan.save(path)
    res = _cli("examples.models:gpt_factory", "--nproc", "2", "--plan", str(path))
    assert res.exit_code == 0 and "all 2 ranks' programs check" in res.output, res.output
    res = _cli("examples.models:gpt_factory", "--nproc", "4", "--plan", str(path))
    assert res.exit_code == 2 and "use --nproc 2" in res.output, res.output


def test_verify_static_exits_1_on_a_failed_check(monkeypatch):
    """A program that does not check (rank 1's train program without one of its all-reduces,
    rank 0's intact): rank 1's line says FAIL with the type error, rank 0's with the
    collective orders that now differ, and the command exits 1. Rank 1's
    program differs from rank 0's, so it is checked on its own (``program_key``), not taken
    as rank 0's result."""
    build = sv.Builder.build

    def rank1_missing_all_reduce(self, coord):
        programs, ctx = build(self, coord)
        if coord == (1,):
            gm = programs["train"]
            ar = calls(gm, C.all_reduce)[0]
            ar.replace_all_uses_with(ar.args[0])
            gm.graph.erase_node(ar)
            gm.recompile()
        return programs, ctx
    monkeypatch.setattr(sv.Builder, "build", rank1_missing_all_reduce)
    res = _cli("examples.models:gpt_factory", "--nproc", "2", "--pin", "tensor=2", "--meta")
    assert res.exit_code == 1, res.output
    assert "rank 0 (0,) train" in res.output and "rank 1 (1,) train" in res.output, res.output
    lines = {line.split(":")[0].strip(): line for line in res.output.splitlines() if "train" in line}
    # rank 0's program checks; the two ranks' collectives then differ (rank 1 lacks one)
    assert "FAIL collective order" in lines["rank 0 (0,) train"], res.output
    assert "FAIL the train program" in lines["rank 1 (1,) train"], res.output
    assert "P there" in lines["rank 1 (1,) train"], res.output


def test_ranks_of_one_program_are_checked_once(monkeypatch):
    """``static_verify`` type-checks each distinct program once: the 4 ranks of a 1-D data
    plan are one program (one check each of train and forward); each rank still gets its
    own line, and its own collectives compared."""
    real, seen = sv.check_program, []

    def counted(gm, ctx):
        seen.append(ctx.which)
        return real(gm, ctx)
    monkeypatch.setattr(sv, "check_program", counted)
    ex, plan, cap = planned("gpt", 4, (("data", 4),))
    results = sv.static_verify(cap, plan, ex.model)
    assert all(r.ok for r in results) and len(results) == 8, results
    assert sorted(seen) == ["forward", "train"], seen
    assert len({r.collectives for r in results if r.which == "train"}) == 1


def test_verify_static_refuses_timing():
    res = _cli("examples.models:gpt_factory", "--nproc", "2", "--timing")
    assert res.exit_code == 2 and "--timing runs the model" in res.output, res.output


def test_the_sweep_checks_every_case_statically(monkeypatch):
    """``benchmarks/sweep_cases.run_threads`` runs the static check on the case's plan
    before training it: a check that fails fails the case, saying so."""
    import benchmarks.sweep_cases as sc

    def failing(gm, ctx):
        raise StaticCheckError(f"the {ctx.which} program: planted")
    monkeypatch.setattr(sv, "check_program", failing)
    r = sc.run_threads(sc.make_case("ex-gpt", "data", 2, "mean", {"data": 2}))
    assert r.status == "fail" and r.message.startswith("static check: rank 0 train: "), r
