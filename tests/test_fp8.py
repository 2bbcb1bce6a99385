"""``precision="fp8"``: torchao's float8 training recipes (``autopar.ops.fp8``), the plan's fp8
linears (``passes/fp8_linears.py``), their price (``cost_models/fp8.py``, ``pricing/fp8.py``).

The format: e4m3 keeps 3 mantissa bits, so neighbouring values differ by q = 2^-3 of their
size (rounding error up to q/2 = 2^-4); e5m2 (tensorwise gradients) 2 bits, q = 2^-2.
bf16's unit roundoff is u = 2^-8.

In process: one fp8 linear bit-equal to torchao 0.14's ``Float8Linear`` under either recipe,
and against the fp32 one (its error is fp8's, not bf16's); the
amax reductions of a tensor-sharded linear on thread ranks: every output the shards compute
without a partial sum is bit-equal to the unsharded fp8 linear's (column-parallel forward
and weight gradient, row-parallel input and weight gradients), under both recipes.

Distributed (``tests/fp8_worker.py``, ONE torchrun launch of 2 gloo ranks): the small GPT,
3 AdamW steps, under data=2, tensor=2, data=2 x ZeRO-3 and pipeline=2 (1F1B, 4 micro-batches),
tensorwise and rowwise, against the same recipe on one device applied per rank's rows
(``fp8_worker.reference``). Tolerances:

- data, ZeRO-3, pipeline: the same fp8 values are computed (the scales are those of the same
  rows, the weights whole; ZeRO-3 tensorwise gathers the weights in fp8, each shard cast
  with the whole weight's scale: the same bytes as the gathered weight's cast, and the
  test counts the uint8 elements each rank's gathers sent); what differs is the order of fp32 sums (gradient reduction,
  micro-batch accumulation): fp32's unit roundoff is 2^-24 = 6e-8. Loss and gradients
  <= EXACT_TOL = 1e-6 (measured <= 3.1e-8), weights (relative to the update) <=
  EXACT_WEIGHT_TOL = 1e-4 (measured <= 3.0e-6: AdamW divides by sqrt(v) + eps, which
  magnifies tiny gradients' differences). One fp8 element rounded differently moves it by
  q = 12.5% and the gradient norm by ~1e-4 or more: these bounds mean equal fp8 arithmetic.
- tensor=2: the row-parallel partial sums are rounded to bf16 and summed in bf16 (as
  Megatron; ``tests/test_precision.py``), so a GEMM's input differs from one device's by up
  to u relative. An element perturbed by u crosses an fp8 rounding boundary with probability
  u / q and then moves by q: per element an RMS change of sqrt(u q) = 2^-5.5 (e4m3) or
  2^-5 (e5m2). Gradients (first step) <= TP_GRAD_TOL = 2^-5 (measured 0.0167 tensorwise,
  0.0112 rowwise). Loss of every step <= TP_LOSS_TOL = u (a mean over every token; measured
  1.6e-3 after two updates). Weights: AdamW's first steps move each weight by about lr *
  sign(g), so the ~2% gradient changes flip the signs of the small gradients; no tighter
  bound than "nearer the fp8 reference than the bf16 run" (measured 0.157 vs 0.234).
- "really fp8", every case: the gradients are farther from the plain bf16 run than the
  tolerance allows by a wide margin: e4m3 rounding's RMS error is q / sqrt(12) = 3.6% per
  element; measured 2.4-3.2% on the gradients, against BF16_FLOOR = 0.01.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

import autopar
from autopar.analysis.fp8_layers import fp8_linears
from autopar.capture import capture
from autopar.errors import PinError
from autopar.ops.comm import ThreadWorld
from autopar.ops.fp8 import fp8_linear
from autopar.options import Options
from autopar.placement import P as P_
from launch import case_result, torchrun_cases

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

Q_E4M3, Q_E5M2, U_BF16 = 2.0 ** -3, 2.0 ** -2, 2.0 ** -8
EXACT_TOL, EXACT_WEIGHT_TOL = 1e-6, 1e-4
TP_GRAD_TOL, TP_LOSS_TOL = math.sqrt(U_BF16 * Q_E5M2), U_BF16
BF16_FLOOR = 0.01
PP = {"pipeline": 2, "micro_batch_size": 2, "schedule": "1f1b"}
PLANS = {"data2": ({"data": 2}, 2), "tensor2": ({"tensor": 2}, 1),
         "zero3": ({"data": 2, "zero": 3}, 2), "pp2": (PP, 4)}
"""Pins, and the row blocks a step of each splits the batch into (ranks' rows, micro-batches)."""
GPT_FP8 = sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                 for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
GPT_MLP = sorted(f"transformer.h.{i}.mlp.{m}" for i in range(2) for m in ("c_fc", "c_proj"))
CASES = [{"id": f"{s}-{k}", "plan": k, "pins": pins, "slices": slices, "scaling": s,
          "fp8_layers": "all"}
         for s in ("tensorwise", "rowwise") for k, (pins, slices) in PLANS.items()] + [
    # a pinned subset: the runtime converts exactly those (the MLPs' 4 of 8)
    {"id": "tensorwise-data2-mlp", "plan": "data2", "pins": {"data": 2}, "slices": 2,
     "scaling": "tensorwise", "fp8_layers": GPT_MLP},
    # chosen by price on this machine's ranks: the run and its reference apply the plan's set
    {"id": "tensorwise-data2-price", "plan": "data2", "pins": {"data": 2}, "slices": 2,
     "scaling": "tensorwise", "fp8_layers": None}]


# ---- the pins --------------------------------------------------------------------------------
def test_fp8_pins():
    assert Options.from_pins(precision="fp8").fp8_scaling == "tensorwise"
    assert Options.from_pins(precision="fp8", fp8_scaling="rowwise").fp8_scaling == "rowwise"
    with pytest.raises(PinError, match="fp8_scaling='blockwise'"):
        Options.from_pins(precision="fp8", fp8_scaling="blockwise")
    with pytest.raises(PinError, match="pin precision='fp8' too"):
        Options.from_pins(precision="bf16", fp8_scaling="rowwise")
    Options.from_pins(precision="fp8", grad_reduce="bf16")       # mixed precision's pin


# ---- one fp8 linear --------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_error_is_fp8s(scaling):
    """Against the fp32 linear: the output's relative error is below two e4m3 roundings
    (2 x q/2 = q) and above bf16's unit roundoff (so it was quantized to 3 bits); the
    gradients, through an e5m2 or e4m3 dy too, below q_e5m2 = 2^-2 and above u."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y = fp8_linear(x, w, b, scaling)
    gy = torch.randn(y.shape)
    y.backward(gy)
    got = (y.detach().float(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = b.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(gy)
    assert y.dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    rel = [float((g - r).norm() / r.norm()) for g, r in zip(got, (ref.detach(), x.grad, w.grad))]
    assert U_BF16 < rel[0] < Q_E4M3, rel
    assert all(U_BF16 < e < Q_E5M2 for e in rel[1:]), rel


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_is_torchaos_recipe(scaling):
    """Bit-equal to torchao's ``Float8Linear`` (``convert_to_float8_training`` with
    ``Float8LinearConfig.from_recipe_name``) on a bf16 layer: output, dx, dW, db."""
    pytest.importorskip("torchao", reason="pip install -e '.[dev]' installs torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    for seed in range(3):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(64, 48).bfloat16()
        x0 = torch.randn(2, 16, 64, dtype=torch.bfloat16)
        gy = torch.randn(2, 16, 48, dtype=torch.bfloat16)
        theirs = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(lin)),
                                            config=Float8LinearConfig.from_recipe_name(scaling))[0]
        mine = copy.deepcopy(lin)
        got = []
        for run in (lambda x: theirs(x), lambda x: fp8_linear(x, mine.weight, mine.bias, scaling)):
            x = x0.clone().requires_grad_()
            y = run(x)
            y.backward(gy)
            got.append([y.detach(), x.grad])
        got[0] += [theirs.weight.grad, theirs.bias.grad]
        got[1] += [mine.weight.grad, mine.bias.grad]
        assert all(torch.equal(a, b) for a, b in zip(*got)), seed


def _sharded_linear(scaling: str, kind: str):
    """fp8_linear of a tensor=2 shard on thread ranks, and on one device: (per rank: out, gx,
    gw), (out, gx, gw)."""
    torch.manual_seed(1)
    x = torch.randn(2, 8, 64)
    w = torch.randn(32, 64)
    gy = torch.randn(2, 8, 32)

    def one(xx, ww, gg, **shards):
        xx, ww = xx.clone().requires_grad_(), ww.clone().requires_grad_()
        y = fp8_linear(xx, ww, None, scaling, **shards)
        y.backward(gg)
        return y.detach(), xx.grad, ww.grad

    def body(comm):
        r = comm.coord[0]
        if kind == "column":       # W rows sharded: out and dy sharded on N
            return one(x, w.chunk(2, 0)[r], gy.chunk(2, -1)[r].contiguous(),
                       w_shards=((0, 0),), out_shards=((0, 2),))
        return one(x.chunk(2, -1)[r].contiguous(), w.chunk(2, 1)[r].contiguous(), gy,   # row
                   x_shards=((0, 2),), w_shards=((0, 1),))
    return ThreadWorld((2,)).run(body), one(x, w, gy)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_column_parallel_equals_one_device(scaling):
    ranks, (y, gx, gw) = _sharded_linear(scaling, "column")
    assert torch.equal(torch.cat([r[0] for r in ranks], -1), y)
    assert torch.equal(torch.cat([r[2] for r in ranks], 0), gw)
    # dx is a partial sum over the ranks (bf16 GEMM outputs summed): up to u apart
    err = float((ranks[0][1] + ranks[1][1] - gx).norm() / gx.norm())
    assert err <= U_BF16, err


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_row_parallel_equals_one_device(scaling):
    ranks, (y, gx, gw) = _sharded_linear(scaling, "row")
    assert torch.equal(torch.cat([r[1] for r in ranks], -1), gx)
    assert torch.equal(torch.cat([r[2] for r in ranks], 1), gw)
    err = float(((ranks[0][0].float() + ranks[1][0].float()) - y.float()).norm() / y.float().norm())
    assert err <= U_BF16, err


def test_unreduced_shards_differ():
    """The check above can fail: without the amax reduction, each shard scales by its own
    amax and the outputs are not the one-device ones."""
    torch.manual_seed(1)
    x, w = torch.randn(2, 8, 64), torch.randn(32, 64)
    w = torch.cat([w[:16] * 3, w[16:]])       # shards of different ranges
    whole = fp8_linear(x, w, None, "tensorwise")
    parts = torch.cat([fp8_linear(x, s.contiguous(), None, "tensorwise") for s in w.chunk(2, 0)], -1)
    assert not torch.equal(parts, whole)


# ---- which linears ---------------------------------------------------------------------------
def test_fp8_linears_skip_heads():
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()          # tied lm_head: the embedding reads its weight too
    assert sorted(fp8_linears(capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)).values()) == GPT_FP8
    ex = EXAMPLES["llama"]()        # untied output head: the last linear
    chosen = set(fp8_linears(capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)).values())
    assert "output.weight" not in chosen and any(".w2." in c for c in chosen) and len(chosen) > 4


class _Routed(torch.nn.Module):
    """A router that calls ``F.linear`` on a weight of its own (as transformers'
    ``MixtralTopKRouter``), an ``nn.MultiheadAttention`` (its projections: ``F.linear`` on
    ``in_proj_weight`` and ``out_proj.weight``), two ``nn.Linear`` layers and a head."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Module()
        self.router.weight = torch.nn.Parameter(torch.randn(4, 32))
        self.attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
        self.up, self.down, self.head = (torch.nn.Linear(32, 64), torch.nn.Linear(64, 32),
                                         torch.nn.Linear(32, 8))

    def forward(self, x):
        gate = torch.softmax(torch.nn.functional.linear(x, self.router.weight), -1)
        x = x + self.attn(x, x, x, need_weights=False)[0] * gate[..., :1]
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_fp8_linears_are_nn_linear_layers():
    """Only linears an ``nn.Linear`` module calls, as torchao swaps: a router's ``F.linear``
    on its own weight and MultiheadAttention's projections stay bf16 (were converted, and
    the one-device recipe, ``use_fp8_linears``, could not apply them: the sweep's
    mixtral:fp8:881400 and torch-encoder:fp8:548178)."""
    x = torch.randn(2, 8, 32)
    cap = capture(_Routed(), (x,), torch.nn.functional.mse_loss, target=torch.randn(2, 8, 8))
    assert sorted(fp8_linears(cap).values()) == ["down.weight", "up.weight"]


