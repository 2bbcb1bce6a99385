"""Hugging Face ``transformers`` models out of the box: capture, coverage, plans, gloo ranks.

Every architecture in ``MATRIX`` is built from a tiny config (hidden 32, 2 layers, vocabulary
128, sequence 16, batch 4; every ``*drop*`` field 0; eager attention unless the row says
otherwise; no KV cache) with random weights (nothing is downloaded; the builders are
``examples/zoo.py``'s, the differential sweep's zoo), and checked four ways:

- capture and coverage: ``autopar.coverage`` captures one flat ATen graph (shapes on every
  node; export's grad-mode / autocast-off regions such as the rotary embeddings inlined by
  ``autopar.capture.hops``, in-place ops on fresh values made out-of-place, tensor constants
  made factory ops) and lists the ops without a sharding rule, which must equal the row's
  ``gaps`` (a new gap, or a fixed one, fails until the matrix says so);
- plans: ``autopar.plan`` free; then, on one capture (``solve(..., captured=)``, the driver
  ``autopar.plan`` calls), ``data=2``, ``tensor=2``, and a memory budget that only plans
  storing the weights sharded meet: that plan holds fewer parameter bytes per device than
  the model has;
- gloo: 3 SGD steps on 2 gloo ranks under torchrun (``tests/hf_worker.py``; every selected
  case in one launch, started in the background when the module starts), loss, every
  gradient and the weights after the steps equal to one device (``tests/equivalence.py``).

The loss is a cross-entropy on ``out.logits`` with ``target=`` (in the graph, so it is
sharded too), or the model's own (``gpt2-own-loss``: ``labels=`` through ``OwnLoss``,
``loss_fn=None``). A row that cannot pass keeps its place with ``fails``: the stage, the
exception and the message it must raise, asserted at that stage and every later one that
reaches it (never skipped).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_hf_models.py
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs transformers")

import autopar  # noqa: E402
from autopar.capture import CaptureError, capture  # noqa: E402
from autopar.capture.cache import caching  # noqa: E402
from autopar.solver.driver import solve  # noqa: E402
from autopar.solver.errors import InfeasibleError  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- building tiny models: examples/zoo.py (the differential sweep's zoo) -------------------

from examples.zoo import B, DEC, ENC, HF_BUILDERS, S, V, H, Built, OwnLoss  # noqa: E402,F401


# ---- the matrix ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fails:
    """An expected failure: at ``stage`` ("capture", "plan" or "gloo") with ``error`` whose
    message matches ``match``; ``why`` is the concrete reason."""
    stage: str
    error: type
    match: str
    why: str


@dataclass(frozen=True)
class Arch:
    build: Callable[[], Built]
    family: str
    gaps: tuple[str, ...] = ()           # ops without a sharding rule (sorted)
    gloo: tuple[dict, ...] = ({"tensor": 2},)   # pins of the gloo runs
    fails: Fails | None = None
    notes: str = ""


MATRIX: dict[str, Arch] = {
    # decoders
    "gpt2": Arch(HF_BUILDERS["gpt2"], "decoder",
                 gloo=({"tensor": 2}, {"data": 2})),
    "gpt2-own-loss": Arch(HF_BUILDERS["gpt2-own-loss"], "decoder"),
    "llama": Arch(HF_BUILDERS["llama"], "decoder",
                  gloo=({"tensor": 2}, {"data": 2})),
    "llama-sdpa": Arch(HF_BUILDERS["llama-sdpa"], "decoder"),
    "llama-flex-attention": Arch(
        HF_BUILDERS["llama-flex-attention"], "decoder",
        fails=Fails("capture", CaptureError,
                    r"(?s)could not capture LlamaForCausalLM.*FlexAttention does not support "
                    r"backward on CPU",
                    "attn_implementation='flex_attention': torch's flex attention has no "
                    "backward on CPU (on other devices export would emit the flex_attention "
                    "higher-order op, which autopar names and refuses); use 'sdpa' or 'eager'")),
    "mistral": Arch(HF_BUILDERS["mistral"], "decoder"),
    "qwen2": Arch(HF_BUILDERS["qwen2"], "decoder"),
    "gemma": Arch(HF_BUILDERS["gemma"], "decoder"),
    "gemma3": Arch(HF_BUILDERS["gemma3"], "decoder",
                   notes="sliding-window and global layers; its rotary embedding, called once "
                         "per attention kind, is no layer (it reads no parameter)"),
    "phi": Arch(HF_BUILDERS["phi"], "decoder"),
    "gpt_neox": Arch(HF_BUILDERS["gpt_neox"], "decoder"),
    "opt": Arch(HF_BUILDERS["opt"], "decoder"),
    "falcon": Arch(HF_BUILDERS["falcon"], "decoder"),
    "bloom": Arch(HF_BUILDERS["bloom"], "decoder"),
    "mixtral": Arch(HF_BUILDERS["mixtral"], "decoder (mixture of experts)",
                    notes="each layer's experts are one op (autopar.ops.experts), split by "
                          "expert or by token as the plan chooses"),
    "qwen2_moe": Arch(HF_BUILDERS["qwen2_moe"], "decoder (mixture of experts)",
                      notes="routed experts beside a gated shared expert"),
    # encoders
    "bert": Arch(HF_BUILDERS["bert"], "encoder",
                 gloo=({"tensor": 2}, {"data": 2})),
    "roberta": Arch(HF_BUILDERS["roberta"], "encoder"),
    "distilbert": Arch(HF_BUILDERS["distilbert"], "encoder"),
    # vision
    "vit": Arch(HF_BUILDERS["vit"], "vision"),
    "resnet": Arch(HF_BUILDERS["resnet"], "vision",
                   gaps=("aten.add_.Tensor",), gloo=({"tensor": 2}, {"data": 2}),
                   notes="gap: BatchNorm's num_batches_tracked += 1, an in-place update of a "
                         "0-dim buffer (replicated; nothing to shard)"),
    "convnext": Arch(HF_BUILDERS["convnext"], "vision"),
    # encoder-decoder
    "t5": Arch(HF_BUILDERS["t5"], "encoder-decoder"),
    "bart": Arch(HF_BUILDERS["bart"], "encoder-decoder"),
}
NAMES = sorted(MATRIX)


@functools.lru_cache(maxsize=None)
def built(name: str) -> Built:
    return MATRIX[name].build()


def _fails(name: str, stage: str) -> Fails | None:
    f = MATRIX[name].fails
    return f if f is not None and f.stage == stage else None


def _reached(name: str, stage: str) -> bool:
    """False when the architecture is expected to fail at an earlier stage."""
    f = MATRIX[name].fails
    order = ["capture", "plan", "gloo"]
    return f is None or order.index(f.stage) >= order.index(stage)


# ---- capture and coverage ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_capture_and_coverage(name):
    """``autopar.coverage`` captures the model (a CaptureError if any node lacks a shape or a
    higher-order op is left) and lists the ops without a rule: exactly the expected gaps."""
    b = built(name)
    f = _fails(name, "capture")
    if f is not None:
        with pytest.raises(f.error, match=f.match):
            autopar.coverage(b.model, b.inputs, b.loss_fn, target=b.target)
        return
    with caching():     # stored in the session's capture cache: test_plans reads it back
        cov = autopar.coverage(b.model, b.inputs, b.loss_fn, target=b.target)
    assert tuple(sorted(cov.missing)) == MATRIX[name].gaps, str(cov)
    assert sum(cov.covered.values()) > 20


# ---- plans ---------------------------------------------------------------------------------

def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_plans(name):
    """Free (``autopar.plan``, capture included), then on one capture of the graph
    (``solve(..., captured=)``, the driver ``autopar.plan`` calls): data=2, tensor=2, and a
    memory budget that only plans storing the weights sharded meet. The graph is captured
    once a model: test_capture_and_coverage's capture, stored in the session's capture
    cache (``autopar.capture.cache``, ``tests/conftest.py``), is what ``autopar.plan`` and
    the capture below read (each of the 2-3 captures of a model was 2-9 s here;
    tests/test_capture_cache.py proves a hit plans as a fresh capture does)."""
    b = built(name)
    kw = dict(target=b.target, cluster="cpu:2")
    f = MATRIX[name].fails
    if f is not None and f.stage in ("capture", "plan"):    # planning captures first
        with pytest.raises(f.error, match=f.match):
            autopar.plan(b.model, b.inputs, b.loss_fn, **kw)
        return
    full = _param_bytes(b.model)
    free = autopar.plan(b.model, b.inputs, b.loss_fn, **kw)
    with caching():
        cap = capture(b.model, b.inputs, b.loss_fn, b.target)

    def plan(pins=None, **more):
        return solve(b.model, b.inputs, b.loss_fn, pins=pins, captured=cap, **kw, **more).plan

    dp, tp = plan({"data": 2}), plan({"tensor": 2})
    for p in (free, dp, tp):
        assert p.world_size == 2 and p.solver.status in ("OPTIMAL", "FEASIBLE"), p.solver
    assert dp.mesh_shape == (2,) and tp.mesh_shape == (2,)
    assert dp.pins == {"data": 2} and tp.pins == {"tensor": 2}
    assert tp.estimate.memory_bytes["params"] < full, tp.estimate.memory_bytes
    # A budget 0.4 x the parameters' bytes above the smallest plan: every plan of the whole
    # batch that keeps the weights whole (even with ZeRO-2 and recomputation) needs at least
    # half of them more than the smallest one, which stores them sharded (accumulate=1: the
    # free search may instead accumulate micro-batches, whose activations are smaller). So
    # close to the smallest plan the ILP proves optimality slowly (T5: minutes): 5 s per
    # solve, a FEASIBLE plan is enough.
    with pytest.raises(InfeasibleError) as nothing_fits:
        plan(memory_budget=1)
    budget = _smallest_plan_bytes(nothing_fits.value) + 0.4 * full
    tight = plan({"accumulate": 1}, memory_budget=budget, time_limit_s=5.0)
    assert tight.estimate.memory_total <= budget
    assert tight.estimate.memory_bytes["params"] < full, tight.estimate.memory_bytes
    print(f"{name}: free plan params {free.estimate.memory_bytes['params'] / full:.2f} of the "
          f"model's, {free.estimate.step_time_s * 1e3:.2f} ms; budget "
          f"{budget / 2**10:.0f} KiB -> params {tight.estimate.memory_bytes['params'] / full:.2f} "
          f"of the model's, recompute {len(tight.recompute)} layers")


def _smallest_plan_bytes(e: Exception) -> float:
    """The memory of the smallest plan, as autopar reports it for a budget nothing fits."""
    m = re.search(r"smallest plan needs ([\d.]+) (B|KiB|MiB|GiB)", str(e))
    assert m, f"the infeasible plan does not say what fits: {e}"
    return float(m.group(1)) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]


# ---- higher-order ops, in-place ops and the mask rules, on small modules ------------------

def _grads_through_graph(cap, model, inputs):
    """Run the captured graph with the model's parameters and return its loss and the
    parameters' gradients (by graph placeholder)."""
    state = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args = []
    for n in cap.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in cap.params:
            args.append(state[cap.params[n.name][0]])
        elif n.name in cap.buffers:
            args.append(buffers[cap.buffers[n.name]])
    args += list(inputs)
    out = cap.gm(*args)
    loss = out[0]
    model.zero_grad()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in state.items()}


