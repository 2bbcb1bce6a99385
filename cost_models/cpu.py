"""This machine as a cluster: one CPU core's rates and the TCP loopback link, measured once
per machine and kept on disk (``machine.py``: the first process measures, every later one
reads the same rounded figures, so plans for ``cpu:`` clusters do not move with the load
or the noise of one process's measurement), and gloo's measured collective constants.

``parse_cluster("cpu:4")`` (``hardware.py``) runs :func:`cpu_cluster`: 4 gloo ranks on this
CPU, each with its share of the cores, joined by loopback TCP.
"""
from __future__ import annotations

import math
import os
import socket
import threading
import time
from dataclasses import replace

import torch

from .devices import Cluster, Device, Link
from .machine import measured_once

_cpu_core: Device | None = None
_loopback: Link | None = None


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_core() -> Device:
    """One core of this machine, measured once per machine (about 0.3 s), kept on disk and
    read by every later process (``machine.measured_once``: figures rounded to 2
    significant digits; the first measurement on a machine wins), and kept per process.

    Measured on ONE thread: on a shared machine a multi-threaded matmul waits for its
    slowest thread, and a thread that loses its core to another process stalls the whole
    op for a scheduler tick (we saw 12-16 ms per 512^2 matmul with two threads next to one
    busy process, 2.7 ms with one). Peaks are the best of a few matmuls of 128..512 per
    side (an achieved rate, so ``max_efficiency`` is 1); ``fill_time`` is a 64^3 matmul's
    time beyond ideal; ``mem_bandwidth`` is a warm 32 MB copy (read + write);
    ``launch_overhead`` is a one-element add with autograd recording (eager dispatch),
    ``view_overhead`` a view of it;
    memory is the machine's (sysconf).
    """
    global _cpu_core
    if _cpu_core is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            figures = measured_once("cpu-core", lambda: _core_figures(_measure_cpu()))
            fp8 = measured_once("cpu-fp8", _measure_fp8)
            figures = {**figures, "peak_flops": {**figures["peak_flops"], **fp8}}
        finally:
            torch.set_num_threads(threads)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        _cpu_core = Device(name="cpu-core", memory_bytes=float(memory),
                           max_efficiency=1.0, mem_efficiency=1.0, **figures)
    return _cpu_core


_CORE_FIGURES = ("peak_flops", "mem_bandwidth", "fill_time", "launch_overhead", "view_overhead")
"""The fields of :func:`cpu_core`'s Device that are measured (and kept on disk)."""


def _core_figures(device: Device) -> dict:
    return {k: getattr(device, k) for k in _CORE_FIGURES}


def cpu_device() -> Device:
    """This machine's CPU as one device: a core's rates times the number of cores."""
    return cpu_share(1)


def cpu_share(ranks: int) -> Device:
    """One rank's share of this CPU when ``ranks`` processes run on it at once.

    One rank alone uses every core (torch's default thread count). Several ranks run one
    thread each (torchrun sets OMP_NUM_THREADS=1 when it starts more than one process per
    node), so each gets one core's compute and bandwidth while ranks <= cores, and
    ``cores / ranks`` of it beyond. Memory is split evenly. Launch overhead is per process.
    """
    core, n_cores = cpu_core(), cores()
    scale = n_cores if ranks <= 1 else min(1.0, n_cores / ranks)
    name = "cpu" if ranks <= 1 else f"cpu/{ranks}"
    return replace(core, name=name, memory_bytes=core.memory_bytes / max(1, ranks),
                   peak_flops={k: v * scale for k, v in core.peak_flops.items()},
                   mem_bandwidth=core.mem_bandwidth * scale)


def _best(fn, repeats: int, budget: float = 0.05) -> float:
    """Best time of ``fn`` over up to ``repeats`` runs within ``budget`` seconds (at least 3):
    the best run is the one the other processes on a shared machine did not interrupt."""
    fn()  # warm-up
    best = math.inf
    start = time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if i >= 2 and t1 - start > budget:
            break
    return best