# ---- priced ----------------------------------------------------------------------------------
def _gpt_13b():
    from examples.models import EXAMPLES
    with torch.device("meta"):
        return EXAMPLES["gpt"](batch=16, config="gpt-1.3b")


def test_fp8_priced_faster_on_h100():
    """gpt-1.3b (h = 2048, s = 2048, V = 50257, L = 24) on 8 H100s, data=8: the fp8 linears'
    share of the model's matmul FLOPs is phi = 24h^2 / (24h^2 + 4sh + 2hV/L) = 0.80 (per token
    and layer: the four linears 24h^2, attention's two products 4sh, the head's share). At
    most they run twice as fast (fp8 peak 1,979 / bf16 989.5 TFLOP/s), so the step is at
    most 1 / (1 - phi/2) = 1.66x faster. Compiled (the casts fused, torchao's roofline) a
    GEMM-bound model must come out faster; eager, the op-by-op casts move 33 bytes an
    element (measured 1.7-2.2x slower than bf16 on an H200), and the per-layer choice
    (``fp8_layers=None``) keeps in bf16 what fp8 would slow: never slower than bf16."""
    ex = _gpt_13b()
    h, s, v, layers = 2048, 2048, 50257, 24
    phi = 24 * h * h / (24 * h * h + 4 * s * h + 2 * h * v / layers)
    for compiled in (True, None):
        t = {}
        for prec in ("bf16", "fp8"):
            p = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x8xH100",
                             precision=prec, data=8, pipeline=1, compile=compiled)
            t[prec] = p.estimate.step_time_s
        ratio = t["bf16"] / t["fp8"]
        low = 1.0 if compiled else 1.0 - 1e-9
        assert low < ratio <= 1 / (1 - phi / 2), (compiled, t, ratio, phi)


