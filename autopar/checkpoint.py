"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), across plans.

``save_checkpoint(path, pm, optimizer, extra)`` has every rank write only its shards of the
model's parameters and buffers and of the optimizer's state, under the original model's
names; ``load_checkpoint(path, pm, optimizer)`` reads them into any plan (data, tensor,
ZeRO, pipeline, another world size): DCP reads for every local shard the overlapping parts
of the saved chunks. How autopar's placements are described to DCP is in
``autopar.runtime.dcp_state``.

For a training job: ``save_step_checkpoint(root, step, ...)`` writes ``root/step-<step>``
atomically (a temporary directory renamed once every rank has written), and
``latest_checkpoint(root)`` finds the newest complete one to resume from after a restart.

Faults (``autopar.runtime.ckpt_files``): every save records the CRC-32 of each shard file,
and a load first checks that every file is there, whole and unchanged, or raises
:class:`CheckpointError` naming the file; a directory whose save did not finish is refused
naming the newest complete checkpoint. A save that fails (the disk full on one rank, a rank
that died) is a ``CheckpointError`` on every rank, and ``save_step_checkpoint`` keeps the
previous checkpoint. ``autopar.Preemption`` saves one on SIGTERM.

``export_checkpoint`` writes the model part as one plain state dict (what
``model.load_state_dict`` accepts); ``import_state_dict`` writes a plain state dict as a
checkpoint that ``load_checkpoint`` reads. Both run in one process, without ranks.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import ArgumentError, CheckpointError
from autopar.ops.comm import is_comm_failure
from autopar.runtime.ckpt_files import check_files, first_failure, partial_or_missing, write_checksums
from autopar.runtime.dcp_state import FORMAT, MODEL, load_plan, save_state
from autopar.runtime.parallel_module import ParallelModule
from autopar.runtime.save_watch import TimedSave

__all__ = ["save_checkpoint", "load_checkpoint", "export_checkpoint", "import_state_dict",
           "save_step_checkpoint", "latest_checkpoint", "CheckpointError"]

_STEP_DIR = re.compile(r"step-(\d+)")


def _check_module(pm) -> None:
    if not isinstance(pm, ParallelModule):
        raise ArgumentError(f"expected the ParallelModule autopar.parallelize returned, got "
                            f"{type(pm).__name__}")


def save_checkpoint(path: str | os.PathLike, pm, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None, checksums: bool = True,
                    timeout: float | None = None) -> None:
    """Write ``pm``'s shards (and ``optimizer``'s state, and the small picklable dict
    ``extra``: rank 0's is kept) to the directory ``path``. Collective: every rank calls it
    with the same path. ``checksums``: each rank then reads its files back for their CRC-32
    (``runtime.ckpt_files``; ``load_checkpoint`` checks them): about 2 s a GB per rank at
    zlib's 0.5 GB/s measured on the 2-core test machine; False skips it (a damaged shard is
    then found only when it is missing or short). ``timeout``: seconds a rank waits for the
    others to finish writing (``runtime.save_watch``: a rank that stalls makes the others
    raise ``CheckpointError`` naming it); None: the default process group's timeout."""
    _check_module(pm)
    path = os.fspath(path)
    timeout = _check_save_timeout(timeout)
    timed = TimedSave(path, timeout) if timeout is not None and dist.is_initialized() else None
    try:
        dcp.save(save_state(pm, optimizer, extra),
                 storage_writer=timed.writer if timed else dcp.FileSystemWriter(path),
                 process_group=timed.group if timed else None)
    except CheckpointException as e:     # one rank's failure, raised on every rank by DCP
        raise CheckpointError(f"saving the checkpoint {path!r} failed on {first_failure(e)}: the "
                              "directory is incomplete (no .metadata unless the failure came "
                              "after it); fix the cause (e.g. free disk space) and save again") from None
    except RuntimeError as e:            # a peer died or hangs in the save's collectives
        if not is_comm_failure(e):
            raise
        stalled = timed.unfinished() if timed else []
        if stalled:
            err = CheckpointError(
                f"saving the checkpoint {path!r} failed on rank {_rank()}: rank(s) {stalled} did "
                f"not finish writing their shards within timeout={timeout:g} s (they hang, e.g. on "
                "a stalled file system, or died); look at their logs. The directory is "
                "incomplete; its files are left for inspection. If the writes are only slow, "
                "raise timeout=")
            err.rank_lost, err.ranks = True, stalled
            raise err from None
        err = CheckpointError(f"saving the checkpoint {path!r} failed on rank {_rank()}: another "
                              f"rank stopped taking part (it died or hangs): {' '.join(str(e).split()).split('. ')[0][:300]}. "
                              "The directory is incomplete; its files are left for inspection")
        err.rank_lost = True
        raise err from None
    if timed:
        timed.done()
    if checksums:
        write_checksums(path)      # the CRC-32 of every shard file, checked at load


