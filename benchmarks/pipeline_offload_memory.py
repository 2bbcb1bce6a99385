"""Activation offload inside pipeline stages: each gloo rank's device peak on this CPU against
the plan's estimate (the fullest rank's), with and without ``offload_activations="full"``.

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/pipeline_offload_memory.py \\
        [--schedule 1f1b] [--micro-batch-size 2] [--precision fp32|bf16]

The GPT of ``tests/test_offload_memory.py`` (hidden 128, 4 layers, 8 x 128 tokens,
vocabulary 1,024), ``pipeline=2``, SGD with momentum. On each rank one warm-up step, then
one step measured as ``benchmarks/offload_memory.py`` measures a flat one (``device_peak``:
the live tensor storages at once, less the offload hooks' host copies, plus the rank's
weights and momentum). Rank 0 prints every rank's peak, the estimate's terms and what the
hooks copied to the host in the measured step."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import autopar  # noqa: E402
from examples.models import gpt_factory  # noqa: E402
from offload_memory import device_peak  # noqa: E402

MiB = 2**20


def measure(offload: str, args) -> dict:
    torch.manual_seed(0)
    ex = gpt_factory(batch=8, n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=1024)
    pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, pipeline=2,
                             schedule=args.schedule, micro_batch_size=args.micro_batch_size,
                             recompute="none", optimizer="sgd_momentum", offload_activations=offload,
                             **({"precision": args.precision} if args.precision != "fp32" else {}))
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        pm.train_step(*ex.inputs, target=ex.target)
        pm.step(opt)
    step()
    hooks = [sg.gm.meta["offload_host"] for sg, _ in pm.runner.stages["train"]
             if "offload_host" in sg.gm.meta]
    before = sum(h.packed_bytes for h in hooks)
    opt.zero_grad(set_to_none=True)
    peak = device_peak(pm, opt, step)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (peak, sum(h.packed_bytes for h in hooks) - before))
    return {"plan": pm.plan, "peaks": every}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    for off in ("none", "full"):
        r = measure(off, args)
        if dist.get_rank() == 0:
            plan = r["plan"]
            est = plan.estimate
            terms = ", ".join(f"{k} {b / MiB:.3f}" for k, b in est.memory_bytes.items())
            peaks = ", ".join(f"rank {k} {p / MiB:.3f} MiB (copied to the host {h / MiB:.3f})"
                              for k, (p, h) in enumerate(r["peaks"]))
            print(f"offload={off} {plan.schedule} m={plan.n_microbatches}: measured {peaks}; "
                  f"estimate (fullest rank) {est.memory_total / MiB:.3f} MiB [{terms}]; host "
                  f"{plan.host_memory_bytes.get('activations', 0.0) / MiB:.3f} MiB", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
