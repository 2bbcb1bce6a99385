"""Profiled compute cost: time each op's forward and backward on the local device, cached.

:class:`Profiler` answers the same question as :func:`autopar.cost_models.compute.node_time`
— (forward seconds, backward seconds) of one call on its LOCAL shapes — by running the op.
It builds real tensors from the :class:`~autopar.sharding.registry.TensorMeta` s of the call
(random floats; integer inputs in a range that is valid for the call, see
:func:`_int_range`), runs a warm-up, then times repeats and keeps the median:

- forward: the op itself with autograd recording (floating inputs require grad, as in
  training), ``number`` calls per repeat so a repeat lasts ``min_repeat_s``;
- backward: ``torch.autograd.grad`` of the floating outputs with respect to the floating
  inputs (``retain_graph=True``, so one forward serves every repeat), minus the engine's
  fixed cost per ``autograd.grad`` call (which a real backward pays once per step, not
  once per op); the engine's cost per node stays in, as a real backward pays it per op.

CPU times are wall-clock (``time.perf_counter``) at the profiler's thread count; CUDA
times come from ``torch.cuda.Event`` pairs around the repeats, after a synchronize.

Results are cached on disk as JSON (``<cache_dir>/profile-<device>.json``; ``cache_dir``
defaults to ``$AUTOPAR_CACHE`` or ``~/.cache/autopar``), keyed by op, shapes, dtypes, the
non-tensor arguments, the device and (CPU) the thread count, so a second plan of the same
model profiles nothing.

The profiler has no time (``None``) for what it cannot or should not run, and the cost
model falls back to the roofline there: ops that are not ATen ``OpOverload`` s (autopar's
own local ops need a communicator), views (zero by convention, as in the roofline),
calls whose tensors exceed ``max_bytes`` (planning for a cluster from a laptop: a 175B
model's matmuls do not fit here), and calls that raise (the reason is kept in
``failures``).

>>> from autopar.sharding.registry import TensorMeta
>>> prof = Profiler("cpu", cache_dir="/tmp/autopar-doc")
>>> x, w = TensorMeta((64, 128), torch.float32), TensorMeta((256, 128), torch.float32)
>>> fwd, bwd = prof.node_time(torch.ops.aten.linear.default, [x, w],
...                           [TensorMeta((64, 256), torch.float32)], (x, w), {})
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .families import VIEW, family, op_name
from .machine import default_cache_dir

_FORMAT = 2     # 2: forward timed with autograd recording, engine per-node cost kept


class Profiler:
    """Time ATen calls on ``device`` ("cpu" or "cuda[:i]") and cache the results.

    ``threads`` (CPU): torch's intra-op thread count while timing; None = the current one.
    ``time_scale``: multiplies every time returned (not the cached ones): a rank that
    shares its core with others runs ``ranks / cores`` times slower.
    ``progress``: show a progress bar inside ``with profiler:`` (default: when stderr is a
    terminal). Use it around planning: ``with prof: autopar.plan(..., profiler=prof)``; the
    cache is written when the block ends.
    """

    def __init__(self, device: str = "cpu", cache_dir: str | os.PathLike | None = None, *,
                 threads: int | None = None, warmup: int = 2, repeats: int = 7,
                 min_repeat_s: float = 2e-3, max_bytes: float = 2**30,
                 time_scale: float = 1.0, progress: bool | None = None):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"Profiler device must be 'cpu' or 'cuda[:i]', got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("Profiler(device='cuda'): CUDA is not available on this machine")
        self.threads = threads
        self.warmup, self.repeats, self.min_repeat_s = warmup, repeats, min_repeat_s
        self.max_bytes = max_bytes
        self.time_scale = time_scale
        self.show_progress = sys.stderr.isatty() if progress is None else progress
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.path = self.cache_dir / f"profile-{self._device_tag()}.json"
        self.table: dict[str, list[float]] = self._load()
        self.failures: dict[str, str] = {}     # key -> why the call has no profile
        self.measured = 0                      # calls timed by this object (cache misses)
        self._dirty = False
        self._engine_s: float | None = None
        self._bar = None

    # ---- the interface the cost model uses -------------------------------------------------
    def node_time(self, op, inputs, outputs, args: tuple = (), kwargs: dict | None = None
                  ) -> tuple[float, float] | None:
        """(forward seconds, backward seconds) of ``op(*args, **kwargs)`` whose tensor
        arguments (``TensorMeta`` in ``args`` / ``kwargs``, in the order of ``inputs``) have
        the shapes of ``inputs``; None where the call is not profiled."""
        kwargs = kwargs or {}
        if not isinstance(op, torch._ops.OpOverload) or family(op) == VIEW:
            return None
        nbytes = sum(_nbytes(m) for m in list(inputs) + list(outputs))
        if nbytes > self.max_bytes:
            return None
        key = self.key(op, inputs, args, kwargs)
        hit = self.table.get(key)
        if hit is None:
            if key in self.failures:
                return None
            try:
                hit = self._measure(op, inputs, args, kwargs)
            except Exception as e:  # noqa: BLE001 - recorded; the roofline prices this call
                self.failures[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                return None
            self.table[key] = hit
            self.measured += 1
            self._dirty = True
            self._advance(op, inputs)
        return hit[0] * self.time_scale, hit[1] * self.time_scale

    # ---- session: progress bar and cache flush ---------------------------------------------
    def __enter__(self) -> "Profiler":
        if self.show_progress and self._bar is None:
            # lazy: rich.progress is only needed for this optional bar (show_progress)
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            self._bar = Progress(SpinnerColumn(), TextColumn("profiling {task.completed} ops"),
                                 TextColumn("[dim]{task.description}"), TimeElapsedColumn(),
                                 transient=True)
            self._task = self._bar.add_task("", total=None)
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self.save()

    def _advance(self, op, inputs) -> None:
        if self._bar is not None:
            shapes = " ".join("x".join(map(str, m.shape)) or "()" for m in inputs)
            self._bar.update(self._task, advance=1, description=f"{op_name(op)} {shapes}")
        elif self.measured % 50 == 0:
            self.save()        # outside a session: flush now and then

    # ---- cache -------------------------------------------------------------------------------
    def key(self, op, inputs, args, kwargs) -> str:
        """Op, shapes and dtypes of the tensors, the other arguments, device and threads."""
        it = iter(inputs)

        def enc(a):
            if _is_meta(a):
                m = next(it)
                return f"T{list(m.shape)}:{str(m.dtype).replace('torch.', '')}"
            if isinstance(a, torch.dtype):
                return str(a)
            return repr(a)
        flat = pytree.tree_map(enc, (tuple(args), dict(sorted(kwargs.items()))),
                               is_leaf=_is_meta)
        return f"{op}|{flat}|{self._device_tag()}"

    def _device_tag(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device).replace(" ", "_")
        return f"cpu-t{self.threads or torch.get_num_threads()}"

    def _load(self) -> dict[str, list[float]]:
        try:
            d = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return d.get("times", {}) if d.get("format") == _FORMAT else {}

    def save(self) -> None:
        """Write the table (merged with what other processes wrote meanwhile)."""
        if not self._dirty:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        merged = {**self._load(), **self.table}
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _FORMAT, "device": self._device_tag(), "times": merged}, f)
        os.replace(tmp, self.path)
        self._dirty = False

    # ---- measuring ---------------------------------------------------------------------------
    def _measure(self, op, inputs, args, kwargs) -> list[float]:
        threads = torch.get_num_threads()
        if self.threads is not None and self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        try:
            return self._measure_call(op, inputs, args, kwargs)
        finally:
            torch.set_num_threads(threads)

    def _measure_call(self, op, inputs, args, kwargs) -> list[float]:
        tensors = self._tensors(op, inputs, args, kwargs)
        it = iter(tensors)
        sub = lambda a: next(it) if _is_meta(a) else a  # noqa: E731
        args_t, kwargs_t = pytree.tree_map(sub, (tuple(args), dict(kwargs)), is_leaf=_is_meta)

        def fwd():
            return op(*args_t, **kwargs_t)

        leaves = [t for t in tensors if t.is_floating_point()]
        for t in leaves:
            t.requires_grad_(True)
        # as in training: autograd records the call (its node, the tensors it saves)
        t_fwd = self._time(fwd)
        out = [o for o in pytree.tree_leaves(fwd()) if isinstance(o, torch.Tensor)
               and o.is_floating_point() and o.requires_grad]
        if not out:
            return [t_fwd, 0.0]
        grads = [torch.randn_like(o) for o in out]
        ins = [t for t in leaves]

        def bwd():
            return torch.autograd.grad(out, ins, grads, retain_graph=True, allow_unused=True)

        t_bwd = max(0.0, self._time(bwd) - self._engine_time())
        return [t_fwd, t_bwd]

    def _engine_time(self) -> float:
        """The engine's fixed cost per ``autograd.grad`` call, which a real backward pays
        once per step: the time through a one-node graph less the cost of one node (the
        slope of the time through chains of 1 and 17 one-element nodes). The per-node cost
        stays in every op's backward, as it does in a real step."""
        if self._engine_s is None:
            x = torch.ones(1, device=self.device, requires_grad=True)

            def chain(k):
                y = x
                for _ in range(k):
                    y = y * 1.0
                return y
            y1, y17 = chain(1), chain(17)
            t1 = self._time(lambda: torch.autograd.grad(y1, x, retain_graph=True))
            t17 = self._time(lambda: torch.autograd.grad(y17, x, retain_graph=True))
            self._engine_s = max(0.0, t1 - max(0.0, t17 - t1) / 16)
        return self._engine_s

    def _time(self, fn) -> float:
        """Median seconds of one ``fn()`` over ``repeats`` repeats of ``number`` calls."""
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        once = max(time.perf_counter() - t0, 1e-7)
        number = max(1, min(1000, int(self.min_repeat_s / once)))
        samples = []
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(number):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e-3 / number)
            else:
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                samples.append((time.perf_counter() - t0) / number)
        return statistics.median(samples)

    def _tensors(self, op, inputs, args, kwargs) -> list[torch.Tensor]:
        """A real tensor per ``TensorMeta`` of the call, integers in a valid range."""
        out = []
        for k, m in enumerate(inputs):
            if m.dtype.is_floating_point or m.dtype.is_complex:
                out.append(torch.randn(m.shape, dtype=m.dtype, device=self.device))
            elif m.dtype == torch.bool:
                out.append(torch.rand(m.shape, device=self.device) < 0.5)
            else:
                hi = _int_range(op, inputs, k)
                out.append(torch.randint(0, max(1, hi), m.shape, dtype=m.dtype, device=self.device))
        return out


