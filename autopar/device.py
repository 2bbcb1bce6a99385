"""The one place the runtime names a device type.

Everything in ``autopar/runtime``, ``autopar/ops`` and ``passes`` takes the device from
here (``rank_device()``), from the communicator (``comm.device``, which ``DistComm`` gets
from :func:`mesh_device`) or from a tensor it is given; ``tests/test_devices.py`` fails if
another runtime module writes a device type ("cpu", "cuda", ``torch.device("...")``).

- :func:`rank_device`: CUDA device ``LOCAL_RANK`` when CUDA is available (made the current
  device: call it before the process group and the mesh exist), else the CPU.
- :func:`backend_for`: the process group backend for that device (NCCL on CUDA, else gloo).
- :data:`SHARE_GPUS_ENV`: ``AUTOPAR_SHARE_GPUS=1`` lets more ranks than GPUs run on a node,
  rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK % device_count`` over gloo (NCCL refuses two ranks
  on one GPU): how a one-GPU machine runs a multi-rank CUDA program at all (the GPU check's
  two-rank section); slow, for checks, not for training.
- :func:`mesh_device`: the device a mesh of a given device type keeps this rank's tensors on.
- :func:`object_device`: the ``device=`` argument of ``broadcast_object_list`` and friends
  (NCCL moves the pickled bytes through the current CUDA device; gloo through host memory).
- :data:`HOST`: host memory, where weight files are read (memory-mapped) before a rank's
  shard moves to its device, and where capture's fake tensors stand.
- :func:`pin_host_memory`: whether host buffers a device copies to are pinned (ZeRO-Offload).
- :func:`synchronize`, :func:`allocator_peak`: waiting for a device's queued work, and the
  peak its caching allocator held (timing reports).
- :func:`p2p_matched_by_tag`: whether two threads may exchange point-to-point messages
  between the same ranks at once (gloo: by tag; NCCL: by issue order).
- :class:`SideStream`: the stream a second host thread queues its work on (DualPipeV's
  overlapped forward, ``runtime.overlap``): a CUDA stream of its own, nothing on the CPU.
"""
from __future__ import annotations

import contextlib
import os

import torch

CPU = "cpu"
CUDA = "cuda"
HOST = CPU
SHARE_GPUS_ENV = "AUTOPAR_SHARE_GPUS"


def gpus_shared() -> bool:
    """Whether ``AUTOPAR_SHARE_GPUS=1`` lets several ranks of a node use one GPU."""
    return os.environ.get(SHARE_GPUS_ENV, "") == "1"


def rank_device() -> torch.device:
    """This rank's device: CUDA device ``LOCAL_RANK`` when CUDA is available (made the current
    device, so call this before the process group and mesh exist), else the CPU. With more
    local ranks than GPUs: GPU ``LOCAL_RANK % count`` under ``AUTOPAR_SHARE_GPUS=1``, else an
    error that says how many ranks to launch."""
    if torch.cuda.is_available():
        index, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if index >= count:
            if not gpus_shared():
                raise RuntimeError(
                    f"LOCAL_RANK {index} but this node has {count} CUDA device(s): launch at most "
                    f"{count} rank(s) per node (torchrun --nproc-per-node {count}), or set "
                    f"{SHARE_GPUS_ENV}=1 to run several ranks on one GPU over gloo (slow: for checks)")
            index %= count
        torch.cuda.set_device(index)
        return torch.device(CUDA, index)
    return torch.device(CPU)


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL on CUDA, gloo otherwise
    (and on CUDA under ``AUTOPAR_SHARE_GPUS=1``: NCCL refuses two ranks on one GPU, gloo
    moves CUDA tensors through host memory)."""
    return "nccl" if device.type == CUDA and not gpus_shared() else "gloo"


def mesh_device(device_type: str) -> torch.device:
    """Where a rank of a DeviceMesh of ``device_type`` keeps its tensors: the current CUDA
    device on a CUDA mesh, else the device type itself."""
    if device_type == CUDA:
        return torch.device(CUDA, torch.cuda.current_device())
    return torch.device(device_type)


def object_device(device: torch.device) -> torch.device | None:
    """``device=`` for torch.distributed's object collectives on ranks of ``device``."""
    return device if backend_for(device) == "nccl" else None


def pin_host_memory(device: torch.device) -> bool:
    """Whether host buffers that ``device`` copies to and from should be pinned (page-locked,
    so the copies run asynchronously): on CUDA; a CPU rank's host is its device."""
    return device.type == CUDA


def records_cuda_graphs(device: torch.device) -> bool:
    """Whether programs on ``device`` can be recorded as CUDA graphs (``compile=
    "reduce-overhead"``, ``runtime.compiled.inductor_options``): on CUDA only."""
    return device.type == CUDA


def p2p_matched_by_tag(device: torch.device) -> bool:
    """Whether point-to-point messages between two ranks on ``device``'s backend are matched
    by tag (gloo, the CPU's), so that two threads may send and receive between the same
    ranks at once; NCCL matches them by the order they were issued in, which two threads
    would make differ between the ranks."""
    return device.type != CUDA


class SideStream:
    """Where a second host thread runs its device work beside the calling thread's: on CUDA
    a stream of its own (kernels of the two threads then run at once, the first waiting for
    what the caller queued before it started, the caller waiting for it at the join); on the
    CPU every op runs on its host thread, which is the overlap already (nothing to do)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == CUDA else None

    def caller(self):
        """The calling thread's current stream (None on the CPU): read before the thread starts."""
        return torch.cuda.current_stream(self.device) if self.stream is not None else None

    @contextlib.contextmanager
    def run(self, caller):
        """In the second thread: its work on the side stream, after ``caller``'s queued work."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield

    def join(self, caller, handed=()) -> None:
        """In the calling thread after the second one finished: ``caller`` (its stream) waits
        for the side stream's work, so what the second thread made is read after it is made;
        the tensors in ``handed`` (made on the side stream, read on ``caller``) are marked in
        use by ``caller`` until its work queued so far is done, so that the caching allocator
        does not give their memory back to the side stream before (``record_stream``)."""
        if self.stream is not None:
            caller.wait_stream(self.stream)
            for t in handed:
                if isinstance(t, torch.Tensor) and t.device.type == CUDA:
                    t.record_stream(caller)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA streams); the host runs in order."""
    if device.type == CUDA:
        torch.cuda.synchronize(device)


def allocator_peak(device: torch.device, fn) -> float | None:
    """Peak bytes the caching allocator of ``device`` held while ``fn()`` ran; None where the
    device has no such allocator (the CPU: measure live tensors instead)."""
    if device.type != CUDA:
        return None
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device))
