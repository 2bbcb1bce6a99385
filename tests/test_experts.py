"""Mixture-of-experts models and expert parallelism (``autopar.ops.experts``).

Each MoE layer's experts are captured as one op, split by the plan by token (data
parallel), by expert with an all-to-all dispatch, or by expert with an all-gather dispatch.
Every case here is planned, trained 3 SGD and 3 AdamW steps under its plan and on one
device, and compared parameter by parameter (``benchmarks/sweep_cases.py``), after checking
that the plan really splits the experts (each rank holds its share of every stack).

The gloo cases (real torch.distributed processes: ``all_to_all_single`` with sizes known
only at run time) and the pipelines run in ``tests/test_sweep.py``'s fixed list.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import sweep_cases as sc  # noqa: E402
from examples import zoo  # noqa: E402
from launch import case_result, register_cases, shared_cases  # noqa: E402

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.ops.experts import EXPERTS_OP  # noqa: E402
from autopar.placement import Shard  # noqa: E402
from autopar.report import expert_choice  # noqa: E402

C = sc.make_case
GLOO_MEMORY = {"id": "experts-memory", "experts_case": True, "pins": {"expert": 2}}
register_cases("zero_worker.py", 2, [GLOO_MEMORY])   # tests/test_zero.py's spawn
A2A, GATHER = {"expert_dispatch": "all-to-all"}, {"expert_dispatch": "all-gather"}

# (case, the dispatch the plan must use on the expert axis)
CASES = [
    (C("mixtral", "expert", 2, "mean", {"expert": 2, **A2A}), "all-to-all"),
    (C("mixtral", "expert", 2, "smoothing", {"expert": 2, **GATHER}), "all-gather"),
    (C("qwen3_moe", "expert", 4, "own", {"expert": 2, "data": 2}), None),   # + aux loss
    (C("qwen3_moe", "expert", 4, "mean", {"expert": 2, "tensor": 2, **GATHER}), "all-gather"),
    (C("deepseek_v3", "expert", 4, "mean", {"expert": 4, **A2A}), "all-to-all"),
    (C("deepseek_v3", "expert", 4, "own", {"expert": 2, "tensor": 2, **A2A}), "all-to-all"),
    (C("deepseek_v3", "expert", 4, "padded", {"expert": 2, "data": 2, **GATHER}), "all-gather"),
    # every token to the first experts: the others (and their ranks) receive none
    (C("mixtral-skewed", "expert", 4, "mean", {"expert": 4, **A2A}), "all-to-all"),
    (C("deepseek_v3-skewed", "expert", 2, "mean", {"expert": 2, **A2A}), "all-to-all"),
    (C("deepseek_v3-skewed", "expert", 2, "sum", {"expert": 2, **GATHER}), "all-gather"),
    (C("olmoe", "expert", 2, "own", {"expert": 2}), None),
    (C("gpt_oss", "expert", 2, "mean", {"expert": 2, **A2A}), "all-to-all"),
]
# tensor-sharded experts: each expert's MLP split (gate_up strided, down on its input dim)
TENSOR_CASES = [
    C("mixtral", "tensor", 2, "mean", {"tensor": 2, "expert_dispatch": "tensor"}),
    C("deepseek_v3-skewed", "tensor", 4, "mean", {"tensor": 2, "data": 2, "expert_dispatch": "tensor"}),
    C("qwen3_moe", "tensor", 2, "own", {"tensor": 2, "expert_dispatch": "tensor"}),
]


def _plan(case):
    b = sc.model_inputs(case)
    got = sc.plan_case(case, b)
    return got[0] if isinstance(got, tuple) else got


def _plan_and_run(case, monkeypatch, static_check: bool = False):
    """The case's plan, and its thread ranks' verdict under that same plan (planned once:
    ``run_threads`` would plan it again, 20-50 s of CBC for a 2-D mesh on this machine).
    The sweep's static check of every rank's programs (7-20 s a case here) is left to
    ``tests/test_static_check.py`` (its expert plans) and to the free plans below: these
    cases are judged by the numbers against one device."""
    b = zoo.cached(case.arch, case.batch, case.loss)     # the model run_threads trains
    planned = sc.plan_case(case, b)
    monkeypatch.setattr(sc, "plan_case", lambda c, built, captured=None: planned)
    if not static_check:
        monkeypatch.setattr(sc, "static_problem", lambda cap, plan, model: None)
    return planned[0], sc.run_threads(case)


@pytest.mark.parametrize("case,dispatch", CASES, ids=[c.id for c, _ in CASES])
def test_expert_parallel_plan_equals_one_device(case, dispatch, monkeypatch):
    plan, r = _plan_and_run(case, monkeypatch)
    a = plan.mesh_axes.index("expert")
    experts = [n for n, op in plan.node_ops.items() if op == "autopar.moe_experts.default"]
    assert experts, "no experts op in the plan"
    for n in experts:
        node = plan.nodes[n]
        assert node.input(3)[a] == Shard(0), (n, str(node))       # experts split
        if dispatch is not None:
            assert dispatch in expert_choice(plan, n), expert_choice(plan, n)
    assert r.status == "pass", f"{case.id}: {r.message}\n{r.detail}\nrepro: {case.repro}"


@pytest.mark.parametrize("case", TENSOR_CASES, ids=[c.id for c in TENSOR_CASES])
def test_tensor_sharded_experts_equal_one_device(case, monkeypatch):
    # the static check once on tensor-sharded experts (the 2-rank Mixtral: the cheapest)
    plan, r = _plan_and_run(case, monkeypatch, static_check=case is TENSOR_CASES[0])
    a = plan.mesh_axes.index("tensor")
    for n, op in plan.node_ops.items():
        if op == "autopar.moe_experts.default":
            node = plan.nodes[n]
            assert (node.input(3)[a], node.input(4)[a]) == (Shard(1, 2), Shard(2)), str(node)
    assert r.status == "pass", f"{case.id}: {r.message}\n{r.detail}\nrepro: {case.repro}"


def test_tensor_sharded_experts_are_not_offered_where_the_layout_forbids(monkeypatch):
    """GPT-OSS's experts carry a down-projection bias (a partial sum would add it once per
    rank) and store their stacks transposed and interleaved: no tensor-sharded option, so
    under expert_dispatch="tensor" its experts stay whole (replicated on the tensor axis),
    and the plan still equals one device."""
    case = C("gpt_oss", "tensor", 2, "mean", {"tensor": 2, "expert_dispatch": "tensor"})
    plan, r = _plan_and_run(case, monkeypatch, static_check=True)
    for n, op in plan.node_ops.items():
        if op == "autopar.moe_experts.default":
            assert expert_choice(plan, n) == "experts replicated", expert_choice(plan, n)
    assert r.status == "pass", f"{case.id}: {r.message}\n{r.detail}"


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_free_plan_of_a_moe_equals_one_device(arch):
    """The plan a user gets first (no pins), on 2 ranks."""
    r = sc.run_threads(C(arch, "free", 2, "mean"))
    assert r.status == "pass", f"{r.message}\n{r.detail}"


def _routing(model, inputs) -> list[torch.Tensor]:
    """The top-k expert ids each MoE layer chose on one forward."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(args[1].detach().clone()))
             for m in model.modules() if type(m).__name__.endswith("Experts")]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["mixtral-skewed", "deepseek_v3-skewed"])
