"""Run by tests/test_elastic_axes.py under torchrun: an elastic job pinned one model axis
(``context``, ``expert``, ``tensor`` or ``pipeline``) loses half its ranks and resumes.

Each case is one job in two worlds of one launch (``main``), its checkpoint directory shared:

- ``save`` (4 ranks): ``autopar.parallelize(..., elastic=True, batch="per_rank", data=2,
  <axis>=2)`` (``CASES``), each data rank reading its slice of the global batches from
  ``autopar.elastic.GlobalBatchSampler``, AdamW, ``save_step_checkpoint`` every ``EVERY``
  steps; it trains ``LOST_AT`` steps, so the last one (after checkpoint ``LOST_AT - 1``) is
  lost with the ranks;
- ``resume`` (ranks 0 and 1 in a new world of 2, the same pins): ``elastic=True`` re-plans
  for the world it has (the axis kept, ``data`` takes the rest: 1, with ``accumulate`` 2, or
  under the pipeline micro-batches of half the rows), ``autopar.elastic.resume`` loads the
  newest complete checkpoint (saved under the 4-rank mesh) and it trains to ``STEPS``; rank
  0 writes the final full state dict.

Every step's loss and where the mode happened (mesh, the parameters split on the axis, the
pipeline's micro-batches) come back in the result; the test compares the losses and the
final weights with one device's run of the same global batches (``one_device``).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autopar  # noqa: E402
from autopar.checkpoint import save_step_checkpoint  # noqa: E402
from autopar.elastic import GlobalBatchSampler, resume  # noqa: E402
from autopar.placement import Shard  # noqa: E402
from launch import free_port  # noqa: E402
from worker_loop import run_cases  # noqa: E402

STEPS, EVERY, LOST_AT = 7, 2, 5          # checkpoints 2 and 4; step 5's work is lost
BATCH, SAMPLES, LR = 8, 24, 1e-2         # 3 global batches an epoch: two epoch boundaries
# AdamW divides by sqrt(v) + eps: a gradient that is ~1e-9 by rounding alone would move its
# weight by up to lr / (1e-9 + eps); eps 1e-6 keeps that near 1e-3 of an lr-sized step
# (tests/checkpoint_worker.py's EPS, for the same reason)
EPS = 1e-6
SEQ = 16                                 # divides into 2 x context=2 balanced chunks

# axis: (model, its pins on 4 ranks). ZeRO-3 where the axis allows it (not beside expert=:
# options._check_combinations), so that the weights and moments are stored split 4 ways on
# 4 ranks and 2 ways on 2: the checkpoint is resharded, not just reread
CASES = {
    "context": ("llama", {"context": 2, "data": 2, "zero": 3}),
    "expert": ("mixtral", {"expert": 2, "data": 2, "expert_dispatch": "all-to-all"}),
    "tensor": ("mlp", {"tensor": 2, "data": 2, "zero": 3}),
    "pipeline": ("mlp", {"pipeline": 2, "data": 2, "micro_batch_size": 2}),
}


def build(model: str):
    """(module, loss_fn, one global batch's example inputs and target, vocabulary or None)."""
    if model in ("mlp", "llama"):       # autopar's own examples: no transformers to import
        from examples.models import llama_factory, mlp_factory
        ex = (mlp_factory if model == "mlp" else llama_factory)(batch=BATCH, seed=0)
        return ex.model, ex.loss_fn, ex.inputs, ex.target, getattr(ex.config, "vocab_size", None)
    from examples.zoo import DEC, V, causal_lm, lm_loss       # a transformers Mixtral
    b = causal_lm("MixtralConfig", "MixtralForCausalLM", attn="sdpa", num_local_experts=4,
                  num_experts_per_tok=2, **DEC)(batch=BATCH)
    return b.model, lm_loss, b.inputs, b.target, V


def dataset(model: str) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    _, _, inputs, target, vocab = build(model)
    if vocab is None:
        return TensorDataset(torch.randn(SAMPLES, *inputs[0].shape[1:], generator=g),
                             torch.randn(SAMPLES, *target.shape[1:], generator=g))
    assert inputs[0].shape[1] == SEQ, inputs[0].shape
    return TensorDataset(torch.randint(0, vocab, (SAMPLES, SEQ), generator=g),
                         torch.randint(0, vocab, (SAMPLES, SEQ), generator=g))


def one_device(model: str, steps):
    """(initial state dict, final state dict, losses) of one-device AdamW steps over the
    global batches ``GlobalBatchSampler`` gives: steps ``0 .. steps - 1``, or the list of
    steps ``steps``. On one thread: on 2 shared cores under load (7), torch's 2 intra-op
    threads made these tiny steps 20x slower (measured: the Llama's 14 steps took 14 s on
    2 threads, 0.7 s on 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_device(model, range(steps) if isinstance(steps, int) else steps)
    finally:
        torch.set_num_threads(threads)


def _one_device(model: str, steps):
    net, loss_fn, _, _, _ = build(model)
    ds = dataset(model)
    sampler = GlobalBatchSampler(len(ds), BATCH)
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    opt = torch.optim.AdamW(net.parameters(), lr=LR, eps=EPS)
    losses = []
    for s in steps:
        x, y = ds[sampler.global_indices(s)]
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    return init, {k: v.detach().clone() for k, v in net.state_dict().items()}, losses


def _split_on(pm, axis: str) -> list[str]:
    """This stage's parameters held split (``Shard``) on mesh axis ``axis``."""
    names = list(pm.plan.mesh_axes)[1 if pm.plan.pipeline_stages > 1 else 0:]   # the stage's mesh
    if axis not in names:
        return []
    a = names.index(axis)
    return sorted(n for n, pl in pm._shards.placements.items()
                  if a < len(pl) and isinstance(pl[a], Shard))


def run_case(case: dict) -> dict:
    axis = case["axis"]
    model, pins = CASES[axis]
    net, loss_fn, inputs, target, _ = build(model)
    pm = autopar.parallelize(net, inputs, loss_fn, target=target, batch="per_rank", elastic=True,
                             timeout=60, **pins)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    root = os.path.join(case["dir"], "ckpt")
    extra = resume(root, pm, opt, verbose=False) or {"step": 0, "reload_seconds": 0.0}
    step = extra["step"]
    plan = pm.plan
    info = {"resumed_from": step, "mesh": dict(zip(plan.mesh_axes, plan.mesh_shape)),
            "pipeline_stages": plan.pipeline_stages, "microbatches": plan.n_microbatches,
            "accumulate": plan.accumulate, "data_world": pm.data_world,
            "world": dist.get_world_size(), "split_on_axis": _split_on(pm, axis),
            "plan_seconds": round(pm.elastic.plan_seconds, 3),
            "reload_seconds": round(extra["reload_seconds"], 3)}
    last = LOST_AT if case["phase"] == "save" else STEPS
    ds = dataset(model)
    sampler = GlobalBatchSampler(len(ds), BATCH, pm.data_rank, pm.data_world, start=step,
                                 steps=last)
    losses = []
    for x, y in DataLoader(ds, batch_sampler=sampler):
        loss = pm.train_step(x, target=y)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
        step += 1
        if step % EVERY == 0:
            save_step_checkpoint(root, step, pm, opt, keep=2, extra={"step": step})
    full = pm.full_state_dict()
    if case["phase"] == "resume" and dist.get_rank() == 0:
        torch.save(full, os.path.join(case["dir"], "final.pt"))
    return {**info, "losses": losses, "steps": step}


def main() -> None:
    """``argv[1]``: the cases, ``argv[2]``: where rank 0 writes the results. The ``save``
    cases run on the launch's 4 ranks; then ranks 2 and 3 leave (the lost ranks) and 0 and 1
    start a new 2-rank world (a fresh process group, its store on a port rank 0 chose while
    the launch's store held its own) for the ``resume`` cases."""
    cases, out = json.loads(sys.argv[1]), sys.argv[2]
    phases = [[c for c in cases if c["phase"] == p] for p in ("save", "resume")]
    rank, results = int(os.environ["RANK"]), []
    if rank == 0:
        with open(f"{out}.port", "w") as f:
            f.write(str(free_port()))
    for k, todo in enumerate(phases):
        if k == 1:              # run_cases' closing barrier: rank 0 wrote the port before it
            if rank >= 2:
                return                  # the ranks lost
            with open(f"{out}.port") as f:
                port = f.read()
            os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=port,
                              TORCHELASTIC_USE_AGENT_STORE="False")   # rank 0 hosts the store
        sys.argv[1:3] = [json.dumps(todo), f"{out}.{k}"]
        run_cases(run_case)         # inits the process group of this world; destroys it at the end
        if rank == 0:
            with open(f"{out}.{k}") as f:
                results += json.load(f)
            with open(out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main()
