"""ZeRO-Offload's prices (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
Training"): the link between a device and its host, and the optimizer step on the host.

Under ``offload="optimizer"`` each rank's optimizer shard (fp32 master copy and moments) lives
in host memory. Per step and per parameter shard of ``b`` fp32 bytes (autopar's gradients and
working weights are fp32, mixed precision included, see ``memory.py``):

- the gradient shard goes down, device -> host: ``b / bandwidth``;
- the host steps it: AdamW reads and writes the master copy and its 2 moments and reads the
  gradient, ``(3 + 2 * states) * b`` bytes of host memory traffic, at
  ``host_mem_bandwidth`` (a roofline on memory: an optimizer step does a few flops per byte);
- the updated shard goes up, host -> device: ``b / bandwidth``.

Overlap rule: the copies down overlap backward except the last bucket's, the copies up
overlap the all-gathers except the first bucket's; the host step is never hidden. The
runtime (``autopar.runtime.offload``) copies a bucket's gradient shards down as soon as its
reduction finishes, while backward goes on, and the host step waits only for the copies; a
bucket's masters go up just before its gather, so the copy of bucket i+1 runs beside the
gather of bucket i. The bucket left exposed each way is one ``DDP_BUCKET_BYTES`` bucket (as
``pricing.costing.overlap_rule`` takes the last reduction's), or the whole shard when it is
smaller: of a rank's ``S`` shard bytes the copies expose ``min(1, DDP_BUCKET_BYTES / S)``
(:func:`exposed_share`). The solver prices per parameter, so each parameter's copies are
counted at that share (they sum to one bucket each way), beside its whole host step. Device
memory drops the optimizer term (``pricing.costing``); the host holds it.

Every constant cites its source, as in ``gpus.py``; what is assumed says so.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

from . import comm
from .devices import Device
from .gpus import A100_80GB, GB, H100_80GB, H200
from .machine import measured_once

# --- Host links ----------------------------------------------------------------------------
# PCIe line rates per direction for x16 (PCI-SIG: 4.0 = 16 GT/s, 5.0 = 32 GT/s per lane,
#   128b/130b encoding): 4.0 x16 = 31.5 GB/s, 5.0 x16 = 63 GB/s. DGX A100 attaches each GPU
#   over PCIe 4.0 x16, DGX H100 / H200 over PCIe 5.0 x16 (NVIDIA DGX A100 / DGX H100 user
#   guides, system topology). Achieved: 80% of line rate, the scale CUDA's bandwidthTest
#   reports for pinned host memory (~25 GB/s on PCIe 4.0 x16). Checked on one H200
#   (benchmarks/host_link.py, benchmarks/results/host_link_nvidia-h200_session28.json,
#   2026-11-29): pinned copies of 64 MiB-1 GiB at 54.6-55.1 GB/s device to host and
#   51.7-53.2 host to device, 82-87% of 5.0 x16's line rate; a 1 GiB copy on a side stream
#   beside bf16 GEMMs was 95% hidden.
_PCIE_EFF = 0.8
PCIE4_X16 = 16e9 * 16 * 128 / 130 / 8        # bytes/s per direction, line rate
PCIE5_X16 = 32e9 * 16 * 128 / 130 / 8
# Host memory: DGX A100 has 2 AMD EPYC 7742 (DGX A100 datasheet), 8 channels of DDR4-3200
#   each = 204.8 GB/s per socket (AMD EPYC 7742 product page); DGX H100 2 Intel Xeon Platinum
#   8480C (DGX H100 datasheet), 8 channels of DDR5-4800 = 307.2 GB/s per socket (Intel ARK).
#   The 8 GPUs' host steps run at once, so one GPU's step gets 1/8 of the node's bandwidth,
#   of which STREAM-like kernels reach ~80% (ASSUMED from STREAM triad on such servers).
_STREAM_EFF = 0.8
_DGX_A100_HOST_MEM = 2 * 204.8 * GB
_DGX_H100_HOST_MEM = 2 * 307.2 * GB


@dataclass(frozen=True)
class HostLink:
    """A device's path to its host's memory."""
    bandwidth: float
    """Bytes/s per direction between the device and host memory (pinned)."""
    host_mem_bandwidth: float
    """Bytes/s of host memory traffic one device's host-side optimizer step gets."""


