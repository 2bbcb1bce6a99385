"""The example models run, train, export (non-strict), and the export equals eager."""

import copy

import pytest
import torch
import torch.nn as nn

from examples.models import EXAMPLES, GPT_PRESETS, Example, gpt_config, gpt_factory


class WithLoss(nn.Module):
    """model + loss_fn as one module, as autopar captures them: forward(*inputs, target)."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *args):
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


@pytest.fixture(params=sorted(EXAMPLES))
def name(request) -> str:
    return request.param


@pytest.fixture
def example(name) -> Example:
    return EXAMPLES[name](batch=8, seed=0)


def test_forward_backward(example):
    loss = example.loss()
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in example.model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name


def test_deterministic_from_seed(name, example):
    again = EXAMPLES[name](batch=8, seed=0)
    other = EXAMPLES[name](batch=8, seed=1)
    torch.testing.assert_close(example.loss(), again.loss(), rtol=0, atol=0)
    assert not torch.equal(example.loss(), other.loss())


def test_default_dims_divisible_by_4(example):
    for name, p in example.model.named_parameters():
        for d in p.shape:
            assert d % 4 == 0 or d in (1, 3), f"{name} {tuple(p.shape)}"
    for x in (*example.inputs, example.target):
        assert x.shape[0] == 8


def test_export_matches_eager(example):
    eager = copy.deepcopy(example.model)  # BatchNorm updates running stats: fresh copies
    ref = example.loss_fn(eager(*example.inputs), example.target)

    ep = torch.export.export(copy.deepcopy(example.model), example.inputs, strict=False)
    out = ep.module()(*example.inputs)
    torch.testing.assert_close(example.loss_fn(out, example.target), ref)

    # The loss captured in the same graph, as autopar does, and its gradients.
    ep = torch.export.export(WithLoss(copy.deepcopy(example.model), example.loss_fn),
                             (*example.inputs, example.target), strict=False)
    gm = ep.module()
    loss = gm(*example.inputs, example.target)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in gm.named_parameters()}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_export_graph_has_shapes(example):
    ep = torch.export.export(WithLoss(example.model, example.loss_fn),
                             (*example.inputs, example.target), strict=False)
    for node in ep.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            assert all(isinstance(d, int) for d in node.meta["val"].shape), node


def test_gpt_weights_tied():
    model = gpt_factory().model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt_on_meta_device_exports():
    with torch.device("meta"):
        ex = gpt_factory(batch=2, n_layer=2, n_embd=64, n_head=4)
    assert all(p.is_meta for p in ex.model.parameters())
    ep = torch.export.export(WithLoss(ex.model, ex.loss_fn), (*ex.inputs, ex.target),
                             strict=False)
    out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].shape == ()


def test_gpt_presets():
    assert set(GPT_PRESETS) >= {"gpt2-124m", "gpt-1.3b", "gpt-24layer", "gpt-175b"}
    c = gpt_config("gpt-175b")
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.vocab_size) == (96, 12288, 96, 2048, 50257)
    c = gpt_config("gpt-24layer")
    assert (c.n_layer, c.n_embd) == (24, 1024)
    with torch.device("meta"):
        m = gpt_factory(batch=1, config="gpt2-124m").model
    n = sum(p.numel() for p in m.parameters())
    assert 120e6 < n < 130e6, n
    with pytest.raises(KeyError):
        gpt_config("gpt-7t")
    with pytest.raises(TypeError):
        gpt_factory(n_layers=3)
