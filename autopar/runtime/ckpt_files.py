"""The files of a checkpoint directory: what is there, whether it is whole, and the error
that names the one file that is not.

DCP's ``FileSystemWriter`` has every rank write its shards to ``__<rank>_<n>.distcp``; the
coordinator writes ``.metadata`` last, once every rank has written (so a directory without
it is a save that did not finish). Each tensor is one ``torch.save`` record at an
(offset, length) of a file, recorded in ``.metadata``'s ``storage_data``.

``torch.load`` does not check the zip records' CRC-32 when it reads (a byte flipped in a
tensor's data loads silently as another number; measured on torch 2.13), so autopar adds
its own: after a save, every rank computes the CRC-32 (``zlib.crc32``) and size of the files
it wrote, and rank 0 writes them to ``.autopar-checksums.json``. At load, before reading
anything, the files ``.metadata`` names are checked: each exists and holds every byte
range recorded for it (cheap: one ``stat`` per file, on every rank); then, when the
checksums file is there, each file's CRC-32, the files shared out over the ranks (rank r
checks files r, r + world, ...) and the verdicts gathered, so every rank raises the same
:class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import glob
import json
import os
import zlib

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from autopar.errors import CheckpointError

CHECKSUMS = ".autopar-checksums.json"
METADATA = ".metadata"
_CHUNK = 1 << 22     # 4 MiB reads for the CRC


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def crc32(path: str) -> int:
    """The CRC-32 (zlib's) of the whole file ``path``."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_checksums(path: str, no_dist: bool = False) -> None:
    """After a complete save into ``path``: each rank's CRC-32 and size of the shard files it
    wrote (``__<rank>_*.distcp``), gathered; rank 0 writes them to ``path/.autopar-checksums.json``.
    Collective unless ``no_dist``."""
    rank, world = (0, 1) if no_dist else _world()
    mine = {}
    for f in sorted(glob.glob(os.path.join(glob.escape(path), f"__{rank}_*.distcp"))):
        mine[os.path.basename(f)] = {"size": os.path.getsize(f), "crc32": crc32(f)}
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    if rank == 0:
        table = {k: v for part in every for k, v in part.items()}
        tmp = os.path.join(path, CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"algorithm": "crc32", "files": table}, f)
        os.replace(tmp, os.path.join(path, CHECKSUMS))


def partial_or_missing(path: str, latest=lambda root: None) -> CheckpointError | None:
    """The error for a ``path`` that is not a complete checkpoint directory (None when it is
    one): no directory, or a save that did not finish (shards but no ``.metadata``).
    ``latest(root)``: the newest complete checkpoint under ``root``, named as the fix."""
    if os.path.isdir(path) and os.path.exists(os.path.join(path, METADATA)):
        return None
    root = os.path.dirname(os.path.abspath(path))
    shards = glob.glob(os.path.join(glob.escape(path), "*.distcp")) if os.path.isdir(path) else []
    if shards or os.path.basename(os.path.normpath(path)).endswith(".tmp"):
        latest = latest(root)
        fix = (f"load the newest complete one, {latest!r} (autopar.checkpoint.latest_checkpoint"
               f"({root!r}))" if latest else
               "load a complete checkpoint (autopar.checkpoint.latest_checkpoint(root) finds the "
               "newest), or start from step 0")
        return CheckpointError(
            f"{path!r} is a checkpoint whose save did not finish ({len(shards)} shard files but no "
            f".metadata: a rank died or the job stopped while writing it); it cannot be loaded: {fix}")
    return CheckpointError(f"{path!r} is not a checkpoint directory (no .metadata in it): pass "
                           "the directory save_checkpoint or `autopar checkpoint import` wrote")


def _fix(path: str) -> str:
    return ("restore the file from a copy, or load an older checkpoint "
            f"(the step directories beside {os.path.basename(os.path.normpath(path))!r})")


def check_files(path: str, metadata, no_dist: bool = False) -> None:
    """Raise :class:`CheckpointError` naming the first shard file of checkpoint ``path`` that
    is missing, shorter than the byte ranges ``.metadata`` records in it, or whose CRC-32
    differs from the one saved. ``metadata``: DCP's ``Metadata``. Collective (the CRCs are
    shared out over the ranks) unless ``no_dist``."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name in sorted(need):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise CheckpointError(f"checkpoint {path!r}: the shard file {f!r} is missing (its "
                                  f".metadata records {need[name]} bytes in it): {_fix(path)}")
        size = os.path.getsize(f)
        if size < need[name]:
            raise CheckpointError(f"checkpoint {path!r}: the shard file {f!r} is truncated ({size} "
                                  f"bytes; its .metadata records data up to byte {need[name]}): "
                                  f"{_fix(path)}")
    sums_path = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(sums_path):
        return      # saved before checksums existed, or by plain DCP: sizes checked only
    with open(sums_path) as fh:
        saved = json.load(fh)["files"]
    rank, world = (0, 1) if no_dist else _world()
    names = sorted(saved)
    bad = []
    for name in names[rank::world]:
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            bad.append(f"the shard file {f!r} is missing")
            continue
        size, crc = os.path.getsize(f), crc32(f)
        if size != saved[name]["size"] or crc != saved[name]["crc32"]:
            bad.append(f"the shard file {f!r} is corrupted (CRC-32 {crc:08x}, {size} bytes; saved "
                       f"{saved[name]['crc32']:08x}, {saved[name]['size']} bytes)")
    if world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, bad)
        bad = [b for part in every for b in part]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint {path!r}: {bad[0]}{more}: {_fix(path)}")


def first_failure(e: CheckpointException) -> str:
    """``rank r: <the exception>`` of the lowest failing rank of a DCP ``CheckpointException``."""
    failures = getattr(e, "failures", {}) or {}
    if not failures:
        return str(e).splitlines()[0][:300]
    rank = min(failures)
    exc = failures[rank][0]
    return f"rank {rank}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