HOST_LINKS: dict[str, HostLink] = {
    A100_80GB.name: HostLink(PCIE4_X16 * _PCIE_EFF, _DGX_A100_HOST_MEM / 8 * _STREAM_EFF),
    H100_80GB.name: HostLink(PCIE5_X16 * _PCIE_EFF, _DGX_H100_HOST_MEM / 8 * _STREAM_EFF),
    H200.name: HostLink(PCIE5_X16 * _PCIE_EFF, _DGX_H100_HOST_MEM / 8 * _STREAM_EFF),  # DGX H200: DGX H100's host
}
DEFAULT_GPU_LINK = HostLink(PCIE4_X16 * _PCIE_EFF, _DGX_A100_HOST_MEM / 8 * _STREAM_EFF)
"""A GPU without a preset (a measured local description): a DGX A100's host, ASSUMED."""


def host_link(device: Device) -> HostLink:
    """The host link of ``device``. A CPU rank's host IS its memory: the "link" is a memcpy,
    which reads and writes each byte (``Device.mem_bandwidth`` counts both), and the host
    step runs at the rank's own memory bandwidth (``cpu.py`` measures both)."""
    if device.name in HOST_LINKS:
        return HOST_LINKS[device.name]
    if device.name.startswith("cpu"):
        return HostLink(device.mem_bandwidth / 2, device.mem_bandwidth)
    return DEFAULT_GPU_LINK


def exposed_share(rank_shard_bytes: float, bucket_bytes: float | None = None) -> float:
    """The share of a rank's copies left on the step when its whole offloaded shard is
    ``rank_shard_bytes``: one bucket (``bucket_bytes``, default ``comm.DDP_BUCKET_BYTES``)
    each way, all of it when the shard is smaller (module docstring's overlap rule)."""
    if bucket_bytes is None:
        bucket_bytes = comm.DDP_BUCKET_BYTES
    return 1.0 if rank_shard_bytes <= bucket_bytes else bucket_bytes / rank_shard_bytes


def offload_times(shard_bytes: float, optimizer_states: int, device: Device,
                  exposed: float = 1.0) -> tuple[float, float]:
    """(seconds of the two copies left on the step, seconds of the host step) for an
    optimizer shard of ``shard_bytes`` fp32 bytes, ``exposed`` of whose copies are not
    hidden (:func:`exposed_share`; 1: all of them)."""
    link = host_link(device)
    transfer = exposed * 2 * shard_bytes / link.bandwidth
    step = (3 + 2 * optimizer_states) * shard_bytes / link.host_mem_bandwidth
    return transfer, step


def offload_seconds(shard_bytes: float, optimizer_states: int, device: Device,
                    exposed: float = 1.0) -> float:
    """Seconds per step ZeRO-Offload adds for a shard of ``shard_bytes`` fp32 bytes."""
    return sum(offload_times(shard_bytes, optimizer_states, device, exposed))


# --- The disk tier (ZeRO-Infinity, Rajbhandari et al. 2021: ``offload="disk"``) ------------
# Under ``offload="disk"`` the optimizer shard (fp32 master copy and moments, ``(1 + states)
# * b`` bytes) lives in files between steps; each step reads it in and writes it back
# (``autopar.runtime.disk_offload``), bucket by bucket: the next bucket is read ahead while
# the host steps this one, and a stepped bucket is written back while the host steps the
# next. Overlap rule: the disk's reads and writes run beside the host step, so a step pays
# the disk time beyond the host step (``max(0, read + write - host step)``); the copies and
# the host step are ZeRO-Offload's (above), unchanged.
#
# NVMe per node, measured through DeepSpeed's DeepNVMe (``ds_io``, 1 GB transfers, drives in
# one RAID-0 volume; DeepSpeed blog "DeepNVMe: Affordable I/O scaling for Deep Learning
# Applications", blogs/deepnvme/03-2025 in github.com/deepspeedai/DeepSpeed): 4 PCIe Gen4
# SSDs read 10 GB/s and write 5 GB/s; 8 Gen5 SSDs (Azure ND-H200-v5) read 48 GB/s and
# write 26 GB/s. A DGX A100 has 4 U.2 NVMe data drives (PCIe Gen4; DGX A100 datasheet:
# 15 TB = 4 x 3.84 TB), so its row is the 4 x Gen4 figure; the H100 and H200 rows take the
# 8-drive Gen5 node (ASSUMED: DGX H100 holds 8 x 3.84 TB U.2 drives; their generation varies
# by node). The node's 8 GPUs stream at once: one GPU's share is 1/8.
_DISK_NODE_GPUS = 8


