"""Losses whose normalisation is not "mean of equal counts", on every kind of parallelism.

Distributed (``tests/loss_worker.py`` on real gloo ranks, one torchrun launch per world
size): losses {mean, sum, padded targets with ignore_index, label smoothing, class weights,
padded targets shifted inside the loss}
x modes {data 2, ZeRO-3 on data 2, tensor 2, data 2 x tensor 2, pipeline 2 with each of
gpipe / 1f1b / interleaved-1f1b / zero-bubble and 4 micro-batches, pipeline 2 x data 2}, each
compared with the single-device model: loss, every gradient, weights after 3 SGD steps.
Before the micro-batch loss rewrite (``autopar.analysis.microbatch_loss``) the pipeline
averaged micro-batch means and divided gradients by m: the sum cases were 1/m of the truth
and the padded ones off by ~35% in their gradients.

Single process: the rewritten graph run per micro-batch and summed equals the original loss
(and its gradients) on the whole batch, for every loss ATen gives a mean of.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.analysis.microbatch_loss import MicrobatchLossError, denominator_inputs, rewrite
from autopar.capture import capture
from launch import torchrun_cases

HERE = os.path.dirname(os.path.abspath(__file__))

LOSSES = ("mean", "sum", "ignore", "smoothing", "weight", "shifted")
PP = {"pipeline": 2, "micro_batch_size": 2}
MODES = {                                          # name -> (ranks, pins)
    "data2": (2, {"data": 2}),
    "zero3": (2, {"data": 2, "zero": 3}),
    "tensor2": (2, {"tensor": 2}),
    "pp2-gpipe": (2, {**PP, "schedule": "gpipe"}),
    "pp2-1f1b": (2, {**PP, "schedule": "1f1b"}),
    "pp2-interleaved-1f1b": (2, {**PP, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
    "pp2-zero-bubble": (2, {**PP, "schedule": "zero-bubble"}),
    "dp2xtp2": (4, {"data": 2, "tensor": 2}),
    "pp2xdp2-1f1b": (4, {**PP, "data": 2, "schedule": "1f1b"}),
}
# every loss under every mode of one axis or a pipeline; the two 4-rank meshes, whose axes
# each loss already meets alone, take half of the losses each (a 4-rank case costs ~8 s of
# this 2-core machine, a 2-rank one ~1.5 s)
ON_4_RANKS = {"dp2xtp2": ("mean", "ignore", "weight"), "pp2xdp2-1f1b": ("sum", "smoothing", "shifted")}
MATRIX = [(loss, mode) for loss, mode in itertools.product(LOSSES, MODES)
          if loss in ON_4_RANKS.get(mode, LOSSES)]
# the small GPT (lm_loss: mean cross entropy, ignore_index -100), its targets padded
GPT_CASE = {"id": "gpt-ignore-pp2xdp2-interleaved", "model": "gpt", "loss": "ignore",
            "pins": {**PP, "data": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}}


def _id(loss: str, mode: str) -> str:
    return f"{loss}-{mode}"


def _torchrun(nproc: int, cases: list[dict], tmp) -> tuple[dict, str]:
    return torchrun_cases("loss_worker.py", nproc, cases, tmp / f"losses_{nproc}.json",
                          timeout=600, case_timeout=120)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(nproc)``: every case of that world size, run once per module."""
    done: dict[int, tuple[dict, str]] = {}

    def get(nproc: int):
        if nproc not in done:
            tmp = tmp_path_factory.mktemp(f"losses{nproc}")
            cases = [{"id": _id(loss, mode), "loss": loss, "pins": MODES[mode][1]}
                     for loss, mode in MATRIX if MODES[mode][0] == nproc]
            if nproc == 4:
                cases.append(GPT_CASE)
            done[nproc] = _torchrun(nproc, cases, tmp)
        return done[nproc]
    return get


@pytest.mark.parametrize("loss,mode", MATRIX, ids=[_id(*c) for c in MATRIX])
def test_loss_matches_one_device(launch, loss, mode):
    nproc, pins = MODES[mode]
    results, failed = launch(nproc)
    r = results.get(_id(loss, mode))
    assert r is not None, f"{_id(loss, mode)}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{_id(loss, mode)}: {r['error']}\n{r.get('trace', '')}"
    if "pipeline" in pins:
        assert r["m"] == 4 and r["mesh"][0] == 2 and r["schedule"] == pins["schedule"]
    print(f"{_id(loss, mode)}: loss {r['worst']['loss']:.1e} grad {r['worst']['grad']:.1e} "
          f"weight {r['worst']['weight']:.1e} ({r['seconds']:.1f}s)")


def test_gpt_with_padded_targets_pipelined(launch):
    """Tied embedding and head on different stages, data 2, interleaved 1F1B, padded targets."""
    results, failed = launch(4)
    r = results.get(GPT_CASE["id"])
    assert r is not None, f"{GPT_CASE['id']}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{GPT_CASE['id']}: {r['error']}\n{r.get('trace', '')}"
    assert r["m"] == 4 and r["mesh"] == [2, 2]
    print(f"{GPT_CASE['id']}: loss {r['worst']['loss']:.1e} grad {r['worst']['grad']:.1e} "
          f"weight {r['worst']['weight']:.1e} ({r['seconds']:.1f}s)")


