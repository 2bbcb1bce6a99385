"""Run by tests/test_accumulate.py under torchrun (2 gloo ranks, one launch): gradient
accumulation without a pipeline (``accumulate=k`` / ``micro_batch_size=``, or chosen by the
free search under a memory budget), each case against the model on one device on the whole
batch (``tests/equivalence.py``: the loss of 3 SGD-momentum steps, every gradient, the
weights after the steps); bf16 against one-device autocast.

The model and losses are ``tests/loss_worker.py``'s: a tiny token classifier, losses whose
normalisation is not "mean of equal counts" (sum, padded targets, label smoothing, class
weights, a target shifted inside the loss).

Each case also watches the step: every bucket of the data-parallel gradient sync must start
during or after the last micro-batch (never once per micro-batch), and a sharded plan must
hold less than the whole model on the rank. Rank 0 writes one JSON result per case.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from loss_worker import example  # noqa: E402
from precision_worker import loss_dist, reference, weight_dist  # noqa: E402
from worker_loop import on_rank0, run_cases  # noqa: E402

STEPS = 3


def watch_sync(pm) -> dict:
    """Count the micro-batches begun and, for each gradient-sync bucket launched, how many
    had begun when it launched. Buckets of one gradient each: each launches as soon as its
    gradient is final (the tiny model's would otherwise fill one bucket, launched at the end)."""
    log = {"microbatches": 0, "launched_at": []}
    runner, sync = pm.runner, pm._grad_sync
    sync.bucket_bytes = 1
    run_one, start = runner._loss, sync._start

    def counted_loss(*a, **kw):
        log["microbatches"] += 1
        return run_one(*a, **kw)

    def logged_start(*a, **kw):
        log["launched_at"].append(log["microbatches"])
        return start(*a, **kw)
    runner._loss, sync._start = counted_loss, logged_start
    return log


def local_fraction(pm, model) -> float:
    """Bytes of parameters this rank holds over the whole model's."""
    mine = sum(p.numel() * p.element_size() for p in pm.parameters())
    return mine / sum(p.numel() * p.element_size() for p in model.parameters())


def run_case(case: dict) -> dict:
    model, inputs, target, loss_fn = example(case["loss"])
    if case.get("plan_file"):
        # a saved accumulating plan: parallelize(plan=path) captures at its micro-batch
        planned = on_rank0(lambda: autopar.plan(model, inputs, loss_fn, target=target,
                                                cluster="cpu:2", **case["pins"]))
        with tempfile.TemporaryDirectory(prefix="autopar-accumulate-") as tmp:
            path = os.path.join(tmp, "plan.json")
            planned.save(path)
            pm = autopar.parallelize(model, inputs, loss_fn, target=target, plan=path)
    else:
        pm = autopar.parallelize(model, inputs, loss_fn, target=target,
                                 memory_budget=case.get("budget"), batch=case.get("batch", "global"),
                                 **case["pins"])
    k = pm.plan.accumulate
    log = watch_sync(pm)
    info = {"mesh": list(pm.plan.mesh_shape), "accumulate": k, "pins": pm.plan.pins,
            "local_fraction": local_fraction(pm, model),
            "synced": len(pm._grad_sync.params)}
    if case.get("precision") == "bf16":
        w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(pm.train_step(*inputs, target=target).item())
            pm.step(opt)
        w = pm.full_state_dict()
        w = {n: w[n] for n in w0}
        ref_losses, ref_w, _ = reference(model, inputs, target, loss_fn, "bf16", 1.0)
        fp_losses, fp_w, _ = reference(model, inputs, target, loss_fn, "fp32", 1.0)
        info.update(loss_err=loss_dist(losses, ref_losses), weight_err=weight_dist(w, ref_w, w0),
                    fp32_loss_dist=loss_dist(losses, fp_losses))
    else:
        ref = reference_run(model, inputs, target, loss_fn, steps=STEPS)
        # batch="per_rank": this data rank's slice of the global batch
        mine = tuple(pm.rank_data.slice(t) for t in inputs), pm.rank_data.slice(target)
        got = parallel_run(pm, *mine, steps=STEPS)
        info["rows"] = int(mine[1].shape[0])
        info["worst"] = compare(ref, got, f"{case['id']} rank {dist.get_rank()}")
    info["microbatches"], info["launched_at"] = log["microbatches"], log["launched_at"]
    return info


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
