"""A deep model exported shallow with its blocks stamped (autopar/capture/stamp.py) captures
the very graph torch.export gives for the whole model: node by node (names, ops, targets,
arguments, values' shapes / dtypes / strides, module stacks), the Captured fields, the
fingerprint, the generated code and the graph's namespace; at full batch and through
``capture_microbatch``. A model whose blocks differ by their index falls back to the whole
export, and equals it too.
"""
from __future__ import annotations


import importlib
import logging
import os
import sys
from dataclasses import fields

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.capture import capture, fingerprint  # noqa: E402
from autopar.solver.pipeline_search import capture_microbatch  # noqa: E402

export_mod = importlib.import_module("autopar.capture.export")   # (autopar.capture: a function)
stamp = importlib.import_module("autopar.capture.stamp")


def _val(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device.type,
                v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_val(x) for x in v)
    return v


def _arg(a):
    if isinstance(a, torch.fx.Node):
        return ("node", a.name)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__ if not isinstance(a, tuple) else "tuple", [_arg(x) for x in a])
    if isinstance(a, dict):
        return {k: _arg(v) for k, v in a.items()}
    return (type(a).__name__, a)


def assert_same_capture(got, want) -> None:
    """``got`` is ``want`` node by node, field by field."""
    gn, wn = list(got.gm.graph.nodes), list(want.gm.graph.nodes)
    assert [n.name for n in gn] == [n.name for n in wn]
    for a, b in zip(gn, wn):
        assert (a.op, a.target) == (b.op, b.target), a.name
        assert _arg(a.args) == _arg(b.args) and _arg(a.kwargs) == _arg(b.kwargs), a.name
        assert set(a.meta) == set(b.meta), a.name
        for key in b.meta:
            if key == "val":
                assert _val(a.meta[key]) == _val(b.meta[key]), a.name
            else:
                assert a.meta[key] == b.meta[key], (a.name, key)
    for f in fields(want):
        if f.name not in ("gm", "microbatch_loss"):
            assert getattr(got, f.name) == getattr(want, f.name), f.name
    if want.microbatch_loss is not None:
        a, b = got.microbatch_loss, want.microbatch_loss
        assert (a.m, a.terms, a.error, a.graph_inputs) == (b.m, b.terms, b.error, b.graph_inputs)
        assert (a.graph is None) == (b.graph is None)
        assert a.graph is None or a.graph.code == b.graph.code
    assert fingerprint(got) == fingerprint(want)
    assert got.gm.code == want.gm.code
    ns_a, ns_b = got.gm.graph._graph_namespace, want.gm.graph._graph_namespace
    assert ns_a._used_names == ns_b._used_names
    assert ns_a._base_count == ns_b._base_count


@pytest.fixture
def stamped(monkeypatch):
    """Records how many blocks each capture stamped (None: exported whole)."""
    seen = []

    def record(*a, **k):
        prog = stamp.export_stamped(*a, **k)
        seen.append(prog.blocks if prog is not None else None)
        return prog
    monkeypatch.setattr(export_mod, "export_stamped", record)
    return seen


def _gpt(layers=8):
    from examples.models import gpt_factory
    return gpt_factory(batch=4, n_layer=layers)


def _llama(layers=8):
    from examples.llama import llama_factory
    from examples.llama import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, max_seq_len=16, n_layer=layers, n_head=4, n_kv_head=2,
                      dim=32, hidden_dim=48)
    return llama_factory(batch=4, config=cfg)


def _megatron(layers=8):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    from published_runs import MegatronGPT, _example
    model = MegatronGPT(layers=layers, h=32, heads=4, vocab=64, seq=16)
    return _example(model, batch=4, seq=16, vocab=64)


def _hf_llama(layers=8):
    transformers = pytest.importorskip("transformers")
    from examples.base import Example
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids, use_cache=False).logits

    def loss(out, tgt):
        return nn.functional.cross_entropy(out.reshape(-1, 64), tgt.reshape(-1))
    return Example(model=Logits(), inputs=(torch.randint(0, 64, (4, 16)),), loss_fn=loss,
                   target=torch.randint(0, 64, (4, 16)))


MODELS = {"gpt": _gpt, "llama_gqa": _llama, "megatron": _megatron, "hf_llama": _hf_llama}
# compared at the full batch, through capture_microbatch (a pipeline's and accumulation's
# graph, captured at the micro-batch, its loss rewritten), or both (the time budget)
FULL = ("gpt", "megatron")
MICRO = ("gpt", "llama_gqa", "hf_llama")


def _whole(fn, *args):
    """``fn(*args)`` with every capture exported whole."""
    keep = export_mod.export_stamped
    export_mod.export_stamped = lambda *a, **k: None
    try:
        return fn(*args)
    finally:
        export_mod.export_stamped = keep


