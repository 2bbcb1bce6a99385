"""A ParallelModule's local shards (and its optimizer's state) as entries of a
``torch.distributed.checkpoint`` (DCP) state dict, keyed by the original model's names.

Each tensor is described to DCP in its global shape, so that DCP reshards on load:

- placements of only ``Shard(d)`` and ``Replicate`` -> a ``DTensor`` built with
  ``DTensor.from_local`` on the stage's device mesh (torch's ``Shard(d)`` / ``Replicate``;
  several axes sharding one dim nest left to right in both autopar and DTensor);
- a strided shard ``S(d/g)`` -> :class:`Pieces`: the local tensor as the several contiguous
  blocks of the global tensor it is (one per group). DCP's DTensor path describes a rank's
  shard by one offset, which a strided shard (``_StridedShard``) does not have, so that
  tensor is written as ``g`` plain chunks of the global layout and read back exactly;
- no mesh axes (a stage of a pure pipeline) -> the local tensor itself (it is whole).

Under a pipeline only the first pipeline rank holding a tensor (``pm.owners``) puts it in the
state dict it saves: on that stage's sub-mesh DCP writes each distinct chunk once (its
``dedup_save_plans`` keeps one of the ranks with the same chunk, e.g. the replicas of a
data axis). Every owner reads it on load.

Keys: ``model.<name>`` (the first name of a tied weight; the others are kept in the
``autopar`` entry), ``optim.<name>.<state key>`` (state tensors shaped like the local shard
are sharded like their parameter; others, such as AdamW's ``step``, are plain tensors),
``autopar`` (the alias table, every rank's param groups' hyperparameters and, under fp16,
the loss scaler's state; under ``workers=``, the schedule's state) and ``extra``
(pickled bytes, rank 0's).
"""
from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard

from autopar.errors import ArgumentError, CheckpointError
from autopar.placement import Replicate, Shard

FORMAT = 1
MODEL, OPTIM = "model.", "optim."


# ---- a shard made of several blocks ----------------------------------------------------------
def _index_runs(size: int, steps) -> list[tuple[int, int, int]]:
    """(global start, local start, length) runs of one dim after ``steps``: (n, c, groups)."""
    idx = torch.arange(size)
    for n, c, g in steps:
        idx = idx.unflatten(0, (g, -1)).chunk(n, dim=1)[c].flatten() if g > 1 else idx.chunk(n)[c]
    runs, local = [], 0
    for v in idx.tolist():
        if runs and runs[-1][0] + runs[-1][2] == v:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((v, local, 1))
        local += 1
    return runs


def blocks(shape, placements, coord, mesh_shape) -> list[tuple[tuple, tuple, tuple]]:
    """The contiguous blocks of the global tensor a rank holds: (global offsets, local offsets,
    sizes) for every block (the same cut as ``passes.shard_parameters.shard_tensor``)."""
    steps: dict[int, list] = {}
    for p, c, n in zip(placements, coord, mesh_shape):
        if isinstance(p, Shard):
            steps.setdefault(p.dim % len(shape), []).append((n, c, p.groups))
    per_dim = [_index_runs(s, steps.get(d, [])) for d, s in enumerate(shape)]
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim)]


class Pieces(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds the blocks of ``local``: what DCP asks
    of a checkpointable tensor (write items, chunk list, a block by its offset). It has no
    data of its own; no torch op runs on it."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape, block_list, copy: bool):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype,
                                                device=local.device)
        r._blocks = {}
        for off, loff, sizes in block_list:
            view = local[tuple(slice(o, o + s) for o, s in zip(loff, sizes))]
            r._blocks[torch.Size(off)] = (torch.Size(sizes), view.contiguous().clone() if copy else view)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"Pieces is a checkpoint description, not a tensor to compute with ({func})")

    def __create_write_items__(self, fqn: str, obj: Any):
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=off, sizes=sizes),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.size()))
                for off, (sizes, view) in self._blocks.items()]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=off, sizes=sizes) for off, (sizes, _) in self._blocks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex):
        return self._blocks[torch.Size(index.offset)][1]


