"""``precision="fp8"`` on a mixture of experts' expert GEMMs (``autopar.ops.fp8_experts``).

On thread ranks (in process; ``benchmarks/sweep_cases.run_threads`` and ``sweep_fp8``'s
judge), the tiny Mixtral against one device running the same recipe
(``use_fp8_linears`` + ``use_fp8_experts``): loss, every gradient, the weights after the
SGD and AdamW steps.

- data=2, tensorwise, ``fp8_layers="all"`` (its attention linears AND its experts
  modules): each rank's experts scale its own rows, so one device runs the plan's row
  blocks apart (``sweep_fp8``'s reference as for any fp8 plan);
  Both compute the same fp8 values, so what differs is the order of fp32 sums:
  ``tests/test_fp8.py``'s EXACT_TOL / EXACT_WEIGHT_TOL (measured 0.0);
- expert=2 with the all-to-all dispatch (rowwise), the experts alone in fp8: an expert's rank receives the rows of both data
  ranks and scales them together (``ops.fp8_experts``: one GEMM an expert, as torchao's
  grouped fp8 MoE training), so one device runs the whole batch at once. Not bit-equal:
  the bf16 rest of the model on the whole batch is not the per-rank run's bit for bit
  (CPU bf16 GEMMs of other shapes; loss 6.4e-5, gradient 1.8e-3 measured for the
  all-to-all case, against the plain bf16 run's 1.1e-2), and an input moved by a bf16
  rounding flips fp8 roundings (``tests/test_fp8.py``'s tensor=2 argument): judged by
  ``sweep_fp8``'s tolerances, and nearer the recipe than the bf16 run.

In every case the experts' GEMMs really ran fp8 (``fp8_linear`` called from the experts'
forward) and the gradient is farther from the plain bf16 run than BF16_FLOOR. The forms'
scale groups are checked exactly at the op (:func:`test_split_forms_scale_each_expert_over_its_rows`:
the all-to-all and all-gather forms on 2 thread ranks against one device over every token,
to EXACT_TOL; the all-gather form run whole on the tiny Mixtral once passed as the
all-to-all case does, left out of the suite for its 18 s). The grouping matters:
the all-to-all plan (``fp8_layers="all"``, tensorwise) against the per-block recipe, whose
experts scale each rank's rows apart, is 4.5e-2 off in the gradient (measured), about the
plain bf16 run's distance.

The price (``pricing/experts_fp8.py``): the GEMMs at the fp8 peak and the recipe's casts;
chosen by price, and bf16 in a compiled program (whose experts stay bf16).
"""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
import sweep_cases as sc  # noqa: E402

import autopar.ops.fp8_experts as fp8_experts  # noqa: E402
from autopar.analysis.fp8_layers import fp8_experts as fp8_experts_of  # noqa: E402
from autopar.analysis.fp8_layers import planned_fp8_experts, planned_fp8_linears  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.cost_models.fp8 import fused_casts  # noqa: E402
from autopar.cost_models.hardware import parse_cluster  # noqa: E402
from autopar.errors import PinError  # noqa: E402
from autopar.ops.comm import ThreadWorld  # noqa: E402
from autopar.ops.experts import EXPERTS_OP, run_experts, template_key  # noqa: E402
from autopar.options import Options  # noqa: E402
from autopar.placement import Replicate, Shard  # noqa: E402
from autopar.pricing.costing import CostModel  # noqa: E402
from autopar.pricing.experts import experts_time, gemms_time  # noqa: E402
from autopar.pricing.experts_fp8 import experts_fp8_time  # noqa: E402
from autopar.pricing.fp8 import runs_fp8  # noqa: E402
from autopar.report import expert_choice  # noqa: E402
from autopar.sharding.registry import Strategy, TensorMeta  # noqa: E402

