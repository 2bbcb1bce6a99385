"""Runtime overhead: autopar's data-parallel module against torch's DistributedDataParallel
on the same model, the same ranks and the same batch, side by side in one run.

    python benchmarks/runtime_overhead.py [--nproc 2] [--steps 10]

Launches torchrun; each rank times the median training step (forward, backward, gradient
sync, optimizer) of DDP and of ``autopar.parallelize(..., data=N)``; rank 0 prints both and
their ratio (autopar / DDP; 1.0 = no overhead).
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import autopar  # noqa: E402
from examples.models import gpt_factory  # noqa: E402


def worker(steps: int) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ex = gpt_factory(batch=8 * world, n_embd=128, n_layer=4, n_head=4, vocab_size=256, block_size=64, seq_len=64)

    def timed(step_fn):
        times = []
        for i in range(steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            step_fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])

    # DDP: each rank feeds its own slice of the global batch
    ddp = DDP(copy.deepcopy(ex.model))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    b = ex.inputs[0].shape[0] // world
    x, y = ex.inputs[0][rank * b:(rank + 1) * b], ex.target[rank * b:(rank + 1) * b]

    def ddp_step():
        opt.zero_grad()
        ex.loss_fn(ddp(x), y).backward()
        opt.step()

    pm = autopar.parallelize(copy.deepcopy(ex.model), ex.inputs, ex.loss_fn, target=ex.target, data=world)
    popt = torch.optim.SGD(pm.parameters(), lr=0.01)

    def autopar_step():
        popt.zero_grad()
        pm.train_step(*ex.inputs, target=ex.target)
        popt.step()

    t_ddp, t_ap = timed(ddp_step), timed(autopar_step)
    if rank == 0:
        print(f"model: GPT 4 layers, n_embd 128, seq 64, global batch {ex.inputs[0].shape[0]}, "
              f"{world} gloo ranks, median of {steps} steps")
        print(f"DDP      step {t_ddp * 1e3:8.2f} ms")
        print(f"autopar  step {t_ap * 1e3:8.2f} ms   (data={world})")
        print(f"ratio autopar / DDP: {t_ap / t_ddp:.2f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.steps)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", "--steps", str(args.steps)]
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
