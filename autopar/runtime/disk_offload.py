"""ZeRO-Infinity's disk tier (Rajbhandari et al. 2021) in the runtime: ``offload="disk"``.

ZeRO-Offload (``autopar.runtime.offload``) keeps each rank's optimizer shard (the fp32
master copy of the parameter blocks it steps, and the optimizer's state next to it) in host
memory. The disk tier keeps that shard in files on local disk between steps and streams it
through host memory a bucket at a time:

- The files: each rank makes its own directory (under ``offload_dir=``, default
  ``tempfile.gettempdir()``), removed with the module. The masters are views of one file
  (``masters.bin``), the optimizer's state tensors of others (``state-K.bin``), each
  memory-mapped shared (``torch.from_file(shared=True)``: a write to the tensor is a write
  to the file's page cache, a read of a page not in memory reads it from disk), each tensor
  at a page-aligned offset so its pages are its own. ``pm.parameters()`` are these masters:
  build the optimizer on them as on any plan.
- The optimizer's state: torch's optimizers make their state lazily, in host memory. A
  global step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``; it
  acts only on an optimizer over these masters) moves each state tensor shaped like its
  parameter that is not in a file yet (the first step's, or one a checkpoint load put
  there) into one: a new file, or in place into the file tensor it replaces.
- ``pm.step(opt)`` steps by buckets (``bucket_bytes`` of masters, default
  ``cost_models.comm.DDP_BUCKET_BYTES``): the optimizer steps one bucket's parameters at a
  time (the others' gradients are hidden for that call; an optimizer steps only parameters
  with a gradient, and per parameter the update is the same), while a background I/O
  thread reads the next bucket ahead (``posix_fadvise(WILLNEED)``: the kernel reads it into
  the page cache) and writes the stepped bucket's state back (``msync``), then drops it from
  the process and from the page cache (``madvise(DONTNEED)``, ``posix_fadvise(DONTNEED)``).
  The first bucket is read ahead as soon as backward hands over its first gradients. A
  bucket's masters are written back and dropped once they have gone up to the device
  (:meth:`DiskOptimizer.up`, ZeRO-1/2's per-bucket copies before each gather, ZeRO-3's
  before the next forward). Between steps the rank holds none of its optimizer state in
  memory (``resident_bytes()`` counts the files' pages in memory, by ``mincore``).
- A bare ``opt.step()`` is still exact (the pages are read as the step touches them); the
  post-hook then writes the whole state back.

Reads and writes of the same page are coherent through the kernel's page cache whatever
the I/O thread is doing, so the streaming changes when bytes move, never the numbers: the
step is ZeRO-Offload's, equal to one device. The ctypes calls (``msync``, ``madvise``,
``mincore``) release the GIL, so the write-back runs beside the host step. On a GPU the
masters are pageable (the copies up are not asynchronous); gradients go down to pinned
buffers as under ``offload="optimizer"``. Linux only (``mincore``, ``posix_fadvise``).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.cost_models.comm import DDP_BUCKET_BYTES
from autopar.errors import ArgumentError
from autopar.runtime.offload import HostOptimizer

PAGE = mmap.PAGESIZE
_MS_SYNC = 4            # <sys/mman.h> on Linux
_LIBC = []


def _libc():
    """The C library's ``msync``, ``madvise`` and ``mincore`` (loaded on first use)."""
    if not _LIBC:
        lib = ctypes.CDLL(None, use_errno=True)
        for name, args in (("msync", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
                           ("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
                           ("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        _LIBC.append(lib)
    return _LIBC[0]


def _pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages."""
    return (n + PAGE - 1) // PAGE * PAGE


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class StateFile:
    """Tensors of ``specs`` (shape, dtype) in one new file at ``path``, memory-mapped shared,
    each at a page-aligned offset (``tensors``, in order)."""

    def __init__(self, path: str, specs: list[tuple[torch.Size, torch.dtype]]):
        self.path = path
        self.spans: list[tuple[int, int]] = []      # (offset, bytes) of each tensor
        pos = 0
        for shape, dtype in specs:
            n = math.prod(shape) * dtype.itemsize
            self.spans.append((pos, n))
            pos += _pages(max(n, 1))
        self.nbytes = pos
        with open(path, "wb") as f:
            f.truncate(pos)
        self.fd = os.open(path, os.O_RDWR)
        weakref.finalize(self, os.close, self.fd)
        raw = torch.from_file(path, shared=True, size=pos, dtype=torch.uint8)
        self.base = raw.data_ptr()
        self.tensors = [raw[o:o + n].view(dtype).view(shape)
                        for (o, n), (shape, dtype) in zip(self.spans, specs)]

    def read_ahead(self, offset: int, n: int) -> None:
        """Start reading ``n`` bytes at ``offset`` into the page cache (returns at once)."""
        os.posix_fadvise(self.fd, offset, _pages(n), os.POSIX_FADV_WILLNEED)

    def write_back(self, offset: int, n: int) -> None:
        """Write ``n`` bytes at ``offset`` to disk, then drop them from this process and from
        the page cache (the next read reads the disk)."""
        n = _pages(n)
        _check(_libc().msync(self.base + offset, n, _MS_SYNC), f"msync {self.path}")
        _check(_libc().madvise(self.base + offset, n, mmap.MADV_DONTNEED), f"madvise {self.path}")
        os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of this file in memory now (its pages in the page cache, by ``mincore``)."""
        pages = self.nbytes // PAGE
        vec = (ctypes.c_ubyte * pages)()
        _check(_libc().mincore(self.base, self.nbytes, vec), f"mincore {self.path}")
        return sum(v & 1 for v in vec) * PAGE


def rank_directory(offload_dir: str | None) -> str:
    """A new directory for this rank's files inside ``offload_dir`` (default the temporary
    directory); ArgumentError naming the fix when ``offload_dir`` cannot hold it."""
    base = tempfile.gettempdir() if offload_dir is None else os.fspath(offload_dir)
    if not os.path.isdir(base):
        raise ArgumentError(f"offload_dir={base!r} is not a directory: create it on a local disk "
                            "(NVMe) with room for the optimizer state, or leave offload_dir= out "
                            "(a temporary directory)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ArgumentError(f"offload_dir={base!r} is not writable by this process: give a "
                            "directory it may write in, or leave offload_dir= out")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return tempfile.mkdtemp(prefix=f"autopar-offload-rank{rank}-", dir=base)


def _close(io: ThreadPoolExecutor, hook, directory: str) -> None:
    hook.remove()
    io.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class DiskOptimizer(HostOptimizer):
    """:class:`HostOptimizer` whose masters and optimizer state live in files under
    ``offload_dir`` (module docstring)."""

    def __init__(self, device_params: dict[str, nn.Parameter], device: torch.device,
                 offload_dir: str | None = None, bucket_bytes: int | None = None):
        self.directory = rank_directory(offload_dir)
        self.bucket_bytes = bucket_bytes or DDP_BUCKET_BYTES
        self.files: list[StateFile] = []
        self._where: dict[int, tuple[StateFile, int, int]] = {}   # data_ptr -> (file, offset, bytes)
        self.state: dict[str, dict[str, torch.Tensor]] = {}     # attr -> key -> file tensor
        self._io = ThreadPoolExecutor(1, thread_name_prefix="autopar-disk")
        self._pending: list[Future] = []
        self._stepping = False
        self._read: set[str] = set()         # attrs read ahead and not written back since
        try:
            super().__init__(device_params, device)
        except BaseException:
            self._io.shutdown()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._master_attr = {id(m): a for a, m in self.masters.items()}
        self.write_back(self.masters)        # on disk from the start; host memory freed
        me = weakref.ref(self)

        def after_step(optimizer, args, kwargs):
            if me() is not None:
                me()._after_step(optimizer)
        hook = register_optimizer_step_post_hook(after_step)
        weakref.finalize(self, _close, self._io, hook, self.directory)

    # ---- the files ---------------------------------------------------------------------
    def _master_buffers(self) -> list[torch.Tensor]:
        return self._new_file("masters", [(p.shape, p.dtype) for p in self.device_params.values()])

    def _new_file(self, stem: str, specs) -> list[torch.Tensor]:
        f = StateFile(os.path.join(self.directory, f"{stem}.bin"), specs)
        self.files.append(f)
        for t, (offset, n) in zip(f.tensors, f.spans):
            self._where[t.data_ptr()] = (f, offset, n)
        return f.tensors

    def disk_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state in the files: ``"optimizer"``, the tensors (masters and
        state); ``"files"``, the files' sizes (each tensor padded to whole pages)."""
        tensors = list(self.masters.values()) + [t for st in self.state.values() for t in st.values()]
        return {"optimizer": sum(t.numel() * t.element_size() for t in tensors),
                "files": sum(os.path.getsize(f.path) for f in self.files)}

    def resident_bytes(self) -> int:
        """Bytes of the files in memory now (0 between steps, once :meth:`drain` returned)."""
        return sum(f.resident_bytes() for f in self.files)

    def on_disk(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the file tensors (a master or a state tensor)."""
        return t.data_ptr() in self._where

    # ---- background I/O ------------------------------------------------------------------
    def _submit(self, fn, spans) -> None:
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._io.submit(lambda: [fn(f, o, n) for f, o, n in spans]))

    def _spans(self, attrs, masters: bool = True, state: bool = True):
        out = []
        for a in attrs:
            ts = ([self.masters[a]] if masters else []) + (list(self.state.get(a, {}).values()) if state else [])
            out += [self._where[t.data_ptr()] for t in ts if t.data_ptr() in self._where]
        return out

    def read_ahead(self, attrs, state: bool = True) -> None:
        attrs = list(attrs)
        self._read.update(attrs)
        self._submit(StateFile.read_ahead, self._spans(attrs, state=state))

    def write_back(self, attrs, masters: bool = True, state: bool = True) -> None:
        attrs = list(attrs)
        if masters:
            self._read.difference_update(attrs)
        self._submit(StateFile.write_back, self._spans(attrs, masters, state))

    def drain(self) -> None:
        """Wait for the reads and writes in flight (raising the first error)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    # ---- the optimizer's state -----------------------------------------------------------
    def _ours(self, optimizer) -> bool:
        return any(id(p) in self._master_attr for g in optimizer.param_groups for p in g["params"])

    def _after_step(self, optimizer) -> None:
        """The step post-hook: the state made or loaded since goes to the files; after a
        bare ``opt.step()`` (not :meth:`step`'s buckets) all of it is written back."""
        if not self._ours(optimizer):
            return
        self.spill(optimizer)
        if not self._stepping:
            self.write_back(list(self.state), masters=False)

    @torch.no_grad()
    def spill(self, optimizer) -> None:
        """Move each of ``optimizer``'s state tensors shaped like its parameter that is not in
        a file into one: in place into the file tensor it replaced (a load), or a new file."""
        new = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                attr = self._master_attr.get(id(p))
                if attr is None or p not in optimizer.state:
                    continue
                mine = self.state.setdefault(attr, {})
                for key, v in optimizer.state[p].items():
                    if not torch.is_tensor(v) or v.dim() == 0 or v.shape != p.shape or mine.get(key) is v:
                        continue
                    old = mine.get(key)
                    if old is not None and old.dtype == v.dtype:
                        old.copy_(v)
                        optimizer.state[p][key] = old
                    else:
                        new.append((p, attr, key, v))
        if new:
            made = self._new_file(f"state-{len(self.files)}", [(v.shape, v.dtype) for *_, v in new])
            for (p, attr, key, v), t in zip(new, made):
                t.copy_(v)
                optimizer.state[p][key] = self.state[attr][key] = t

    # ---- the step, by buckets ------------------------------------------------------------
    def buckets(self, params) -> list[list]:
        """``params`` in order, cut into runs of about ``bucket_bytes`` of masters."""
        out, cur, size = [], [], 0
        for p in params:
            n = p.numel() * p.element_size()
            if cur and size + n > self.bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += n
        return out + ([cur] if cur else [])

    def _attrs(self, params) -> list[str]:
        return [self._master_attr[id(p)] for p in params if id(p) in self._master_attr]

    def stepping(self, optimizer):
        """What ``pm.step`` steps: ``optimizer`` whose ``step()`` is :meth:`step`."""
        return _Streamed(self, optimizer)

    def step(self, optimizer) -> None:
        """``optimizer.step()`` one bucket at a time, the next read ahead and the last
        written back in the background (module docstring)."""
        self.drain()
        self.spill(optimizer)          # a checkpoint's state, loaded into host memory
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        buckets = self.buckets([p for p in params if p.grad is not None])
        if buckets and not set(self._attrs(buckets[0])) <= self._read:
            self.read_ahead(self._attrs(buckets[0]))
        self._stepping = True
        try:
            for i, bucket in enumerate(buckets):
                if i + 1 < len(buckets):
                    self.read_ahead(self._attrs(buckets[i + 1]))
                mine = {id(p) for p in bucket}
                for p, g in zip(params, grads):
                    p.grad = g if id(p) in mine else None
                optimizer.step()
                self.write_back(self._attrs(bucket), masters=False)   # masters: once copied up
        finally:
            self._stepping = False
            for p, g in zip(params, grads):
                p.grad = g
        stepped = {a for b in buckets for a in self._attrs(b)}
        left = [a for a in self._read if a not in stepped]   # read ahead, not stepped
        if left:
            self.write_back(left)

    # ---- HostOptimizer's hooks -----------------------------------------------------------
    def reduced(self, tensors) -> None:
        """As :meth:`HostOptimizer.reduced`; the first of a step also starts reading the first
        bucket ahead, while backward goes on."""
        if not self._read:
            first = self.buckets(list(self.masters.values()))
            if first:
                self.read_ahead(self._attrs(first[0]))
        super().reduced(tensors)

    def up(self, tensors) -> None:
        """As :meth:`HostOptimizer.up`; then the masters copied go back to disk."""
        tensors = list(tensors)
        super().up(tensors)
        self.write_back([self._attr[id(p)] for p in tensors if id(p) in self._attr], state=False)


class _Streamed:
    """An optimizer whose ``step()`` is :meth:`DiskOptimizer.step` (what ``pm.step`` and the
    fp16 loss scaler call); everything else is the optimizer's."""

    def __init__(self, disk: DiskOptimizer, optimizer):
        self._disk, self._optimizer = disk, optimizer

    def step(self, closure=None):
        if closure is not None:
            raise ArgumentError("pm.step(opt) under offload='disk' steps without a closure: "
                                "compute the loss with pm.train_step first")
        self._disk.step(self._optimizer)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