@pytest.mark.parametrize("name", list(MODELS))
def test_stamped_capture_is_the_whole_export(name, stamped):
    ex = MODELS[name]()
    n_blocks = len(stamp.find_container(export_mod._WithLoss(ex.model, None, 1))[1])
    if name in FULL:
        got = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
        assert stamped[-1] == n_blocks - stamp.SHALLOW, "the capture was not stamped"
        assert_same_capture(got, _whole(capture, ex.model, ex.inputs, ex.loss_fn, ex.target))
    if name in MICRO:
        args = (ex.model, ex.inputs, ex.loss_fn, ex.target, 2)
        got = capture_microbatch(*args)
        assert stamped[-1] == n_blocks - stamp.SHALLOW, "the capture was not stamped"
        assert_same_capture(got, _whole(capture_microbatch, *args))


def _scaled(y, i):
    return y * 2 if i % 2 else torch.relu(y)


class _Block(nn.Module):
    def __init__(self, i, width=16):
        super().__init__()
        self.index = i
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return _scaled(self.fc(x), self.index)    # its own index decides (as a call argument)


class _ReadsIndex(_Block):
    def forward(self, x):
        return self.fc(x) * (self.index + 1)       # reads its index


class _Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _Counts(_Net):
    def forward(self, x):          # reads the container's length (out of the forward's
        for b in self.blocks:      # source): the shallow copy would answer 4
            x = b(x)
        return self.head(x) / self.depth()

    def depth(self):
        return len(self.blocks)


class _Enumerates(_Net):
    def forward(self, x):          # the loop tells position 6 apart
        for i, b in enumerate(self.blocks):
            x = b(x) if i != 6 else torch.tanh(b(x))
        return self.head(x)


@pytest.mark.parametrize("model", [
    _Net([_Block(i) for i in range(9)]),                          # seen on the shallow graph
    _Net([_ReadsIndex(i) for i in range(9)]),                      # seen in the source
    _Net([nn.Sequential(nn.Linear(16, 16)) if i != 5 else         # one block of other shape
          nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)) for i in range(9)]),
    _Counts([nn.Linear(16, 16) for _ in range(9)]),               # len() of the container
    _Enumerates([nn.Linear(16, 16) for _ in range(9)]),           # enumerate(): not a plain loop
], ids=["index-graph", "index-read", "other-shape", "len", "enumerate"])
def test_blocks_that_differ_fall_back(model, stamped):
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    loss = nn.functional.mse_loss
    got = capture(model, (x,), loss, y)
    assert stamped == [None]
    assert_same_capture(got, capture(model, (x,), loss, y, stamp=False))


def test_plain_blocks_stamp(stamped):
    """The small model of the fallback cases stamps when its blocks are alike (so those
    cases fall back for the reason each names)."""
    model = _Net([nn.Linear(16, 16) for _ in range(9)])
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    got = capture(model, (x,), nn.functional.mse_loss, y)
    assert stamped == [9 - stamp.SHALLOW], "the capture was not stamped"
    assert stamp.find_container(export_mod._WithLoss(model, None, 1)) is not None
    assert_same_capture(got, capture(model, (x,), nn.functional.mse_loss, y, stamp=False))


def test_a_stamping_failure_is_said_at_warning_level(stamped, monkeypatch, caplog):
    """Where the blocks qualify but stamping fails (here: planted), the model is exported
    whole, the same graph, and a warning says why and that the capture is slower."""
    model = _Net([nn.Linear(16, 16) for _ in range(9)])
    x, y = torch.randn(4, 16), torch.randn(4, 4)

    def broken(self, root):
        raise KeyError("planted: torch.fx renamed its namespace")
    monkeypatch.setattr(stamp._Stamper, "run", broken)
    with caplog.at_level(logging.WARNING, logger="autopar.capture.stamp"):
        got = capture(model, (x,), nn.functional.mse_loss, y)
    assert stamped == [None]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("exporting _Net whole (slower" in w and "planted" in w for w in warned), warned
    assert_same_capture(got, capture(model, (x,), nn.functional.mse_loss, y, stamp=False))


def test_stamped_graph_trains_like_one_device(stamped):
    """The runtime runs the stamped graph: an 8-layer GPT captured with 4 blocks stamped,
    planned tensor 2, trains 3 SGD steps on 2 ranks (simulated as threads, as
    tests/test_equivalence.py does) equal to one device, parameter by parameter, each rank
    holding fewer parameter bytes than the whole model."""
    from autopar.api import plan_captured
    from autopar.cost_models.hardware import parse_cluster
    from autopar.runtime.thread_ranks import simulate
    from equivalence import compare, parallel_run, reference_run
    ex = _gpt(8)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    assert stamped == [8 - stamp.SHALLOW], "the capture was not stamped"
    plan = plan_captured(cap, parse_cluster("cpu:2"), 2, pins={"tensor": 2})
    full_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())

    def run(pm, comm):
        return (parallel_run(pm, ex.inputs, ex.target),
                sum(p.numel() * p.element_size() for p in pm.parameters()))
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for rank, (got, local_bytes) in enumerate(simulate(cap, plan, ex.model, run)):
        compare(ref, got, f"stamped gpt, tensor 2, rank {rank}")
        assert local_bytes < full_bytes
