"""A target that is one of the inputs (a language model's tokens: ``hf_models.build``
passes the same tensor as input and target): the captured graph reads each placeholder as
it would read two distinct tensors (``capture.export._own_target``). Exported as one
tensor passed twice, every read landed on the target's placeholder, the whole model became
the loss's tail (``analysis.stages``) and the full-batch graph had no pipeline cut: the
free pipeline search of Mixtral 8x7B found nothing on any stage mesh."""
from __future__ import annotations

import torch

from autopar.analysis.stages import chain, loss_tail
from autopar.capture import capture
from examples.models import gpt_factory

GPT = dict(batch=4, n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=128)


def _graph(cap):
    return [(n.name, n.op, str(n.target), str(n.args)) for n in cap.gm.graph.nodes]


def test_target_aliasing_an_input_is_captured_as_a_distinct_one():
    with torch.device("meta"):
        ex = gpt_factory(**GPT)
    tokens = ex.inputs[0]
    assert tokens.shape == ex.target.shape and tokens.dtype == ex.target.dtype
    shared = capture(ex.model, (tokens,), ex.loss_fn, tokens, stamp=False)
    apart = capture(ex.model, (tokens,), ex.loss_fn, tokens.clone(), stamp=False)
    assert _graph(shared) == _graph(apart)
    model_in = shared.node(shared.inputs[0])
    assert model_in.users, "the model's input placeholder is read by nothing"
    # the loss tail is the loss alone, not the model: every layer is a chain node to cut at
    tail = loss_tail(shared)
    assert len(tail) < 10 and len(chain(shared)) > len(tail)
    assert chain(shared) == chain(apart)
