"""ZeRO-Offload (Ren et al. 2021) in the runtime: ``offload="optimizer"``.

Each rank's optimizer shard lives in host memory (``autopar.device.HOST``): an fp32 master
copy of every parameter block the rank steps (its ZeRO-1/2 optimizer shard, its ZeRO-3
parameter shard), and with it the optimizer's state (AdamW's moments), which the optimizer
creates next to the tensors it steps. The device keeps what the programs read (the working
parameters; ZeRO-3's shards) and the gradients until the step's sync is done.

- ``pm.parameters()`` are the host master copies: build the optimizer on them as on any
  plan (``torch.optim.AdamW(pm.parameters())``); its ``step`` runs on the host.
- ``train_step``: once the step's gradient sync has finished (ZeRO's reduce-scatter or
  all-reduce, so each device shard holds its block of the summed gradient), each device
  shard's gradient is copied to a host buffer (``non_blocking``; pinned on a GPU, so the
  copies queue behind backward's last kernels and the host waits once for all of them)
  and becomes the master's ``.grad``; the device gradient is released.
- ``pm.step(opt)``: the optimizer steps the host masters; the updated blocks are copied
  host -> device into the device shards, then ZeRO gathers them as without offload. A step
  taken with ``opt.step()`` (or a state dict or checkpoint loaded into the masters) is seen
  by the masters' version counters and copied up before the next forward.

On a CPU rank host and device are one memory: the masters are still separate tensors and
every copy is made, so the path the tests run is the one a GPU runs.
"""
from __future__ import annotations

import torch
from torch import nn

from autopar.device import HOST, pin_host_memory, synchronize
from autopar.plan import Plan


def offloaded(plan: Plan) -> bool:
    """Whether ``plan`` runs ZeRO-Offload."""
    return getattr(plan, "offload", None) == "optimizer"


class HostOptimizer:
    """Host master copies of ``device_params`` (attribute path -> the device tensor the
    optimizer would otherwise step) on ``device``'s host."""

    def __init__(self, device_params: dict[str, nn.Parameter], device: torch.device):
        self.device = device
        self.pinned = pin_host_memory(device)
        self.device_params = dict(device_params)
        self.masters: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for attr, p in self.device_params.items():
                host = torch.empty(p.shape, dtype=p.dtype, device=HOST, pin_memory=self.pinned)
                host.copy_(p.detach())
                self.masters[attr] = nn.Parameter(host, requires_grad=p.requires_grad)
        self._versions = self._now()

    def _now(self) -> list[int]:
        return [m._version for m in self.masters.values()]

    def dirty(self) -> bool:
        """A master changed since it was last copied up (an optimizer step, a load)."""
        return self._now() != self._versions

    @torch.no_grad()
    def grads_down(self) -> None:
        """Each device shard's gradient (summed by the step's sync) to its master's ``.grad``
        (a fresh host buffer: ``train_step`` adds earlier steps' gradients to it); the device
        gradient is released. Waits once for all the copies."""
        for attr, p in self.device_params.items():
            g = p.grad
            if g is None:
                continue
            host = torch.empty(g.shape, dtype=g.dtype, device=HOST, pin_memory=self.pinned)
            host.copy_(g, non_blocking=self.pinned)
            self.masters[attr].grad = host
            p.grad = None
        synchronize(self.device)

    @torch.no_grad()
    def params_up(self) -> None:
        """Copy every master into its device shard (in place: the programs' tensors, or ZeRO's
        shards, which then gather)."""
        for attr, p in self.device_params.items():
            p.copy_(self.masters[attr], non_blocking=self.pinned)
        self._versions = self._now()
