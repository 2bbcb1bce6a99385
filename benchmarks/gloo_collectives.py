"""gloo collectives on this machine: the alpha-beta constants of the CPU cluster model.

    python benchmarks/gloo_collectives.py            # 2 and 4 ranks, prints a table and a fit

Times ``all_reduce``, ``all_gather`` (list form, as ``autopar.runtime.comm.DistComm``),
``reduce_scatter_tensor`` and ``all_to_all_single`` from 4 B to 16 MB on real gloo ranks
(torchrun, ``OMP_NUM_THREADS=1``), keeps the best of several runs after a barrier (the one
other processes on the shared machine disturbed least, as ``hardware.cpu_core`` does) and
fits, per collective, the model of ``autopar.cost_models.comm``::

    t = steps(n) * alpha + factor(n) * S / busbw

alpha from the 4-byte run, busbw from the 1..16 MB runs (least squares through the
latency). ``hardware.GLOO_COLLECTIVES`` holds the figures this prints for 2 ranks on 2
cores; 4 ranks share the cores and ``hardware._cpu_cluster`` scales busbw by cores / ranks.
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

SIZES = [1, 256, 16384, 262144, 1048576, 4194304]      # floats per rank
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]


def worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    w = dist.get_world_size()
    res = {}
    for kind in KINDS:
        for n in SIZES:
            # S of the model: all_reduce the tensor, all_gather the gathered result,
            # reduce_scatter the unreduced input, all_to_all the local tensor
            x = torch.randn(n * w if kind in ("reduce_scatter", "all_to_all") else n)
            size = x.numel() * 4 * (w if kind == "all_gather" else 1)

            def op():
                if kind == "all_reduce":
                    dist.all_reduce(x)
                elif kind == "all_gather":
                    dist.all_gather([torch.empty_like(x) for _ in range(w)], x)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(torch.empty(n), x)
                else:
                    dist.all_to_all_single(torch.empty_like(x), x)
            for _ in range(2):
                op()
            ts = []
            for _ in range(12 if n < 1e6 else 5):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
            t = torch.tensor([min(ts), statistics.median(ts)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res.setdefault(kind, []).append((size, float(t[0]), float(t[1])))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def fit(kind: str, n: int, rows, stat: str = "best") -> tuple[float, float]:
    """(per-step alpha, busbw) of ``kind`` on ``n`` ranks from ``rows`` of
    (size, best, median); ``stat`` picks the column."""
    from autopar.cost_models.comm import _BANDWIDTH_FACTOR, _LATENCY_STEPS
    col = 1 if stat == "best" else 2
    steps, factor = _LATENCY_STEPS[kind](n), _BANDWIDTH_FACTOR[kind](n)
    alpha = rows[0][col] / steps
    big = [(r[0], r[col]) for r in rows if r[0] >= 2**20]
    # t - steps*alpha = factor * S / B  ->  1/B = sum(x*y) / sum(x*x), x = factor*S
    xs = [factor * s for s, _ in big]
    ys = [max(t - steps * alpha, 1e-9) for _, t in big]
    inv_b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return alpha, 1.0 / inv_b


def measure(world: int) -> dict:
    """Run the worker on ``world`` gloo ranks; {collective: [(size, best s, median s)]}."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               os.path.abspath(__file__), "--worker", out]
        subprocess.run(cmd, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            return json.load(f)


def constants(world: int, stat: str = "best") -> tuple[tuple[str, float, float], ...]:
    """``Link.collectives`` for ``world`` gloo ranks, measured now."""
    res = measure(world)
    return tuple((kind, *fit(kind, world, res[kind], stat)) for kind in KINDS)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    for n in (2, 4):
        res = measure(n)
        print(f"\n{n} ranks            size      best us    median us")
        for kind in KINDS:
            for size, best, med in res[kind]:
                print(f"  {kind:<16}{size:>10}{best * 1e6:>12.0f}{med * 1e6:>12.0f}")
        for stat in ("best", "median"):
            print(f"  fit ({stat} runs): per-step alpha, bus bandwidth")
            for kind in KINDS:
                alpha, bw = fit(kind, n, res[kind], stat)
                print(f"    {kind:<16} alpha {alpha * 1e6:7.0f} us   busbw {bw / 1e9:6.3f} GB/s")
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
