"""A catalogue of bad inputs, as a new user makes them, kept as data.

``CASES``: each is a call into the public API (planning, plan files, running, checkpoints)
with one thing wrong, the exception type it must raise and the words its message must hold:
the thing that is wrong and the fix. Every one must be an ``autopar.errors.AutoparInputError``
(what the ``autopar`` command exits 2 on) and none an internal-crash type (AssertionError,
KeyError, AttributeError, IndexError). ``COMMANDS``: the same for the ``autopar`` command,
which must exit 2 with one ``autopar: error:`` line and no traceback; any other exception is
a bug and exits 3 with its traceback (``test_an_internal_error_exits_3``).

One tiny MLP (batch 4) serves every case: a plan and a ParallelModule on one simulated rank,
and one on a single-process gloo group for the checkpoint cases.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import autopar
from autopar import cli as cli_mod
from autopar.analysis.layers import RecomputeError
from autopar.capture import CaptureError
from autopar.checkpoint import export_checkpoint, import_state_dict
from autopar.cli import INTERNAL_ERROR, REPORT, cli
from autopar.cost_models.hardware import ClusterError
from autopar.errors import ArgumentError, AutoparInputError, CheckpointError, PinError
from autopar.ops.comm import ThreadWorld
from autopar.plan import PlanError
from autopar.solver.errors import InfeasibleError
from examples.models import EXAMPLES

CRASHES = (AssertionError, KeyError, AttributeError, IndexError)
pytestmark = pytest.mark.filterwarnings("ignore:Using a target size")   # target-of-another-batch
MLP = "examples.models:mlp_factory"


class World:
    """What the cases call into: the example, a plan, plan files, ParallelModules."""

    def __init__(self, tmp):
        ex = EXAMPLES["mlp"](batch=4)
        self.tmp = tmp
        self.model, self.x, self.y, self.loss_fn = ex.model, ex.inputs[0], ex.target, ex.loss_fn
        self.plan = autopar.plan(ex.model, (self.x,), self.loss_fn, target=self.y, cluster="cpu:1")
        self.plan2 = autopar.plan(ex.model, (self.x,), self.loss_fn, target=self.y, cluster="cpu:2",
                                  data=2)
        self.plan_file = tmp / "plan.json"
        self.plan.save(self.plan_file)
        comm = ThreadWorld((1,)).comm(0)
        self.comm = comm
        self.pm = autopar.parallelize(copy.deepcopy(self.model), (self.x,), self.loss_fn,
                                      target=self.y, plan=self.plan, comm=comm)
        # the loss outside the graph (no target= at planning), returning a non-scalar
        self.pm_outside = autopar.parallelize(copy.deepcopy(self.model), (self.x,),
                                              lambda out, t: (out - t) ** 2, comm=comm,
                                              cluster="cpu:1")
        self.doc = json.loads(self.plan_file.read_text())

    def plan_with(self, *args, **kw):
        kw.setdefault("cluster", "cpu:1")
        return autopar.plan(*args, **kw)

    def bad_file(self, name: str, text: str):
        path = self.tmp / name
        path.write_text(text)
        return path

    def run_plan_file(self, path):
        return autopar.parallelize(copy.deepcopy(self.model), (self.x,), self.loss_fn,
                                   target=self.y, plan=path, comm=self.comm)

    def binary_file(self, name: str):
        path = self.tmp / name
        path.write_bytes(b"\xff\xfe\x00 not text")
        return path

    def edited(self, name: str, edit: Callable[[dict], None]):
        doc = copy.deepcopy(self.doc)
        edit(doc)
        return self.bad_file(name, json.dumps(doc))

    def state(self, **changes):
        sd = dict(self.model.state_dict())
        for k, v in changes.items():
            if v is None:
                del sd[k.replace("__", ".")]
            else:
                sd[k.replace("__", ".")] = v
        return sd


@dataclass(frozen=True)
class Bad:
    name: str
    call: Callable[[World], object]
    raises: type[BaseException]
    says: tuple[str, ...]


def _set(path: str, value):
    def edit(doc):
        *parents, last = path.split(".")
        for p in parents:
            doc = doc[p]
        doc[last] = value
    return edit


def _drop_first_node(doc):
    doc["nodes"].pop(next(iter(doc["nodes"])))


def _shard_dim_9(doc):
    doc["nodes"]["p_model_fc1_weight"]["outputs"] = ["S(9)"]


def _first_node_input(doc):
    doc["nodes"][next(iter(doc["nodes"]))]["inputs"] = ["Q(7)"]


CASES = [
    # ---- planning: autopar.plan / autopar.parallelize arguments, pins, clusters, loss_fn ----
    Bad("bare-tensor-inputs", lambda w: w.plan_with(w.model, w.x, w.loss_fn, target=w.y),
        ArgumentError, ("example_inputs is one tensor of shape [4, 32]", "(x,)")),
    Bad("inputs-not-a-tuple", lambda w: w.plan_with(w.model, {"x": w.x}, w.loss_fn, target=w.y),
        ArgumentError, ("example_inputs is a dict", "tuple of the model's positional inputs")),
    Bad("input-not-a-tensor", lambda w: w.plan_with(w.model, (w.x, 3), w.loss_fn, target=w.y),
        ArgumentError, ("example_inputs[1] is a int", "pass each tensor as its own input")),
    Bad("input-a-tuple-of-tensors", lambda w: w.plan_with(w.model, ((w.x, w.x),), w.loss_fn, target=w.y),
        ArgumentError, ("example_inputs[0] is a tuple", "wrap the model")),
    Bad("model-not-a-module", lambda w: w.plan_with(lambda t: t, (w.x,), w.loss_fn, target=w.y),
        ArgumentError, ("not a torch.nn.Module", "nn.Module whose forward")),
    Bad("loss-fn-not-callable", lambda w: w.plan_with(w.model, (w.x,), "mse", target=w.y),
        ArgumentError, ("loss_fn is a str", "loss_fn(output, target) -> scalar")),
    Bad("loss-fn-without-target", lambda w: autopar.capture(w.model, (w.x,), w.loss_fn),
        ArgumentError, ("loss_fn was given without a target", "pass target=")),
    Bad("target-without-loss-fn", lambda w: w.plan_with(w.model, (w.x,), None, target=w.y),
        ArgumentError, ("target= was given without loss_fn", "pass loss_fn=")),
    Bad("target-of-another-batch", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y[:3]),
        CaptureError, ("loss_fn(output, target) failed", "output is Tensor[4, 16], target is "
                       "Tensor[3, 16]", "Fix: pass a target=")),
    Bad("loss-not-a-scalar", lambda w: w.plan_with(w.model, (w.x,), lambda o, t: (o - t) ** 2,
                                                   target=w.y),
        ArgumentError, ("loss_fn returned Tensor[4, 16], not a scalar", ".mean()")),
    Bad("meta-model-cpu-inputs", lambda w: w.plan_with(copy.deepcopy(w.model).to("meta"), (w.x,),
                                                       w.loss_fn, target=w.y),
        ArgumentError, ("the model is on ['meta'] but example_inputs / target are on ['cpu']",
                        "device='meta'")),
    Bad("unknown-pin", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, tensr=2),
        ArgumentError, ("unknown pin(s) ['tensr']", "pins are [")),
    Bad("pin-not-an-int", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, data="2"),
        PinError, ("pin data='2'", "must be a positive integer")),
    Bad("pins-do-not-fill-the-world", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                            cluster="cpu:4", data=3),
        PinError, ("do not multiply to the world size 4", "whose product is 4")),
    Bad("pins-fill-half-the-world", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                          cluster="cpu:4", data=2, tensor=1),
        PinError, ("pins data=2 tensor=1 use 2 devices of the world size 4",
                   "pin pipeline=2 too", "whose product is 4")),
    Bad("zero-stage", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, zero=5),
        PinError, ("zero=5", "ZeRO stages", "are 0", "1", "2", "and 3")),
    Bad("offload-value", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, offload="cpu"),
        PinError, ("offload='cpu'", "use 'optimizer'", "or None")),
    Bad("offload-with-zero-0", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                     offload="optimizer", zero=0),
        PinError, ("zero=0 keeps no shard", "pin zero=1, 2 or 3", "leave zero= out")),
    Bad("precision", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, precision="fp4"),
        PinError, ("precision='fp4'", "use 'fp32', 'bf16', 'fp16' or 'fp8'")),
    Bad("fp8-scaling", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, precision="fp8",
                                             fp8_scaling="blockwise"),
        PinError, ("fp8_scaling='blockwise'", "use 'tensorwise' (the default) or 'rowwise'")),
    Bad("schedule-without-pipeline", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                           schedule="1f1b"),
        PinError, ("the pin schedule= needs pipeline parallelism", "pin pipeline= > 1")),
    Bad("unknown-schedule", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                  cluster="cpu:2", pipeline=2, schedule="zigzag"),
        PinError, ("unknown schedule 'zigzag'", "choose one of gpipe")),
    # options added since the catalogue began (a value each, and the combinations refused)
    Bad("stage-split-value", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                   cluster="cpu:2", pipeline=2, stage_split="even"),
        PinError, ("stage_split='even'", "use 'balanced'", "'even-layers'")),
    Bad("stage-split-without-pipeline", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                              stage_split="even-layers"),
        PinError, ("the pin stage_split= needs pipeline parallelism", "pin pipeline= > 1")),
    Bad("expert-dispatch-value", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                       expert_dispatch="alltoall"),
        PinError, ("expert_dispatch='alltoall'", "use 'all-to-all', 'all-gather' or 'tensor'")),
    Bad("expert-with-tensor-dispatch", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                             cluster="cpu:2", expert=2,
                                                             expert_dispatch="tensor"),
        PinError, ("expert=2 splits the experts over an axis", "pin expert_dispatch='all-to-all'")),
    Bad("expert-with-zero", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                  cluster="cpu:2", expert=2, zero=3),
        PinError, ("expert=2 with zero=3 is not supported", "drop one of the two pins")),
    Bad("expert-imbalance-below-one", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                            expert_imbalance=0.5),
        PinError, ("expert_imbalance=0.5", "a number >= 1")),
    Bad("context-attention-value", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                         context_attention="ulysses"),
        PinError, ("context_attention='ulysses'", "use 'ring' or 'all-gather'")),
    Bad("context-with-compile", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                      cluster="cpu:2", context=2, compile=True),
        PinError, ("context=2 with compile=True is not supported", "drop one of the two pins")),
    Bad("compile-value", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                               compile="max-autotune"),
        PinError, ("compile='max-autotune'", "use True", "or False")),
    Bad("grad-reduce-bf16-in-fp32", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                          grad_reduce="bf16"),
        PinError, ("grad_reduce='bf16' needs mixed precision", "pin precision='bf16'")),
    Bad("accumulate-with-pipeline", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                          cluster="cpu:2", pipeline=2, accumulate=2),
        PinError, ("accumulate= is gradient accumulation without a pipeline",
                   "pin micro_batch_size= with pipeline=")),
    Bad("local-sgd-with-zero", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                     cluster="cpu:2", local_sgd=4, zero=1),
        PinError, ("local_sgd=4 works on the replicated data-parallel gradient all-reduce",
                   "drop zero= or the lossy pin")),
    Bad("averaging-period-without-averaging", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn,
                                                                    target=w.y, averaging_period=4),
        PinError, ("averaging_period=4", "with averaging='decentralized' or 'async' pinned too")),
    Bad("offload-dir-without-disk", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                          offload_dir="/tmp/x"),
        PinError, ("offload_dir='/tmp/x' is where offload='disk' keeps", "pin offload='disk' too")),
    # an unknown value is named before a combination problem (here: no target for the pipeline)
    Bad("unknown-schedule-before-missing-target", lambda w: w.plan_with(
        w.model, (w.x,), w.loss_fn, cluster="cpu:2", pipeline=2, schedule="banana"),
        PinError, ("unknown schedule 'banana'", "choose one of gpipe")),
    # a loss outside the graph (no example target) is tried on the output when planning
    Bad("loss-outside-not-a-scalar", lambda w: w.plan_with(
        w.model, (w.x,), lambda out, t: out.pow(2), cluster="cpu:2"),
        ArgumentError, ("loss_fn returned Tensor[", "not a scalar", ".mean() or .sum()")),
    Bad("unknown-cluster", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                 cluster="3xfoo"),
        ClusterError, ("unknown cluster spec '3xfoo'", "e.g. '4x8xH100'")),
    Bad("cluster-not-a-string", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                      cluster=4),
        ClusterError, ("cluster spec must be a string or Cluster, got 4", "'cpu:<ranks>'")),
    Bad("world-larger-than-cluster", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                           cluster="cpu:2", world_size=8),
        ClusterError, ("world_size=8: cluster 'cpu:2' has 2 devices", "plan for 1 to 2 of them")),
    Bad("world-size-zero", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y, world_size=0),
        ArgumentError, ("world_size=0", "number of devices >= 1")),
    Bad("mesh-shape-product", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                    cluster="cpu:4", mesh_shape=(2, 3)),
        ArgumentError, ("mesh_shape (2, 3) has 6 devices", "whose product is 4")),
    Bad("mesh-shape-not-a-tuple", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                        cluster="cpu:4", mesh_shape="2x2"),
        ArgumentError, ("mesh_shape='2x2'", "a tuple of positive ints, e.g. (2, 4)")),
    Bad("time-limit-not-a-number", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                         time_limit_s="fast"),
        ArgumentError, ("time_limit_s='fast'", "a number > 0")),
    Bad("unknown-optimizer", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                   optimizer="lion"),
        ArgumentError, ("optimizer 'lion' unknown", "'adamw'")),
    Bad("memory-budget-not-a-number", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                            memory_budget="40GB"),
        ArgumentError, ("memory_budget='40GB'", "bytes per device as a number")),
    Bad("memory-budget-too-small", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                         memory_budget=1024),
        InfeasibleError, ("fits the memory budget of 1.0 KiB", "raise memory_budget to at least")),
    Bad("recompute-unknown-layer", lambda w: w.plan_with(w.model, (w.x,), w.loss_fn, target=w.y,
                                                         recompute=["h.9"]),
        RecomputeError, ("'h.9' matches no repeated layer", "layers are")),
    Bad("parallelize-meta-model", lambda w: autopar.parallelize(
            copy.deepcopy(w.model).to("meta"), (w.x,), w.loss_fn, target=w.y, comm=w.comm),
        ArgumentError, ("the model is on the meta device ('fc1.weight'", "weights=",
                        "model.to_empty(device='cpu')")),
    # a frozen parameter (ERNIE 4.5's MoE gate holds one) failed deep in torch: "cannot
    # register a hook on a tensor that doesn't require gradient"
    Bad("parallelize-frozen-parameter", lambda w: autopar.parallelize(
            _frozen(w.model), (w.x,), w.loss_fn, target=w.y, comm=w.comm),
        ArgumentError, ("parameter 'fc1.bias' has requires_grad=False", "register_buffer",
                        "requires_grad_(True)")),
    Bad("parallelize-plan-not-a-plan", lambda w: autopar.parallelize(
            w.model, (w.x,), w.loss_fn, target=w.y, comm=w.comm, plan=42),
        ArgumentError, ("plan= is a int", "the path of a plan file")),
    Bad("parallelize-plan-and-pins", lambda w: autopar.parallelize(
            w.model, (w.x,), w.loss_fn, target=w.y, comm=w.comm, plan=w.plan, data=1),
        ArgumentError, ("pass pins to autopar.plan, or pass plan=", "not both")),
    Bad("parallelize-batch-mode", lambda w: autopar.parallelize(
            w.model, (w.x,), w.loss_fn, target=w.y, comm=w.comm, batch="local"),
        ArgumentError, ("batch='local'", "'per_rank'")),
    Bad("plan-for-another-world", lambda w: autopar.parallelize(
            w.model, (w.x,), w.loss_fn, target=w.y, comm=w.comm, plan=w.plan2),
        PlanError, ("made for 2 devices", "this job has 1", "--nproc-per-node 2")),
    Bad("plan-for-another-model", lambda w: autopar.parallelize(
            w.model, (torch.cat([w.x, w.x]),), w.loss_fn, target=torch.cat([w.y, w.y]),
            comm=w.comm, plan=w.plan),
        PlanError, ("made for another graph", "plan again with autopar.plan")),
    # ---- plan files -------------------------------------------------------------------------
    Bad("plan-file-missing", lambda w: autopar.Plan.load(w.tmp / "nowhere.json"),
        PlanError, ("nowhere.json' does not exist", "plan.save(path)")),
    Bad("plan-file-is-a-directory", lambda w: autopar.Plan.load(w.tmp),
        PlanError, ("is a directory, not a plan file", "plan.save(path)")),
    Bad("plan-file-not-json", lambda w: autopar.Plan.load(w.bad_file("nope.json", "{ nope")),
        PlanError, ("not JSON", "plan.save(path)")),
    Bad("plan-file-not-text", lambda w: autopar.Plan.load(w.binary_file("bin.json")),
        PlanError, ("cannot read the plan (UnicodeDecodeError", "plan.save(path)")),
    Bad("plan-file-unknown-version", lambda w: autopar.Plan.load(w.edited("v99.json", _set("version", 99))),
        PlanError, ("plan field version: 99 is not supported", "reads versions 1 to 3",
                    "plan again with this autopar")),
    Bad("plan-file-wrong-field-type", lambda w: autopar.Plan.load(w.edited("ws.json", _set("world_size", "1"))),
        PlanError, ("plan field world_size: '1' has the wrong type", "expected integer")),
    Bad("plan-file-wrong-nested-type", lambda w: autopar.Plan.load(
            w.edited("est.json", _set("estimate.step_time_s", "fast"))),
        PlanError, ("plan field estimate.step_time_s: 'fast' has the wrong type", "expected number")),
    Bad("plan-file-missing-field", lambda w: autopar.Plan.load(w.edited("nofp.json", lambda d: d.pop("fingerprint"))),
        PlanError, ("plan field fingerprint", "is required")),
    Bad("plan-file-bad-placement", lambda w: autopar.Plan.load(w.edited("q7.json", _first_node_input)),
        PlanError, ("'Q(7)' is not a placement", "like \"S(0)R\"")),
    Bad("plan-file-not-an-object", lambda w: autopar.Plan.load(w.bad_file("list.json", "[1, 2]")),
        PlanError, ("a plan is a JSON object, got list",)),
    Bad("plan-file-node-removed", lambda w: w.run_plan_file(w.edited("norm.json", _drop_first_node)),
        PlanError, ("plan field nodes: no placements for graph node", "make the plan again")),
    Bad("plan-file-shard-dim-out-of-range", lambda w: w.run_plan_file(w.edited("dim9.json", _shard_dim_9)),
        PlanError, ("'S(9)' shards dim 9, but p_model_fc1_weight is a tensor of 2 dims",
                    "make the plan again")),
    Bad("plan-file-options-not-options", lambda w: w.run_plan_file(w.edited("opts.json", _set("options", {"zero": "x"}))),
        PlanError, ("plan field options: zero='x'", "make the plan again")),
    Bad("plan-file-mesh-axes-mismatch", lambda w: w.run_plan_file(w.edited("axes.json", _set("mesh_axes", []))),
        PlanError, ("plan field mesh_axes: [] names 0 axes of the mesh [1]", "make the plan again")),
    # ---- running: train_step / forward ------------------------------------------------------
    Bad("train-step-smaller-batch", lambda w: w.pm.train_step(w.x[:3], target=w.y[:3]),
        ArgumentError, ("train_step: input 0 has shape [3, 32], but the plan was made for [4, 32]",
                        "drop_last=True", "plan again")),
    Bad("train-step-larger-batch", lambda w: w.pm.train_step(torch.cat([w.x, w.x]), target=w.y),
        ArgumentError, ("input 0 has shape [8, 32], but the plan was made for [4, 32]",)),
    Bad("train-step-tuple-of-inputs", lambda w: w.pm.train_step((w.x,), target=w.y),
        ArgumentError, ("input 0 is a tuple", "pm.train_step(*inputs)")),
    Bad("train-step-too-many-inputs", lambda w: w.pm.train_step(w.x, w.x, target=w.y),
        ArgumentError, ("expected 1 inputs", "got 2")),
    Bad("train-step-target-positional", lambda w: w.pm.train_step(w.x, w.y),
        ArgumentError, ("expected 1 inputs", "got 2 (the target goes in target=)")),
    Bad("train-step-target-of-another-batch", lambda w: w.pm.train_step(w.x, target=w.y[:2]),
        ArgumentError, ("target has shape [2, 16], but the plan was made for [4, 16]",)),
    Bad("train-step-without-target", lambda w: w.pm.train_step(w.x),
        ArgumentError, ("train_step needs target=",)),
    Bad("train-step-other-dtype", lambda w: w.pm.train_step(w.x.double(), target=w.y),
        ArgumentError, ("input 0 has dtype torch.float64", "x.to(torch.float32)")),
    Bad("forward-other-batch", lambda w: w.pm(w.x[:1]),
        ArgumentError, ("forward: input 0 has shape [1, 32]", "made for [4, 32]")),
    Bad("loss-not-a-scalar-outside-the-graph", lambda w: w.pm_outside.train_step(w.x, target=w.y),
        ArgumentError, ("loss_fn returned a tensor of shape [4, 16], not a scalar loss", ".mean()")),
    # ---- state dicts and checkpoints --------------------------------------------------------
    Bad("state-dict-missing-key", lambda w: w.pm.load_full_state_dict(w.state(fc1__weight=None)),
        ArgumentError, ("1 missing keys ['fc1.weight']", "state_dict() of the model")),
    Bad("state-dict-unexpected-key", lambda w: w.pm.load_full_state_dict(
            w.state(fc9__weight=torch.zeros(1))),
        ArgumentError, ("1 unexpected keys ['fc9.weight']", "state_dict() of the model")),
    Bad("state-dict-other-shape", lambda w: w.pm.load_full_state_dict(
            w.state(fc1__weight=torch.zeros(3, 3))),
        ArgumentError, ("'fc1.weight' is [3, 3], the model's is [64, 32]", "this model's configuration")),
    Bad("state-dict-not-a-dict", lambda w: w.pm.load_full_state_dict(list(w.model.parameters())),
        ArgumentError, ("takes a dict of tensors", "got list")),
    Bad("save-checkpoint-of-the-model", lambda w: autopar.save_checkpoint(w.tmp / "ck", w.model),
        ArgumentError, ("expected the ParallelModule autopar.parallelize returned, got MLP",)),
    Bad("load-checkpoint-missing-dir", lambda w: autopar.load_checkpoint(w.tmp / "no_ckpt", w.pm),
        CheckpointError, ("no_ckpt' is not a checkpoint directory", "pass the directory save_checkpoint")),
    Bad("export-checkpoint-missing-dir", lambda w: export_checkpoint(w.tmp / "no_ckpt", w.tmp / "m.pt"),
        CheckpointError, ("is not a checkpoint directory",)),
    Bad("import-state-dict-not-torch-save", lambda w: import_state_dict(
            w.bad_file("garbage.pt", "not a torch file"), w.tmp / "ck4"),
        CheckpointError, ("garbage.pt' cannot be read by torch.load", "torch.save(model.state_dict())")),
    Bad("import-missing-state-dict", lambda w: import_state_dict(w.tmp / "no.pt", w.tmp / "ck2"),
        CheckpointError, ("no.pt' does not exist", "torch.save(model.state_dict())")),
]


def _frozen(model):
    """A copy of ``model`` with its first layer's bias frozen."""
    m = copy.deepcopy(model)
    m.fc1.bias.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("bad_inputs"))


