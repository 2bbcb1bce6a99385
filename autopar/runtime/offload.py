"""ZeRO-Offload (Ren et al. 2021) in the runtime: ``offload="optimizer"``.

Each rank's optimizer shard lives in host memory (``autopar.device.HOST``): an fp32 master
copy of every parameter block the rank steps (its ZeRO-1/2 optimizer shard, its ZeRO-3
parameter shard), and with it the optimizer's state (AdamW's moments), which the optimizer
creates next to the tensors it steps. The device keeps what the programs read (the working
parameters; ZeRO-3's shards) and each gradient until its bucket's copy to the host.

- ``pm.parameters()`` are the host master copies: build the optimizer on them as on any
  plan (``torch.optim.AdamW(pm.parameters())``); its ``step`` runs on the host.
- ``train_step``: each bucket's gradient shards go down as soon as that bucket's reduction
  finishes, while backward goes on with earlier layers. The bucket machinery hands them
  over through a small listener interface: the step's communicator carries this object as
  ``comm.settings.bucket_listener``, and ``runtime.zero.ZeroGradSync`` (ZeRO-1's all-reduce buckets,
  ZeRO-2's reduce-scatter buckets: all but the last ``IN_FLIGHT`` finished as the next is
  launched) and ``ops.param_buckets.ParamBucket`` (ZeRO-3's reduce-scatter per block) call
  :meth:`HostOptimizer.reduced` with the shards whose gradient is now final. Each copy goes
  to a fresh host buffer (``non_blocking``, pinned on a GPU: it queues on the stream behind
  the reduction and the host does not wait) and the device gradient is released. After the
  sync, :meth:`HostOptimizer.grads_down` copies what no bucket handed over (parameters
  synced outside ZeRO's buckets), waits once for all the copies (``device.synchronize``) and
  makes them the masters' ``.grad``.
- ``pm.step(opt)``: the optimizer steps the host masters; then ZeRO-1/2 copies each bucket's
  changed masters up just before that bucket's all-gather (``OptimizerShards.gather`` calls
  :meth:`HostOptimizer.up`), so on a GPU the copy of bucket i+1 runs beside the gather of
  bucket i; ZeRO-3 copies the changed masters into its shards before the next forward,
  whose gathers read them by blocks (per-bucket copies there are not done: a shard may be
  read outside its bucket). A step taken with ``opt.step()`` (or a state dict or checkpoint
  loaded into the masters) is seen by the masters' version counters and copied up before
  the next forward.

On a CPU rank host and device are one memory: the masters are still separate tensors and
every copy is made, so the path the tests run is the one a GPU runs.

``offload="disk"`` (ZeRO-Infinity's disk tier) is :class:`HostOptimizer` with the masters
and the optimizer's state in files on local disk between steps, streamed through host
memory a bucket at a time: ``autopar.runtime.disk_offload.DiskOptimizer``.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.device import HOST, pin_host_memory, synchronize
from autopar.plan import Plan


def offloaded(plan: Plan) -> bool:
    """Whether ``plan`` runs ZeRO-Offload (``"optimizer"``, or its disk tier ``"disk"``:
    ``autopar.runtime.disk_offload``)."""
    return getattr(plan, "offload", None) in ("optimizer", "disk")


class HostOptimizer:
    """Host master copies of ``device_params`` (attribute path -> the device tensor the
    optimizer would otherwise step) on ``device``'s host.

    It is the bucket listener of the step's communicator (``comm.settings.bucket_listener``): the
    bucket machinery calls :meth:`reduced` with the device tensors whose gradient a
    finished reduction has just made final (``runtime.zero.ZeroGradSync``'s buckets under
    ZeRO-1/2, ``ops.param_buckets.ParamBucket``'s under ZeRO-3), and :meth:`up` with the
    tensors a gather is about to read (``OptimizerShards.gather``'s buckets)."""

    def __init__(self, device_params: dict[str, nn.Parameter], device: torch.device):
        self.device = device
        self.pinned = pin_host_memory(device)
        self.device_params = dict(device_params)
        self._attr = {id(p): a for a, p in self.device_params.items()}
        self.masters: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for (attr, p), host in zip(self.device_params.items(), self._master_buffers()):
                host.copy_(p.detach())
                self.masters[attr] = nn.Parameter(host, requires_grad=p.requires_grad)
        self._versions = self._now()
        self._stepped: set[str] = set()       # masters an optimizer stepped since copied up
        self._down: dict[str, list[torch.Tensor]] = {}   # this step's gradient copies in flight
        self._step_hook()

    def _step_hook(self) -> None:
        """Mark the masters an optimizer holds as changed after its ``step()``: torch's fused
        AdamW (``_fused_adamw_``) updates them in place without bumping their version
        counters (torch 2.13, CPU: measured), so the counters alone missed its steps and the
        device parameters never changed (the MLP under ``offload="optimizer"`` and a fused
        AdamW: the same loss every step; ``tests/test_offload.py``)."""
        ids, ref = {id(m): a for a, m in self.masters.items()}, weakref.ref(self)

        def stepped(optimizer, args, kwargs) -> None:
            me = ref()
            if me is not None:
                me._stepped.update(ids[id(p)] for g in optimizer.param_groups for p in g["params"]
                                   if id(p) in ids)
        handle = register_optimizer_step_post_hook(stepped)
        weakref.finalize(self, handle.remove)

    def _master_buffers(self) -> list[torch.Tensor]:
        """Uninitialised host tensors for the masters, one per device parameter in order (the
        disk tier's are views of a memory-mapped file)."""
        return [torch.empty(p.shape, dtype=p.dtype, device=HOST, pin_memory=self.pinned)
                for p in self.device_params.values()]

    def _now(self) -> dict[str, int]:
        return {a: m._version for a, m in self.masters.items()}

    def dirty(self) -> bool:
        """A master changed since it was last copied up (an optimizer step, a load)."""
        return bool(self._stepped) or self._now() != self._versions

    # ---- gradients down ------------------------------------------------------------------
    @torch.no_grad()
    def reduced(self, tensors) -> None:
        """A bucket's reduction finished: start copying the gradient of each of ``tensors``
        (device parameters) to a fresh host buffer (``non_blocking``: the copy runs while
        backward goes on) and release the device gradient. Tensors that are not the
        optimizer's (another axis's parameters) are left alone."""
        for p in tensors:
            attr = self._attr.get(id(p))
            g = p.grad
            if attr is None or g is None:
                continue
            host = torch.empty(g.shape, dtype=g.dtype, device=HOST, pin_memory=self.pinned)
            host.copy_(g, non_blocking=self.pinned)
            self._down.setdefault(attr, []).append(host)
            p.grad = None

    @torch.no_grad()
    def grads_down(self) -> None:
        """The step's sync has finished: copy the gradients no bucket handed over (those
        synced outside ZeRO's buckets), wait for every copy once (the host step needs them)
        and make each master's ``.grad`` its copy (the sum of its copies: a weight whose
        bucket finished twice, as a tied one gathered twice; ``train_step`` adds earlier
        steps' gradients to it)."""
        self.reduced([p for p in self.device_params.values() if p.grad is not None])
        synchronize(self.device)
        for attr, copies in self._down.items():
            g = copies[0]
            for more in copies[1:]:
                g = g.add_(more)
            self.masters[attr].grad = g
        self._down = {}

    # ---- parameters up -------------------------------------------------------------------
    @torch.no_grad()
    def up(self, tensors) -> None:
        """Copy the master of each of ``tensors`` (device parameters) that changed since it
        was last copied into it (in place: a gather reads it next)."""
        for p in tensors:
            attr = self._attr.get(id(p))
            if attr is None:
                continue
            m = self.masters[attr]
            if attr in self._stepped or m._version != self._versions[attr]:
                p.copy_(m, non_blocking=self.pinned)
                self._versions[attr] = m._version
                self._stepped.discard(attr)

    def stepping(self, optimizer):
        """What ``pm.step`` steps: ``optimizer`` itself (the disk tier's steps by buckets)."""
        return optimizer

    def params_up(self) -> None:
        """Copy every changed master into its device shard."""
        self.up(self.device_params.values())
