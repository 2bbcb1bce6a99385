"""Run by tests/test_rank_data.py under torchrun: ``batch="per_rank"``. Each rank passes its
own slice, drawn by a ``DistributedSampler(num_replicas=pm.data_world, rank=pm.data_rank)``
(interleaved indices, so the concatenated batch is not the example batch in its order);
the run must equal the model on one device on the concatenation of the slices in data-rank
order: the outputs of ``pm(slice)`` (this rank's rows of them), the loss of 3 SGD-momentum steps, every gradient, the
weights after the steps. A slice of the wrong size is refused before any collective.

The model is loss_worker's token classifier with a mean or a padded (``ignore_index``)
cross entropy: the padded one has a different token count on every data rank, so a
per-slice mean would be wrong. Rank 0 writes one JSON result per case.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from loss_worker import example  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def slices(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Data rank r's slice: the rows a DistributedSampler without shuffling gives rank r."""
    return [t[list(DistributedSampler(range(t.shape[0]), num_replicas=world, rank=r,
                                      shuffle=False))] for r in range(world)]


def run_case(case: dict) -> dict:
    model, (ids,), target, loss_fn = example(case["loss"])
    pm = autopar.parallelize(model, (ids,), loss_fn, target=target, batch="per_rank", **case["pins"])
    w, r = pm.data_world, pm.data_rank
    if w != case["data_world"]:
        raise AssertionError(f"data_world {w}, expected {case['data_world']} (mesh "
                             f"{pm.plan.mesh_shape} {pm.plan.mesh_axes})")
    ids_s, target_s = slices(ids, w), slices(target, w)
    whole_ids, whole_target = torch.cat(ids_s), torch.cat(target_s)
    if w > 1:
        assert not torch.equal(whole_ids, ids), "the sampler's order should differ from the batch's"
        try:
            pm.train_step(ids, target=target)       # the global batch: refused on every rank
        except ValueError as e:
            assert "per_rank" in str(e), e
        else:
            raise AssertionError("a slice of the wrong size was accepted")
    # forward: every rank gets its rows of the output of the concatenated batch (DDP's form)
    out = pm(ids_s[r])
    want = model(whole_ids).tensor_split(w)[r]
    fwd_err = float((out - want).abs().max() / want.abs().max())
    assert fwd_err < 1e-5, f"forward differs from one device: {fwd_err:.2e}"
    ref = reference_run(model, (whole_ids,), whole_target, loss_fn)
    got = parallel_run(pm, (ids_s[r],), target_s[r])
    info = {"mesh": list(pm.plan.mesh_shape), "axes": list(pm.plan.mesh_axes),
            "data_world": w, "forward": fwd_err}
    info["worst"] = compare(ref, got, f"{case['id']} rank {dist.get_rank()}")
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (list(pm.comm.coord), r))
    info["data_ranks"] = ranks
    return info


if __name__ == "__main__":
    run_cases(run_case)