def _measure_fp8() -> dict:
    """The fp8 GEMM rate as ``precision="fp8"`` runs it (``torch._scaled_mm``, e4m3 operands,
    bf16 out), one thread, best of 128..512 per side: CPUs have no fp8 units and torch
    converts (2026-11-29, this machine, 512^3: 14.6 GFLOP/s against fp32's 20 and bf16's
    0.64). Its own figure set, so a machine's earlier measurements stay valid."""
    one = torch.ones(())
    rate = 0.0
    for n in (128, 256, 512):
        a = torch.randn(n, n).to(torch.float8_e4m3fn)
        b = torch.randn(n, n).to(torch.float8_e4m3fn).t()
        t = _best(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
        rate = max(rate, 2 * n**3 / t)
        if t > 10e-3:
            break
    return {"fp8": rate}


def _measure_cpu() -> Device:
    peak: dict[str, float] = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                       ("fp16", torch.float16)):
        rate = 0.0
        for n in (128, 256, 512):  # stop early: some CPUs emulate a dtype at < 1 GFLOP/s
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t = _best(lambda: torch.mm(a, b), 20)
            rate = max(rate, 2 * n**3 / t)
            if t > 10e-3:
                break
        peak[key] = rate
    peak["tf32"] = peak["fp32"]  # CPUs have no TF32 mode

    x = torch.ones(1, requires_grad=True)
    launch = _best(lambda: torch.add(x, x), 200)
    view = _best(lambda: x.view(1, 1), 200)

    n = 64  # a small fp32 matmul's time beyond ideal = fill time
    a, b = torch.randn(n, n), torch.randn(n, n)
    t_small = _best(lambda: torch.mm(a, b), 50)
    fill = max(0.0, t_small - launch - 2 * n**3 / peak["fp32"])

    src = torch.ones(8 * 2**20)  # 32 MB: beyond the caches
    dst = torch.empty_like(src)
    t = _best(lambda: dst.copy_(src), 10)
    bandwidth = 2 * src.nbytes / t  # read + write

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device(name="cpu-core", memory_bytes=float(memory), peak_flops=peak,
                  mem_bandwidth=bandwidth, max_efficiency=1.0, mem_efficiency=1.0,
                  fill_time=fill, launch_overhead=launch, view_overhead=view)


def loopback_link() -> Link:
    """The link between gloo ranks on this machine, measured once and cached.

    gloo moves tensors over TCP, here over the loopback device. We time a 16 MB transfer
    through a 127.0.0.1 TCP socket (bandwidth) and one-byte ping-pongs (half the best round
    trip = latency). This is the link of ranks that each have a core; :func:`parse_cluster`
    divides the bandwidth when ranks outnumber cores and floors the latency at gloo's own
    per-step cost (``GLOO_STEP_LATENCY``). Measured once per machine and kept on disk, as
    :func:`cpu_core` is (``machine.measured_once``).
    """
    global _loopback
    if _loopback is None:
        figures = measured_once("loopback", lambda: {
            k: getattr(lo, k) for lo in [_measure_loopback()] for k in ("bandwidth", "latency")})
        _loopback = Link(**figures)
    return _loopback