def _check(e: BaseException, case_raises, says):
    assert not isinstance(e, CRASHES), f"an internal-crash type escaped: {type(e).__name__}: {e}"
    assert isinstance(e, AutoparInputError), f"{type(e).__name__} is no input error: {e}"
    assert isinstance(e, case_raises), f"expected {case_raises.__name__}, got {type(e).__name__}: {e}"
    for s in says:
        assert s in str(e), f"{s!r} not in the message: {e}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_named_with_its_fix(world, case):
    with pytest.raises(BaseException) as info:
        case.call(world)
    _check(info.value, case.raises, case.says)


def test_the_catalogue_is_large_and_its_names_unique():
    names = [c.name for c in CASES] + [c.name for c in COMMANDS] + [c.name for c in GLOO_CASES]
    assert len(set(names)) == len(names)
    assert len(names) >= 30


# ---- the autopar command --------------------------------------------------------------------
@dataclass(frozen=True)
class BadCommand:
    name: str
    args: Callable[[World], list]
    says: tuple[str, ...]


COMMANDS = [
    BadCommand("cli-unknown-command", lambda w: ["frobnicate"], ("No such command 'frobnicate'",)),
    BadCommand("cli-unknown-pin", lambda w: ["plan", MLP, "--pin", "tensr=2"],
               ("unknown pin(s) ['tensr']", "e.g. --pin tensor=2")),
    BadCommand("cli-pin-not-key-value", lambda w: ["plan", MLP, "--pin", "data"],
               ("--pin 'data' is not key=value",)),
    BadCommand("cli-pin-not-an-int", lambda w: ["plan", MLP, "--pin", "data=two"],
               ("pin data='two' must be a positive integer",)),
    BadCommand("cli-unknown-cluster", lambda w: ["plan", MLP, "--cluster", "3xdgx-z900"],
               ("unknown cluster spec '3xdgx-z900'", "e.g. '4x8xH100'")),
    BadCommand("cli-unreadable-budget", lambda w: ["plan", MLP, "--budget", "lots"],
               ("cannot read the memory budget 'lots'", "40GiB")),
    BadCommand("cli-factory-not-module-colon-name", lambda w: ["plan", "examples.models"],
               ("is not MODULE:FACTORY", "examples.models:gpt_factory")),
    BadCommand("cli-unknown-hf-model", lambda w: ["plan", "hf:llama9-1t", "--batch", "2", "--seq", "8"],
               ("hf:llama9-1t is not a shipped config", "llama3-8b")),
    BadCommand("cli-hf-without-batch", lambda w: ["plan", "hf:llama3-8b", "--seq", "8"],
               ("hf:llama3-8b needs a batch size", "--batch B")),
    BadCommand("cli-hf-sequence-too-long", lambda w: ["plan", "hf:gpt2", "--batch", "2", "--seq", "4096"],
               ("--seq 4096 is longer than", "max_position_embeddings 1024", "--seq 1024 or less")),
    BadCommand("cli-missing-plan-file", lambda w: ["show", str(w.tmp / "nowhere.json")],
               ("no plan file", "autopar plan MODULE:FACTORY -o")),
    BadCommand("cli-plan-file-unknown-version",
               lambda w: ["show", str(w.edited("cli_v99.json", _set("version", 99)))],
               ("plan field version: 99 is not supported", "make a new one with `autopar plan`")),
    BadCommand("cli-plan-file-is-a-directory", lambda w: ["diff", str(w.tmp), str(w.plan_file)],
               ("no plan file",)),
    BadCommand("cli-viz-unknown-format", lambda w: ["viz", str(w.plan_file), "-o", str(w.tmp / "out.xyz")],
               ("cannot write 'out.xyz'", "use an output ending in .html")),
    BadCommand("cli-checkpoint-export-missing-dir",
               lambda w: ["checkpoint", "export", str(w.tmp / "no_ckpt"), "-o", str(w.tmp / "m.pt")],
               ("is not a checkpoint directory", "pass the directory save_checkpoint")),
    BadCommand("cli-checkpoint-import-missing-file",
               lambda w: ["checkpoint", "import", str(w.tmp / "no.pt"), "-o", str(w.tmp / "ck3")],
               ("does not exist", "torch.save(model.state_dict())")),
]


