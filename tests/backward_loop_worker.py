"""Run by tests/test_backward_loop.py under torchrun: the loop people already have,
``loss_fn(pm(x), y).backward(); opt.step()`` (``autopar.runtime.backward_loop``), on real
gloo ranks, compared with the model on one device: the loss of 3 AdamW steps, every
gradient by name, the weights after the steps (``tests/equivalence.py``).

A case names a model (the examples' GPT, or a transformers architecture of
``examples/zoo.py``), the pins (none: the free plan) and ``k``: with k > 1 the plan is made
for a k-th of the batch and each step accumulates k backward passes, all but the last
under ``pm.no_sync()``; ``in_graph``: the loss is ``pm(x, target=y)``, the plan's own;
``per_rank``: ``batch="per_rank"``, each rank passing its slice. A case with ``refused`` expects the backward to raise an
``ArgumentError`` whose message holds that text, on every rank, and no rank to hang.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.verify import backward_run  # noqa: E402
from equivalence import compare, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from examples.zoo import HF_BUILDERS  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def example(name: str):
    """(model, inputs, target, loss_fn) of a case's model."""
    if name in EXAMPLES:
        ex = EXAMPLES[name]()
        return ex.model, ex.inputs, ex.target, ex.loss_fn
    b = HF_BUILDERS[name]()
    if b.loss_fn is None:       # the model's own loss: the labels are its second input
        return b.model, b.inputs, None, None
    return b.model, b.inputs, b.target, b.loss_fn


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = example(case["model"])
    k = case.get("k", 1)
    first = tuple(x.tensor_split(k)[0] for x in inputs)      # the plan's (micro-)batch
    first_t = target.tensor_split(k)[0] if target is not None else None
    per_rank = case.get("per_rank", False)
    pm = autopar.parallelize(model, first, loss_fn, target=first_t, **case["pins"],
                             **({"batch": "per_rank"} if per_rank else {}))
    # batch="per_rank": each data rank passes its slice of the global batch
    mine = (lambda t: t.tensor_split(pm.data_world)[pm.data_rank]) if per_rank else None
    info = {"mesh": list(pm.plan.mesh_shape), "axes": list(pm.plan.mesh_axes)}
    if "refused" in case:
        try:
            backward_run(pm, first, first_t, loss_fn, steps=1, rank_slice=mine)
        except autopar.ArgumentError as e:
            assert case["refused"] in str(e), f"the error does not say {case['refused']!r}: {e}"
            return {**info, "error": str(e)}
        raise AssertionError("loss.backward() through pm(x) trained a plan that cannot run it")
    if case.get("twice"):
        return {**info, "error": _backward_twice(pm, first, first_t, loss_fn)}
    opt = case.get("optimizer", "adamw")
    ref = reference_run(model, inputs, target, loss_fn, optimizer=opt)
    got = backward_run(pm, inputs, target, loss_fn, optimizer=opt, micro_batches=k,
                       in_graph=case.get("in_graph", False), rank_slice=mine)
    info["worst"] = compare(ref, got, f"{case['id']} rank {dist.get_rank()}")
    info["local_param_bytes"] = sum(p.numel() * p.element_size() for p in pm.parameters())
    info["model_param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return info


def _backward_twice(pm, inputs, target, loss_fn) -> str:
    """forward, forward, backward, backward: the second backward would add unsynced
    gradients to synced ones, so it must raise."""
    l1 = loss_fn(pm(*inputs), target)
    l2 = loss_fn(pm(*inputs), target)
    l1.backward()
    try:
        l2.backward()
    except autopar.ArgumentError as e:
        return str(e)
    raise AssertionError("a second backward after the step's sync ran without an error")


if __name__ == "__main__":
    run_cases(run_case)