def _check_save_timeout(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or timeout == float("inf"):
        raise ArgumentError(f"timeout={timeout!r}: pass how many seconds a rank waits for the "
                            "others to finish writing their shards (a positive number, e.g. "
                            "600), or None for the default process group's timeout")
    return float(timeout)


def _metadata(path, no_dist: bool = True) -> dict:
    """The checkpoint's ``state_dict_metadata``, after checking that every shard file it
    names is there, whole and (when checksums were saved) unchanged. Collective unless
    ``no_dist``."""
    path = os.fspath(path)
    err = partial_or_missing(path, latest_checkpoint)
    if err is not None:
        raise err
    md = dcp.FileSystemReader(path).read_metadata()
    check_files(path, md, no_dist=no_dist)
    return md.state_dict_metadata


def load_checkpoint(path: str | os.PathLike, pm, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Read the checkpoint at ``path`` into ``pm`` (whatever plan it was saved under) and,
    when given, into ``optimizer`` (built over ``pm.parameters()``; its state is replaced,
    its param groups take the saved hyperparameters). Returns the saved ``extra``.
    Collective."""
    _check_module(pm)
    md = _metadata(path, no_dist=False)
    sd, finish = load_plan(pm, md, optimizer)
    try:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.fspath(path)))
    except CheckpointException as e:
        raise CheckpointError(f"loading the checkpoint {os.fspath(path)!r} failed on "
                              f"{first_failure(e)}: load an older checkpoint, or restore this "
                              "one's files") from None
    return finish()


def save_step_checkpoint(root: str | os.PathLike, step: int, pm,
                         optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
                         keep: int | None = None, checksums: bool = True,
                         timeout: float | None = None) -> str:
    """``save_checkpoint`` to ``root/step-<step>`` (8 digits), atomically: every rank writes
    into ``root/.step-<step>.tmp``, which rank 0 renames once the save is complete, so a
    job killed mid-save leaves no directory ``latest_checkpoint`` would pick. ``keep``: how
    many of the newest step directories to keep (None: all); ``timeout``: as
    ``save_checkpoint``'s. Returns the directory.
    Collective; ``root`` must be one directory every rank sees (a shared file system)."""
    _check_module(pm)
    _check_save_timeout(timeout)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ArgumentError(f"step={step!r}: pass the number of training steps done (an int >= 0)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ArgumentError(f"keep={keep!r}: pass how many newest checkpoints to keep (an int >= 1) "
                            "or None")
    root = os.fspath(root)
    final, tmp = os.path.join(root, f"step-{step:08d}"), os.path.join(root, f".step-{step:08d}.tmp")
    lead = not dist.is_initialized() or dist.get_rank() == 0
    if lead:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)    # left by a save that was cut short
    _barrier()
    try:
        save_checkpoint(tmp, pm, optimizer, extra, checksums, timeout)   # returns once all is written
    except CheckpointError as e:     # e.g. the disk full: every rank raises; the last one is kept
        if lead and not getattr(e, "rank_lost", False):   # a lost rank's partial files stay
            shutil.rmtree(tmp, ignore_errors=True)        # (a later save of the step clears them)
        kept = latest_checkpoint(root)
        err = CheckpointError(f"step {step}: {e}. The previous checkpoint is kept: "
                              f"{kept if kept else 'none (this was the first save)'}; "
                              "latest_checkpoint(root) returns it")
        err.ranks = getattr(e, "ranks", None)     # those that did not finish writing, when known
        raise err from None
    if lead:
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again
        os.replace(tmp, final)
        if keep is not None:
            for old in _step_dirs(root)[:-keep]:
                shutil.rmtree(old[1], ignore_errors=True)
    _barrier()
    return final


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete ``step-N`` checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.fullmatch(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint ``save_step_checkpoint`` wrote under ``root`` (the
    ``step-N`` directory with the largest N holding DCP's ``.metadata``), or None when there
    is none (or no ``root``): what a restarted job resumes from. Temporary directories of a
    save cut short are never picked."""
    found = _step_dirs(os.fspath(root))
    return found[-1][1] if found else None


def _info(path, md) -> dict:
    if "autopar" not in md:
        return {"aliases": {}}
    sd = {"autopar": b""}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.fspath(path)), no_dist=True)
    return pickle.loads(sd["autopar"])


def read_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model tensors of a checkpoint, every name of a tied weight included (one
    process; no ranks needed)."""
    md = _metadata(path)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in md.items() if k.startswith(MODEL) and isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.fspath(path)), no_dist=True)
    out = {k[len(MODEL):]: v for k, v in sd.items()}
    for name, aliases in _info(path, md).get("aliases", {}).items():
        for a in aliases:
            if name in out:
                out.setdefault(a, out[name])
    return out


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Write the model part of checkpoint ``path`` to ``out`` with ``torch.save``: a plain
    state dict ``model.load_state_dict`` accepts. Returns it."""
    sd = read_model_state(path)
    parent = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {os.fspath(out)!r}: its folder {parent!r} does not "
                              "exist; create it or write elsewhere")
    torch.save(sd, os.fspath(out))
    return sd


def import_state_dict(state_dict: dict[str, torch.Tensor] | str | os.PathLike,
                      out: str | os.PathLike) -> None:
    """Write a plain state dict (or a ``torch.save`` file of one) as a checkpoint directory
    ``out`` that ``load_checkpoint`` reads into any plan (model tensors only: no optimizer
    state, ``extra`` None). One process."""
    if not isinstance(state_dict, dict):
        src = os.fspath(state_dict)
        if not os.path.isfile(src):
            raise CheckpointError(f"{src!r} does not exist: pass a file written by torch.save(model.state_dict())")
        try:
            state_dict = torch.load(src, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a file torch cannot read is the user's input
            raise CheckpointError(f"{src!r} cannot be read by torch.load ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}): pass a file "
                                  "written by torch.save(model.state_dict())") from e
        if not isinstance(state_dict, dict):
            raise CheckpointError(f"{src!r} holds a {type(state_dict).__name__}, not a state dict")
    sd: dict[str, Any] = {MODEL + k: v.detach().cpu() for k, v in state_dict.items()
                          if isinstance(v, torch.Tensor)}
    sd["autopar"] = pickle.dumps({"format": FORMAT, "aliases": {}, "param_groups": [],
                                  "has_optimizer": False})
    sd["extra"] = pickle.dumps(None)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.fspath(out)), no_dist=True)
    write_checksums(os.fspath(out), no_dist=True)
