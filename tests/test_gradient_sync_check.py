"""Issue 26: the free plan equals one device, the static gradient-sync check, and the
first-step check users can turn on.

- The free plan of a small model replicates everything; on 2 and 4 ranks its gradients
  must equal one device (they were 2x on Llama, BERT, ``nn.TransformerEncoder`` until
  ``insert_collectives`` stopped taking the graph's output for a metadata check).
- ``passes.check_grad_sync`` derives, from the rewritten program alone, whether each
  parameter's gradient is whole or partial on each mesh axis, and refuses a gradient sync
  that disagrees. With the fix reverted (the old ``_uses_partial``, planted here) building
  the module raises, naming the parameter and the axis.
- ``parallelize(..., check=True)`` computes the first step on one device too: with both the
  fix and the static check out of the way, it still catches the doubled gradients.

All on ranks simulated as threads (the same rewrite and runtime as under torchrun).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture import capture
from autopar.first_step import FirstStepMismatch
from autopar.ops.comm import ThreadWorld
from autopar.passes import insert_collectives as ic
from autopar.passes.check_grad_sync import GradSyncMismatch, check_grad_sync
from autopar.placement import Replicate
from autopar.runtime import program_passes
from autopar.runtime.thread_ranks import simulate
from autopar.verify import compare, parallel_run, reference_run

transformers = pytest.importorskip("transformers")
B, S, V = 4, 8, 64


class Encoder(nn.Module):
    """torch's own ``nn.TransformerEncoder`` with a token embedding and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, V)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)))


def _hf(cfg_cls, model_cls, **kw):
    cfg = cfg_cls(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32, **kw)
    for k, v in list(cfg.to_dict().items()):
        if "drop" in k and isinstance(v, float):
            setattr(cfg, k, 0.0)
    cfg.use_cache = False
    torch.manual_seed(0)
    m = model_cls._from_config(cfg, attn_implementation="eager")

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x).logits
    return Logits()


MODELS = {
    "llama": lambda: _hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, num_key_value_heads=2),
    "bert": lambda: _hf(transformers.BertConfig, transformers.BertForMaskedLM),
    "transformer-encoder": Encoder,
}


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_free_plan_equals_one_device(name, world):
    model, (x, y) = MODELS[name](), batch()
    plan = autopar.plan(model, (x,), lm_loss, target=y, cluster=f"cpu:{world}")
    cap = capture(model, (x,), lm_loss, y)
    ref = reference_run(model, (x,), y, lm_loss)
    runs = simulate(cap, plan, model, lambda pm, comm: parallel_run(pm, (x,), y))
    c = compare(ref, runs[0])
    assert c.ok, f"{name} free plan on {world} ranks ({plan.mesh_shape}): {c}"


def _old_uses_partial(node, a, cand, plan, calls):
    """``_uses_partial`` as e778ea8 left it: the graph's output taken for a metadata check."""
    ok = bool(node.users)
    for user in node.users:
        if user.name not in plan.nodes and not user.users:
            continue
        if user.name in cand:
            continue
        call = calls.get(user.name)
        if call is None:
            return False
        combo = ic._combo(plan, user.name, len(call.inputs), len(call.outputs))
        for k, t in enumerate(ic._tensor_arg_names(user)):
            if t == node.name and not (isinstance(combo[a].inputs[k], Replicate)
                                       and ic._grad_partial(combo, k)[a]):
                return False
    return ok


def test_static_check_catches_the_reverted_fix(monkeypatch):
    model, (x, y) = MODELS["llama"](), batch()
    plan = autopar.plan(model, (x,), lm_loss, target=y, cluster="cpu:2")
    cap = capture(model, (x,), lm_loss, y)
    monkeypatch.setattr(ic, "_uses_partial", _old_uses_partial)
    with pytest.raises(RuntimeError, match=r"(?s)gradient of parameter '.*' on mesh axis 0 "
                                           r"\(size 2\) is whole on every rank.*2x too large") as e:
        simulate(cap, plan, model, lambda pm, comm: None)
    assert isinstance(e.value.__cause__, GradSyncMismatch)     # raised on the simulated rank


def test_static_check_catches_a_missing_sync():
    """A data-parallel program whose replicated weights' gradients are partial sums: the
    check passes with the sync the rewrite asks for and fails without it."""
    model, (x, y) = MODELS["transformer-encoder"](), batch()
    plan = autopar.plan(model, (x,), lm_loss, target=y, cluster="cpu:2", data=2)
    cap = capture(model, (x,), lm_loss, y)
    attr_of = {ph: names[0] for ph, names in cap.params.items()} | dict(cap.buffers)
    rw = ic.insert_collectives(cap, plan, model, attr_of, "loss", defer_loss=True)
    assert rw.grad_sync and all(axes == (0,) for axes in rw.grad_sync.values())
    check_grad_sync(rw.gm, rw.grad_sync, cap, plan, attr_of)
    dropped = next(iter(rw.grad_sync))
    with pytest.raises(GradSyncMismatch, match=rf"'{dropped}'.*partial sums on each rank.*not summed "
                                               r"over axis 0"):
        check_grad_sync(rw.gm, {a: v for a, v in rw.grad_sync.items() if a != dropped},
                        cap, plan, attr_of)


def _run_checked(model, x, y, world=2, **kw):
    copies = [copy.deepcopy(model) for _ in range(world)]

    def body(comm):
        pm = autopar.parallelize(copies[comm.rank], (x,), lm_loss, target=y, comm=comm,
                                 check=True, **kw)
        armed = pm.first_step_check is not None
        losses = [float(pm.train_step(x, target=y)) for _ in range(2)]
        return losses, (armed, pm.first_step_check)
    return ThreadWorld((world,)).run(body)


def test_check_true_passes_a_right_plan():
    model, (x, y) = MODELS["transformer-encoder"](), batch()
    for losses, step in _run_checked(model, x, y, data=2):
        assert step == (True, None)      # armed by parallelize; later steps run unchecked
        assert len(losses) == 2


def test_check_true_catches_doubled_gradients(monkeypatch):
    """The fix and the static check both reverted: the first step raises, naming a
    parameter, its error and the plan."""
    model, (x, y) = MODELS["llama"](), batch()
    monkeypatch.setattr(ic, "_uses_partial", _old_uses_partial)
    monkeypatch.setattr(program_passes, "check_grad_sync", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match=r"(?s)differs from one device \(autopar plan: mesh "
                                           r"\(2,\).*worst gradient: '.*', relative error 1\.0") as e:
        _run_checked(model, x, y)
    assert isinstance(e.value.__cause__, FirstStepMismatch)


def test_check_from_the_environment(monkeypatch):
    from autopar.first_step import wanted
    monkeypatch.setenv("AUTOPAR_CHECK", "1")
    assert wanted(None) and not wanted(False)
    monkeypatch.setenv("AUTOPAR_CHECK", "0")
    assert not wanted(None) and wanted(True)
    with pytest.raises(autopar.errors.ArgumentError, match="check= takes True or False"):
        wanted("yes")
