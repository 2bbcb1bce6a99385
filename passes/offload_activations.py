"""Activation offload (``offload_activations=``): the chosen layers keep what they save for
backward in host memory instead of on the device.

The pass takes a per-rank training graph (every op node carries ``meta["source"]``, the
captured node it computes, as for ``passes.recompute``) and the layers to offload, and
returns a new graph in which each layer's region (the same span ``passes.recompute``
takes: from the first to the last node computed for one of the layer's captured nodes) is a
submodule whose forward runs under one program-wide :class:`autopar.ops.host_activations.HostActivations`
(saved-tensor hooks: the copies to the host in forward, back in backward, on a side stream
with a one-layer prefetch on CUDA). Nothing is run twice: forward and backward compute what
they computed without the pass, from the same values, so results are bit for bit those of the
plan without it.

Layers are named as for ``recompute=`` (``autopar.analysis.layers.select_layers``); a layer
may be offloaded or recomputed, not both (``autopar.options``).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule

from autopar.ops.host_activations import HostActivations
from autopar.passes.recompute import wrap_layers


class OffloadedRegion(nn.Module):
    """Calls ``body`` (a GraphModule of one layer's region) with its saved tensors offloaded
    through ``host`` (shared by the program's regions), as the ``index``-th such layer."""

    def __init__(self, body: GraphModule, layer: str, host: HostActivations, index: int):
        super().__init__()
        self.body = body
        self.layer = layer
        self.index = index
        object.__setattr__(self, "host", host)       # not a submodule: shared, no state

    def forward(self, *args):
        with self.host.layer(self.index):
            return self.body(*args)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}"


def offload_layers(gm: GraphModule, regions: dict[str, set[str]], device,
                   keep_weight_casts: bool = False) -> GraphModule:
    """A new GraphModule in which each region (layer name -> captured node names) runs with
    its saved tensors in host memory (module docstring); ``out.meta["offload_host"]`` is the
    program's :class:`HostActivations`. ``gm`` is left alone; its parameters are shared.
    ``keep_weight_casts``: a pipeline stage's program, whose 16-bit weight casts live through
    the step (``HostActivations``' docstring)."""
    host = HostActivations(torch.device(device), keep_weight_casts)
    out = wrap_layers(gm, regions, lambda body, layer, k: OffloadedRegion(body, layer, host, k),
                      "offload")
    out.meta["offload_host"] = host
    return out


__all__ = ["OffloadedRegion", "offload_layers"]
