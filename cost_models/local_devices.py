"""The cluster this job runs on, from the devices it sees (``autopar.parallelize`` without
``cluster=``).

- No CUDA: ``"cpu:<world>"`` (this machine's measured CPU as gloo ranks, ``cpu.py``).
- CUDA, and the device's name (``torch.cuda.get_device_name``) names a preset GPU (A100,
  H100, H200; ``gpus.py``): that preset's node with ``<nodes> x <per node>`` devices, the
  preset device's memory replaced by the memory the device reports. Its name is a preset
  string ``parse_cluster`` reads back (``"1x4xA100"``).
- CUDA, any other device: a generic description whose compute peak and memory bandwidth are
  measured on the device here (one large matmul per dtype, one large copy) and whose links
  are a stated assumption (:data:`GENERIC_INTRA`, :data:`GENERIC_INTER`), never a string the
  parser rejects: the :class:`Cluster` itself is returned.

Nodes: ``world / per_node`` with ``per_node`` = torchrun's ``LOCAL_WORLD_SIZE`` (else the
visible device count, at most ``world``).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import replace

import torch

from autopar.errors import ArgumentError

from .host import GPU_HOST_OP_S
from .devices import Cluster, Device, Link
from .gpus import DEVICES, NODE_OF_DEVICE, NODES

GB = 1e9
# Links of an unknown GPU (not measured: measuring needs the process group this choice
# comes before). PCIe 4.0 x16 is ~25 GB/s per direction; NCCL over it reaches ~20 GB/s
# busbw. Between nodes one 100 Gb/s NIC at 90%. Latency as the presets' NCCL hop.
GENERIC_INTRA = Link(bandwidth=20 * GB, latency=2.5e-6)
GENERIC_INTER = Link(bandwidth=100e9 / 8 * 0.9, latency=2.5e-6)


def preset_key(device_name: str) -> str | None:
    """The ``gpus.DEVICES`` key a CUDA device name stands for ("NVIDIA A100-SXM4-80GB" ->
    "a100", "NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    for key in DEVICES:
        if any(w.startswith(key) and not w[len(key):].isdigit() for w in words):
            return key
    return None


def _per_node(world: int) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    n = int(local) if local else min(torch.cuda.device_count(), world)
    n = max(1, min(n, world))
    if world % n:
        raise ArgumentError(f"{world} ranks do not fill nodes of {n} devices (LOCAL_WORLD_SIZE); "
                            "pass cluster= to autopar.parallelize")
    return n


def local_cluster(world: int) -> "str | Cluster":
    """The cluster of this job's ``world`` ranks as seen from this process (see module doc)."""
    if not torch.cuda.is_available():
        return f"cpu:{world}"
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    per_node = _per_node(world)
    nodes = world // per_node
    key = preset_key(name)
    if key is not None:
        node = NODES[NODE_OF_DEVICE[key]]
        memory = float(torch.cuda.get_device_properties(index).total_memory)
        return Cluster(name=f"{nodes}x{per_node}x{key.upper()}", nodes=nodes,
                       devices_per_node=per_node,
                       device=replace(node.device, memory_bytes=memory),
                       intra=node.intra, inter=node.inter)
    device = measured_device(torch.device("cuda", index), name)
    return Cluster(name=f"local:{nodes}x{per_node}x{device.name}", nodes=nodes,
                   devices_per_node=per_node, device=device,
                   intra=GENERIC_INTRA, inter=GENERIC_INTER if nodes > 1 else GENERIC_INTRA)


def _timed(fn, device: torch.device, reps: int = 3) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measured_device(device: torch.device, name: str, n: int = 2048) -> Device:
    """A :class:`Device` whose peaks are measured on ``device``: an ``n``-cube matmul per
    dtype (fp32, bf16, fp16; fp8 where ``torch._scaled_mm`` runs) and a copy of ``n * n * 16`` bytes. Memory: what the device
    reports (the host's for a CPU device: only for tests)."""
    flops = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        flops[label] = 2 * n ** 3 / _timed(lambda: a @ b, device)
    flops["tf32"] = flops["fp32"]
    try:        # precision="fp8"'s GEMM (torch._scaled_mm); none before Ada / Hopper
        one = torch.ones((), device=device)
        a8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        flops["fp8"] = 2 * n ** 3 / _timed(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        pass        # no fp8 rate: precision="fp8" is refused there (cost_models.fp8.check_fp8)
    src = torch.empty(n * n * 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), device)
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    # measured rates are achieved ones: efficiency 1 against them
    return Device(name=re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "gpu",
                  memory_bytes=memory, peak_flops=flops, mem_bandwidth=bandwidth,
                  max_efficiency=1.0, mem_efficiency=1.0, fill_time=3e-6, launch_overhead=5e-6,
                  host_op_s=GPU_HOST_OP_S if device.type == "cuda" else 0.0,
                  p2p_by_tag=device.type != "cuda")
