"""Run by tests/test_pipeline_runtime.py under torchrun: pipelined models on real gloo ranks.

Each case pins ``pipeline=`` (and a schedule, micro-batches, data/tensor degrees), builds the
model with ``autopar.parallelize``, trains 3 SGD-momentum steps and compares loss, every
gradient and the weights with one device (``tests/equivalence.py``; a case's ``"optimizer":
"adamw"`` steps AdamW instead). Models with BatchNorm
compare with one device running the same micro-batches with gradient accumulation: batch
statistics are per micro-batch under any pipeline, so that is the single-device model with
the same semantics. Rank 0 writes one JSON result per case. The cases of one example model
share its capture (``tests/capture_reuse.py``; torch.export was most of each case's time)
and its single-device run (the same weights and batch).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from capture_reuse import same_model  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def _meta_bytes(infos) -> int:
    """Bytes a micro-batch's receive buffers of ``infos`` (torch's ``_RecvInfo``) take."""
    return sum(math.prod(i.tensor_meta.shape) * i.tensor_meta.dtype.itemsize
               for i in infos if not i.is_root_arg and i.tensor_meta is not None)


def _example(name: str):
    if name == "unet":
        from examples.unet import unet_factory
        return unet_factory()
    if name == "mixtral":       # transformers' Mixtral, 2 layers of 4 experts, batch 8
        from examples import zoo
        return zoo.build("mixtral", batch=8)
    return EXAMPLES[name]()


_REFERENCES: dict[tuple[str, int], tuple] = {}


def _reference(name: str, ex, micro_batches: int, optimizer: str = "sgd"):
    """One device's run of ``ex`` (``equivalence.reference_run``), once per spawn for every
    case of the same example: kept with the weights, buffers, inputs and target it started
    from, and run again unless they are equal."""
    start = [*ex.model.state_dict().values(), *ex.inputs, ex.target]
    hit = _REFERENCES.get((name, micro_batches, optimizer))
    if hit is not None and len(hit[0]) == len(start) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(hit[0], start)):
        return hit[1]
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn, micro_batches=micro_batches,
                        optimizer=optimizer)
    _REFERENCES[(name, micro_batches, optimizer)] = ([t.detach().clone() for t in start], ref)
    return ref


def run_case(case: dict) -> dict:
    with same_model(case["model"]):
        return _run_case(case)


def _run_case(case: dict) -> dict:
    t0 = time.perf_counter()
    ex = _example(case["model"])
    pins = dict(case["pins"])
    if case.get("plan") == "saved":
        path = case["path"]
        if dist.get_rank() == 0:
            autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                         cluster=f"cpu:{dist.get_world_size()}", **pins).save(path)
        dist.barrier()
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=path)
    elif case.get("cuts"):
        # the plan for the pins with its cuts replaced (rank 0 plans, every rank runs it)
        box = [None]
        if dist.get_rank() == 0:
            plan = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                cluster=f"cpu:{dist.get_world_size()}", **pins)
            box = [replace(plan, pipeline=replace(plan.pipeline, stage_cuts=tuple(case["cuts"])))]
        dist.broadcast_object_list(box, 0)
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=box[0])
    else:
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **pins)
    has_bn = any(isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) for mod in ex.model.modules())
    info = {"mesh": list(pm.plan.mesh_shape), "m": pm.plan.n_microbatches,
            "v": pm.plan.virtual_stages, "schedule": pm.plan.schedule,
            "cuts": list(pm.plan.stage_cuts), "my_stages": None}
    ranks_stages = [None] * dist.get_world_size()
    dist.all_gather_object(ranks_stages, list(pm.runner.my_stages))
    info["my_stages"] = ranks_stages
    seconds = {"build": time.perf_counter() - t0}
    if case.get("owners"):
        # which pipeline ranks each rank thinks hold these tensors (must agree everywhere)
        owners = [None] * dist.get_world_size()
        dist.all_gather_object(owners, {a: pm.owners[a] for a in case["owners"]})
        info["owners"] = owners
    if case.get("forward") and not has_bn:
        out = pm(*ex.inputs)
        with torch.no_grad():
            want = ex.model(*ex.inputs)
        err = float((out - want).norm() / want.norm())
        assert err < 1e-5, f"forward output differs from one device: rel err {err:.2e}"
        info["forward_err"] = err
    seconds["forward"] = time.perf_counter() - t0 - sum(seconds.values())
    optimizer = case.get("optimizer", "sgd")
    ref = _reference(case["model"], ex, pm.plan.n_microbatches if has_bn else 1, optimizer)
    seconds["reference"] = time.perf_counter() - t0 - sum(seconds.values())
    got = parallel_run(pm, ex.inputs, ex.target, optimizer=optimizer)
    seconds["train"] = time.perf_counter() - t0 - sum(seconds.values())
    info["phases"] = {k: round(v, 3) for k, v in seconds.items()}
    info["worst"] = compare(ref, got, f"{case} rank {dist.get_rank()}")
    # the stages whose data-parallel reductions started during the last step, in order
    order = [None] * dist.get_world_size()
    dist.all_gather_object(order, list(pm.runner.sync_order))
    info["sync_order"] = order
    # the peak bytes of receive buffers each rank's train stages held at once in the last
    # step, the plan's prediction of them for its pipeline rank, what they hold after it,
    # and per stage (index, a micro-batch's values received, its gradients received)
    buffers = [None] * dist.get_world_size()
    ranks = pm.plan.estimate.rank_memory_bytes
    dist.all_gather_object(buffers, (pm.runner.receive_buffer_bytes(),
                                     ranks[pm.runner.pp_rank].get("pipeline_buffers", 0.0)
                                     if ranks else None,
                                     pm.runner.held_receive_buffer_bytes(),
                                     [(st.stage_index, _meta_bytes(st.args_recv_info[0]),
                                       _meta_bytes(st.grad_recv_info.get(0, ())))
                                      for _, st in pm.runner.stages["train"]]))
    info["buffers"] = buffers
    # which stages split their backward in two halves (zero bubble), by stage index
    split = [None] * dist.get_world_size()
    dist.all_gather_object(split, {st.stage_index: st.split_backward
                                   for _, st in pm.runner.stages.get("train", [])})
    info["split_backward"] = {k: v for d in split for k, v in d.items()}
    if case.get("overlap"):
        # DualPipeV's pairs run at once (runtime.overlap): per rank, the OVERLAP_F_B actions
        # its schedule lists a step, the pairs whose forward ran on the second thread over
        # the steps, and of them those whose two halves ran at the same time
        ov = pm.runner.overlap
        listed = sum(1 for a in pm.runner._schedule.pipeline_order[pm.runner.pp_rank]
                     if a is not None and a.sub_actions is not None)
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, None if ov is None else
                               {"listed": listed, "pairs": ov.pairs, "concurrent": ov.concurrent})
        info["overlap"] = counts
        info["steps"] = len(got.losses)
    if case.get("regions"):
        # the layers each train stage runs under checkpointing (passes/recompute), by stage
        regions = [None] * dist.get_world_size()
        dist.all_gather_object(regions, {sg.index: list(sg.gm.meta.get("recompute", ()))
                                         for sg, _ in pm.runner.stages.get("train", [])})
        info["regions"] = {k: v for d in regions for k, v in d.items()}
        info["recompute"] = list(pm.plan.recompute)
    if case.get("skips"):
        # which ranks received which skip values (the middle stages must receive none)
        received = [None] * dist.get_world_size()
        dist.all_gather_object(received, pm.received_skips())
        info["received"] = received
        info["skip_edges"] = [(e.value, e.src, e.dst) for e in pm.runner.skip_edges["train"].values()]
        info["stage_inputs"] = {}
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, {sg.index: sg.inputs for sg, _ in pm.runner.stages["train"]})
        info["stage_inputs"] = names
    return info


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    main()
