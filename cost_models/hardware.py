"""Devices, links and clusters: the hardware the cost models price against.

A :class:`Cluster` is ``nodes x devices_per_node`` identical :class:`Device` s joined by two
:class:`Link` s: ``intra`` inside a node (NVLink; TCP loopback for gloo ranks on this CPU) and ``inter``
between nodes (InfiniBand). Write one as a preset string for :func:`parse_cluster`::

    "4x8xH100"       4 nodes of 8 H100-80GB SXM (DGX H100 links)
    "128xdgx-a100"   128 DGX A100 nodes (8 GPUs each)
    "8xA100"         one node of 8 A100-80GB SXM
    "cpu:4"          this machine's CPU as 4 gloo ranks;  "local" = one rank per core

Every constant cites its source. Bandwidths are what a collective achieves (nccl-tests
"busbw"), not line rates; nothing here is fitted to end-to-end training results.

Mesh axes are laid out row-major over ranks ``0 .. world-1`` and ranks
``0 .. devices_per_node-1`` sit on node 0. :func:`axis_link` gives the link one mesh axis
communicates over.

Inter-node model (stated once, used by :func:`axis_link`): ``inter.bandwidth`` is the bus
bandwidth of one whole node's NICs (DGX: 8 NICs, one per GPU, "rail optimized"). All
groups of an axis run their collective at the same time (SPMD), so the node's NICs are
shared by the ``devices_per_node / m`` groups that have ``m`` members on the node; each
group gets ``inter.bandwidth * m / devices_per_node``, and never more than ``intra``
(its members on one node still meet over NVLink). An axis with one rank per node thus gets
one NIC; an axis spanning whole nodes gets all of them (nccl-tests#119: 3 nodes x 4 HDR
NICs reach 85-96 GB/s busbw against 100 GB/s of NICs per node).
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, replace

import torch

GB = 1e9
Gbit = 1e9 / 8

DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Device:
    """One accelerator (or one rank's share of a CPU)."""
    name: str
    memory_bytes: float
    """Device memory in bytes."""
    peak_flops: dict[str, float]
    """Dense FLOP/s by compute dtype: "fp32" (vector units), "tf32", "bf16", "fp16"
    (tensor cores on GPUs). Datasheet peaks for GPUs; measured for the CPU."""
    mem_bandwidth: float
    """Memory bandwidth in bytes/s (datasheet for GPUs; measured copy for the CPU)."""
    max_efficiency: float = 1.0
    """Fraction of ``peak_flops`` a large GEMM reaches (published cuBLAS numbers; 1.0 for a
    measured peak, which already is an achieved rate)."""
    mem_efficiency: float = 1.0
    """Fraction of ``mem_bandwidth`` a large streaming kernel reaches."""
    fill_time: float = 0.0
    """Seconds of pipeline fill / tail (wave quantization) per compute kernel: an op of
    ``peak * max_efficiency * fill_time`` FLOPs runs at half of ``max_efficiency``."""
    launch_overhead: float = 0.0
    """Seconds of fixed cost per kernel (launch and framework dispatch)."""
    pipeline_action: float = 0.0
    """Seconds the pipeline runtime adds per scheduled action of a stage (a forward, a
    backward, or zero bubble's input and weight halves): torch.distributed.pipelining's
    bookkeeping, the stage program's call and its point-to-point messages. Measured for CPU
    ranks (``benchmarks/pipeline_overhead.py``); zero for GPUs, whose host runs ahead."""
    view_overhead: float = 0.0
    """Seconds per view op (a reshape, transpose, ...: framework dispatch and autograd
    bookkeeping, no kernel), forward and backward alike. Zero for GPUs, whose host runs
    ahead of the kernels; the CPU's host IS the device, so every view is on its clock."""

    def __hash__(self) -> int:  # peak_flops is a dict; hash by name and sizes
        return hash((self.name, self.memory_bytes, self.mem_bandwidth))


@dataclass(frozen=True)
class Link:
    """One communication link class."""
    bandwidth: float
    """Bytes/s per direction that a collective achieves (nccl-tests "busbw")."""
    latency: float
    """Seconds per ring step (alpha)."""
    collectives: tuple[tuple[str, float, float], ...] = ()
    """``(collective, latency, bandwidth)`` for collectives whose implementation reaches a
    different alpha or bus bandwidth on this link than ``latency`` / ``bandwidth`` (gloo's
    all_gather and reduce_scatter are several times slower than its all_reduce)."""
    skew: float = 0.0
    """Seconds a collective between computations waits for its last peer beyond the ring's
    latency (ranks leave their computation unevenly), once per collective. Zero where the
    devices run a stream each (GPUs: the host runs ahead and kernels queue); measured for
    CPU ranks, whose collective starts when the rank's own compute ends."""


@dataclass(frozen=True)
class Cluster:
    """``nodes x devices_per_node`` identical devices."""
    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    """Link between devices of one node (NVLink; memory for CPU ranks)."""
    inter: Link
    """Link between nodes; ``bandwidth`` is per node (all its NICs together)."""

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"cluster {self.name!r}: nodes ({self.nodes}) and "
                             f"devices_per_node ({self.devices_per_node}) must be >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


# --- GPUs --------------------------------------------------------------------------------
# Peaks are dense (no 2:4 sparsity). Large-GEMM efficiencies:
#   A100: cuBLAS fp16 GEMMs of several thousand per side reach ~250 of 312 TFLOP/s, i.e.
#         ~80% (NVIDIA "Matrix Multiplication Background User's Guide", DU-09799-001, its
#         GEMM-throughput-vs-size plots; the exact figure number is not pinned here).
#   H100: 780 of 989 TFLOP/s for a tuned bf16 mm (gist Chillee/2ec89696db8b7ed1c24461159e325405,
#         "H100 peak matmul FLOPS"); cuBLAS is within a few percent of it.
# fill_time 3 us: a GEMM needs whole waves of output tiles over 108 / 132 SMs (same guide,
#   "Wave Quantization"); ~3 us of fill and tail per kernel is the scale of one tile's
#   main loop, so an op of peak*3us FLOPs runs at half efficiency.
# launch_overhead 5 us: CUDA kernel launch plus PyTorch eager dispatch per op (the few-us
#   launch latency in the CUDA C++ Best Practices Guide, "Asynchronous Transfers"; the
#   PyTorch per-op CPU overhead is of the same order).
# Achieved HBM bandwidth ~90% of datasheet (BabelStream / STREAM triad on A100 and H100).
_GPU_FILL = 3e-6
_GPU_LAUNCH = 5e-6
_GPU_MEM_EFF = 0.9

A100_80GB = Device(
    name="A100-80GB-SXM",
    memory_bytes=80 * 2**30,
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS.
    peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    mem_bandwidth=2039 * GB,  # datasheet: HBM2e 2,039 GB/s
    max_efficiency=0.8, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH,
)

H100_80GB = Device(
    name="H100-80GB-SXM",
    memory_bytes=80 * 2**30,
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, TF32 494.5, BF16/FP16 989.5
    # TFLOPS dense (the datasheet's 989 / 1,979 are with sparsity).
    peak_flops={"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    mem_bandwidth=3350 * GB,  # datasheet: HBM3 3.35 TB/s
    max_efficiency=0.79, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH,
)

H200 = Device(
    name="H200-141GB-SXM",
    memory_bytes=141 * GB,  # NVIDIA H200 datasheet: 141 GB HBM3e
    # Same compute as H100 SXM (H200 datasheet lists identical Tensor Core peaks).
    peak_flops=dict(H100_80GB.peak_flops),
    mem_bandwidth=4800 * GB,  # datasheet: 4.8 TB/s
    max_efficiency=0.79, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH,
)

DEVICES: dict[str, Device] = {"a100": A100_80GB, "h100": H100_80GB, "h200": H200}

# --- Links -------------------------------------------------------------------------------
# NVLink busbw: line rate minus NCCL's ~20% protocol overhead ("450GB/s is the line rate.
#   With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
#   370GB/s", S. Jeaugey, nccl-tests#212). A100: 300 GB/s line rate -> 240 GB/s (8x A100
#   SXM measure 200-230 GB/s all_reduce busbw, nccl-tests#149, #178).
# InfiniBand busbw: 90% of the node's NIC line rate (nccl-tests#119: 85-96 of 100 GB/s).
# Latency: NCCL's per-hop ring latency for the LL128 protocol, 2.5 us on NVLink and on the
#   network (nccl src/graph/tuning.cc, hwLat table).
_NCCL_NVLINK_EFF = 370 / 450
_IB_EFF = 0.9
_HOP_LATENCY = 2.5e-6

NVLINK3 = Link(bandwidth=300 * GB * _NCCL_NVLINK_EFF, latency=_HOP_LATENCY)  # DGX A100
NVLINK4 = Link(bandwidth=450 * GB * _NCCL_NVLINK_EFF, latency=_HOP_LATENCY)  # DGX H100/H200
IB_8xHDR = Link(bandwidth=8 * 200 * Gbit * _IB_EFF, latency=_HOP_LATENCY)    # 8 x 200 Gb/s
IB_8xNDR = Link(bandwidth=8 * 400 * Gbit * _IB_EFF, latency=_HOP_LATENCY)    # 8 x 400 Gb/s


@dataclass(frozen=True)
class NodePreset:
    device: Device
    devices_per_node: int
    intra: Link
    inter: Link


NODES: dict[str, NodePreset] = {
    # DGX A100: 8 A100 SXM, NVLink3 300 GB/s per direction, 8 x 200 Gb/s HDR InfiniBand.
    "dgx-a100": NodePreset(A100_80GB, 8, NVLINK3, IB_8xHDR),
    # DGX H100: 8 H100 SXM, NVLink4 450 GB/s per direction, 8 x 400 Gb/s NDR InfiniBand.
    "dgx-h100": NodePreset(H100_80GB, 8, NVLINK4, IB_8xNDR),
    # DGX H200: same fabric as DGX H100.
    "dgx-h200": NodePreset(H200, 8, NVLINK4, IB_8xNDR),
}
_NODE_OF_DEVICE = {"a100": "dgx-a100", "h100": "dgx-h100", "h200": "dgx-h200"}


# --- This machine's CPU ------------------------------------------------------------------
_cpu_core: Device | None = None
_loopback: Link | None = None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_core() -> Device:
    """One core of this machine, measured once per process (about 0.3 s) and cached.

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
            _cpu_core = _measure_cpu()
        finally:
            torch.set_num_threads(threads)
    return _cpu_core


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
    core, cores = cpu_core(), _cores()
    scale = cores if ranks <= 1 else min(1.0, cores / ranks)
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
    per-step cost (``GLOO_STEP_LATENCY``).
    """
    global _loopback
    if _loopback is None:
        _loopback = _measure_loopback()
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


# --- Parsing -----------------------------------------------------------------------------
_PRESET_HELP = ("'<nodes>x<devices>x<A100|H100|H200>' (e.g. '4x8xH100'), "
                "'<nodes>x<dgx-a100|dgx-h100|dgx-h200>' (e.g. '128xdgx-a100'), "
                "'<devices>x<A100|H100|H200>' (one node, e.g. '8xA100'), "
                "'cpu:<ranks>' (e.g. 'cpu:4'), 'local'")


def parse_cluster(spec: "str | Cluster") -> Cluster:
    """A :class:`Cluster` from a preset string (or the cluster itself).

    >>> parse_cluster("4x8xH100").world_size
    32
    """
    if isinstance(spec, Cluster):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"cluster spec must be a string or Cluster, got {spec!r}; "
                         f"valid presets: {_PRESET_HELP}")
    s = spec.strip().lower()
    if s == "local":
        return _cpu_cluster(_cores(), spec)
    m = re.fullmatch(r"cpu(?::(\d+))?", s)
    if m:
        return _cpu_cluster(int(m.group(1) or 1), spec)
    m = re.fullmatch(r"(\d+)x(dgx-[a-z0-9]+)", s)
    if m and m.group(2) in NODES:
        return _gpu_cluster(spec, int(m.group(1)), NODES[m.group(2)], None)
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([a-z0-9]+?)(?:-80gb|-141gb)?(?:-sxm)?", s)
    if m and m.group(3) in DEVICES:
        node = NODES[_NODE_OF_DEVICE[m.group(3)]]
        return _gpu_cluster(spec, int(m.group(1) or 1), node, int(m.group(2)))
    raise ValueError(f"unknown cluster spec {spec!r}; valid presets: {_PRESET_HELP}; "
                     f"or pass a Cluster")


def _gpu_cluster(spec: str, nodes: int, node: NodePreset, per_node: int | None) -> Cluster:
    per_node = node.devices_per_node if per_node is None else per_node
    if nodes < 1 or per_node < 1:
        raise ValueError(f"cluster spec {spec!r} has no devices; valid presets: {_PRESET_HELP}")
    return Cluster(name=spec, nodes=nodes, devices_per_node=per_node, device=node.device,
                   intra=node.intra, inter=node.inter)


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
# scaled by cores / ranks, the rule ``_cpu_cluster`` applies.
GLOO_COLLECTIVES = {
    "all_reduce": (325e-6, 0.952e9),
    "all_gather": (424e-6, 0.274e9),
    "reduce_scatter": (483e-6, 0.297e9),
    "all_to_all": (201e-6, 0.421e9),
}
# The pipeline runtime's cost per action on this machine, one rank per core:
# ``benchmarks/pipeline_overhead.py`` (2 ranks, a stage of one tiny layer, 2 against 8
# micro-batches) measured 230-850 us per action over the four schedules and three runs on
# a quiet machine (2026-11-22); the median of the runs' medians.
PIPELINE_ACTION = 0.54e-3
# What a collective between computations waits for its last peer (the same script: busy
# runs under 1 MB less the alpha-beta time; the median over the 4 collectives x 3 runs,
# which spread from 0.4 to 2.2 ms: the scheduler's jitter on a shared 2-core VM).
GLOO_SKEW = 1.2e-3


def _cpu_cluster(ranks: int, spec: str) -> Cluster:
    if ranks < 1:
        raise ValueError(f"cluster spec {spec!r} needs at least one rank; "
                         f"valid presets: {_PRESET_HELP}")
    if ranks > 1:
        # TCP over loopback is CPU work (kernel copies) and a gloo ring step also reduces
        # in memory: ranks beyond the core count share the cores, so the bandwidth drops
        # and each step waits for its peers to be scheduled.
        lo = loopback_link()
        share = min(1.0, _cores() / ranks)
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
        device = replace(device, pipeline_action=PIPELINE_ACTION / min(1.0, _cores() / ranks))
    return Cluster(name=spec, nodes=1, devices_per_node=ranks, device=device,
                   intra=link, inter=link)


# --- Mesh axes ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def axis_link(cluster: Cluster, mesh_shape: tuple[int, ...], axis: int) -> Link:
    """The link the groups of mesh axis ``axis`` communicate over (see the module
    docstring for the inter-node sharing model)."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if math.prod(mesh_shape) != cluster.world_size:
        raise ValueError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} ranks but cluster "
                         f"{cluster.name!r} has {cluster.world_size}")
    if not -len(mesh_shape) <= axis < len(mesh_shape):
        raise ValueError(f"axis {axis} out of range for mesh {mesh_shape}")
    axis %= len(mesh_shape)
    size = mesh_shape[axis]
    stride = math.prod(mesh_shape[axis + 1:])
    dpn = cluster.devices_per_node
    if size == 1:
        return cluster.intra
    # The group through its lowest rank r is r + k*stride, k < size. A node boundary may cut
    # groups unevenly, so look at every group; the slowest (fewest members on some node,
    # hence the smallest NIC share) sets the pace of the whole axis.
    m = dpn
    crosses = False
    for start in _group_starts(mesh_shape, axis):
        nodes: dict[int, int] = {}
        for k in range(size):
            n = (start + k * stride) // dpn
            nodes[n] = nodes.get(n, 0) + 1
        if len(nodes) > 1:
            crosses = True
        m = min(m, *nodes.values())
    if not crosses:
        return cluster.intra
    share = cluster.inter.bandwidth * m / dpn
    return Link(bandwidth=min(share, cluster.intra.bandwidth),
                latency=max(cluster.inter.latency, cluster.intra.latency))


def _group_starts(mesh_shape: tuple[int, ...], axis: int):
    """The lowest rank of every group along ``axis`` (its index on ``axis`` is 0)."""
    others = [range(s) if i != axis else range(1) for i, s in enumerate(mesh_shape)]
    strides = [math.prod(mesh_shape[i + 1:]) for i in range(len(mesh_shape))]
    for idx in itertools.product(*others):
        yield sum(i * st for i, st in zip(idx, strides))