def test_amax_reductions_follow_the_shards():
    """The price's amax all-gathers are the runtime's (``ops.fp8``): tensorwise, a
    column-parallel linear reduces W's amax (forward and backward) and dy's, a row-parallel one
    x's and W's (forward), W's again in backward (it is cast again there); rowwise, per row: W's output rows are whole in a column shard,
    so only its per-column amax over N (backward) and dy's per-token amax cross the shards."""
    from autopar.cost_models.devices import Link
    from autopar.placement import R, Shard
    from autopar.pricing.fp8 import amax_gathers
    from autopar.sharding.registry import Strategy, TensorMeta
    link = Link(bandwidth=1e11, latency=1e-5)
    x, w, y = (TensorMeta(s, torch.float32) for s in ((4, 8, 64), (16, 64), (4, 8, 16)))
    column = (Strategy((R, Shard(0)), (Shard(2),)),)
    row = (Strategy((Shard(2), Shard(1)), (P_,)),)
    kinds = lambda g: sorted((when, n) for when, n, _, _ in g)  # noqa: E731
    assert kinds(amax_gathers(column, [x, w], [y], (2,), [link], False)) == [("bwd", 1), ("bwd", 1), ("fwd", 1)]
    assert kinds(amax_gathers(row, [x, w], [y], (2,), [link], False)) == [("bwd", 1), ("fwd", 1), ("fwd", 1)]
    assert kinds(amax_gathers(column, [x, w], [y], (2,), [link], True)) == [("bwd", 32), ("bwd", 64)]
    assert kinds(amax_gathers(row, [x, w], [y], (2,), [link], True)) == [("fwd", 16), ("fwd", 32)]
    replicated = (Strategy((Shard(0), R), (Shard(0),)),)     # data parallel: rows per rank
    assert amax_gathers(replicated, [x, w], [y], (2,), [link], False) == ()


