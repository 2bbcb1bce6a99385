"""GradSync launches no collective over a mesh axis of one rank (a world-1 plan, a pipeline
stage's size-1 data axis): a sum over one rank is a no-op, and every launch cost a
flatten, a gloo call and a copy back each step (benchmarks/runtime_overhead.py)."""
import torch
from torch import nn

from autopar.ops.comm import Comm, _Done
from autopar.runtime.grad_sync import GradSync


class _RecordingComm(Comm):
    """A mesh of ``shape``; an all-reduce over axis ``a`` multiplies by its size (every
    rank holding the same gradient) and is recorded."""

    def __init__(self, shape):
        self.mesh_shape, self.coord, self.rank = tuple(shape), (0,) * len(shape), 0
        self.device = torch.device("cpu")
        self.calls = []

    def all_reduce_coalesced(self, tensors, axis):
        self.calls.append(axis)
        flat = torch.cat([t.reshape(-1) for t in tensors]) * self.mesh_shape[axis]
        return _Done(tensors, flat)


def _step(comm, axes):
    w = nn.Parameter(torch.ones(3))
    sync = GradSync({"w": w}, {"w": axes}, comm)
    sync.begin()
    w.grad = torch.full((3,), 2.0)
    sync.ready(["w"])
    sync.finish()
    return w.grad


def test_no_collective_over_one_rank():
    comm = _RecordingComm((1,))
    assert torch.equal(_step(comm, (0,)), torch.full((3,), 2.0))
    assert comm.calls == []


def test_only_the_axes_of_more_than_one_rank():
    comm = _RecordingComm((2, 1, 3))
    assert torch.equal(_step(comm, (0, 1, 2)), torch.full((3,), 12.0))
    assert comm.calls == [0, 2]
