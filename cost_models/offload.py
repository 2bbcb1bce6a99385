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

The three run one after the other: autopar's runtime starts the copies once the step's
gradient sync has finished (``autopar.runtime.offload``), so no overlap with backward is
counted. Device memory drops the optimizer term (``solver.costing``); the host holds it.

Every constant cites its source, as in ``gpus.py``; what is assumed says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import Device
from .gpus import A100_80GB, GB, H100_80GB, H200

# --- Host links ----------------------------------------------------------------------------
# PCIe line rates per direction for x16 (PCI-SIG: 4.0 = 16 GT/s, 5.0 = 32 GT/s per lane,
#   128b/130b encoding): 4.0 x16 = 31.5 GB/s, 5.0 x16 = 63 GB/s. DGX A100 attaches each GPU
#   over PCIe 4.0 x16, DGX H100 / H200 over PCIe 5.0 x16 (NVIDIA DGX A100 / DGX H100 user
#   guides, system topology). Achieved: 80% of line rate, the scale CUDA's bandwidthTest
#   reports for pinned host memory (~25 GB/s on PCIe 4.0 x16); ASSUMED, not one pinned table.
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


def offload_times(shard_bytes: float, optimizer_states: int, device: Device) -> tuple[float, float]:
    """(seconds of the two copies, seconds of the host step) for an optimizer shard of
    ``shard_bytes`` fp32 bytes (module docstring)."""
    link = host_link(device)
    transfer = 2 * shard_bytes / link.bandwidth
    step = (3 + 2 * optimizer_states) * shard_bytes / link.host_mem_bandwidth
    return transfer, step


def offload_seconds(shard_bytes: float, optimizer_states: int, device: Device) -> float:
    """Seconds per step ZeRO-Offload adds for a shard of ``shard_bytes`` fp32 bytes."""
    return sum(offload_times(shard_bytes, optimizer_states, device))