def _measure_loopback() -> Link:
    payload = 16 * 2**20
    chunk = b"\0" * (1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        peer, _ = server.accept()
        with client, peer:
            for s in (client, peer):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def sink():
                got = 0
                while got < payload:
                    got += len(peer.recv(1 << 20))
                peer.sendall(b"k")

            th = threading.Thread(target=sink)
            th.start()
            t0 = time.perf_counter()
            for _ in range(payload // len(chunk)):
                client.sendall(chunk)
            client.recv(1)
            bw = payload / (time.perf_counter() - t0)
            th.join()

            def echo(k):
                for _ in range(k):
                    peer.sendall(peer.recv(1))

            k, batches = 40, 5  # best batch: the one no other process interrupted
            th = threading.Thread(target=echo, args=(k * batches,))
            th.start()
            rtt = math.inf
            for _ in range(batches):
                t0 = time.perf_counter()
                for _ in range(k):
                    client.sendall(b"x")
                    client.recv(1)
                rtt = min(rtt, (time.perf_counter() - t0) / k)
            th.join()
    return Link(bandwidth=bw, latency=rtt / 2)


# gloo's fixed cost per ring step is well above a TCP round trip: a 4-byte all_reduce
# through gloo on this 2-core machine (torchrun, 2 and 4 ranks, best of 10) took 155-280 us,
# i.e. 25-140 us per step of the 2(n-1)-step ring; TCP loopback's half round trip is ~10 us.
# 50 us per step sits inside the measured range.
GLOO_STEP_LATENCY = 50e-6


# gloo's collectives on this machine, one rank per core: (per-step alpha, bus bandwidth),
# the fit of ``benchmarks/gloo_collectives.py 2`` (2 ranks on this 2-core machine; the median
# of three runs on a quiet machine, 2026-11-22). alpha is from idle ranks (after a barrier,
# 4 B .. 256 KB); the bandwidth is what a collective reaches between two computations
# (1 .. 16 MB, ranks computing a matmul chain before each collective, no barrier), which is
# how every collective of a training step runs: below the idle figure (1.0-2.9 GB/s for
# all_reduce), since the buffers are out of cache and gloo's threads wake from sleep. gloo
# reaches a third of its all_reduce bandwidth in all_gather and reduce_scatter;
# ``DistComm.all_gather`` uses the list form, so that holds for every all_gather autopar
# issues. With 4 ranks on the 2 cores the same script measures about the 2-rank figures
# scaled by cores / ranks, the rule ``cpu_cluster`` applies.
GLOO_COLLECTIVES = {
    "all_reduce": (325e-6, 0.952e9),
    "all_gather": (424e-6, 0.274e9),
    "reduce_scatter": (483e-6, 0.297e9),
    "all_to_all": (201e-6, 0.421e9),
}
# gloo's send / recv (a pipeline's activations and gradients, one message per tensor), not
# fitted on their own: a 2-rank all_to_all is one send and one receive per rank, so a
# message costs its alpha. Timing the pipeline's case here (two gloo ranks exchanging one
# or two 64 KB tensors each way between computations, 2 and 4 ranks, load 12) gave 0.4-1.1
# ms per extra message, above it under load, as every alpha here is.
GLOO_COLLECTIVES["send"] = GLOO_COLLECTIVES["recv"] = GLOO_COLLECTIVES["all_to_all"]
# The pipeline runtime's cost per action on this machine, one rank per core:
# ``benchmarks/pipeline_overhead.py`` (2 ranks, a stage of one tiny layer, 2 against 8
# micro-batches) measured 230-850 us per action over the four schedules and three runs on
# a quiet machine (2026-11-22); the median of the runs' medians.
PIPELINE_ACTION = 0.54e-3
# What a collective between computations waits for its last peer (the same script: busy
# runs under 1 MB less the alpha-beta time; the median over the 4 collectives x 3 runs,
# which spread from 0.4 to 2.2 ms: the scheduler's jitter on a shared 2-core VM).
GLOO_SKEW = 1.2e-3


def cpu_cluster(ranks: int, spec: str) -> Cluster:
    """This machine as ``ranks`` gloo ranks on one node, named ``spec`` (``ranks >= 1``)."""
    if ranks > 1:
        # TCP over loopback is CPU work (kernel copies) and a gloo ring step also reduces
        # in memory: ranks beyond the core count share the cores, so the bandwidth drops
        # and each step waits for its peers to be scheduled.
        lo = loopback_link()
        share = min(1.0, cores() / ranks)
        link = Link(bandwidth=lo.bandwidth * share,
                    latency=max(lo.latency, GLOO_STEP_LATENCY),
                    collectives=tuple((k, a / share, b * share)
                                      for k, (a, b) in GLOO_COLLECTIVES.items()),
                    skew=GLOO_SKEW / share)
    else:
        link = Link(bandwidth=math.inf, latency=0.0)
    # One node; there is no inter-node link, so it is the loopback link as well.
    device = cpu_share(ranks)
    if ranks > 1:
        device = replace(device, pipeline_action=PIPELINE_ACTION / min(1.0, cores() / ranks))
    return Cluster(name=spec, nodes=1, devices_per_node=ranks, device=device,
                   intra=link, inter=link)
