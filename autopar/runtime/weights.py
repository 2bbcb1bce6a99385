"""Pretrained weights for a model built on the meta device: each rank reads only its shards.

``autopar.parallelize(model, inputs, loss_fn, weights=path)`` with ``model`` built under
``torch.device("meta")`` (or ``autopar.meta_parameters()``) captures it as if it were on
the CPU (:func:`capture_view`: its meta tensors seen as CPU FakeTensors, so the graph and
its fingerprint are those of the real model), allocates each rank's local shards empty and
fills them from ``path`` (:func:`load_weights`). The kind of source is told by the path
(:func:`weights_kind`):

- ``"torch"``: a file ``torch.save(model.state_dict(), ...)`` wrote (``.pt``, ``.pth``,
  ``.bin``), opened with ``torch.load(mmap=True, weights_only=True)``: the file is mapped,
  not read, and each rank copies the blocks of its shards out of it;
- ``"safetensors"``: a ``.safetensors`` file or a directory of them (Hugging Face's
  ``save_pretrained``, sharded or not): ``safe_open(...).get_slice(name)[rows, cols]`` reads
  just each block of the rank's shard;
- ``"dcp"``: a ``torch.distributed.checkpoint`` directory (with ``.metadata``), as
  ``autopar.save_checkpoint`` writes it (model tensors under ``model.``) or a plain DCP
  state dict (``dcp.save(model.state_dict(), ...)``): read by DCP's own resharding load, the
  rank's shards described to it as ``autopar.runtime.dcp_state`` does for checkpoints.

Names are the model's ``state_dict`` names (a tied weight under any of its names). A
parameter the source lacks, or a source tensor that is none of the model's parameters and
buffers, is a :class:`WeightsError` naming them. Buffers come from the source when it has
them; otherwise from the model's own init when the model holds them for real (built under
``meta_parameters()``, rotary tables for instance); a buffer that is only on the meta device
and not in the source is an error naming it and the fix.
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils import _pytree as pytree

from autopar.device import HOST
from autopar.errors import AutoparInputError
from autopar.runtime.dcp_state import MODEL, Layout, blocks

__all__ = ["WeightsError", "weights_kind", "load_weights", "capture_view", "has_meta",
           "meta_parameters", "KINDS"]

KINDS = ("torch", "safetensors", "dcp")
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
ACCEPTED = ("weights= takes a torch.save state-dict file (.pt, .pth, .bin), a .safetensors file "
            "or a directory of them (Hugging Face save_pretrained), or a torch.distributed."
            "checkpoint directory (autopar.save_checkpoint, dcp.save)")
SHOWN = 8        # names listed in an error


class WeightsError(AutoparInputError):
    """A weights source that cannot be read into the model (path, kind, names, shapes)."""


def _some(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{names[:SHOWN]}{more}"


# ---- which source --------------------------------------------------------------------------
def weights_kind(path: str | os.PathLike) -> str:
    """``"torch"``, ``"safetensors"`` or ``"dcp"`` for ``path``; a WeightsError naming the
    path and the accepted kinds otherwise."""
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, ".metadata")):
            return "dcp"
        if glob.glob(os.path.join(p, "*.safetensors")):
            return "safetensors"
        raise WeightsError(f"{p!r} is a directory with neither a DCP .metadata file nor "
                           f"*.safetensors files: {ACCEPTED}")
    if os.path.isfile(p):
        if p.endswith(".safetensors"):
            return "safetensors"
        if p.endswith(TORCH_SUFFIXES):
            return "torch"
        raise WeightsError(f"{p!r} is neither a torch state-dict file nor a safetensors file "
                           f"(by its suffix): {ACCEPTED}")
    raise WeightsError(f"{p!r} does not exist: {ACCEPTED}")


class _TorchFile:
    """A ``torch.save`` state dict, memory-mapped."""

    def __init__(self, path: str):
        try:
            sd = torch.load(path, map_location=HOST, mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - reported with the path
            raise WeightsError(f"{path!r} could not be read by torch.load(mmap=True, "
                               f"weights_only=True): {type(e).__name__}: {str(e)[:200]}; save "
                               "it with torch.save(model.state_dict(), path)") from e
        if not isinstance(sd, dict):
            raise WeightsError(f"{path!r} holds a {type(sd).__name__}, not a state dict: save "
                               "it with torch.save(model.state_dict(), path)")
        self._t = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def names(self) -> set[str]:
        return set(self._t)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._t[name][index]


class _Safetensors:
    """A safetensors file, or every ``*.safetensors`` file of a directory."""

    def __init__(self, path: str):
        from safetensors import safe_open    # optional: installed with transformers
        files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
        self._where: dict[str, Any] = {}
        for f in files:
            handle = safe_open(f, framework="pt", device=HOST)
            for k in handle.keys():
                if k in self._where:
                    raise WeightsError(f"{k!r} is in two safetensors files of {path!r}")
                self._where[k] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if not index:
            return self._where[name].get_tensor(name)
        return self._where[name].get_slice(name)[index]


class _Dcp:
    """A DCP checkpoint directory: autopar's (``model.`` names) or a plain state dict's."""

    def __init__(self, path: str, wanted: set[str]):
        self.path = path
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        tensors = {k: m for k, m in md.items() if isinstance(m, TensorStorageMetadata)}
        # autopar.save_checkpoint keeps the model under "model." (optimizer state beside it);
        # a plain dcp.save(model.state_dict()) keeps the bare names
        self.prefix = MODEL if "autopar" in md or (
            sum(MODEL + n in tensors for n in wanted) > sum(n in tensors for n in wanted)) else ""
        self._md = {k[len(self.prefix):]: m for k, m in tensors.items() if k.startswith(self.prefix)}

    def names(self) -> set[str]:
        return set(self._md)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._md[name].size)


def _open(kind: str, path: str, wanted: set[str]):
    if kind == "torch":
        return _TorchFile(path)
    if kind == "safetensors":
        return _Safetensors(path)
    return _Dcp(path, wanted)


# ---- the model's view for capture ----------------------------------------------------------
def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


@contextlib.contextmanager
def capture_view(model: nn.Module, example_inputs, target) -> Iterator[tuple[Any, Any]]:
    """While open, ``model``'s meta parameters and buffers are CPU FakeTensors (no memory),
    and it yields ``(example_inputs, target)`` as FakeTensors of the same mode: capturing
    then gives the graph of the real model on the CPU (same ops, same fingerprint; on the
    meta device some kernels give other strides and the graph gains copies)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    swapped = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in fakes:      # a tied weight stays one tensor
                    with mode:
                        f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=HOST)
                    fakes[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else f
                swapped.append((store, key, t))
                store[key] = fakes[id(t)]

    def fake(x):
        return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
    try:
        yield pytree.tree_map(fake, tuple(example_inputs)), pytree.tree_map(fake, target)
    finally:
        for store, key, t in swapped:
            store[key] = t


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers for real: every
    parameter is moved to meta as it is registered (before the module's init fills it, so
    nothing is initialised), while buffers such as rotary tables are computed by the
    model's own init. Then ``parallelize(..., weights=...)`` reads the parameters from the
    weights and keeps the buffers the source lacks.

    >>> with autopar.meta_parameters():
    ...     model = Llama(config)
    """
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# ---- reading a rank's shards ---------------------------------------------------------------
def load_weights(pm, path: str | os.PathLike, model: nn.Module) -> dict[str, str]:
    """Fill ``pm``'s local shards from the weights at ``path``; ``model`` is the model ``pm``
    was built from (which of its tensors are meta, every name it has). Returns, by tensor
    name, where each held tensor came from (``"weights"`` or ``"model"``). Collective for a
    DCP source (every rank calls it)."""
    path = os.fspath(path)
    kind = weights_kind(path)
    sh = pm._shards
    wanted = {n for attr in sh.placements for n in sh.aliases[attr]}
    src = _open(kind, path, wanted)
    stored = src.names()
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
            {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unexpected = stored - known
    name_of, missing, missing_buffers, bad_shape = {}, [], [], []
    for attr in sh.placements:
        name = next((n for n in sh.aliases[attr] if n in stored), None)
        if name is not None:
            name_of[attr] = name
            if src.shape(name) != tuple(sh.shapes[attr]):
                bad_shape.append(f"{name}: {src.shape(name)} in the weights, {tuple(sh.shapes[attr])} in the model")
        elif attr in sh.params:
            missing.append(attr)
        elif _model_tensor(model, attr).is_meta:
            missing_buffers.append(attr)
    problems = []
    if missing:
        problems.append(f"it lacks {len(missing)} parameters of the model: {_some(missing)}")
    if unexpected:
        problems.append(f"it has {len(unexpected)} tensors the model does not: {_some(unexpected)}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} shapes differ: {_some(bad_shape)}")
    if missing_buffers:
        problems.append(f"the buffers {_some(missing_buffers)} are neither in it nor computed "
                        "(the model holds them on the meta device): build the model under "
                        "autopar.meta_parameters() so that its init computes them, or put them in "
                        "the weights")
    if problems:
        raise WeightsError(f"weights {path!r} ({kind}) do not fit {type(model).__name__}: "
                           + "; ".join(problems) + ". Is it this model's checkpoint?")
    lay = Layout(pm)
    held = {a: t for a, t in lay.held.items() if a in name_of}
    with torch.no_grad():
        if kind == "dcp":
            _read_dcp(src, lay, held, name_of)
        else:
            for attr, t in held.items():
                _read_blocks(src, name_of[attr], t, sh.shapes[attr], sh.placements[attr], lay)
    return {sh.aliases[a][0]: ("weights" if a in held else "model") for a in lay.held}


def _model_tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod, _, leaf = name.rpartition(".")
    owner = model.get_submodule(mod) if mod else model
    return getattr(owner, leaf)


def _read_blocks(src, name: str, local: torch.Tensor, shape, placements, lay: Layout) -> None:
    """Copy each contiguous block of ``local`` out of the source (only that block is read)."""
    for off, loff, sizes in blocks(shape, placements, lay.coord, lay.mesh_shape):
        got = src.block(name, tuple(slice(o, o + s) for o, s in zip(off, sizes)))
        local[tuple(slice(o, o + s) for o, s in zip(loff, sizes))].copy_(got)


def _read_dcp(src: _Dcp, lay: Layout, held: dict[str, torch.Tensor], name_of: dict[str, str]) -> None:
    """One ``dcp.load`` of every held tensor, straight into the local shards (DCP reads each
    shard's overlap with the saved chunks)."""
    sd = {src.prefix + name_of[attr]: lay.wrap(attr, t, copy=False) for attr, t in held.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(src.path))