# ---- the layout of one ParallelModule -------------------------------------------------------
class Layout:
    """Where each of ``pm``'s tensors lives on this rank, and how to hand it to DCP."""

    def __init__(self, pm):
        sh = pm._shards
        self.pm, self.shards = pm, sh
        self.coord = tuple(pm._stage_comm.coord)
        self.mesh_shape = tuple(pm._stage_mesh)
        self.pp_rank = pm.runner.pp_rank
        self.held = dict(pm.module.named_parameters()) | dict(pm.module.named_buffers())
        self.name = {attr: sh.aliases[attr][0] for attr in sh.placements}
        self._mesh = None

    def writes(self, attr: str) -> bool:
        """This rank puts ``attr`` in the state dict it saves: the first owner's stage does."""
        return attr in self.held and self.pp_rank == self.pm.owners[attr][0]

    def mesh(self):
        if self._mesh is None:
            comm, plan = self.pm.comm, self.pm.plan
            if not hasattr(comm, "mesh"):
                raise ArgumentError("checkpoints run on torch.distributed ranks (torchrun), not "
                                    "on simulated ones")
            axes = tuple(plan.mesh_axes)
            self._mesh = comm.mesh[axes[1:]] if plan.pipeline_stages > 1 else comm.mesh
        return self._mesh

    def wrap(self, attr: str, local: torch.Tensor, copy: bool):
        """``local`` (a tensor shaped like ``attr``'s shard) as a DCP entry of global shape."""
        placements = tuple(self.shards.placements[attr])
        shape = self.shards.shapes[attr]
        if not placements:
            return local.detach().clone() if copy else local
        if any(isinstance(p, Shard) and p.groups > 1 for p in placements):
            return Pieces(local.detach(), shape, blocks(shape, placements, self.coord, self.mesh_shape), copy)
        if not all(isinstance(p, (Shard, Replicate)) for p in placements):
            raise ValueError(f"{attr!r} is held as {placements}: a stored tensor is R or S(d)")
        tp = [TShard(p.dim % len(shape)) if isinstance(p, Shard) else TReplicate() for p in placements]
        src = local.detach().clone() if copy else local.detach()
        return DTensor.from_local(src, self.mesh(), tp, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))


def _contiguous_stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _optim_names(pm, optimizer) -> dict[int, str]:
    """id(local parameter) -> its attr, for the optimizer's parameters that are pm's."""
    attrs = {id(p): attr for attr, p in pm.module.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in attrs:
                raise ArgumentError("the optimizer holds a parameter that is not one of the "
                                    "ParallelModule's local shards: build it from pm.parameters()")
            out[id(p)] = attrs[id(p)]
    return out


def save_state(pm, optimizer=None, extra=None) -> dict[str, Any]:
    """The state dict this rank hands to ``dcp.save``."""
    lay = Layout(pm)
    sd: dict[str, Any] = {}
    for attr, t in lay.held.items():
        if lay.writes(attr):
            sd[MODEL + lay.name[attr]] = lay.wrap(attr, t, copy=True)
    groups = []
    if optimizer is not None:
        attr_of = _optim_names(pm, optimizer)
        for group in optimizer.param_groups:
            names = [lay.name[attr_of[id(p)]] for p in group["params"]]
            groups.append(({k: v for k, v in group.items() if k != "params"}, names))
            for p in group["params"]:
                attr = attr_of[id(p)]
                if not lay.writes(attr):
                    continue
                for key, v in optimizer.state.get(p, {}).items():
                    fqn = f"{OPTIM}{lay.name[attr]}.{key}"
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                        sd[fqn] = lay.wrap(attr, v, copy=True)
                    elif isinstance(v, torch.Tensor):
                        sd[fqn] = v.detach().clone()
                    else:
                        sd[fqn] = pickle.dumps(v)
    # every rank's groups (a pipeline rank's optimizer holds only its stages' parameters);
    # rank 0 writes them, the alias table and its own ``extra``
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, groups)
        groups = [g for rank_groups in every for g in rank_groups]
    if not dist.is_initialized() or dist.get_rank() == 0:
        info = {"format": FORMAT, "aliases": {lay.name[a]: list(al) for a, al in pm._shards.aliases.items()},
                "param_groups": groups, "has_optimizer": optimizer is not None,
                "loss_scaler": pm.scaler.state_dict() if pm.scaler is not None else None,
                # the update rule's state (workers=: its regime); every rank holds the same
                "update_schedule": pm.update_rule.state_dict()}
        sd["autopar"] = pickle.dumps(info)
        sd["extra"] = pickle.dumps(extra)
    return sd