@dataclass(frozen=True)
class DiskLink:
    """One rank's share of its node's local disk."""
    read: float
    """Bytes/s the rank reads its optimizer files at."""
    write: float
    """Bytes/s it writes them back at."""


DISK_LINKS: dict[str, DiskLink] = {
    A100_80GB.name: DiskLink(10 * GB / _DISK_NODE_GPUS, 5 * GB / _DISK_NODE_GPUS),
    H100_80GB.name: DiskLink(48 * GB / _DISK_NODE_GPUS, 26 * GB / _DISK_NODE_GPUS),
    H200.name: DiskLink(48 * GB / _DISK_NODE_GPUS, 26 * GB / _DISK_NODE_GPUS),
}
DEFAULT_GPU_DISK = DISK_LINKS[A100_80GB.name]
"""A GPU without a preset: a DGX A100's 4 Gen4 drives, ASSUMED."""

_measured_disk: DiskLink | None = None


def measure_disk(directory: str | None = None, nbytes: int = 32 * 2**20) -> DiskLink:
    """This machine's disk (``directory`` None: measured once per machine and kept on disk,
    rounded, as ``cpu.py``'s figures are: ``machine.measured_once``; else measured in that
    directory now, about 0.1-0.5 s): the best of two rounds of writing ``nbytes`` to a file in ``directory`` (default
    ``tempfile.gettempdir()``, where ``offload="disk"`` puts its files) and ``fsync``-ing
    it, then reading it back after dropping it from the page cache
    (``posix_fadvise(DONTNEED)``), as the runtime writes its state back and reads it again."""
    global _measured_disk
    if directory is None:
        if _measured_disk is None:
            figures = measured_once("disk", lambda: vars(_measure_disk(None, nbytes)))
            _measured_disk = DiskLink(**figures)
        return _measured_disk
    return _measure_disk(directory, nbytes)


def _measure_disk(directory: str | None, nbytes: int) -> DiskLink:
    buf = os.urandom(1 << 20) * (nbytes >> 20)
    best_w = best_r = float("inf")
    fd, path = tempfile.mkstemp(prefix="autopar-disk-probe-", dir=directory)
    try:
        for _ in range(2):
            os.lseek(fd, 0, os.SEEK_SET)
            t0 = time.perf_counter()
            os.write(fd, buf)
            os.fsync(fd)
            best_w = min(best_w, time.perf_counter() - t0)
            os.posix_fadvise(fd, 0, len(buf), os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = os.pread(fd, len(buf), 0)
            best_r = min(best_r, time.perf_counter() - t0)
            assert len(got) == len(buf)
    finally:
        os.close(fd)
        os.unlink(path)
    return DiskLink(len(buf) / best_r, len(buf) / best_w)


def disk_link(device: Device) -> DiskLink:
    """The disk share of one rank on ``device``: a GPU's from its node's NVMe (above); a CPU
    rank's from this machine's disk, measured (:func:`measure_disk`), split among the ranks
    that share this CPU (``cpu/N``: N ranks, as ``cpu.cpu_share`` names them)."""
    if device.name in DISK_LINKS:
        return DISK_LINKS[device.name]
    if device.name.startswith("cpu"):
        disk = measure_disk()
        _, _, n = device.name.partition("/")
        ranks = int(n) if n.isdigit() else 1
        return DiskLink(disk.read / ranks, disk.write / ranks)
    return DEFAULT_GPU_DISK


def disk_times(shard_bytes: float, optimizer_states: int, device: Device) -> tuple[float, float]:
    """(seconds of reading, of writing back) the optimizer files of a shard of
    ``shard_bytes`` fp32 bytes: its master copy and ``optimizer_states`` moments."""
    link = disk_link(device)
    state = (1 + optimizer_states) * shard_bytes
    return state / link.read, state / link.write


def disk_seconds(shard_bytes: float, optimizer_states: int, device: Device) -> float:
    """Seconds per step the disk tier adds beyond ZeRO-Offload's for a shard of
    ``shard_bytes``: its reads and writes beyond the host step they run beside."""
    read, write = disk_times(shard_bytes, optimizer_states, device)
    _, step = offload_times(shard_bytes, optimizer_states, device)
    return max(0.0, read + write - step)
