"""This rank's shards of a model's parameters and buffers, by the placements a plan chose.

Every rank starts from the same full model and keeps its block of every parameter and
buffer (``passes.shard_parameters.shard_tensor``), on its device, under the attribute path
of the tensor's first name (a tied weight has several names, one tensor). The rewritten
programs read them with ``get_attr``; the runtime module then keeps those its stages read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.capture import Captured
from autopar.passes.shard_parameters import shard_tensor
from autopar.placement import local_shape
from autopar.plan import Plan


@dataclass
class Shards:
    """What describes every parameter and buffer's local shard (the tensors themselves are
    under the root module ``shard_model`` returns)."""
    attr_of: dict[str, str] = field(default_factory=dict)        # placeholder -> attribute path
    placements: dict[str, tuple] = field(default_factory=dict)   # attr -> placements
    aliases: dict[str, list[str]] = field(default_factory=dict)  # attr -> every name it has
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)   # attr -> global shape
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)              # attrs that are parameters

    def local_shape(self, attr: str, mesh_shape) -> tuple[int, ...]:
        return tuple(local_shape(self.shapes[attr], self.placements[attr], tuple(mesh_shape)))


def shard_model(cap: Captured, plan: Plan, coord, model: nn.Module,
                device: torch.device, meta_ok: bool = False) -> tuple[nn.Module, Shards]:
    """Cut ``model``'s parameters and buffers by ``plan`` (placements on the mesh whose
    coordinate this rank has is ``coord``), move the shards to ``device`` and register them
    on a new root module. ``meta_ok``: a tensor on the meta device gets an uninitialised
    local shard (``autopar.runtime.weights`` fills it from a weights source)."""
    mesh = tuple(plan.mesh_shape)
    full = dict(model.named_parameters(remove_duplicate=False))
    full_buffers = dict(model.named_buffers())
    root, out = nn.Module(), Shards()
    for ph, names in cap.params.items():
        attr, src = names[0], full[names[0]]
        placements = plan.nodes[ph].output(0)
        local = _local(attr, src.detach(), placements, coord, mesh, device, meta_ok)
        set_tensor(root, attr, nn.Parameter(local, requires_grad=src.requires_grad))
        out.params.append(attr)
        _describe(out, cap, ph, attr, placements, list(names))
    for ph, name in cap.buffers.items():
        placements = plan.nodes[ph].output(0)
        set_tensor(root, name, _local(name, full_buffers[name], placements, coord, mesh, device, meta_ok),
                   buffer=True)
        _describe(out, cap, ph, name, placements, [name])
    return root, out


def _local(name: str, src: torch.Tensor, placements, coord, mesh, device,
           meta_ok: bool) -> torch.Tensor:
    """This rank's block of ``src`` on ``device``; uninitialised when ``src`` is on meta."""
    if src.is_meta and not meta_ok:
        raise ValueError(f"{name!r} is on the meta device: build the model on a real device to "
                         "run it, or pass weights= (a state-dict file, safetensors or a DCP "
                         "checkpoint) to read each rank's shards")
    if src.is_meta:
        return torch.empty(local_shape(tuple(src.shape), placements, mesh), dtype=src.dtype,
                           device=device)
    return shard_tensor(src, placements, coord, mesh).to(device)


def _describe(out: Shards, cap: Captured, ph: str, attr: str, placements, names) -> None:
    val = cap.node(ph).meta["val"]
    out.attr_of[ph] = attr
    out.placements[attr], out.aliases[attr] = placements, names
    out.shapes[attr], out.dtypes[attr] = tuple(val.shape), val.dtype


def get_tensor(root: nn.Module, path: str):
    """The parameter or buffer at dotted ``path`` under ``root``."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_tensor(root: nn.Module, path: str, value, buffer: bool = False) -> None:
    """Register ``value`` at dotted ``path``, creating the modules on the way."""
    *mods, leaf = path.split(".")
    m = root
    for name in mods:
        if not hasattr(m, name):
            m.add_module(name, nn.Module())
        m = getattr(m, name)
    if buffer:
        m.register_buffer(leaf, value)
    else:
        m.register_parameter(leaf, value)