def stored_name(attr_names: list[str], md: dict, prefix: str) -> str | None:
    """The name under which one of a tensor's names is stored (a tied weight's first name,
    or any of them in an imported state dict)."""
    for n in attr_names:
        if prefix + n in md:
            return n
    return None


def load_plan(pm, md: dict, optimizer=None):
    """(the state dict to hand to ``dcp.load``, a function that copies what it read into pm
    and the optimizer). ``md``: the checkpoint's ``state_dict_metadata``."""
    lay = Layout(pm)
    sd: dict[str, Any] = {}
    copies = []
    missing, other_shape = [], []
    for attr, t in lay.held.items():
        name = stored_name(pm._shards.aliases[attr], md, MODEL)
        if name is None:
            missing.append(lay.name[attr])
            continue
        saved = getattr(md[MODEL + name], "size", None)
        if saved is not None and tuple(saved) != tuple(pm._shards.shapes[attr]):
            other_shape.append(f"{name} {list(saved)} (the model's: {list(pm._shards.shapes[attr])})")
            continue
        buf = torch.empty_like(t)
        sd[MODEL + name] = lay.wrap(attr, buf, copy=False)
        copies.append((t, buf))
    if missing or other_shape:
        raise CheckpointError(
            "the checkpoint does not fit this model: "
            + "; ".join(([f"it lacks {len(missing)} of the model's tensors {missing[:5]}"] if missing else [])
                        + ([f"{len(other_shape)} tensors of another shape: {', '.join(other_shape[:3])}"]
                           if other_shape else []))
            + ". Load it into the model (and configuration) it was saved from")
    opt_state = []
    if optimizer is not None:
        attr_of = _optim_names(pm, optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                attr = attr_of[id(p)]
                name = stored_name(pm._shards.aliases[attr], md, MODEL)
                prefix = f"{OPTIM}{name}."
                for fqn, m in md.items():
                    if not fqn.startswith(prefix) or "." in fqn[len(prefix):]:
                        continue
                    key = fqn[len(prefix):]
                    if isinstance(m, TensorStorageMetadata):
                        dtype = m.properties.dtype
                        if tuple(m.size) == tuple(lay.shards.shapes[attr]) and len(m.size) > 0:
                            buf = torch.empty(p.shape, dtype=dtype, device=p.device)
                            sd[fqn] = lay.wrap(attr, buf, copy=False)
                        else:
                            buf = torch.empty(tuple(m.size), dtype=dtype)
                            sd[fqn] = buf
                        opt_state.append((p, key, buf, None))
                    else:
                        sd[fqn] = b""
                        opt_state.append((p, key, None, fqn))
    sd["autopar"] = b""
    sd["extra"] = b""

    def finish() -> Any:
        with torch.no_grad():
            for t, buf in copies:
                t.copy_(buf)
        info = pickle.loads(sd["autopar"])
        if optimizer is not None:
            for p, key, buf, fqn in opt_state:
                optimizer.state[p][key] = buf if fqn is None else pickle.loads(sd[fqn])
            _restore_groups(pm, optimizer, info.get("param_groups", []), lay)
        if pm.scaler is not None and info.get("loss_scaler"):    # fp16: resume with the saved scale
            pm.scaler.load_state_dict(info["loss_scaler"])
        if info.get("update_schedule"):     # the update rule's state (workers=: the regime)
            pm.update_rule.load_state_dict(info["update_schedule"])
        return pickle.loads(sd["extra"])
    return sd, finish


def _restore_groups(pm, optimizer, saved, lay: Layout) -> None:
    """Each param group takes the hyperparameters of the saved group holding its first parameter."""
    attr_of = _optim_names(pm, optimizer)
    where = {}
    for hyper, names in saved:
        for n in names:
            where[n] = hyper
    for group in optimizer.param_groups:
        for p in group["params"]:
            attr = attr_of[id(p)]
            hyper = next((where[n] for n in pm._shards.aliases[attr] if n in where), None)
            if hyper is not None:
                group.update({k: v for k, v in hyper.items() if k in group})
                break