class _NoGradScale(torch.nn.Module):
    """A weight read twice: once with grad disabled (nested: grad enabled again inside, and
    an autocast-off region), once normally; only the normal use has a gradient."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            gate = self.lin(x).sigmoid()
            with torch.enable_grad():
                inner = self.out(x).tanh()
        with torch.autocast("cpu", enabled=False):
            y = self.lin(x) * gate + inner
        return (y * y).sum()


def test_grad_mode_and_autocast_off_regions_are_inlined_with_their_semantics():
    from autopar.capture.hops import higher_order_ops
    torch.manual_seed(0)
    model, x = _NoGradScale(), torch.randn(4, 8)
    ep = torch.export.export(model, (x,), strict=False)
    assert {name for _, name in higher_order_ops(ep.graph_module)} == {
        "wrap_with_set_grad_enabled", "wrap_with_autocast"}
    cap = capture(model, (x,))
    ops = [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in ops if isinstance(t, torch._ops.HigherOrderOperator)]
    assert not list(cap.gm.named_children()), "the regions' bodies are left on the module"
    assert torch.ops.aten.detach.default in ops        # no gradient into the no-grad region
    loss, grads = _grads_through_graph(cap, model, (x,))
    ref_model = copy.deepcopy(model)
    ref = ref_model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for k, p in ref_model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[k], want, msg=lambda m: f"{k}: {m}")


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.lin(t), lambda t: -self.lin(t), (x,)).sum()


class _Autocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float().sum()


@pytest.mark.parametrize("module,match", [
    (_Branchy, r"(?s)higher-order op torch.ops.higher_order.cond \(node cond, module .*"
               r"Fix: .*torch.where"),
    (_Autocast, r"(?s)torch.autocast\('cpu', dtype=torch.bfloat16, enabled=True\).*"
                r"Fix: remove the autocast region"),
])
def test_other_higher_order_ops_are_named(module, match):
    with pytest.raises(CaptureError, match=match):
        capture(module(), (torch.randn(4, 8),))
    with pytest.raises(CaptureError, match=match):
        autopar.plan(module(), (torch.randn(4, 8),), cluster="cpu:2")


class _InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.a(x)
        h += self.b(x)              # a fresh result: made out-of-place
        v = h.view(4, 2, 4)
        v.mul_(2.0)                 # a view: stays in place
        return self.bn(h).sum()     # num_batches_tracked += 1: a buffer, stays in place


def test_inplace_ops_on_fresh_results_become_out_of_place():
    torch.manual_seed(0)
    model, x = _InPlace(), torch.randn(4, 8)
    cap = capture(copy.deepcopy(model), (x,))
    targets = [str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"]
    assert "aten.add.Tensor" in targets and "aten.add_.Tensor" in targets   # the buffer's
    assert "aten.mul_.Tensor" in targets
    loss, grads = _grads_through_graph(cap, copy.deepcopy(model), (x,))
    ref_model = copy.deepcopy(model)
    ref = ref_model(x)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    for k, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, msg=lambda m: f"{k}: {m}")


def test_mask_rules_match_one_device():
    from autopar.sharding.check import call_from_tensors, check_strategy
    from autopar.sharding.registry import axis_strategies, mesh_strategies
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, dtype=torch.float64, generator=g)
    b1, b2 = torch.rand(4, 1, 8, generator=g) > 0.5, torch.rand(4, 8, 8, generator=g) > 0.5
    ids = torch.randint(0, 9, (4, 8), generator=g)
    cases = [
        (aten.__and__.Tensor, (b1, b2), {}),
        (aten.__or__.Tensor, (b2, b1), {}),
        (aten.min.other, (x, torch.full_like(x, 0.3)), {}),
        (aten.max.other, (x, x.flip(0)), {}),
        (aten.diff.default, (x, 1, -1, x[:, :1].clone()), {}),
        (aten.diff.default, (ids, 1, -1, ids[:, :1] - 1), {}),
        (aten.new_ones.default, (x, []), {"dtype": torch.bool}),
        (aten.new_zeros.default, (x, [3, 2]), {}),
    ]
    for op, args, kw in cases:
        call, _ = call_from_tensors(op, args, kw)
        assert len(axis_strategies(call)) > 1, f"{op} offers only Replicate"
        for mesh in [(2,), (2, 2)]:
            for combo in mesh_strategies(call, mesh):
                check_strategy(op, args, kw, combo, mesh)


# ---- gloo ranks ----------------------------------------------------------------------------

def _pin_id(pins: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in sorted(pins.items())) or "free"


GLOO = [(name, pins) for name in NAMES if _reached(name, "gloo") for pins in MATRIX[name].gloo]
GLOO_IDS = [f"{name}-{_pin_id(pins)}" for name, pins in GLOO]


class _Launch:
    """One torchrun launch (2 gloo ranks) running every gloo case, started in the background
    when the module's first test runs (planning tests run meanwhile), read by each case."""

    def __init__(self, tmp, ids: set[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.out = tmp / "hf_gloo.json"
        cases = [{"id": i, "name": n, "pins": p} for i, (n, p) in zip(GLOO_IDS, GLOO) if i in ids]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.join(HERE, "hf_worker.py"), json.dumps(cases), str(self.out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_CASE_TIMEOUT": "180"}
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.done = None

    def result(self, case_id: str) -> dict:
        if self.done is None:
            _, err = self.proc.communicate(timeout=1200)
            results = json.loads(self.out.read_text()) if self.out.exists() else []
            noise = ("Warning", "warn(", "return func(")
            log = "\n".join(x for x in err.splitlines() if not any(w in x for w in noise))
            failed = "" if self.proc.returncode == 0 else f"torchrun failed ({self.proc.returncode}):\n{log[-6000:]}"
            self.done = ({r["case"]["id"]: r for r in results}, failed,
                         time.perf_counter() - self.t0)
        results, failed, _ = self.done
        r = results.get(case_id)
        assert r is not None, f"{case_id}: no result, the launch ended before it\n{failed}"
        return r


@pytest.fixture(scope="module", autouse=True)
def launch(request, tmp_path_factory):
    """Start the launch at once with the gloo cases of this module that are selected."""
    selected = {item.callspec.id for item in request.session.items
                if getattr(item, "originalname", "") == "test_gloo_equals_one_device"
                and item.module is request.module}
    run = _Launch(tmp_path_factory.mktemp("hf_gloo"), selected) if selected else None
    yield run
    if run is not None and run.proc.poll() is None:
        run.proc.kill()
        run.proc.communicate()


@pytest.mark.parametrize("name,pins", GLOO, ids=GLOO_IDS)
def test_gloo_equals_one_device(launch, name, pins):
    r = launch.result(f"{name}-{_pin_id(pins)}")
    f = _fails(name, "gloo")
    if f is not None:
        assert not r["ok"] and re.search(f.match, r["error"]), r.get("error")
        return
    assert r["ok"], f"{r['error']}\n{r.get('trace', '')}"
    assert r["mesh"] == [2]
    w = r["worst"]
    print(f"{name} {pins}: loss {w['loss']:.1e} grad {w['grad']:.1e} weight {w['weight']:.1e} "
          f"({r['seconds']:.1f}s)")