def test_fp8_price_terms():
    """One fp8 linear on an H100: compiled, its GEMMs at the fp8 peak beat bf16's at a large
    shape; eager they do not; rowwise casts more than tensorwise (backward); an amax gather
    adds its collective."""
    from autopar.cost_models import compute
    from autopar.cost_models.devices import Link
    from autopar.cost_models.fp8 import CAST_BYTES_PER_ELEMENT, cast_time, fp8_linear_time
    from autopar.cost_models.gpus import H100_80GB
    from autopar.sharding.registry import TensorMeta
    lin = torch.ops.aten.linear.default
    ins = [TensorMeta((8192, 4096), torch.bfloat16), TensorMeta((4096, 4096), torch.bfloat16)]
    outs = [TensorMeta((8192, 4096), torch.bfloat16)]
    bf = compute.node_time(lin, ins, outs, (), {}, H100_80GB, "bf16", native=True)
    tw = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False, compiled=True)
    rw = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, True, compiled=True)
    assert sum(tw) < sum(bf) and rw[1] > tw[1]
    # eager, op by op, the casts cost more than the GEMMs save (an H200 measured 1.7x)
    assert sum(fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False)) > sum(bf)
    n = 8192 * 4096
    assert cast_time(n, H100_80GB) >= CAST_BYTES_PER_ELEMENT * n / H100_80GB.mem_bandwidth
    link = Link(bandwidth=1e11, latency=1e-5)
    with_gather = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False, (("fwd", 1, 2, link),),
                                  compiled=True)
    assert with_gather[0] > tw[0] and with_gather[1] == tw[1]