# ---- the rewrite, one process ---------------------------------------------------------------

V, B, T, M = 12, 8, 5, 4


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        self.register_buffer("w", torch.linspace(0.5, 2.0, V))

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _padded(target: torch.Tensor) -> torch.Tensor:
    keep = torch.tensor([5, 0, 3, 1, 4, 2, 5, 1])
    return torch.where(torch.arange(T)[None, :] < keep[:, None], target, -100)


def _flat(o):
    return o.reshape(-1, V)


LOSS_FNS = {
    "ce": lambda mod: lambda o, t: F.cross_entropy(_flat(o), t.reshape(-1)),
    "ce-ignore-weight-smoothing": lambda mod: lambda o, t: F.cross_entropy(
        _flat(o), t.reshape(-1), weight=mod.w, label_smoothing=0.2),
    "ce-class-dim-1": lambda mod: lambda o, t: F.cross_entropy(o.transpose(1, 2), t, ignore_index=-100),
    "nll-weight": lambda mod: lambda o, t: F.nll_loss(F.log_softmax(_flat(o), -1), t.reshape(-1), weight=mod.w),
    # the target computed inside the graph (shifted, as Hugging Face models do)
    "ce-shifted": lambda mod: lambda o, t: F.cross_entropy(_flat(o[:, :-1]), t[:, 1:].reshape(-1)),
    "ce-sum": lambda mod: lambda o, t: F.cross_entropy(_flat(o), t.reshape(-1), reduction="sum"),
    "ce-probs": lambda mod: lambda o, t: F.cross_entropy(_flat(o), F.one_hot(t.clamp(min=0), V).float().reshape(-1, V)),
    "mse": lambda mod: lambda o, t: F.mse_loss(o[..., 0], t.float()),
    "l1+smooth-l1": lambda mod: lambda o, t: F.l1_loss(o[..., 0], t.float()) + F.smooth_l1_loss(o[..., 1], t.float()),
    "bce-logits": lambda mod: lambda o, t: F.binary_cross_entropy_with_logits(o[..., 0], (t > 3).float()),
    "kl-div": lambda mod: lambda o, t: F.kl_div(F.log_softmax(o, -1), F.softmax(o.detach() * 0.5, -1)),
    "user-mean+reg": lambda mod: lambda o, t: ((o[..., 0] - t.float()) ** 2).mean() + 0.1 * mod.head.weight.square().sum(),
    # reductions over the batch dim that are not over every element
    "mean-over-batch-then-sum": lambda mod: lambda o, t: o.square().mean(0).sum(),
    "sum-over-batch-then-mean": lambda mod: lambda o, t: (o[..., 0] - t.float()).abs().sum(0).mean() + 1.0,
    "per-sample-mean-plus-constant": lambda mod: lambda o, t: (o[..., 0].square().mean(-1) + 1.0).mean(),
    "two-means": lambda mod: lambda o, t: 0.5 * (F.cross_entropy(_flat(o), t.reshape(-1)) + o.square().mean(-1).mean()),
}