def test_skewed_routers_send_every_token_to_the_first_experts(arch):
    """The skewed builders make the cases above what they claim: every token goes to the
    same experts (top-k of tied scores) and at least one expert receives none (under
    expert=2 on Mixtral, every expert of one rank)."""
    b = zoo.build(arch)
    for ids in _routing(b.model, b.inputs):
        counts = torch.bincount(ids.reshape(-1), minlength=int(ids.max()) + 2)
        assert (counts == 0).any() and counts.max() >= ids.shape[0], counts
    if arch == "mixtral-skewed":
        assert all(len(ids.unique()) == 2 for ids in _routing(b.model, b.inputs))


def test_capture_does_not_depend_on_the_example_routing():
    """The same model captured on a batch routed evenly and on one routed to two experts
    gives the same graph: one experts op per MoE layer, no shape set by the routing."""
    even, skewed = zoo.build("mixtral"), zoo.build("mixtral")
    zoo.skew_routers(skewed.model)
    graphs = []
    for b in (even, skewed):
        cap = capture(b.model, b.inputs, b.loss_fn, b.target)
        graphs.append([(n.op, str(n.target), tuple(n.meta["val"].shape)
                        if isinstance(n.meta.get("val"), torch.Tensor) else None)
                       for n in cap.gm.graph.nodes])
        ops = {str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"}
        assert not {o for o in ops if "histc" in o or "grouped_mm" in o or "sort" in o}, ops
        assert sum(n.target is EXPERTS_OP for n in cap.gm.graph.nodes) == 2
    assert graphs[0] == graphs[1]


def test_deepseek_layers_dense_then_moe_share_decisions_per_kind():
    """DeepSeek-V3's first layer is dense, the next two MoE: the solver's repeated-layer map
    sends layer 2's nodes and parameters to layer 1's (one shared decision each) and keeps
    layer 0's apart (before, a container whose layers were not all alike shared nothing)."""
    from autopar.pricing.problem import graph_index
    b = zoo.build("deepseek_v3")
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    rep = graph_index(cap).repetition
    layer_of_node = {}
    from autopar.capture import layer_of
    for n in cap.gm.graph.nodes:
        lay = layer_of(n) if n.op == "call_function" else None
        if lay is not None:
            layer_of_node[n.name] = lay[1]
    by_layer = {i: [n for n, l in layer_of_node.items() if l == i] for i in (0, 1, 2)}
    assert by_layer[2] and all(layer_of_node.get(rep.get(n)) == 1 for n in by_layer[2])
    assert not any(n in rep for n in by_layer[0] + by_layer[1])
    params = {names[0]: ph for ph, names in cap.params.items()}
    assert rep[params["model.layers.2.mlp.experts.gate_up_proj"]] == \
        params["model.layers.1.mlp.experts.gate_up_proj"]
    assert params["model.layers.0.mlp.gate_proj.weight"] not in rep


def test_experts_run_in_16_bits_under_autocast(monkeypatch):
    """Under mixed precision (the runtime's forward is under ``torch.autocast``) the experts
    op runs its matrix products on 16-bit tokens and stacks, as autocast gives any GEMM:
    transformers' grouped experts (``torch._grouped_mm``) are not autocast-enabled and cast
    the tokens to the weights' dtype, so with fp32 master weights they ran in fp32 (on an
    H200, 379 ms of DeepSeek-V3's 692 ms rank step). Its output keeps the hidden state's
    dtype, its values within bf16 rounding of the fp32 op's, and without autocast it is the
    fp32 op as before. (A GPU's choice, ``SIXTEEN_BIT_DEVICES``; made the CPU's here.)"""
    from torch.utils._python_dispatch import TorchDispatchMode
    from autopar.ops import experts
    from autopar.ops.experts import run_whole
    monkeypatch.setattr(experts, "SIXTEEN_BIT_DEVICES", {"cuda", "cpu"})

    class Dtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if any(k in name for k in ("mm", "matmul", "linear")):
                self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            return func(*args, **(kwargs or {}))
    b = zoo.cached("mixtral", 2, "mean")
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    node = next(n for n in cap.gm.graph.nodes if n.target is EXPERTS_OP)
    key = node.args[4]
    stacks = [getattr(cap.gm, s.target) if s.op == "get_attr" else
              torch.randn(s.meta["val"].shape) * 0.1 for s in node.args[3]]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(node.args[0].meta["val"].shape, generator=g)
    k = node.args[1].meta["val"].shape[1]
    index = torch.randint(0, stacks[0].shape[0], (hidden.shape[0], k), generator=g)
    weights = torch.rand(hidden.shape[0], k, generator=g)
    plain, mixed = Dtypes(), Dtypes()
    with plain:
        ref = run_whole(hidden, index, weights, stacks, key)
    with torch.autocast("cpu", dtype=torch.bfloat16), mixed:
        got = run_whole(hidden, index, weights, stacks, key)
    assert plain.seen == {torch.float32}, plain.seen
    assert mixed.seen == {torch.bfloat16}, mixed.seen
    assert got.dtype == hidden.dtype == ref.dtype
    assert (got - ref).norm() <= 2e-2 * ref.norm()


def test_expert_pins_are_checked():
    with pytest.raises(autopar.PinError, match="expert_dispatch"):
        autopar.Options.from_pins(expert=2, expert_dispatch="ring")
    with pytest.raises(autopar.PinError, match="expert_imbalance"):
        autopar.Options.from_pins(expert=2, expert_imbalance=0.5)
    with pytest.raises(autopar.PinError, match="zero"):
        autopar.Options.from_pins(expert=2, zero=3)
    with pytest.raises(autopar.PinError, match="splits each expert instead"):
        autopar.Options.from_pins(expert=2, expert_dispatch="tensor")
    b = zoo.build("mixtral")
    with pytest.raises(autopar.PinError, match="expert=3 does not divide"):
        autopar.plan(b.model, b.inputs, loss_fn=b.loss_fn, target=b.target, cluster="cpu:4",
                     expert=3)


def test_the_all_to_all_is_priced_and_grows_with_imbalance():
    """Splitting experts over a slow link costs its all-to-all: the op's time under the
    all-to-all form exceeds the token-split form's by at least the four all-to-alls of
    ``T k H`` elements, and an imbalance factor scales the expert work and dispatch."""
    from autopar.cost_models.comm import Link
    from autopar.cost_models.hardware import axis_link, parse_cluster
    from autopar.pricing.experts import experts_time
    from autopar.sharding.registry import make_call, mesh_strategies
    b = zoo.build("mixtral")
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    node = next(n for n in cap.gm.graph.nodes if n.target is EXPERTS_OP)
    call = make_call(node)
    cl = parse_cluster("1x4xH100")
    mesh = (4,)
    links = [axis_link(cl, mesh, 0)]
    opts = {str(o[0]): o for o in mesh_strategies(call, mesh)}
    tokens = opts["S(0),S(0),S(0),R,R->S(0)"]
    a2a = opts["S(0),S(0),S(0),S(0),S(0)->S(0)"]
    t_tok = experts_time(call, tokens, mesh, cl.device, "bf16", links)
    t_a2a = experts_time(call, a2a, mesh, cl.device, "bf16", links)
    t_skew = experts_time(call, a2a, mesh, cl.device, "bf16", links, imbalance=2.0)
    n_tok, k, h = call.inputs[0].shape[0], call.inputs[1].shape[1], call.inputs[0].shape[1]
    from autopar.cost_models import comm
    one = comm.collective_time("all_to_all", n_tok / 4 * k * h * 2, 4, links[0])
    free = experts_time(call, a2a, mesh, cl.device, "bf16", [Link(bandwidth=1e30, latency=0.0)])
    assert sum(t_a2a) - sum(free) == pytest.approx(4 * one, rel=1e-9)     # dispatch, combine, x2
    assert sum(t_tok) != sum(t_a2a)
    free_skew = experts_time(call, a2a, mesh, cl.device, "bf16", [Link(bandwidth=1e30, latency=0.0)],
                             imbalance=2.0)
    twice = comm.collective_time("all_to_all", n_tok / 4 * k * h * 2 * 2, 4, links[0])
    assert sum(t_skew) - sum(free_skew) == pytest.approx(4 * twice, rel=1e-9)
    assert sum(free_skew) > sum(free)          # the busiest rank computes twice the pairs


def test_the_all_to_all_is_communication_in_the_estimate():
    """The experts op's all-to-alls sit inside its time (``pricing.experts``); the plan's
    communication table shows them as ``all_to_all`` on the expert axis, taken out of
    compute, the step unchanged: their seconds are each MoE layer's op time on the cluster's
    link less its time on an infinitely fast one. The all-gather form has none."""
    from autopar.cost_models.comm import Link
    from autopar.cost_models.hardware import axis_link, parse_cluster
    from autopar.pricing.experts import experts_time
    from autopar.sharding.registry import make_call, mesh_strategies
    b = zoo.build("mixtral")
    cl = parse_cluster("1x2xH100")
    plans = {d: autopar.plan(b.model, b.inputs, b.loss_fn, target=b.target, cluster="1x2xH100",
                             expert=2, expert_dispatch=d) for d in ("all-to-all", "all-gather")}
    plan = plans["all-to-all"]
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    links = [axis_link(cl, (2,), 0)]
    want = 0.0
    for node in (n for n in cap.gm.graph.nodes if n.target is EXPERTS_OP):
        call = make_call(node)
        combo = {str(o[0]): o for o in mesh_strategies(call, (2,))}[str(plan.nodes[node.name])]
        on_link = experts_time(call, combo, (2,), cl.device, "fp32", links)     # fp32 training
        free = experts_time(call, combo, (2,), cl.device, "fp32", [Link(bandwidth=1e30, latency=0.0)])
        want += sum(on_link) - sum(free)
    assert want > 0
    assert plan.estimate.comm["all_to_all@expert"] == pytest.approx(want, rel=1e-9)
    assert "all_to_all@expert" not in plans["all-gather"].estimate.comm


def test_experts_memory_per_rank_matches_the_estimate():
    """Expert weights, their gradients and AdamW state per rank under expert=4 are a
    quarter of the model's, as held on thread ranks, and the plan's estimate of them is
    within 15%."""
    case = C("mixtral", "expert", 4, "mean", {"expert": 4, **A2A})
    plan = _plan(case)
    b = sc.model_inputs(case)
    stacks = {n: p for n, p in b.model.named_parameters() if ".experts." in n}
    full = sum(p.numel() * p.element_size() for p in stacks.values())
    from autopar.ops.comm import ThreadWorld

    cap = sc._captured(case, b)
    from autopar.runtime import build
    copies = [copy.deepcopy(b.model) for _ in range(4)]

    def rank(comm):
        pm = build(cap, plan, copies[comm.rank], b.loss_fn if b.target is None else None, comm)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        inputs, target = sc._rank_inputs(case, b, pm)
        pm.train_step(*inputs, target=target)
        opt.step()
        # each stack's weight, gradient and AdamW's two moments
        return sum(p.numel() * p.element_size() * 4 for n, p in pm.named_parameters()
                   if "experts" in n)

    held = ThreadWorld((4,)).run(rank)
    assert all(h == held[0] for h in held)
    assert held[0] == pytest.approx(full * 4 / 4, rel=1e-6)        # (w + g + m + v) / 4 ranks
    est = plan.estimate.memory_bytes
    total_est = sum(est.get(k, 0) for k in ("params", "grads", "optimizer"))
    total_held = held[0] + sum(p.numel() * p.element_size() * 4 for n, p in b.model.named_parameters()
                               if n not in stacks)
    assert math.isclose(total_est, total_held, rel_tol=0.15), (total_est, total_held)


def test_a_load_balancing_loss_is_no_sum_over_micro_batches():
    """OLMoE's own loss adds the router's load-balancing loss: expert counts (histc) times
    mean router probabilities, a product of two batch sums, which no split into micro-batches
    reproduces. Accumulation and pipelines are refused when planning (they trained to other
    numbers before: the product of counts read as a per-sample value, its sum as a batch
    sum); the batch-linearity analysis labels the aux term a batch statistic (S)."""
    from autopar.analysis.batch_linearity import analyse
    from autopar.analysis.microbatch_loss import MicrobatchLossError
    b = zoo.build("olmoe", loss="own")
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    lin = analyse(cap, cap.gm.graph)
    loss = next(n for n in cap.gm.graph.nodes if n.op == "output").args[0][0]
    assert lin.state[loss] == "S" and lin.lost is not None
    assert any(lin.state[n] == "P" for n in cap.gm.graph.nodes if "histc" in str(n.target))
    for pins in ({"accumulate": 2}, {"pipeline": 2, "micro_batch_size": 2, "schedule": "gpipe"}):
        with pytest.raises(MicrobatchLossError, match="not linear"):
            autopar.plan(b.model, b.inputs, loss_fn=b.loss_fn, target=b.target,
                         cluster="cpu:2", **pins)
    # the same model with a plain cross-entropy (no aux loss) accumulates
    m = zoo.build("olmoe", loss="mean")
    autopar.plan(m.model, m.inputs, loss_fn=m.loss_fn, target=m.target, cluster="cpu:2",
                 accumulate=2)


def test_experts_memory_on_gloo_ranks_matches_the_estimate(tmp_path_factory):
    """On 2 gloo processes under expert=2: each rank holds half of every expert stack, and
    its parameters, gradients and AdamW moments, measured from the live tensors, are the
    plan's estimate within 15% per term."""
    tmp = tmp_path_factory.mktemp("zero")
    r = case_result(shared_cases("zero_worker.py", 2, tmp, timeout=600, case_timeout=120),
                    GLOO_MEMORY["id"])
    assert r["mesh_axes"] == ["expert"]
    assert r["stacks_local"] * 2 == r["stacks_whole"], r
    for term in ("params", "grads", "optimizer"):
        m, e = r["measured"][term], r["estimate"][term]
        assert abs(m - e) <= 0.15 * e, (term, r["measured"], r["estimate"])
