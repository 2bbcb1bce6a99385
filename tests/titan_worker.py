"""Run by tests/test_titan.py under torchrun: torchtitan's Llama 3 or Qwen3 (a case's
``"model"``, Llama 3 by default: tests/titan_llama.py) parallelized with ``compile=True`` on real gloo ranks, 3 AdamW steps compared with one
device (loss, every gradient, the weights after the steps: tests/equivalence.py).

``"rank_branch": true`` puts back what issue 43 hung on: ``ops.collectives.to_partial``
choosing by a Python branch on the rank, so that rank 0's traced graph reads the tensor and
the others' do not. Inductor then orders the two ranks' collectives differently; the case
returns the ``CollectiveOrderError`` that refuses the program before it runs (``refused``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
import titan_llama  # noqa: E402
from autopar.ops import collectives  # noqa: E402
from autopar.ops.comm import current_comm  # noqa: E402
from autopar.runtime.collective_order import CollectiveOrderError  # noqa: E402
from equivalence import compare, measure, parallel_run, reference_run  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def _rank_branch(ctx, x, axis):
    """``to_partial``'s forward before the fix: a Python branch on the rank."""
    return x.clone() if current_comm().coord[axis] == 0 else torch.zeros_like(x)


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = titan_llama.build(model=case.get("model", "llama3"))
    torch._dynamo.reset()
    pm = autopar.parallelize(model, inputs, loss_fn, target=target, optimizer="adamw",
                             compile=case.get("compile", True), **case["pins"])
    if case.get("rank_branch"):
        fixed = collectives._ToPartial.forward
        collectives._ToPartial.forward = staticmethod(_rank_branch)
        try:
            pm.train_step(*inputs, target=target)
        except CollectiveOrderError as e:
            refused = str(e)
        else:
            refused = None
        finally:
            collectives._ToPartial.forward = fixed
            torch._dynamo.reset()
        on = [None] * dist.get_world_size()
        dist.all_gather_object(on, refused is not None)
        return {"refused": refused, "refused_on": on}
    ref = reference_run(model, inputs, target, loss_fn, optimizer="adamw")
    got = parallel_run(pm, inputs, target, optimizer="adamw")
    worst = compare(ref, got, f"{case} torchtitan {case.get('model', 'llama3')}")
    c = measure(ref, got)       # which parameters are worst (compare gives the errors)
    return {"worst": worst, "worst_of": {"grad": c.grad_worst, "weight": c.weight_worst},
            "report": pm.compile_report(), "options": pm.plan.options.pinned(),
            "local_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "placements": {a: str(pm.plan.nodes[p].outputs[0]) for a, p in pm.plan.params.items()}}


if __name__ == "__main__":
    run_cases(run_case)
