"""A checkpoint save that cannot hang: a time limit on DCP's own collectives, and the names
of the ranks that did not finish writing (``autopar.save_checkpoint(..., timeout=)``).

DCP coordinates a save with collectives on a process group (it gathers every rank's plan,
then every rank's write results, on rank 0): a rank that never finishes writing its shard
leaves the others waiting in that gather for the group's timeout (30 minutes under gloo
by default). :class:`TimedSave` runs the save on a gloo group of its own made with
``timeout`` seconds (DCP's collectives carry pickled objects, which gloo moves for CPU and
CUDA jobs alike; ``dcp.async_save`` itself requires a CPU backend for them), and every rank marks in the
job's store that its shard is written (:class:`MarkingWriter`): on a timeout the ranks
whose mark is missing are the ones named.
"""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopar.ops.fault_notice import job_store

__all__ = ["MarkingWriter", "TimedSave"]

_saves = itertools.count()


class MarkingWriter(dcp.FileSystemWriter):
    """DCP's file writer that, once this rank's shard files are written, sets
    ``<prefix>/<rank>`` in the job's store."""

    def __init__(self, path: str, prefix: str):
        super().__init__(path)
        self._mark = f"{prefix}/{dist.get_rank()}"

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)
        done.wait()                     # FileSystemWriter writes before it returns
        job_store().set(self._mark, b"1")
        return done


class TimedSave:
    """The process group and the writer of one save of ``path`` limited to ``timeout``
    seconds. Collective: every rank makes it for the same save (it makes a process group)."""

    def __init__(self, path: str, timeout: float):
        self.path, self.timeout = path, timeout
        self.prefix = f"autopar/save{next(_saves)}"
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.writer = MarkingWriter(path, self.prefix)

    def unfinished(self) -> list[int]:
        """The ranks whose shard is not written (no mark in the store)."""
        store = job_store()
        return [r for r in range(dist.get_world_size()) if not store.check([f"{self.prefix}/{r}"])]

    def done(self) -> None:
        """After a save that finished on every rank: free the group and this rank's mark."""
        dist.destroy_process_group(self.group)
        job_store().delete_key(f"{self.prefix}/{dist.get_rank()}")