def _data(pad: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    target = torch.randint(0, V, (B, T), generator=g)
    return ids, (_padded(target) if pad else target)


def _run_microbatches(cap, model, inputs, target, m):
    """Sum over micro-batches of the rewritten graph's loss; the parameters' gradients."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    scales = denominator_inputs(cap, inputs, target, m)
    whole = dict(zip(cap.inputs, tuple(inputs) + (target,) + scales))
    total = 0.0
    for k in range(m):
        args = []
        for n in cap.gm.graph.nodes:
            if n.op != "placeholder":
                continue
            if n.name in cap.params:
                args.append(params[cap.params[n.name][0]])
            elif n.name in cap.buffers:
                args.append(buffers[cap.buffers[n.name]])
            else:
                args.append(whole[n.name].tensor_split(m)[k])
        total = total + cap.gm(*args)[0]
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    return total, grads


@pytest.mark.filterwarnings("ignore:reduction. .mean. divides")
@pytest.mark.parametrize("name", list(LOSS_FNS))
def test_rewrite_sums_to_the_global_loss(name):
    torch.manual_seed(0)
    model = Tagger()
    loss_fn = LOSS_FNS[name](model)
    pad = "ignore" in name or name in ("ce-shifted", "ce-class-dim-1", "nll-weight")
    ids, target = _data(pad)
    if not pad:
        target = target.clamp(min=0)
    want = loss_fn(model(ids), target)
    want_grads = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    cap = capture(model, (ids[: B // M],), loss_fn, target[: B // M])
    rewrite(cap, M, model)
    assert not cap.microbatch_loss.error, cap.microbatch_loss.error
    got, grads = _run_microbatches(cap, model, (ids,), target, M)
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (float(got), float(want))
    for (pname, _), a, b in zip(model.named_parameters(), grads, want_grads):
        if b is None:
            continue
        err = float((a - b).norm() / b.norm().clamp(min=1e-12))
        assert err < 1e-5, f"{name}: gradient of {pname} off by {err:.1e}"
    # the original mean of micro-batch means is off wherever counts differ
    if pad and name != "ce-shifted":
        means = sum(loss_fn(model(i), t) for i, t in zip(ids.tensor_split(M), target.tensor_split(M))) / M
        assert not torch.allclose(means, want, rtol=1e-4)


def test_rewrite_adds_one_scale_input_per_mean():
    model = Tagger()
    ids, target = _data(True)
    cap = capture(model, (ids[:2],), LOSS_FNS["two-means"](model), target[:2])
    n_before = len(cap.inputs)
    rewrite(cap, M, model)
    spec = cap.microbatch_loss
    assert [t.kind for t in spec.terms] == ["class", "elements"]
    assert cap.inputs[n_before:] == spec.scale_inputs and len(spec.scale_inputs) == 2
    assert cap.node(cap.loss).meta["val"].shape == ()
    scales = denominator_inputs(cap, (ids,), target, M)
    count = int((target != -100).sum())
    assert scales[0].shape == (B * T,) and torch.allclose(scales[0], torch.full((B * T,), 1 / count))
    assert scales[1].shape == (B, T) and torch.allclose(scales[1], torch.full((B, T), 1 / (B * T)))


def test_unpipelined_capture_is_not_rewritten():
    model = Tagger()
    ids, target = _data(True)
    cap = capture(model, (ids,), LOSS_FNS["ce"](model), target)
    assert cap.microbatch_loss is None and not any("loss_scale" in n for n in cap.inputs)


def test_capture_microbatch_rewrites():
    from autopar.solver.pipeline_search import capture_microbatch
    model = Tagger()
    ids, target = _data(True)
    cap = capture_microbatch(model, (ids,), LOSS_FNS["ce"](model), target, M)
    assert cap.microbatch_loss.m == M and cap.inputs[-1] == cap.microbatch_loss.scale_inputs[-1]
    assert cap.node(cap.inputs[-1]).meta["val"].shape == (B // M * T,)


@pytest.mark.parametrize("loss_fn,match", [
    (lambda o, t: F.cross_entropy(_flat(o), t.reshape(-1)).exp(), "exp"),
    (lambda o, t: F.cross_entropy(_flat(o), t.reshape(-1)) ** 2, "pow"),
    (lambda o, t: F.mse_loss(o[..., 0], t.float()).sqrt(), "sqrt"),
])
def test_nonlinear_loss_is_refused_when_run(loss_fn, match):
    model = Tagger()
    ids, target = _data(False)
    cap = capture(model, (ids[:2],), loss_fn, target[:2])
    rewrite(cap, M, model)              # planning still works
    with pytest.raises(MicrobatchLossError, match=match):
        denominator_inputs(cap, (ids,), target, M)


def test_rewrite_of_a_model_on_the_meta_device():
    """Plan-only models live on the meta device: the scale input's shape value follows them."""
    from autopar.solver.pipeline_search import capture_microbatch
    model = Tagger().to("meta")
    ids, target = (t.to("meta") for t in _data(True))
    cap = capture_microbatch(model, (ids,), LOSS_FNS["ce-ignore-weight-smoothing"](model), target, M)
    assert cap.node(cap.inputs[-1]).meta["val"].device.type == "meta"
    assert not cap.microbatch_loss.error and len(cap.microbatch_loss.scale_inputs) == 1


class BatchCentred(Tagger):
    """Subtracts the mean over the whole (micro-)batch: a per-micro-batch statistic, as
    BatchNorm's, which must stay a mean over the micro-batch."""

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(torch.tanh(h - h.mean()))


def test_a_batch_statistic_inside_the_model_is_not_rewritten():
    model = BatchCentred()
    ids, target = _data(True)
    cap = capture(model, (ids[:2],), LOSS_FNS["ce"](model), target[:2])
    means = [n.name for n in cap.gm.graph.nodes if n.target is torch.ops.aten.mean.default]
    rewrite(cap, M, model)
    spec = cap.microbatch_loss
    assert not spec.error and [t.kind for t in spec.terms] == ["class"]
    assert [n.name for n in cap.gm.graph.nodes if n.target is torch.ops.aten.mean.default] == means
    # the sum of the micro-batch terms is the loss of the model with per-micro-batch statistics
    got, _ = _run_microbatches(cap, model, (ids,), target, M)
    per = [F.cross_entropy(_flat(model(i)), t.reshape(-1), reduction="sum")
           for i, t in zip(ids.tensor_split(M), target.tensor_split(M))]
    want = sum(per) / (target != -100).sum()
    assert torch.allclose(got, want, rtol=1e-5)