def test_fp8_refused_on_a100():
    ex = _gpt_13b()
    with pytest.raises(PinError, match="precision='fp8' on A100-80GB-SXM.*pin precision='bf16'"):
        autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x8xA100",
                     precision="fp8", data=8, pipeline=1)


# ---- on gloo ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    return torchrun_cases("fp8_worker.py", 2, CASES, tmp / "fp8.json", timeout=900, case_timeout=200)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_fp8_equals_one_device_recipe(results, case_id):
    r = case_result(results, case_id)
    case = next(c for c in CASES if c["id"] == case_id)
    assert r["plan_pins"]["precision"] == "fp8" and r["plan_pins"]["fp8_scaling"] in case_id
    assert r["row_blocks"] == PLANS[case["plan"]][1]    # analysis.fp8_layers.row_blocks
    if case["fp8_layers"] is None:      # the plan's choice, by name, applied as chosen
        chosen = r["fp8_layers"]
        assert isinstance(chosen, list) and set(chosen) <= {w[:-7] for w in GPT_FP8}, r
        assert r["fp8_weights"] == sorted(f"{m}.weight" for m in chosen), r
        assert r["fp8_calls"] == len(chosen), r
    elif case["fp8_layers"] == "all":
        assert r["fp8_weights"] == GPT_FP8
        # each rank's programs call fp8_linear: every layer's 4, a pipeline rank its stage's
        assert r["fp8_calls"] == (4 if "pp2" in case_id else 8), r
    else:
        assert r["fp8_weights"] == sorted(f"{m}.weight" for m in case["fp8_layers"])
        assert r["fp8_calls"] == len(case["fp8_layers"]), r
    if r["fp8_calls"]:
        assert r["bf16_grad_dist"] > BF16_FLOOR, r
    else:                               # none chosen: the plain bf16 run, on the rank's rows
        assert r["bf16_grad_dist"] <= BF16_FLOOR, r
    if "tensor2" in case_id:
        assert r["grad_err"] <= TP_GRAD_TOL and r["grad_err"] < r["bf16_grad_dist"], r
        assert r["loss_err"] <= TP_LOSS_TOL, r
        assert r["weight_err"] < r["bf16_weight_dist"], r
    else:
        assert r["loss_err"] <= EXACT_TOL and r["grad_err"] <= EXACT_TOL, r
        assert r["weight_err"] <= EXACT_WEIGHT_TOL, r
    # ZeRO-3 tensorwise: the fp8 linears' weights gathered as fp8 bytes (uint8 on the wire),
    # forward and again in backward, each rank its half: the weights' elements, once; rowwise
    # gathers bf16 (passes/fp8_gathers.py); no other plan gathers weights in fp8
    sent = r["gathered_last_step"]
    if case["plan"] == "zero3" and case["scaling"] == "tensorwise":
        assert r["fp8_gathers"] and sent.get("torch.uint8") == r["fp8_weight_numel"], r
    else:
        assert not r["fp8_gathers"] and "torch.uint8" not in sent, r


# ---- which linears, by price -----------------------------------------------------------------
class _Mixed(torch.nn.Module):
    """A large linear (4096 x 4096), a narrow pair (4096 -> 64 -> 4096) and a head."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(4096, 4096)
        self.down = torch.nn.Linear(4096, 64)
        self.up = torch.nn.Linear(64, 4096)
        self.head = torch.nn.Linear(4096, 16)

    def forward(self, x):
        h = torch.relu(self.big(x))
        h = h + self.up(torch.relu(self.down(h)))
        return self.head(h)


def _mixed_plan(**pins):
    """The mixed model's plan on 8 H100s, compiled unless pinned otherwise (compiled casts:
    torchao's roofline; eager ones cost 33 bytes an element, ``test_eager_cast_price_counts_the_code``)."""
    with torch.device("meta"):
        model, x, t = _Mixed(), torch.randn(64, 1024, 4096), torch.randn(64, 1024, 16)
    return autopar.plan(model, (x,), torch.nn.functional.mse_loss, target=t, cluster="1x8xH100",
                        precision="fp8", pipeline=1, **{"compile": True, **pins})


