"""Run by tests/test_compile.py under torchrun: ``compile=True`` plans on real gloo ranks.

Each case parallelizes an example model with its pins and ``compile=True``, trains 3 SGD
steps and compares loss, every gradient and the weights with the same model trained eagerly
on one device (``tests/equivalence.py``). It returns what says the compiled path ran: the
compile report (every program's compile seconds), this rank's parameter bytes against the
model's, and, with ``"count": true``, what the functional all-gathers of one compiled step
send (ZeRO-3: a weight gathered again in backward, not saved, is sent twice; Inductor's
bucketing may merge gathers, so elements are counted, not calls).
"""
from __future__ import annotations

import math
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from examples.models import EXAMPLES  # noqa: E402
from worker_loop import run_cases  # noqa: E402

CASES = [
    # the plan a user gets without pins, on a one-layer GPT (a second layer repeats the
    # first's kernels: with a cold Inductor cache this case was 96 of the 3 cases' 197 s,
    # each rank 20 CPU s, in tests/test_compile.py's launch)
    {"id": "free", "model": "gpt", "pins": {}, "model_kw": {"n_layer": 1}},
    {"id": "data", "model": "mlp", "pins": {"data": 2}},
    {"id": "tensor", "model": "gpt", "pins": {"tensor": 2}},
    {"id": "zero3", "model": "mlp", "pins": {"data": 2, "zero": 3}, "count": True},
    {"id": "pipeline", "model": "mlp", "pins": {"pipeline": 2, "micro_batch_size": 2}},
    {"id": "hf-llama", "model": "hf-llama", "pins": {"tensor": 2}},    # transformers' Llama
    # each MoE layer one experts op: its split forms are opaque ops of the compiled graph
    {"id": "moe-free", "model": "hf-mixtral", "pins": {}},     # the experts op whole: its own op
    {"id": "moe-all-to-all", "model": "hf-mixtral", "pins": {"expert": 2}},
    {"id": "moe-all-gather", "model": "hf-mixtral", "pins": {"expert": 2, "expert_dispatch": "all-gather"}},
    # a compiled stage runs its whole backward at I (torch's split finds no weight behind it)
    {"id": "zero-bubble", "model": "mlp", "pins": {"pipeline": 2, "micro_batch_size": 2,
                                                    "schedule": "zero-bubble"}},
    {"id": "offload", "model": "mlp", "pins": {"data": 2, "offload": "optimizer"}},
    {"id": "compress", "model": "mlp", "pins": {"data": 2, "compress": "topk:1"}},    # every entry: exact
    {"id": "branch", "model": "inception", "pins": {"branch": 2}},
    # compile="reduce-overhead" (CUDA graphs): on CPU ranks compile=True's programs (the same
    # graph as "zero3": Inductor's cache serves it), with a warning that says so
    {"id": "zero3-graphs", "model": "mlp", "pins": {"data": 2, "zero": 3}, "compile": "reduce-overhead"},
]
"""Every compiled case: ``tests/test_compile.py`` runs a few (``CORE``), ``benchmarks/
compiled_plans.py`` all of them."""
SHARDED = ("tensor", "zero3", "zero3-graphs", "pipeline", "hf-llama", "moe-all-to-all", "moe-all-gather", "zero-bubble")


def check_compiled(r: dict) -> None:
    """Asserts what says a case's compiled path ran as planned (its equality with one device
    was checked on the ranks: a difference fails the case there): every program compiled, in
    seconds; a pipelined rank's stage programs among them; sharded plans hold less than the
    whole model."""
    case_id = r["case"]["id"]
    assert r["options"].get("compile") == r["case"].get("compile", True), r
    if r["case"].get("compile") == "reduce-overhead":      # CPU ranks: no CUDA graphs, said once
        assert r["warnings"] == 1 and "CUDA graphs need CUDA devices" in r["warning"], r
    report = r["report"]
    assert report is not None and report["compile_s"], report      # the compiled path ran
    assert all(s > 0 for s in report["compile_s"].values()), report
    if case_id in ("pipeline", "zero-bubble"):   # each of this rank's stages' train programs
        assert any(k.startswith("stage ") for k in report["compile_s"]), report
    if case_id in SHARDED:
        assert r["local_bytes"] < r["model_bytes"], r


GATHER = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")


def run_case(case: dict) -> dict:
    if case["model"].startswith("hf-"):        # a transformers model of the sweep's zoo
        from examples.zoo import build
        ex = build(case["model"][3:], batch=4)
    else:
        ex = EXAMPLES[case["model"]](batch=8, seed=0, **case.get("model_kw", {}))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                 compile=case.get("compile", True), **case["pins"])
    graphs = [str(w.message) for w in said if "CUDA graphs" in str(w.message)]
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    got = parallel_run(pm, ex.inputs, ex.target)
    worst = compare(ref, got, f"{case} compiled")
    res = {"worst": worst, "report": pm.compile_report(), "options": pm.plan.options.pinned(),
           "local_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
           "model_bytes": sum(p.numel() * p.element_size() for p in ex.model.parameters()),
           "warnings": len(graphs), "warning": graphs[0] if graphs else ""}
    if case.get("count"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:
            pm.train_step(*ex.inputs, target=ex.target)
        gathered = [e.input_shapes[0] for e in prof.events() if e.name in GATHER]
        res["gathers"] = len(gathered)
        res["gathered_numel"] = sum(math.prod(s) for s in gathered)      # shards sent
        sharded = [a for a, p in pm.plan.params.items()
                   if "S(" in "".join(map(str, pm.plan.nodes[p].outputs))]
        local = dict(pm.module.named_parameters())
        res["sharded_numel"] = sum(local[a].numel() for a in sharded)
    return res


if __name__ == "__main__":
    run_cases(run_case)