EXACT_TOL, EXACT_WEIGHT_TOL, BF16_FLOOR = 1e-6, 1e-4, 0.01     # tests/test_fp8.py derives them
MIXTRAL_EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(2)]
EXPERTS_ONLY = tuple(MIXTRAL_EXPERTS)
CASES = [
    sc.make_case("mixtral", "fp8", 2, "mean", {"precision": "fp8", "fp8_scaling": "tensorwise",
                                               "fp8_layers": "all", "data": 2}),
    sc.make_case("mixtral", "fp8", 2, "mean", {"precision": "fp8", "fp8_scaling": "rowwise",
                                               "fp8_layers": EXPERTS_ONLY, "expert": 2,
                                               "expert_dispatch": "all-to-all"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fp8_experts_equal_one_device_recipe(case, monkeypatch):
    b = sc.model_inputs(case)
    planned = sc.plan_case(case, b)
    plan = planned[0] if isinstance(planned, tuple) else planned
    assert plan.options.fp8_layers == dict(case.pins)["fp8_layers"]
    experts = [n for n, op in plan.node_ops.items() if op == "autopar.moe_experts.default"]
    assert experts
    if "expert" in plan.mesh_axes:
        a = plan.mesh_axes.index("expert")
        for n in experts:
            assert plan.nodes[n].input(3)[a] == Shard(0), str(plan.nodes[n])
            assert dict(case.pins)["expert_dispatch"] in expert_choice(plan, n), expert_choice(plan, n)
    if dict(case.pins)["fp8_layers"] == EXPERTS_ONLY:    # one device on the whole batch
        monkeypatch.setattr(sc.sweep_fp8, "row_blocks", lambda plan: 1)
    monkeypatch.setattr(sc, "plan_case", lambda c, built, captured=None: planned)
    monkeypatch.setattr(sc, "static_problem", lambda cap, plan, model: None)
    calls = []
    real = fp8_experts.fp8_linear
    monkeypatch.setattr(fp8_experts, "fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = sc.run_threads(case)
    assert r.status == "pass", f"{case.id}: {r.message}\n{r.detail}"
    # the plan's ranks and the reference both ran the experts' GEMMs through fp8_linear
    assert calls, "no expert GEMM ran in fp8"
    n = r.numbers
    assert n["bf16_grad"] > BF16_FLOOR and n["grad"] < n["bf16_grad"], r.detail
    if dict(case.pins)["fp8_layers"] == "all":      # the same rows, the same fp8 values
        assert n["loss"] <= EXACT_TOL and n["grad"] <= EXACT_TOL, r.detail
        assert n["weight"] <= EXACT_WEIGHT_TOL and n["adam_weight"] <= EXACT_WEIGHT_TOL, r.detail


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dispatch", ["all-to-all", "all-gather"])
def test_split_forms_scale_each_expert_over_its_rows(scaling, dispatch):
    """The op's split forms on 2 thread ranks (the experts split, the tokens split too under
    the all-to-all dispatch) against ``fp8_experts_forward`` on one device over every token:
    each expert's GEMMs see the same rows, scaled together, so the output, the hidden
    state's and routing weights' gradients and each rank's experts' stack gradients are the
    one device's (to EXACT_TOL: the routed sums' order)."""
    mod = dict(sc.model_inputs(CASES[0]).model.named_modules())[MIXTRAL_EXPERTS[0]]
    key = fp8_experts.fp8_key(template_key(mod, type(mod).forward), scaling)
    n_tok, n_exp = 24, mod.num_experts
    torch.manual_seed(1)
    hidden = torch.randn(n_tok, mod.hidden_dim)
    index = torch.stack([torch.randperm(n_exp)[:2] for _ in range(n_tok)])
    weights = torch.rand(n_tok, 2)
    grad = torch.randn(n_tok, mod.hidden_dim)
    stacks = [mod.gate_up_proj.detach(), mod.down_proj.detach()]

    def run(h, i, w, s, fn):
        leaves = [t.clone().requires_grad_() for t in (h, w, *s)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(leaves[0], i, leaves[1], leaves[2:])
        (out.float() * fn.grad_of(out)).sum().backward()
        return out.detach().float(), [t.grad for t in leaves]

    def one(h, i, w, s):
        return fp8_experts.fp8_experts_forward(mod, s, h, i, w, scaling)
    one.grad_of = lambda out: grad
    ref_out, ref_grads = run(hidden, index, weights, stacks, one)
    half_t, half_e = n_tok // 2, n_exp // 2

    def rank(comm):
        r = comm.rank
        rows = slice(r * half_t, (r + 1) * half_t) if dispatch == "all-to-all" else slice(None)
        mine = [t[r * half_e:(r + 1) * half_e] for t in stacks]

        def split(h, i, w, s):
            return run_experts(h, i, w, s, key, (0,), (0,) if dispatch == "all-to-all" else ())
        split.grad_of = lambda out: grad[rows]
        return rows, run(hidden[rows], index[rows], weights[rows], mine, split)

    got = ThreadWorld((2,)).run(rank)
    out = sum(o for _, (o, _) in got) if dispatch == "all-gather" else torch.cat([o for _, (o, _) in got])
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(out, ref_out) <= EXACT_TOL
    for r, (rows, (_, grads)) in enumerate(got):
        gh, gw = grads[0], grads[1]
        if dispatch == "all-gather":            # each rank's experts' terms: partial sums
            gh = sum(g[1][1][0] for g in got)
            gw = sum(g[1][1][1] for g in got)
        assert rel(gh, ref_grads[0][rows]) <= EXACT_TOL and rel(gw, ref_grads[1][rows]) <= EXACT_TOL
        for k, g in enumerate(grads[2:]):
            assert rel(g, ref_grads[2 + k][r * half_e:(r + 1) * half_e]) <= EXACT_TOL, (r, k)


def test_the_reference_runs_the_experts_in_fp8():
    """``use_fp8_experts`` changes the experts' output from the bf16 forward's by fp8's
    rounding (e4m3: a few % per element), and refuses a module it cannot run."""
    case = CASES[0]
    b = sc.model_inputs(case)
    mod = dict(b.model.named_modules())[MIXTRAL_EXPERTS[0]]
    torch.manual_seed(0)
    h = torch.randn(16, mod.hidden_dim)
    idx = torch.stack([torch.randperm(mod.num_experts)[:2] for _ in range(16)])
    w = torch.rand(16, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = mod(h, idx, w).float()
        fp8_experts.use_fp8_experts(b.model, MIXTRAL_EXPERTS[:1], "tensorwise")
        got = mod(h, idx, w).float()
    rel = float((got - bf16).detach().norm() / bf16.detach().norm())
    assert 1e-3 < rel < 0.2, rel
    with pytest.raises(ValueError, match="no layout"):
        fp8_experts.use_fp8_experts(b.model, ["model.layers.0.mlp.gate"], "tensorwise")


def _moe_call(tokens: int):
    """One DeepSeek-V3 MoE layer's experts op (H 7168, I 2048, 256 experts, top 8)."""
    f32 = torch.float32
    ins = [TensorMeta((tokens, 7168), f32), TensorMeta((tokens, 8), torch.int64),
           TensorMeta((tokens, 8), f32), TensorMeta((256, 4096, 7168), f32),
           TensorMeta((256, 7168, 2048), f32)]
    call = types.SimpleNamespace(op=EXPERTS_OP, inputs=ins)
    return types.SimpleNamespace(call=call, name="experts")


def test_fp8_experts_price():
    """The all-to-all form on 64 H100s (4 experts a rank, 8,192 rows each): with the casts
    fused (``compile``'s traffic, as ``published_runs`` prices DeepSeek's), the fp8 GEMMs at
    twice bf16's peak beat bf16's, but at most by the GEMMs' half; eager, the op-by-op casts
    cost more than they save, and the price's choice (``fp8_layers=None``) keeps bf16; a
    pinned list runs fp8 whatever it costs. Tensor-sharded experts add their amax
    all-gathers."""
    v = _moe_call(262144)
    a2a = (Strategy((Shard(0),) * 5, (Shard(0),)),)
    cl = parse_cluster("8x8xH100")
    eager = CostModel.for_pins(cl, (64,), Options(precision="fp8", fp8_scaling="rowwise"))
    bf16 = experts_time(v.call, a2a, (64,), cl.device, "bf16", eager.links)
    gemms = gemms_time(v.call, a2a, (64,), cl.device, "bf16")
    with fused_casts():
        fused = experts_fp8_time(eager, v.call, a2a)
    assert sum(bf16) - sum(gemms) / 2 < sum(fused) < sum(bf16), (fused, bf16, gemms)
    slow = experts_fp8_time(eager, v.call, a2a)
    assert sum(slow) > sum(bf16)
    assert runs_fp8(eager, v, a2a, (), ()) == (False, bf16)
    pinned = CostModel.for_pins(cl, (64,), Options(precision="fp8", fp8_scaling="rowwise", fp8_layers="all"))
    assert runs_fp8(pinned, v, a2a, (), ()) == (True, slow)
    compiled = CostModel.for_pins(cl, (64,), Options(precision="fp8", fp8_layers="all", compile=True))
    assert runs_fp8(compiled, v, a2a, (), ())[0] is False      # a compiled program's experts: bf16
    # each expert split 8 ways: its amaxes cross the ranks (a latency each)
    cl8 = parse_cluster("1x8xH100")
    c8 = CostModel.for_pins(cl8, (8,), Options(precision="fp8", fp8_scaling="tensorwise"))
    tp = (Strategy((Replicate(),) * 3 + (Shard(1, 2), Shard(2)), (Replicate(),)),)
    with_tp = experts_fp8_time(c8, v.call, tp)
    c8.links = [type(c8.links[0])(bandwidth=c8.links[0].bandwidth, latency=0.0)]
    assert sum(with_tp) > sum(experts_fp8_time(c8, v.call, tp))


def test_which_experts_run_fp8():
    """``fp8_layers`` names experts modules as it names linears: every one under "all", the
    named ones; none in a compiled program, where naming one is a PinError naming the fix."""
    b = sc.model_inputs(CASES[0])
    cap = capture(b.model, b.inputs, b.loss_fn, b.target)
    assert sorted(fp8_experts_of(cap).values()) == MIXTRAL_EXPERTS
    every = Options(precision="fp8", fp8_layers="all")
    assert sorted(planned_fp8_experts(cap, every).values()) == MIXTRAL_EXPERTS
    one = Options(precision="fp8", fp8_layers=(MIXTRAL_EXPERTS[1],))
    assert list(planned_fp8_experts(cap, one).values()) == MIXTRAL_EXPERTS[1:]
    assert planned_fp8_linears(cap, one) == {}
    assert planned_fp8_experts(cap, Options(precision="fp8", fp8_layers="all", compile=True)) == {}
    with pytest.raises(PinError, match="compile=False"):
        planned_fp8_experts(cap, Options(precision="fp8", fp8_layers=tuple(MIXTRAL_EXPERTS), compile=True))
    with pytest.raises(PinError, match="model.layers.0.mlp.gate"):
        planned_fp8_experts(cap, Options(precision="fp8", fp8_layers=("model.layers.0.mlp.gate",)))


def test_experts_split_over_tensor_with_idle_experts_keep_the_ranks_in_step(monkeypatch):
    """DeepSeek-V3's experts split over a tensor axis of 2 (the stacks sharded on their experts
    dim, tokens whole) under fp8, with a skewed router, so that some expert of some rank gets
    no token: each rank runs every local expert (zero rows where none came), so backward's
    collectives (the dense fp8 linears' amax gathers, the gradients' all-reduces) come in the
    same order on both ranks. Skipping idle experts made the order follow each rank's routing:
    one rank gathered an amax while the other all-reduced a gradient (sweep case
    ``deepseek_v3-skewed:fp8:856146``, "Tensors must have same number of dimensions")."""
    case = sc.parse_case_id("deepseek_v3-skewed:fp8:856146")
    assert dict(case.pins) == {"fp8_layers": "all", "fp8_scaling": "tensorwise",
                               "precision": "fp8", "tensor": 2}
    b = sc.model_inputs(case)
    planned = sc.plan_case(case, b)
    plan = planned[0] if isinstance(planned, tuple) else planned
    experts = [n for n, op in plan.node_ops.items() if op == "autopar.moe_experts.default"]
    assert experts and all(plan.nodes[n].input(3)[0] == Shard(0) for n in experts)
    monkeypatch.setattr(sc, "plan_case", lambda c, built, captured=None: planned)
    rows = []
    real = fp8_experts.fp8_linear
    monkeypatch.setattr(fp8_experts, "fp8_linear",
                        lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    r = sc.run_threads(case)
    assert r.status == "pass", f"{case.id}: {r.message}\n{r.detail}"
    assert 0 in rows and max(rows) > 0, rows      # idle experts ran, and busy ones
