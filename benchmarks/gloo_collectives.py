"""gloo collectives on this machine: the alpha-beta constants of the CPU cluster model.

    python benchmarks/gloo_collectives.py            # 2 and 4 ranks, prints a table and a fit
    python benchmarks/gloo_collectives.py 2          # 2 ranks only

Times ``all_reduce``, ``all_gather`` (list form, as ``autopar.runtime.comm.DistComm``),
``reduce_scatter_tensor`` and ``all_to_all_single`` from 4 B to 16 MB on real gloo ranks
(torchrun, ``OMP_NUM_THREADS=1``), three ways per size:

- ``best`` and ``median``: the collective alone after a barrier (idle ranks, arriving
  together);
- ``busy``: what the collective adds to a loop that computes between collectives, without
  a barrier (``_busy_cost``): the ranks arrive as unevenly as in training, the buffers are
  out of cache, and gloo's threads wake from sleep. This is the condition every autopar
  collective runs in.

and fits, per collective, the model of ``autopar.cost_models.comm``::

    t = steps(n) * alpha + factor(n) * S / busbw

(alpha from the runs under 1 MB, busbw from the larger ones, see ``fit``).
``hardware.GLOO_COLLECTIVES`` holds the ``busy`` fit for 2 ranks on 2 cores; 4 ranks
share the cores and ``hardware._cpu_cluster`` scales it by cores / ranks.
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
STATS = ("best", "median", "busy")      # the columns measured per size, see ``worker``


def _busy_cost(op, repeats: int) -> float:
    """Seconds ``op`` adds to a training-like loop: each iteration computes (a 384^2
    matmul chain, about the work between two tensor-parallel collectives of a small layer,
    and enough data to push the collective's buffers out of L2) then runs the collective,
    with no barrier, so the ranks arrive as unevenly as they do in training. Blocks of the
    loop alternate with blocks of the compute alone; the cost is the difference of the
    medians per iteration."""
    import torch
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    c = torch.empty(384, 384)

    def compute():
        for _ in range(4):
            torch.mm(a, b, out=c)
    with_op, alone = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compute()
        op()
        t1 = time.perf_counter()
        compute()
        t2 = time.perf_counter()
        with_op.append(t1 - t0)
        alone.append(t2 - t1)
    return max(statistics.median(with_op) - statistics.median(alone), 0.0)


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
            busy = _busy_cost(op, 24 if n < 1e6 else 8)
            t = torch.tensor([min(ts), statistics.median(ts), busy], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res.setdefault(kind, []).append((size, *(float(v) for v in t)))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def fit(kind: str, n: int, rows, stat: str = "best") -> tuple[float, float]:
    """(per-step alpha, busbw) of ``kind`` on ``n`` ranks from ``rows`` of
    (size, best, median, busy); ``stat`` picks the column.

    busbw: least squares of ``t - steps * alpha = factor * S / B`` over the 1 MB and larger
    runs; alpha: the median over the runs under 1 MB of ``(t - factor * S / B) / steps``
    (one small run alone is at the mercy of one scheduler hiccup). Two rounds, starting
    from alpha = 0."""
    from autopar.cost_models.comm import _BANDWIDTH_FACTOR, _LATENCY_STEPS
    col = STATS.index(stat) + 1
    steps, factor = _LATENCY_STEPS[kind](n), _BANDWIDTH_FACTOR[kind](n)
    small = [(r[0], r[col]) for r in rows if r[0] < 2**20]
    big = [(r[0], r[col]) for r in rows if r[0] >= 2**20]
    xs = [factor * s for s, _ in big]
    alpha, inv_b = 0.0, 0.0
    for _ in range(2):
        # t - steps*alpha = factor * S / B  ->  1/B = sum(x*y) / sum(x*x), x = factor*S
        ys = [max(t - steps * alpha, 1e-9) for _, t in big]
        inv_b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        alpha = statistics.median(max(t - factor * s * inv_b, 0.0) / steps for s, t in small)
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
    worlds = [int(a) for a in sys.argv[1:]] or [2, 4]
    for n in worlds:
        res = measure(n)
        print(f"\n{n} ranks            size      best us    median us      busy us")
        for kind in KINDS:
            for size, best, med, busy in res[kind]:
                print(f"  {kind:<16}{size:>10}{best * 1e6:>12.0f}{med * 1e6:>12.0f}{busy * 1e6:>13.0f}")
        for stat in STATS:
            print(f"  fit ({stat} runs): per-step alpha, bus bandwidth")
            for kind in KINDS:
                alpha, bw = fit(kind, n, res[kind], stat)
                print(f"    {kind:<16} alpha {alpha * 1e6:7.0f} us   busbw {bw / 1e9:6.3f} GB/s")
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