def test_fp8_layers_chosen_by_price():
    """On 8 H100s, data=8 (8,192 tokens a rank), compiled: the 4096 x 4096 linear's fp8 GEMMs
    save 3 x 2 x 4096^2 FLOPs a token at half bf16's time, ~100 ns, against casts of ~10 ns a
    token (x and dy, 4 bytes an element each at 3.35 TB/s): fp8. The narrow pair's GEMMs
    (64-wide) save ~2 ns a token against the same casts of their 4096-wide operand: bf16.
    The head stays bf16 (the recipe's). Under tensor=8 each rank's share of the large GEMM is
    8x smaller and the casts of its whole operand are not: fewer fp8 layers. Eager, the
    casts move 33 and 35 bytes an element, ~80 ns a token, and with the W cast and copies
    the big linear too is slower in fp8 (as on the H200: 8,192 x 4,096 x 4,096 ran 1.7x
    slower than bf16): no linear is fp8."""
    p = _mixed_plan(data=8)
    assert p.options.fp8_layers == ("big",), p.options.fp8_layers
    assert _mixed_plan(data=8, compile=None).options.fp8_layers == ()
    assert any(line.startswith("fp8 (tensorwise): 1 linear layers") and "big" in line
               for line in p.summary().splitlines()), p.summary()
    # explain says it per node: the large linear fp8, the narrow ones bf16, the head neither
    from autopar.viz.explain import explain
    with torch.device("meta"):
        model, x, t = _Mixed(), torch.randn(64, 1024, 4096), torch.randn(64, 1024, 16)
    cap = capture(model, (x,), torch.nn.functional.mse_loss, target=t)
    notes = [explain(cap, p, n).fp8 for n in ("linear", "linear_1", "linear_2", "linear_3")]
    assert notes[0].startswith("its GEMMs run in fp8") and notes[3] == "", notes
    assert all(n.startswith("it runs in bf16") for n in notes[1:3]), notes
    tp = _mixed_plan(tensor=8)
    assert len(tp.options.fp8_layers) <= len(p.options.fp8_layers), tp.options.fp8_layers
    from autopar.cost_models import compute
    from autopar.cost_models.fp8 import fp8_linear_time
    from autopar.cost_models.gpus import H100_80GB
    from autopar.sharding.registry import TensorMeta as M
    lin, bf = torch.ops.aten.linear.default, torch.bfloat16

    def saving(n_local):          # the big linear's priced fp8 gain at 8,192 tokens a rank
        ins, outs = [M((8192, 4096), bf), M((n_local, 4096), bf)], [M((8192, n_local), bf)]
        return (sum(compute.node_time(lin, ins, outs, (), {}, H100_80GB, "bf16", native=True))
                - sum(fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False, compiled=True)))
    assert saving(512) < saving(4096) / 4      # column-parallel: its whole x still cast
    # the choice is the cheaper one: pinning every layer fp8 prices a slower step
    every = _mixed_plan(data=8, fp8_layers="all")
    assert every.options.fp8_layers == "all"
    assert every.estimate.step_time_s > p.estimate.step_time_s


def test_fp8_layers_pinned():
    """A pinned list is what the plan runs (recorded as given); a name that is no eligible
    linear, or the pin without precision='fp8', is refused naming the fix."""
    p = _mixed_plan(data=8, fp8_layers=["up", "down"])
    assert p.options.fp8_layers == ("down", "up")
    again = autopar.Plan.from_dict(p.to_dict())           # the plan file keeps the list
    assert again.options.fp8_layers == ("down", "up") and again.digest() == p.digest()
    free = _mixed_plan(data=8)
    assert p.estimate.step_time_s > free.estimate.step_time_s     # the priced-out pair, forced
    with pytest.raises(PinError, match=r"fp8_layers names \['head'\].*leave fp8_layers out"):
        _mixed_plan(data=8, fp8_layers=["head"])
    with pytest.raises(PinError, match="pin precision='fp8' too"):
        Options.from_pins(precision="bf16", fp8_layers=["big"])
    with pytest.raises(PinError, match="fp8_layers=3"):
        Options.from_pins(precision="fp8", fp8_layers=3)


