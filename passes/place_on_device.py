"""Put the tensors a per-rank program creates on the rank's device.

``torch.export`` records the device of every tensor the model creates while it is captured
(``aten.arange(..., device=cpu)`` for GPT's positions, ``aten.zeros`` / ``full`` /
``scalar_tensor`` ...), and of every move to a device (``aten.to.device(x, cpu, ...)``,
its device positional: Hugging Face's rotary embeddings move ``inv_freq`` to the input's
device): the capture's device, usually the CPU, even when the rank runs on a GPU.
:func:`place_on` rewrites every such device argument of ``gm``, keyword or positional (and
of the graph modules it calls, such as recomputed layers) to ``device``, which the runtime
takes from its communicator (``comm.device``, i.e. ``autopar.device``).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule


def place_on(gm: GraphModule, device: torch.device) -> int:
    """Rewrite the device of every node creating or moving a tensor to ``device``; returns
    how many device arguments changed."""
    changed = 0
    for mod in gm.modules():
        if not isinstance(mod, GraphModule):
            continue
        here = 0
        for node in mod.graph.nodes:
            dev = node.kwargs.get("device")
            if isinstance(dev, (torch.device, str)) and torch.device(dev) != device:
                node.kwargs = {**node.kwargs, "device": device}
                here += 1
            if any(isinstance(a, torch.device) and a != device for a in node.args):
                node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
                here += 1
        if here:
            mod.recompile()
            changed += here
    return changed
