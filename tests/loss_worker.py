"""Run by tests/test_losses.py under torchrun: losses whose normalisation is not "mean of equal
counts" (sum, padded targets with ``ignore_index``, label smoothing, class weights) under data,
ZeRO-3, tensor, data x tensor and pipeline parallelism (every schedule, several
micro-batches), each compared with the model on one device: the loss of 3 SGD-momentum
steps, every gradient by name, the weights after the steps (``tests/equivalence.py``).

The model is a tiny token classifier (embedding, two GELU layers, a head over the
vocabulary), the target a (batch, seq) tensor of token ids. Padded targets end in a run of
``-100`` of a different length for every sample, so the count of tokens differs between
micro-batches and between data-parallel ranks. Rank 0 writes one JSON result per case.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from capture_reuse import same_model  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from worker_loop import run_cases  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQ = 32, 16, 8, 6


class TokenClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, 2 * HIDDEN)
        self.head = nn.Linear(2 * HIDDEN, VOCAB)
        # class weights of the weighted loss: a buffer, so the captured loss reads it
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, VOCAB))

    def forward(self, ids):
        h = F.gelu(self.fc1(self.emb(ids)))
        return self.head(F.gelu(self.fc2(h)))


def make_loss(kind: str, model: TokenClassifier):
    def loss_fn(logits, target):
        x, t = logits.reshape(-1, VOCAB), target.reshape(-1)
        if kind == "mean":
            return F.cross_entropy(x, t)
        if kind == "sum":
            return F.cross_entropy(x, t, reduction="sum")
        if kind == "ignore":
            return F.cross_entropy(x, t, ignore_index=-100)
        if kind == "smoothing":
            return F.cross_entropy(x, t, label_smoothing=0.1)
        if kind == "weight":
            return F.cross_entropy(x, t, weight=model.class_weight)
        if kind == "shifted":       # the target shifted inside the loss, as Hugging Face models do
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target[:, 1:].reshape(-1))
        raise ValueError(kind)
    return loss_fn


def example(kind: str, seed: int = 0):
    """(model, inputs, target, loss_fn): every kind but mean and sum pads its targets."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TokenClassifier()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        target = torch.randint(0, VOCAB, (BATCH, SEQ))
    if kind not in ("mean", "sum"):
        # sample i keeps its first keep[i] tokens: counts differ per micro-batch and data rank
        keep = torch.tensor([6, 1, 5, 2, 6, 3, 0, 4])[:BATCH]
        target = torch.where(torch.arange(SEQ)[None, :] < keep[:, None], target, -100)
    return model, (ids,), target, make_loss(kind, model)


def gpt_example():
    """The small GPT (tied embedding and head, on two pipeline stages) with padded targets."""
    from examples.models import EXAMPLES
    ex = EXAMPLES["gpt"]()
    b, t = ex.target.shape
    keep = torch.tensor([16, 3, 11, 0, 7, 16, 1, 9])[:b] * t // 16
    target = torch.where(torch.arange(t)[None, :] < keep[:, None], ex.target, -100)
    return ex.model, ex.inputs, target, ex.loss_fn


def run_case(case: dict) -> dict:
    # one capture per model and loss in this spawn (tests/capture_reuse.py)
    with same_model(f"{case.get('model', 'classifier')}-{case['loss']}"):
        return _run_case(case)


def _run_case(case: dict) -> dict:
    if case.get("model") == "gpt":
        model, inputs, target, loss_fn = gpt_example()
    else:
        model, inputs, target, loss_fn = example(case["loss"])
    pm = autopar.parallelize(model, inputs, loss_fn, target=target, **case["pins"])
    ref = reference_run(model, inputs, target, loss_fn)
    got = parallel_run(pm, inputs, target)
    info = {"mesh": list(pm.plan.mesh_shape), "m": pm.plan.n_microbatches,
            "schedule": pm.plan.schedule}
    info["worst"] = compare(ref, got, f"{case['id']} rank {dist.get_rank()}")
    return info


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
