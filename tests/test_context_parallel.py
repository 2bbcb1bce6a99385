"""Context parallelism (pin ``context=``): the sequence split over a mesh axis through the
whole model, attention included, equal to one device on gloo ranks for transformers Llama
and Qwen2 (grouped-query attention, rotary positions) and GPT-2 (learned positions), alone
and beside tensor, data and pipeline parallelism, with a padded batch too.

The ranks run in two torchrun launches (2 and 4 processes; ``tests/context_parallel_worker.py``)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.capture.sequence_dims import SequenceDims  # noqa: E402
from autopar.errors import PinError  # noqa: E402
from autopar.solver.context_search import balanced_copy  # noqa: E402
from launch import case_result, torchrun_cases  # noqa: E402

TWO = [
    {"id": "llama-c2", "model": "llama", "pins": {"context": 2}},
    {"id": "qwen2-c2-allgather", "model": "qwen2", "pins": {"context": 2, "context_attention": "all-gather"}},
    {"id": "gpt2-c2", "model": "gpt2", "pins": {"context": 2}},
    {"id": "llama-c2-padded", "model": "llama", "pins": {"context": 2}, "padded": True},
    {"id": "llama-c2-zero3", "model": "llama", "pins": {"context": 2, "zero": 3}},
]
FOUR = [
    {"id": "llama-c4", "model": "llama", "pins": {"context": 4}},
    {"id": "gpt2-c4-padded", "model": "gpt2", "pins": {"context": 4}, "padded": True},
    {"id": "qwen2-c2-t2", "model": "qwen2", "pins": {"context": 2, "tensor": 2}},
    {"id": "llama-c2-d2", "model": "llama", "pins": {"context": 2, "data": 2}},
    {"id": "qwen2-c2-d2-zero3", "model": "qwen2", "pins": {"context": 2, "data": 2, "zero": 3}},
    {"id": "gpt2-c2-p2", "model": "gpt2", "pins": {"context": 2, "pipeline": 2, "micro_batch_size": 2}},
    {"id": "memory-c4", "memory": True, "seq": 512},
]
MEMORY_TOL = 0.15
"""The issue's figure. Measured 2026-11-28: 696,840 bytes saved a rank against 700,928
estimated (0.994), after the estimate stopped counting attention's q, k, v twice (once at
their producers, once at the context attention)."""


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return torchrun_cases("context_parallel_worker.py", 2, TWO,
                          tmp_path_factory.mktemp("cp2") / "r.json", timeout=900, case_timeout=240)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return torchrun_cases("context_parallel_worker.py", 4, FOUR,
                          tmp_path_factory.mktemp("cp4") / "r.json", timeout=900, case_timeout=240)


def _check(r, case):
    c = case["pins"]["context"]
    assert r["mesh"][r["axes"].index("context")] == c, r
    # the mode happened: every attention ran with its keys split on the context axis
    assert r["n_sdpa"] >= 2 and len(r["context_sdpa"]) == r["n_sdpa"], r
    assert r["form"] == case["pins"].get("context_attention", r["form"]), r
    assert r["layout"] == "balanced", r     # rank r holds chunks r and 2c-1-r of the sequence
    local, total = r["param_numel"]
    if case["pins"].get("zero") == 3:
        # ZeRO-3 over the context axis too (with the data axis where there is one): every
        # weight stored split, a rank holding 1/(data x context) of them
        assert len(r["split_on_context"]) == len(r["names"]), r
        assert local == total // (c * case["pins"].get("data", 1)), r
    else:
        assert not r["split_on_context"], r


@pytest.mark.parametrize("case", TWO, ids=[c["id"] for c in TWO])
def test_two_ranks_equal_one_device(two, case):
    _check(case_result(two, case["id"]), case)


@pytest.mark.parametrize("case", [c for c in FOUR if not c.get("memory")],
                         ids=[c["id"] for c in FOUR if not c.get("memory")])
def test_four_ranks_equal_one_device(four, case):
    _check(case_result(four, case["id"]), case)


def test_a_sequence_four_times_what_one_rank_holds_runs_on_four_within_its_estimate(four):
    """The budget one rank needs at a quarter of the sequence: the whole sequence does not
    fit one rank under it, and context=4 fits; each rank's saved activations (the distinct
    storages autograd keeps for backward, measured on gloo) within ``MEMORY_TOL`` of the
    plan's activations; the loss's transient gradients (made by the loss's backward beside
    the saved tensors, ``analysis.saved.LOSS_GRADIENTS``; at the step's peak, but no
    saved-tensor hook sees them) are the estimate's term of their own, ``loss_grads``
    (``cost_models.memory.step_phases``)."""
    r = case_result(four, "memory-c4")
    assert not r["fits_one_rank"], r
    assert r["memory_total"] <= r["budget"], r
    assert 0 < r["transient"] < r["estimate"] / 4, r
    assert abs(r["measured"] / r["estimate"] - 1) < MEMORY_TOL, r
    assert abs(r["loss_grads"] / r["transient"] - 1) < MEMORY_TOL, r


def test_the_balanced_order_gives_each_rank_a_head_and_a_tail_chunk():
    import torch
    from autopar.capture.sequence_layout import balanced_order
    from autopar.ops.context_attention import causal_work, shard_positions
    for c in (2, 4):
        perm = balanced_order(32, c)
        for r, block in enumerate(perm.chunk(c)):
            assert torch.equal(block, shard_positions(32, r, c, "balanced"))
        works = [causal_work(32, r, c, "balanced") for r in range(c)]
        assert max(works) == min(works)
        contiguous = [causal_work(32, r, c, "contiguous") for r in range(c)]
        # contiguous: the last rank's work near (2c-1)/c of the mean (1.5 at c=2, 1.75 at c=4)
        assert max(contiguous) / (sum(contiguous) / c) > 0.95 * (2 * c - 1) / c


def test_an_op_that_reads_the_sequence_in_order_is_refused():
    import torch
    from torch import nn

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)

        def forward(self, ids):
            return self.emb(ids).cumsum(1)

    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(PinError, match="reads the sequence in order"):
        autopar.plan(Shifted(), (ids,), lambda y, t: y.sum(), target=torch.zeros(1),
                     world_size=2, cluster="cpu:2", context=2)


class _Alibi(nn.Module):
    """BLOOM's attention in small: an ALiBi bias [batch * heads, 1, seq] added by
    ``baddbmm`` to eager scores, the batch times the heads as long as the sequence."""

    def __init__(self, heads: int = 4, dim: int = 8, vocab: int = 32):
        super().__init__()
        self.h, self.d = heads, dim
        self.emb = nn.Embedding(vocab, heads * dim)
        self.qkv = nn.Linear(heads * dim, 3 * heads * dim)
        self.out = nn.Linear(heads * dim, vocab)

    def forward(self, ids):
        b, s = ids.shape
        h, d = self.h, self.d
        q, k, v = (t.transpose(1, 2).reshape(b * h, s, d)
                   for t in self.qkv(self.emb(ids)).view(b, s, h, 3, d).unbind(3))
        slopes = 2.0 ** -torch.arange(1, h + 1, device=ids.device, dtype=torch.float32)
        alibi = (slopes[:, None, None] * torch.arange(s, device=ids.device)).repeat(b, 1, 1)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), alpha=d ** -0.5)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out((p @ v).view(b, h, s, d).transpose(1, 2).reshape(b, s, h * d))


def _loss_and_grads(cap, model, inputs):
    state, args = dict(model.named_parameters()), []
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":
            args.append(state[cap.params[n.name][0].removeprefix("model.")]
                        if n.name in cap.params else inputs[cap.inputs.index(n.name)])
    loss = cap.gm(*args)[0]
    return loss.detach(), torch.autograd.grad(loss, list(state.values()))


def _balanced_equals_sequence_order(cap, model, inputs):
    """The graph in the balanced order of 2 and of 4 ranks, run on one device, gives the
    loss and every gradient of ``cap`` in sequence order."""
    want, want_grads = _loss_and_grads(cap, model, inputs)
    for c in (2, 4):
        got, grads = _loss_and_grads(balanced_copy(cap, c), model, inputs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_dim_as_long_as_the_sequence_that_is_not_it_keeps_its_order():
    """BLOOM's ALiBi rows (batch x heads = 4 x 4 = 16 positions) were reordered as positions
    under context=4, each head reading another's slopes: its attention weights' gradients
    23% off (sweep case bloom:context:774277). The balanced graph on one device computes
    the loss and the gradients of the graph in sequence order."""
    torch.manual_seed(0)
    model = _Alibi()
    ids, target = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    cap = capture(model, (ids,), lambda y, t: nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()),
                  target)
    alibi = next(n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.baddbmm.default).args[0]
    assert list(alibi.meta["val"].shape) == [16, 1, 16]
    assert SequenceDims(cap.gm.graph, 16, 8).dims(alibi) == [2]      # positions: the last dim only
    _balanced_equals_sequence_order(cap, model, (ids, target))


class _OwnLoss(nn.Module):
    """A causal LM with its loss inside, as transformers' ``ForCausalLMLoss``: the labels
    padded and shifted one position in sequence order, flattened, then moved with
    ``.to(logits.device)`` (a cast node between the flatten and the loss); ``extra`` adds a
    pointwise op on the flattened labels, which no view chain traces back to the sequence."""

    def __init__(self, vocab: int = 32, dim: int = 16, extra: bool = False):
        super().__init__()
        self.emb, self.out, self.extra = nn.Embedding(vocab, dim), nn.Linear(dim, vocab), extra

    def forward(self, ids, labels):
        logits = self.out(torch.tanh(self.emb(ids))).float()
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        flat = shifted.view(-1).to(logits.device)
        if self.extra:
            flat = flat * 1
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), flat, ignore_index=-100)


def test_labels_shifted_inside_the_model_meet_the_stream_in_the_balanced_order():
    """Every model's own loss under context= was wrong (GPT-2, Llama, Qwen3; sweep case
    gpt2:context:79711, gradients 1.5 off): the shifted labels reach the loss through
    ``.to(device)`` after their flatten, the walk back to their sequence dim stopped at the
    cast, and the labels met the balanced logits in sequence order. The balanced graph on
    one device computes the loss and gradients of the graph in sequence order; a label
    tensor whose sequence dim no view chain finds is refused, naming the node."""
    torch.manual_seed(0)
    model = _OwnLoss()
    ids, labels = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    cap = capture(model, (ids, labels))
    _balanced_equals_sequence_order(cap, model, (ids, labels))
    with pytest.raises(PinError, match=r"node mul.*follows the sequence's length"):
        balanced_copy(capture(_OwnLoss(extra=True), (ids, labels)), 2)


def test_context_pins_are_checked():
    with pytest.raises(PinError, match="context_attention"):
        autopar.Options.from_pins(context=2, context_attention="ulysses")
    with pytest.raises(PinError, match="context=2 with expert"):
        autopar.Options.from_pins(context=2, expert=2)
    with pytest.raises(PinError, match="positive integer"):
        autopar.Options.from_pins(context=0)


# ---- pricing (autopar/pricing/context.py) -------------------------------------------------

def _sdpa_var(seq: int, heads: int = 32, kv_heads: int = 8, dim: int = 128, causal: bool = True):
    """The problem variable of one SDPA call [1, heads, seq, dim] on a 4-way mesh axis."""
    import torch
    from autopar.sharding.registry import make_call
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    for n, h in ((q, heads), (k, heads), (v, heads)):
        n.meta["val"] = torch.empty(1, h, seq, dim, dtype=torch.bfloat16, device="meta")
    out = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v),
                          {"is_causal": causal})
    out.meta["val"] = torch.empty(1, heads, seq, dim, dtype=torch.bfloat16, device="meta")
    return make_call(out)


def test_context_attention_prices_its_imbalance_and_its_forms():
    import dataclasses
    from autopar.cost_models.hardware import parse_cluster
    from autopar.placement import Replicate, Shard
    from autopar.pricing.context import context_attention_time
    from autopar.sharding.registry import Strategy
    from autopar.pricing.costing import CostModel
    cl = parse_cluster("1xdgx-h100")
    # a context axis of 4 inside the node (NVLink), as the inner axis of a (2, 4) mesh
    cost = CostModel.for_pins(dataclasses.replace(cl, devices_per_node=4), (4,),
                              autopar.Options.from_pins(precision="bf16"))
    links = cost.links
    assert links[0] == CostModel.for_pins(cl, (2, 4), cost.options).links[1]
    ctx = (Strategy((Shard(2),) * 3, (Shard(2),)),)
    whole = (Strategy((Replicate(),) * 3, (Replicate(),)),)

    def t(call, form, combo=ctx):
        return sum(context_attention_time(call, combo, 0, cost, form))

    long, short = _sdpa_var(131072), _sdpa_var(2048)
    # compute-bound at 128k: the ring hides each block's transfer, the gathers do not hide
    assert t(long, "ring") < t(long, "all-gather")
    # the slowest rank's causal work: (2c - 1) / c of the mean, c = 4: 1.75 x a quarter
    from autopar.cost_models import compute as compute_model
    from autopar.sharding.registry import TensorMeta
    q4 = TensorMeta((1, 32, 131072 // 4, 128), long.inputs[0].dtype)   # a rank's query rows
    # at the efficiency measured for the pairs and their merges (below SDPA's own)
    assert cl.device.context_attention_efficiency[0] < cl.device.attention_efficiency[0]
    flash = dataclasses.replace(cl.device, attention_efficiency=cl.device.context_attention_efficiency)
    local = sum(compute_model.node_time(long.op, [q4, *long.inputs[1:]], [q4], long.args,
                                        long.kwargs, flash, "bf16"))
    from autopar.cost_models import comm as comm_model
    kv_fp32 = 2 * long.inputs[1].numel // 4 * 4          # a rank's K and V block in float32
    # compute-bound: each dK/dV send beside the next block's K/V is hidden behind that block's
    # backward; the last, home to the block's owner, is not
    dkv = comm_model.collective_time("send", kv_fp32, 2, links[0])
    ring = t(long, "ring")
    assert abs(ring - (local * 1.75 + dkv)) < 1e-3 * ring, (ring, local, dkv)
    # the unpinned form is the faster one
    assert t(short, None) == min(t(short, "ring"), t(short, "all-gather"))
    assert t(long, None) == t(long, "ring")


def test_a_free_long_sequence_plan_takes_a_context_axis_and_says_what_it_buys():
    """A tiny transformers Llama over 131,072 tokens on a DGX node, planned free: attention's
    s^2 work dominates, so the search's context stage wins; the plan keeps the best step
    without a context axis, and both summaries (``plan_summary`` and the CLI's tables)
    print it against the plan's own, as it survives the plan file. (At 16,384 tokens it won
    only while the plans without a context axis kept transformers' built mask, priced as
    attention over every block; every capture now runs it causally, and there the tiny
    model's step is its eager program's host time, 10.7 ms, which a context axis adds to.)"""
    import torch
    import transformers
    from rich.console import Console

    from autopar.plan import Plan
    from autopar.report import plan_summary
    from autopar.viz.summary import summary_renderable
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=131072)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    ids = torch.zeros(1, 131072, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (ids,), lambda o, y: torch.nn.functional.cross_entropy(
        o.logits.flatten(0, 1), y.flatten()), target=ids, cluster="1xdgx-h100", precision="bf16")
    assert "context" in plan.mesh_axes and plan.options.context > 1, plan.options
    without = plan.alternatives_s["without a context axis"]
    assert without > plan.estimate.step_time_s
    ratio = f"({without / plan.estimate.step_time_s:.2f}x this plan's)"
    console = Console(record=True, width=240)
    console.print(summary_renderable(Plan.from_dict(plan.to_dict())))
    for text in (plan_summary(plan), console.export_text()):
        assert f"the sequence split {plan.options.context} ways over 'context', causally balanced" in text
        assert "the best plan without a context axis" in text and ratio in text, text[:2000]


def test_the_context_stage_leaves_unsolved_what_cannot_beat_the_best_and_plans_alike(monkeypatch):
    """The free search's context stage bounds each degree's programs by the best step found
    (``context_search.search_context``: compute floor, then LP relaxation): a tiny Llama
    over 32,768 tokens on a DGX node, where the plan without a context axis wins, leaves
    programs of the context meshes unsolved and says so in ``plan.solver.skipped``, and its
    plan is the one the search makes with no bound (the same digest). (Llama-3-8B at 262k
    tokens on 32 H100s, ``benchmarks/frontier.py``: the same plan in 18 s, 313 s before.)"""
    import transformers

    import autopar.solver.free_search as free_search
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=32768)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    ids = torch.zeros(2, 32768, dtype=torch.long, device="meta")

    def plan():
        return autopar.plan(model, (ids,), lambda o, y: torch.nn.functional.cross_entropy(
            o.logits.flatten(0, 1), y.flatten()), target=ids, cluster="1xdgx-h100", precision="bf16")
    bounded = plan()
    assert not bounded.options.context, bounded.options
    assert "context: " in bounded.solver.skipped and "not solved" in bounded.solver.skipped, \
        bounded.solver.skipped
    search = free_search.search_context
    monkeypatch.setattr(free_search, "search_context",
                        lambda spec, cap, plan_with, best_s=None, notes=None:
                        search(spec, cap, plan_with, None, notes))
    unbounded = plan()
    assert "context: " not in unbounded.solver.skipped
    assert unbounded.digest() == bounded.digest()
    assert unbounded.estimate.step_time_s == bounded.estimate.step_time_s