def _int_range(op, inputs, k: int) -> int:
    """Exclusive upper bound for integer input ``k``: the number of rows of an embedding's
    weight, the number of classes of a loss's logits (dim 1, or dim 0 of 1-D logits);
    otherwise the smallest dim of any other tensor input, which every indexing op accepts
    (index, gather, index_select, scatter read indices into one of those dims)."""
    name = op_name(op)
    if name in ("embedding", "embedding_bag", "_embedding_bag") and k == 1:
        return inputs[0].shape[0]
    if name in ("cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
                "nll_loss2d_forward", "nll_loss_nd") and k == 1:
        x = inputs[0]
        return x.shape[1] if len(x.shape) >= 2 else x.shape[0]
    dims = [d for j, m in enumerate(inputs) if j != k for d in m.shape]
    return min(dims) if dims else 1


def _is_meta(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, torch.Tensor)


def _nbytes(m) -> int:
    return math.prod(m.shape) * m.dtype.itemsize


__all__ = ["Profiler", "PeakMemory", "default_cache_dir"]


class PeakMemory:
    """Peak bytes of the tensors allocated inside a ``with`` block that are alive at once.

    CPU: a census under a ``TorchDispatchMode``: every new tensor storage an op returns is
    counted until Python sees it freed (a weak-reference finalizer), views of one storage
    once; tensors that existed before the block (parameters, optimizer state) are not
    counted. This is torch's own view of live tensor bytes, not the allocator's or the
    process's (glibc's heap keeps more; ``ru_maxrss`` never goes down). CUDA: the rise of
    ``torch.cuda.max_memory_allocated`` over the block. The mode is thread-local: on ranks
    simulated as threads, each rank measures its own.

    >>> with PeakMemory() as mem:
    ...     loss = model(x).sum(); loss.backward()
    >>> mem.peak_bytes
    """

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.current_bytes = 0
        self._paused = 0

    @contextmanager
    def uncounted(self):
        """Storages made inside are not counted (CPU): on a CPU rank host and device are one
        memory, so a census of the device leaves out what goes to the host this way (the
        activation offload hooks' copies, ``tests/test_offload_memory.py``)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._seen = WeakIdKeyDictionary()
        self._mode = _CensusMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._mode.__exit__(*exc)

    def _count(self, out, args) -> None:
        if self._paused:
            return
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(args)
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            if st in self._seen or st.data_ptr() in inputs:
                continue       # seen, or a view / in-place result of an input
            n = st.nbytes()
            self._seen[st] = n
            self.current_bytes += n
            weakref.finalize(st, self._free, n)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _free(self, n: int) -> None:
        self.current_bytes -= n


class _CensusMode(TorchDispatchMode):
    """Counts the CPU storages every op creates for a :class:`PeakMemory` meter."""

    def __init__(self, meter: PeakMemory):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter._count(out, (args, kwargs))
        return out
