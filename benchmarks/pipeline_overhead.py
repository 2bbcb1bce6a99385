"""The pipeline runtime's own cost per scheduled action, on this machine's gloo ranks.

    python benchmarks/pipeline_overhead.py          # 2 ranks, every schedule, ~1 min

A pipelined step pays, besides its ops' compute, a fixed cost per action (a stage's
forward, backward, or zero bubble's input- and weight-gradient halves) that no op profile
sees: torch.distributed.pipelining's Python bookkeeping, the stage program's call, the
point-to-point send and receive of the activation or its gradient through gloo, and on a
shared CPU the wait for the peer to arrive. It grows with the stage's graph (zero bubble's
split backward walks the autograd graph in Python).

We measure it with autopar's own runtime on a model whose compute is negligible: one tiny
``Linear(8, 8) + ReLU`` per stage, batch 16, pinned to ``pipeline=2`` under each schedule
with 2 and 8 micro-batches. The step-time difference over the 6 extra micro-batches,
divided by the actions each rank runs per micro-batch, is the cost of one action (the few
tiny ops' own time, which the op profile counts anyway, is a few percent of it). The cost
per op node of the stage (dispatch, the autograd engine) is in the profiled op times and
is not measured again here.

``cost_models/cpu.py``'s ``PIPELINE_ACTION`` holds the median over schedules and runs of what
this prints (one rank per core); the pipeline planner adds it to every stage's time per
micro-batch.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import autopar  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
DEPTH = 1                 # layers per stage
MICRO = (2, 8)
BATCH = 16


def chain(n_layers: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(n_layers):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    model = nn.Sequential(*layers)
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 8)
    return model, (x,), y


def worker(out_path: str) -> None:
    dist.init_process_group("gloo")
    rows = []
    for schedule in SCHEDULES:
        v = 2 if schedule == "interleaved-1f1b" else 1
        for depth in (DEPTH,):
            model, inputs, y = chain(depth * 2 * v)
            for m in MICRO:
                pm = autopar.parallelize(model, inputs, F.mse_loss, target=y, pipeline=2,
                                         schedule=schedule, micro_batch_size=BATCH // m,
                                         virtual_stages=v if v > 1 else None)
                times = []
                for i in range(8):
                    dist.barrier()
                    t0 = time.perf_counter()
                    pm.train_step(*inputs, target=y)
                    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if i >= 2:
                        times.append(float(t))
                nodes = sum(1 for sg, _ in pm.runner.stages["train"] for n in sg.gm.graph.nodes
                            if n.op == "call_function") / v
                t_nodes = torch.tensor([nodes], dtype=torch.float64)
                dist.all_reduce(t_nodes, op=dist.ReduceOp.MAX)
                rows.append({"schedule": schedule, "depth": depth, "m": m, "v": v,
                             "nodes": float(t_nodes), "step_s": statistics.median(times)})
                del pm
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def actions_per_microbatch(schedule: str, v: int) -> int:
    """Actions one rank runs per micro-batch: F and B per stage (F, I and W under zero
    bubble)."""
    return v * (3 if schedule == "zero-bubble" else 2)


def fit(rows: list[dict]) -> dict[str, float]:
    """{schedule: seconds of one action}."""
    out = {}
    for schedule in SCHEDULES:
        r = {row["m"]: row for row in rows if row["schedule"] == schedule}
        lo, hi = r[MICRO[0]], r[MICRO[1]]
        per = (hi["step_s"] - lo["step_s"]) / (MICRO[1] - MICRO[0])
        out[schedule] = max(0.0, per / actions_per_microbatch(schedule, hi["v"]))
    return out


def measure() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.abspath(__file__), "--worker", out]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed:\n{proc.stderr[-6000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    rows = measure()
    print(f"{'schedule':<18}{'layers':>7}{'nodes':>7}{'m':>4}{'step ms':>10}")
    for r in rows:
        print(f"{r['schedule']:<18}{r['depth']:>7}{r['nodes']:>7.0f}{r['m']:>4}{r['step_s'] * 1e3:>10.1f}")
    print("\ncost of one action")
    costs = fit(rows)
    for schedule, a in costs.items():
        print(f"  {schedule:<18} {a * 1e6:7.0f} us")
    print(f"  median             {statistics.median(costs.values()) * 1e6:7.0f} us")
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
