"""Run by tests/test_gloo.py under torchrun: real gloo ranks, the public API.

Each case builds an example model, calls ``autopar.parallelize`` (which plans on rank 0 and
shares the plan) or loads a saved plan, trains 3 steps, and compares loss, every gradient
at every step and the weights with the same model trained on one device in this process.
Rank 0 writes one JSON line per case: the worst errors, or the error message.

A case with ``"shard": true`` lets the solver choose under a memory budget replication does
not fit (``equivalence.sharding_budget``) and checks that every rank holds fewer parameter
bytes than the model. A ``"verify": spec`` case runs ``autopar verify``'s own rank check
(``autopar.verify_worker.check_rank``) and returns its Check: with a ``setup`` that plants a
fault, the check must fail.
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.verify_worker import check_rank  # noqa: E402
from capture_reuse import same_model  # noqa: E402
from equivalence import compare, parallel_run, reference_run, sharding_budget  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from autopar.plan import PlanError  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def run_case(case: dict) -> dict:
    # one capture per model per spawn (capture_reuse): a verify case's factory names its model
    name = case.get("model") or json.dumps([case["verify"]["factory"], case["verify"]["factory_args"]])
    with same_model(name):
        return _run_case(case)


def _run_case(case: dict) -> dict:
    if "verify" in case:
        res = check_rank(case["verify"])
        return {"mesh": res["mesh_shape"], "check": res["check"], "timing": res.get("timing")}
    ex = EXAMPLES[case["model"]]()
    plan = case.get("plan")
    if plan == "saved":
        path = case["path"]
        if dist.get_rank() == 0:
            autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                         cluster=f"cpu:{dist.get_world_size()}", **case["pins"]).save(path)
        dist.barrier()
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=path)
    elif plan == "per-rank":
        # each rank its own plan (a user's mistake): refused on every rank, naming them
        mine = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                            cluster=f"cpu:{dist.get_world_size()}", **case["pins_by_rank"][dist.get_rank()])
        try:
            autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=mine)
        except PlanError as e:
            return {"refused": str(e)}
        return {"refused": None}
    elif case.get("shard"):
        world = dist.get_world_size()
        replicated = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                  cluster=f"cpu:{world}", data=world)
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                 memory_budget=sharding_budget(replicated), mesh_shape=(world,),
                                 recompute="none", **case["pins"])
        local = sum(p.numel() * p.element_size() for p in pm.parameters())
        full = sum(p.numel() * p.element_size() for p in ex.model.parameters())
        assert local < full, f"the solver's plan under a tight budget: {local} of {full} B on this rank"
    else:
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **case["pins"])
    opt = case.get("optimizer", "sgd")
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn, optimizer=opt)
    got = parallel_run(pm, ex.inputs, ex.target, optimizer=opt)
    worst = compare(ref, got, f"{case} rank {dist.get_rank()}")
    out = {"mesh": list(pm.plan.mesh_shape), "worst": worst}
    if case.get("pins", {}).get("offload_activations"):     # the tensors that went to the host
        if pm.plan.pipeline is None:
            host = pm.runner.programs["train"].meta["offload_host"]
            out.update(packed=host.packed, unpacked=host.unpacked)
        else:       # each train stage's program has its own hooks: by stage, from every rank
            mine = {sg.index: [sg.gm.meta["offload_host"].packed, sg.gm.meta["offload_host"].unpacked,
                               sg.gm.meta["offload_host"].packed_bytes]
                    for sg, _ in pm.runner.stages["train"] if "offload_host" in sg.gm.meta}
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            out.update(stages={k: v for d in every for k, v in d.items()},
                       microbatches=pm.plan.n_microbatches, schedule=pm.plan.schedule)
    return out


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