@pytest.mark.parametrize("case", COMMANDS, ids=[c.name for c in COMMANDS])
def test_bad_command_exits_2_with_one_line(world, case):
    res = CliRunner().invoke(cli, [str(a) for a in case.args(world)], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output, res.output
    for s in case.says:
        assert s in res.output, f"{s!r} not in: {res.output}"
    errors = [line for line in res.output.splitlines() if line.startswith("autopar: error:")]
    assert len(errors) == 1 or "Usage:" in res.output, res.output


def test_an_internal_error_exits_3(world, monkeypatch, capsys):
    """A plain ValueError from deep inside (torch's, say) is no input error: exit 3, the
    traceback, and the request to report it; never exit 2's one line."""
    def broken(path):
        raise ValueError("an internal ValueError from torch")
    monkeypatch.setattr(cli_mod, "load_plan", broken)
    res = CliRunner().invoke(cli, ["show", str(world.plan_file)], catch_exceptions=False)
    assert res.exit_code == INTERNAL_ERROR == 3, res.output
    assert "Traceback (most recent call last)" in res.output and "in broken" in res.output
    assert "autopar: internal error: ValueError: an internal ValueError from torch" in res.output
    assert REPORT in res.output and "please report it" in REPORT
    assert "autopar: error:" not in res.output
    assert cli_mod.main(["show", str(world.plan_file)]) == 3     # the console script's code
    assert "please report it" in capsys.readouterr().err


# ---- checkpoints on a real (single-process gloo) group ------------------------------------------
def _other_mlp():
    return EXAMPLES["mlp"](batch=4, hidden=48)


GLOO_CASES = [
    Bad("load-checkpoint-of-another-model",
        lambda g: autopar.load_checkpoint(g["ckpt"], g["other"]),
        CheckpointError, ("the checkpoint does not fit this model", "tensors of another shape",
                          "fc1.weight [64, 32] (the model's: [48, 32])",
                          "Load it into the model (and configuration) it was saved from")),
    Bad("load-checkpoint-optimizer-of-another-module",
        lambda g: autopar.load_checkpoint(g["ckpt"], g["pm"], torch.optim.SGD(g["other"].parameters(), lr=0.1)),
        ArgumentError, ("the optimizer holds a parameter that is not one of the", "pm.parameters()")),
]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """A ParallelModule on a one-rank gloo group, its checkpoint, and a module of another
    model; the group is destroyed afterwards."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    tmp = tmp_path_factory.mktemp("gloo_ckpt")
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    try:
        ex, other = EXAMPLES["mlp"](batch=4), _other_mlp()
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:1")
        pm_other = autopar.parallelize(other.model, other.inputs, other.loss_fn, target=other.target,
                                       cluster="cpu:1")
        autopar.save_checkpoint(tmp / "ckpt", pm)
        yield {"pm": pm, "other": pm_other, "ckpt": tmp / "ckpt"}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", GLOO_CASES, ids=[c.name for c in GLOO_CASES])
def test_bad_checkpoint_load_is_named_with_its_fix(gloo, case):
    with pytest.raises(BaseException) as info:
        case.call(gloo)
    _check(info.value, case.raises, case.says)


def test_a_checkpoint_loads_into_its_own_model(gloo):
    """The cases above fail for what they break, not for every load."""
    assert autopar.load_checkpoint(gloo["ckpt"], gloo["pm"]) is None
