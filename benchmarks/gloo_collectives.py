"""gloo collectives on this machine: the alpha-beta constants of the CPU cluster model.

    python benchmarks/gloo_collectives.py            # 2 and 4 ranks, prints a table and a fit
    python benchmarks/gloo_collectives.py 2          # 2 ranks only

Times ``all_reduce``, ``all_gather`` (list form, as ``autopar.ops.comm.DistComm``),
``reduce_scatter_tensor`` and ``all_to_all_single`` from 4 B to 16 MB on real gloo ranks
(torchrun, ``OMP_NUM_THREADS=1``), three ways per size:

- ``best`` and ``median``: the collective alone after a barrier (idle ranks, arriving
  together);
- ``busy``: what the collective adds to a loop that computes between collectives, without
  a barrier (``_busy_cost``): the ranks arrive as unevenly as in training, the buffers are
  out of cache, and gloo's threads wake from sleep. This is the condition every autopar
  collective runs in.

and fits, per collective, the model of ``autopar.cost_models.comm``::

    t = skew + steps(n) * alpha + factor(n) * S / busbw

(alpha from the idle runs, busbw and skew from the busy ones, see ``fit``).
``cost_models/cpu.py``'s ``GLOO_COLLECTIVES`` and ``GLOO_SKEW`` hold the fit for 2 ranks on 2
cores; 4 ranks share the cores and ``cpu.cpu_cluster`` scales it by cores / ranks.
"""
from __future__ import annotations

import json
import math
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

from autopar.cost_models.comm import _BANDWIDTH_FACTOR, _LATENCY_STEPS  # noqa: E402

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
            busy = _busy_cost(op, 60 if n < 1e6 else 8)
            t = torch.tensor([min(ts), statistics.median(ts), busy], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            res.setdefault(kind, []).append((size, *(float(v) for v in t)))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _bandwidth(rows, col, steps, factor, alpha, skew) -> float:
    """busbw by least squares of ``t - steps*alpha - skew = factor * S / B`` over the runs of
    1 MB and more (``1/B = sum(x*y) / sum(x*x)``, x = factor * S)."""
    big = [(r[0], r[col]) for r in rows if r[0] >= 2**20]
    xs = [factor * size for size, _ in big]
    ys = [max(t - steps * alpha - skew, 1e-9) for _, t in big]
    return sum(x * x for x in xs) / sum(x * y for x, y in zip(xs, ys))


def _small_median(rows, col, fn) -> float:
    return statistics.median(max(fn(size, r[col]), 0.0) for r in rows
                             for size in (r[0],) if size < 2**20)


def fit(kind: str, n: int, rows) -> tuple[float, float, float]:
    """(per-step alpha, busbw, skew) of ``kind`` on ``n`` ranks from ``rows`` of
    (size, best, median, busy) seconds:

    - alpha, the cost of a ring step, from the idle runs (median) under 1 MB, less their
      bandwidth term;
    - busbw from the busy runs of 1 MB and more (least squares), the rate collectives
      reach between computations;
    - skew, what a collective waits beyond that for its peers to arrive (they leave their
      computation unevenly), from the busy runs under 1 MB: the median of
      ``t - steps*alpha - factor*S/busbw``. It is paid once per collective, not per step.

    Two rounds each, starting from zero (each term is small where the others are fitted).
    """
    idle, busy = STATS.index("median") + 1, STATS.index("busy") + 1
    steps, factor = _LATENCY_STEPS[kind](n), _BANDWIDTH_FACTOR[kind](n)
    alpha = skew = 0.0
    for _ in range(2):
        bw_idle = _bandwidth(rows, idle, steps, factor, alpha, 0.0)
        alpha = _small_median(rows, idle, lambda s, t: (t - factor * s / bw_idle) / steps)
    bw = math.inf
    for _ in range(2):
        bw = _bandwidth(rows, busy, steps, factor, alpha, skew)
        skew = _small_median(rows, busy, lambda s, t: t - steps * alpha - factor * s / bw)
    return alpha, bw, skew


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


def constants(world: int) -> tuple[tuple[tuple[str, float, float], ...], float]:
    """(``Link.collectives``, ``Link.skew``) for ``world`` gloo ranks, measured now: the
    skew of the link is the median of the collectives' (it is the peers' arrival, not the
    algorithm)."""
    res = measure(world)
    fits = {kind: fit(kind, world, res[kind]) for kind in KINDS}
    return (tuple((kind, a, b) for kind, (a, b, _) in fits.items()),
            statistics.median(f[2] for f in fits.values()))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    worlds = [int(a) for a in sys.argv[1:]] or [2, 4]
    for n in worlds:
        res = measure(n)
        print(f"\n{n} ranks            size      best us    median us      busy us")
        for kind in KINDS:
            for size, best, med, busy in res[kind]:
                print(f"  {kind:<16}{size:>10}{best * 1e6:>12.0f}{med * 1e6:>12.0f}{busy * 1e6:>13.0f}")
        print("  fit: per-step alpha (idle), bus bandwidth (busy), skew per collective (busy)")
        fits = {kind: fit(kind, n, res[kind]) for kind in KINDS}
        for kind, (alpha, bw, skew) in fits.items():
            print(f"    {kind:<16} alpha {alpha * 1e6:7.0f} us   busbw {bw / 1e9:6.3f} GB/s   "
                  f"skew {skew * 1e6:7.0f} us")
        print(f"  link skew (median): {statistics.median(f[2] for f in fits.values()) * 1e6:.0f} us")
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
