"""The price of activation offload (``offload_activations=``; the runtime is
``autopar.ops.host_activations``).

A layer whose saved activations are offloaded copies its ``S`` saved bytes (per device, per
micro-batch; what ``analysis.saved`` says it keeps for backward, its outputs read by the
next layer aside: they stay) to host memory in forward and back in backward, over the
device's host link of ``bw`` bytes/s per direction (``cost_models.offload.host_link``:
PCIe 5.0 x16 at 80% for H100 / H200, PCIe 4.0 x16 for A100, with their sources there):

    copy = 2 S / bw                                     (out, and back)

(Under mixed precision ``S`` includes the 16-bit copies of the weights only the offloaded
layers read: they are saved tensors the hooks move too; each is priced on its parameter's
node, ``CostModel.with_recompute``.)

**Time.** On a GPU the copy out runs on a side stream beside the next layer's forward and
the copy back beside the backward of the layer after it (backward order: the prefetch), so
only what those do not hide is on the step:

    exposed = max(0, S / bw - F) + max(0, S / bw - B)

with ``F`` / ``B`` the forward / backward compute of the neighbouring layer, which for
repeated layers is a layer alike: the layer's own (the first and last layers' neighbours,
the embedding and the head, are taken as alike too). On a CPU rank nothing runs beside the
copies (one memory, no copy engine): ``exposed = copy`` at a memcpy's rate. The solver
prices per node, linearly, so each offloaded node pays ``exposed_share x 2 a_x / bw`` for
its ``a_x`` saved bytes (as backward time), where ``exposed_share = exposed / copy`` of a
layer (:func:`exposed_share`). ``F``, ``B`` and ``S`` of the layer are taken at each of its
nodes' fastest option: under data, tensor or ZeRO sharding a node's compute and its saved
bytes divide by the same degree, so their ratio, which is all the share reads, hardly
depends on the placements the ILP then chooses.

**Memory.** The offloaded bytes leave the device's activations; what is on the device at
once is the layer in flight (:data:`IN_FLIGHT_LAYERS`): on a GPU the layer whose backward
runs and the one prefetched beside it (two layers' saved bytes), on a CPU rank the one
whose backward runs (one). The freed bytes are in host memory
(``Plan.host_memory_bytes["activations"]``). A layer's output that only the next offloaded
layers read goes with them (they save it), and under mixed precision so do the 16-bit
copies of the weights only they read (``solver.flat.offload_of``). The layers in flight
come back only after the loss's backward, whose gradients (``loss_grads``) they never sit
beside (``cost_models.memory.step_phases``). Measured at world 1 (GPT of the GPU check,
4 layers, bf16): H200 696 MiB, a CPU census of live tensors 681 MiB, against 682 MiB
estimated (935 before; ``tests/test_offload_memory.py``, ``docs/measured.md``).
"""
from __future__ import annotations

from autopar.cost_models.devices import Device
from autopar.cost_models.offload import host_link


def frees_device_memory(device: Device) -> bool:
    """Whether offloading activations frees memory of ``device``: a GPU's saved tensors go
    to the host's memory, apart from its own; a CPU rank's host memory is its memory, so
    there the copies free nothing and the free search never offloads (a pin still runs it:
    the runtime's path is the same)."""
    return not device.name.startswith("cpu")


def overlaps(device: Device) -> bool:
    """Whether ``device`` copies beside its compute (a GPU's copy engines and side stream);
    a CPU rank's copies are memcpys on the cores that compute."""
    return not device.name.startswith("cpu")


IN_FLIGHT_LAYERS = {True: 2, False: 1}
"""Offloaded layers' saved bytes on the device at once, by :func:`overlaps`: a GPU holds the
layer whose backward runs and the one its prefetch brings back; a CPU rank copies back
only when backward reads it."""


def in_flight_layers(device: Device) -> int:
    """:data:`IN_FLIGHT_LAYERS` of ``device``."""
    return IN_FLIGHT_LAYERS[overlaps(device)]


def copy_s(saved_bytes: float, device: Device) -> float:
    """Seconds of the two copies (to the host and back) of ``saved_bytes``: ``2 S / bw``."""
    return 2 * saved_bytes / host_link(device).bandwidth


def exposed_s(saved_bytes: float, forward_s: float, backward_s: float, device: Device) -> float:
    """Seconds of a layer's copies left on the step (module docstring): on a GPU
    ``max(0, S/bw - F) + max(0, S/bw - B)``, on a CPU rank all of :func:`copy_s`."""
    if not overlaps(device):
        return copy_s(saved_bytes, device)
    one_way = saved_bytes / host_link(device).bandwidth
    return max(0.0, one_way - forward_s) + max(0.0, one_way - backward_s)


def exposed_share(saved_bytes: float, forward_s: float, backward_s: float, device: Device) -> float:
    """:func:`exposed_s` over :func:`copy_s` (1 when nothing is saved: no copy to hide)."""
    if saved_bytes <= 0:
        return 1.0
    return exposed_s(saved_bytes, forward_s, backward_s, device) / copy_s(saved_bytes, device)


__all__ = ["IN_FLIGHT_LAYERS", "copy_s", "exposed_s", "exposed_share", "in_flight_layers", "overlaps"]