def test_compiled_casts_cost_less():
    """compile=True prices the casts at torchao's compiled-float8 roofline traffic
    (``cost_models.fp8.CAST_TRAFFIC``), less than eager's op-by-op casts; the GEMMs are the
    same."""
    from autopar.cost_models.fp8 import CAST_TRAFFIC, fp8_linear_time
    from autopar.cost_models.gpus import H100_80GB
    from autopar.sharding.registry import TensorMeta
    lin = torch.ops.aten.linear.default
    m, k, n = 8192, 4096, 4096
    ins = [TensorMeta((m, k), torch.bfloat16), TensorMeta((n, k), torch.bfloat16)]
    outs = [TensorMeta((m, n), torch.bfloat16)]
    eager = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False)
    fused = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False, compiled=True)
    bw, launch = H100_80GB.mem_bandwidth * H100_80GB.mem_efficiency, H100_80GB.launch_overhead
    numel = {"x": m * k, "w": n * k, "dy": m * n}

    def casts(table):
        return sum(b * numel[op] / bw + kern * launch for (_, op), (b, kern) in table.items())
    saved = casts(CAST_TRAFFIC[("tensorwise", False)]) - casts(CAST_TRAFFIC[("tensorwise", True)])
    assert saved > 0 and sum(eager) - sum(fused) == pytest.approx(saved, rel=1e-9)
    assert fused[0] < eager[0] and fused[1] < eager[1]


def test_eager_cast_price_counts_the_code():
    """The eager cast's price (``CAST_BYTES_PER_ELEMENT``, ``CAST_KERNELS``) is what
    ``ops.fp8.cast`` runs: every ATen op it dispatches counted as a kernel, and the bytes
    read and written by those over the whole tensor (the scale's few elements aside). The
    5 bytes an element once priced here (torchao's fused kernels, not this code) made the
    eager fp8 linear 3x faster than it ran on an H200."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.cost_models.fp8 import CAST_BYTES_PER_ELEMENT, CAST_KERNELS, POWER_OF_2_KERNELS
    from autopar.ops.fp8 import E4M3, RECIPES, cast

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            moved = sum(t.nbytes for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
            self.ops.append((str(func), moved))
            return out
    t = torch.randn(256, 128, dtype=torch.bfloat16)
    n = t.numel()
    for recipe, dims, kernels in (("tensorwise", (0, 1), CAST_KERNELS),
                                  ("rowwise", (1,), CAST_KERNELS + POWER_OF_2_KERNELS)):
        with Count() as c:
            cast(t, E4M3, dims, RECIPES[recipe])
        assert len(c.ops) == kernels, c.ops
        whole = sum(b for _, b in c.ops if b >= n)          # the ops over the tensor
        scale = sum(b for _, b in c.ops if b < n)
        assert whole - CAST_BYTES_PER_ELEMENT * n == pytest.approx(0, abs=scale + 1024), c.ops


def test_a_compiled_pipeline_is_priced_compiled():
    """``compile=True`` reaches a pipeline's stages (``pipeline_search.INTRA_PINS``): the
    stages' fused memory-bound ops and fp8 casts price less than eager (before, a pipelined
    plan priced compile=True exactly as eager), and the plan keeps the pin."""
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"](batch=8, seed=0)
    est = {}
    for c in (None, True):
        p = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x2xH100",
                         pipeline=2, micro_batch_size=2, schedule="1f1b", precision="fp8",
                         fp8_layers="all", compile=c)
        assert p.options.compile is c and p.pipeline_stages == 2
        est[c] = p.estimate
    assert est[True].compute_s < est[None].compute_s, est


def test_rowwise_backward_rescale():
    """Rowwise's backward GEMMs run as torchao runs them: cuBLAS's tensorwise GEMM, then the
    bf16 output times the outer product of the row scales (torchao ``float8_ops.py``,
    ``addmm_float8_unwrapped`` without fast accumulation; ``cost_models.fp8.RESCALE_TRAFFIC``):
    dx and dW read and written once more, 4 bytes an element compiled (one fused kernel), 12
    eager (the outer product written in fp32, then the multiply). It decides a ranking the
    way torchao's measured tables do: at M 16,384, K 8,192, N 640 (an output narrower than
    the 2,048 below which torchao's ``_auto_filter_for_rowwise`` leaves a linear in bf16,
    its thresholds read from its measured rowwise table) rowwise is priced slower than bf16,
    where without the rescale it was priced faster; tensorwise, which torchao's tensorwise
    filter converts at this shape (K > 4,096), stays faster than bf16. (N was 1,024 until
    Hopper's GEMMs were priced at their measured rates, ``gpus._HOPPER_GEMM`` and
    ``_HOPPER_MATMUL_BACKWARD``, bf16's and fp8's alike: the prices now cross at N ~830
    where torchao's table puts 2,048; what the rowwise backward GEMMs lose without fast
    accumulation is not priced.)"""
    from autopar.cost_models import compute
    from autopar.cost_models.fp8 import RESCALE_TRAFFIC, fp8_linear_time, rescale_time
    from autopar.cost_models.gpus import H100_80GB
    from autopar.sharding.registry import TensorMeta
    lin = torch.ops.aten.linear.default
    m, k, n = 16384, 8192, 640
    ins = [TensorMeta((m, k), torch.bfloat16), TensorMeta((n, k), torch.bfloat16)]
    outs = [TensorMeta((m, n), torch.bfloat16)]
    bw = H100_80GB.mem_bandwidth * H100_80GB.mem_efficiency
    for compiled, (nbytes, kernels) in ((True, (4, 1)), (False, (12, 2))):
        assert RESCALE_TRAFFIC[compiled] == (nbytes, kernels)
        want = nbytes * (m * k + n * k) / bw + 2 * kernels * H100_80GB.launch_overhead
        assert rescale_time(m * k, n * k, H100_80GB, compiled) == pytest.approx(want, rel=1e-9)
    bf16 = sum(compute.node_time(lin, ins, outs, (), {}, H100_80GB, "bf16", native=True))
    rowwise = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, True, compiled=True)
    tensorwise = sum(fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, False, compiled=True))
    rescale = rescale_time(m * k, n * k, H100_80GB, compiled=True)
    assert sum(rowwise) - rescale < bf16 < sum(rowwise), (bf16, rowwise, rescale)
    assert tensorwise < bf16


def test_fused_casts_price_eager_programs_as_fused():
    """``cost_models.fp8.fused_casts`` (what published runs of fused-cast stacks are priced
    with) prices an eager linear's casts as the compiled ones, and only while open."""
    from autopar.cost_models.fp8 import FUSED_CASTS_ENV, fp8_linear_time, fused_casts
    from autopar.cost_models.gpus import H100_80GB
    from autopar.sharding.registry import TensorMeta
    lin = torch.ops.aten.linear.default
    ins = [TensorMeta((8192, 4096), torch.bfloat16), TensorMeta((4096, 4096), torch.bfloat16)]
    outs = [TensorMeta((8192, 4096), torch.bfloat16)]
    for rowwise in (False, True):
        eager = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, rowwise)
        compiled = fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, rowwise, compiled=True)
        with fused_casts():
            assert fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, rowwise) == compiled
        assert fp8_linear_time(lin, ins, outs, (), {}, H100_80GB, rowwise) == eager != compiled
    assert FUSED_CASTS_ENV not in os.environ


class _ScoringLinear(torch.nn.Linear):
    """An ``nn.Linear`` subclass with its own forward (Llama 4's router: scores and logits)."""

    def forward(self, x):
        logits = super().forward(x)
        return torch.sigmoid(logits), logits


class _ScoredModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 16)
        self.router = _ScoringLinear(16, 16)
        self.down = torch.nn.Linear(16, 16)

    def forward(self, x):
        scores, logits = self.router(self.up(x))
        return self.down(scores * logits)


def test_a_linear_subclass_with_its_own_forward_is_no_fp8_linear():
    """The one-device recipe (``ops.fp8.use_fp8_linears``) replaces a linear's forward, so a
    subclass whose forward returns something else (Llama 4's router) is left in bf16: taken
    for a linear, the recipe broke its forward ("too many values to unpack")."""
    from autopar.ops.fp8 import use_fp8_linears
    m, x = _ScoredModel(), torch.randn(8, 16)
    cap = capture(m, (x,), lambda out, y: ((out - y) ** 2).mean(), torch.zeros(8, 16))
    weights = set(fp8_linears(cap).values())
    assert "up.weight" in weights and "router.weight" not in weights, weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        use_fp8_linears(copy.deepcopy(m), weights, "tensorwise")(x)    # runs


def test_an_fp8_linears_output_may_be_changed_in_place():
    """``fp8_linear``'s output of a 3-D input was a view made inside its autograd Function,
    which torch refuses to let a model change in place (Llama 4's text model adds into a
    projection's output); its gradients are those of the same in-place change on
    ``torch.nn.functional.linear``'s output, up to fp8's error."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)

    def run(linear):
        y = linear(x, w)
        y.mul_(2.0).add_(1.0)
        y.sum().backward()
        grads = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        return grads

    got = run(lambda a, b: fp8_linear(a, b, None, "tensorwise"))
    want = run(torch.nn.functional.linear)
    for g, r in zip(got, want):
        assert (g - r).abs().max() <= 0.1 * r.abs().max(), (g - r).abs().max()
