"""Lossy data-parallel gradient reduction: the pins ``compress=`` and ``local_sgd=``.

:class:`autopar.runtime.grad_sync.GradSync` sums each bucket of gradients over the data axis;
with one of these it hands the bucket to :meth:`Reducer.start` instead (the other mesh axes
are still summed exactly). Every reducer returns the SUM over the data ranks, written into
the bucket's gradients, as the exact all-reduce would.

- ``"bf16"``: torch's ``default_hooks.bf16_compress_hook`` (cast, all-reduce in bf16, cast back).
- ``"powersgd:R"``: torch's ``powerSGD_hook`` with its ``PowerSGDState`` (rank ``R``, error
  feedback and warm start on; the first ``POWERSGD_START`` steps are exact all-reduces, the
  least torch allows with error feedback). Matrices (a gradient viewed as ``shape[0] x
  rest``) where rank ``R`` saves less than half go uncompressed, as torch decides.
- ``"topk:F"``: each rank sends the ``ceil(F * n)`` entries of largest magnitude of its bucket
  (values and int32 indices, all-gathered) and keeps the rest as its error, added to the
  next step's bucket (error feedback). torch has no top-k hook.
- ``"int8"``: each chunk of ``INT8_CHUNK`` values is quantised to uint8 against its own min
  and scale (fp32), all-gathered, and each rank sums the dequantised chunks. torch's
  ``quantization_perchannel_hook`` does this in a Python loop per chunk; this is the same
  arithmetic, vectorised. No error feedback (as torch's).
- ``"nuq:S"``: NUQSGD (Ramezani-Kebrya et al. 2021): each chunk of ``NUQ_CHUNK`` values is
  sent as its L2 norm (fp32) and, per value, a sign and one of the ``S + 1`` exponentially
  spaced levels ``0, 2^-(S-1), ..., 1/2, 1`` of the norm, rounded at random to one of the two
  levels around ``|x| / norm`` with the probability that makes its expectation exactly
  ``|x| / norm`` (unbiased; no error feedback, as in the paper). Codes are 4 bits (two a
  byte) for ``S <= 7``, else a byte; all-gathered, each rank sums the dequantised vectors.
  Each rank draws from its own generator (``NUQ_SEED`` + its global rank). Written here:
  torch has no NUQSGD hook and the authors' code is a fork of an old Horovod/PyTorch.
- ``"accordion:powersgd:R1:R2"`` / ``"accordion:topk:F1:F2"``: Accordion (Agarwal et al. 2021)
  over a PowerSGD or top-k reducer: every ``ACCORDION_INTERVAL`` steps the norm of each
  bucket's summed gradient, accumulated over the interval, is compared with the last
  interval's; a relative change of at least ``ACCORDION_ETA`` (the paper's 0.5) marks a
  critical regime, and the bucket uses the less compressed setting (R2 / F2) until the next
  check, else the more compressed one (R1 / F1). Training starts critical. The two settings
  share one error-feedback residual. The norms are averaged over the data ranks (one
  float a bucket an interval) so every rank switches alike (the detector is
  ``autopar.runtime.regime``'s, shared with ``workers=``, Accordion's batch-size form).
  Written here: no maintained library offers Accordion (the authors' code is a research
  script).
- ``local_sgd=H``: no gradient reduction after the warm-up (``local_sgd_warmup`` steps of
  exact all-reduce, default ``LOCAL_SGD_WARMUP``); each rank steps on its own gradient (its
  term of the global loss times the data size: its local batch's mean), and
  ``ParallelModule.step`` averages the parameters over the data axis every ``H`` steps with
  torch's ``PeriodicModelAverager``. Call ``pm.step(optimizer)`` (not ``optimizer.step()``).

torch's hooks take a DDP ``GradBucket``, which Python cannot build; they only call its
``buffer``/``gradients``/``index``/``is_last``/``set_buffer``, so :class:`FlatBucket` offers
those over one flat tensor. torch's hooks return the mean over ranks, of gradients in DDP's
units (each rank's the mean over its batch); the gradients here are each rank's term of the
global loss, so the bucket is multiplied by the data size going in and the mean is the sum.
Bucket state (error feedback, warm start) is kept by bucket (its parameters' names), which
the ranks launch in the same order every step.

These reducers need torch.distributed process groups (``autopar.parallelize``), not the
thread-simulated ranks.
"""
from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.regime import ACCORDION_ETA, ACCORDION_INTERVAL, RegimeDetector
from autopar.runtime.updates.rule import Reducer, data_group, resolve

POWERSGD_START = 2
LOCAL_SGD_WARMUP = 100
"""Default ``local_sgd_warmup``: torch's post-local-SGD example switches after 100 steps."""
INT8_CHUNK = 512
NUQ_CHUNK = 512
"""Values per NUQSGD norm (the paper's bucket size d; QSGD's 512)."""
NUQ_SEED = 1234


def make_compressed(options: Options, comm: Comm, axis: int | None, params: dict) -> "Reducer | None":
    """``compress=``' rule on the data axis ``axis`` (None with one data rank or none)."""
    if axis is None or comm.size(axis) == 1 or options.compression is None:
        return None      # compress="auto" the solver left unchosen: the exact all-reduce
    kind, arg = options.compression
    return {"bf16": Bf16, "powersgd": PowerSGD, "topk": TopK, "int8": Int8, "nuq": Nuq,
            "accordion": Accordion}[kind](data_group(comm, axis), axis, arg)


def make_local_sgd(options: Options, comm: Comm, axis: int | None, params: dict) -> "LocalSGD | None":
    """``local_sgd=``' rule on the data axis ``axis`` (None with one data rank or none)."""
    if axis is None or comm.size(axis) == 1:
        return None
    warmup = options.local_sgd_warmup if options.local_sgd_warmup is not None else LOCAL_SGD_WARMUP
    return LocalSGD(options.local_sgd, warmup, data_group(comm, axis), axis)


class FlatBucket:
    """What torch's DDP communication hooks read of a ``GradBucket``, over one flat tensor."""

    def __init__(self, index: int, flat: torch.Tensor, shapes: list[torch.Size]):
        self._index, self._flat, self._shapes = index, flat, shapes

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._flat

    def set_buffer(self, t: torch.Tensor) -> None:
        self._flat = t

    def is_last(self) -> bool:
        return False      # the reducer ends the step itself (Reducer.end_step)

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            n = math.prod(s)
            out.append(self._flat[off: off + n].view(s if len(s) else (1,)))
            off += n
        return out


class Bf16(Reducer):
    def __init__(self, group, axis: int, _arg=None):
        super().__init__(group, axis)
        self._hook = bf16_compress_hook

    def reduce(self, index, flat, shapes):
        self._step_bytes += flat.numel() * 2
        return self._hook(self.group, FlatBucket(index, flat.mul_(self.size), list(shapes)))


class PowerSGD(Reducer):
    def __init__(self, group, axis: int, rank: int):
        super().__init__(group, axis)
        self._hook = psgd.powerSGD_hook
        logging.getLogger(psgd.__name__).setLevel(logging.WARNING)    # per-bucket info lines
        self.state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=POWERSGD_START,
                                        use_error_feedback=True, warm_start=True)
        self._shapes: dict[int, list] = {}

    def reduce(self, index, flat, shapes):
        self._shapes[index] = list(shapes)
        self._step_bytes += self._wire(flat, shapes)
        return self._hook(self.state, FlatBucket(index, flat.mul_(self.size), list(shapes)))

    def _wire(self, flat, shapes) -> int:
        """Bytes this bucket sends: all of it before PowerSGD starts; else P and Q of each
        compressed matrix and the uncompressed rest."""
        if self.state.iter < self.state.start_powerSGD_iter:
            return flat.numel() * flat.element_size()
        n_el = 0
        for s in shapes:
            rows = s[0] if len(s) else 1
            cols = math.prod(s) // rows if rows else 0
            r = min(rows, cols, self.state.matrix_approximation_rank)
            low = (rows + cols) * r
            n_el += low if low * self.state.min_compression_rate < rows * cols else rows * cols
        return n_el * flat.element_size()

    def end_step(self) -> None:
        super().end_step()
        self.state.iter += 1     # torch counts on the bucket that is_last(); ours never is

    def local_error(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """This rank's error-feedback residual of a bucket, in the gradients' units (torch
        keeps it in DDP's: times the data size)."""
        e = self.state.error_dict.get(self._index.get(tuple(names), -1))
        return None if e is None else e / self.size


class TopK(Reducer):
    def __init__(self, group, axis: int, fraction: float):
        super().__init__(group, axis)
        self.fraction = fraction
        self.errors: dict[int, torch.Tensor] = {}

    def reduce(self, index, flat, shapes):
        err = self.errors.get(index)
        if err is not None:
            flat.add_(err)
        k = max(1, math.ceil(self.fraction * flat.numel()))
        idx = flat.abs().topk(k, sorted=False).indices
        vals = flat[idx]
        flat[idx] = 0
        self.errors[index] = flat           # what was not sent, sent later
        vals_all, w1 = self._all_gather(vals)
        idx_all, w2 = self._all_gather(idx.to(torch.int32))

        def total():
            w1.wait()
            w2.wait()
            return torch.zeros_like(flat).index_add_(0, idx_all.reshape(-1).long(), vals_all.reshape(-1))
        return total

    def local_error(self, names: tuple[str, ...]) -> torch.Tensor | None:
        return self.errors.get(self._index.get(tuple(names), -1))


def quantize_int8(flat: torch.Tensor, chunk: int = INT8_CHUNK):
    """(uint8 codes, per-chunk (min, scale) as fp32) of ``flat``, zero-padded to chunks."""
    pad = (-flat.numel()) % chunk
    x = torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, chunk)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    scale = ((hi - lo) / 255).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((x - lo) / scale).clamp_(0, 255).to(torch.uint8)
    return codes, torch.cat([lo, scale], 1)


def dequantize_int8(codes: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    return codes.float() * stats[..., 1:] + stats[..., :1]


class Int8(Reducer):
    def __init__(self, group, axis: int, _arg=None):
        super().__init__(group, axis)

    def reduce(self, index, flat, shapes):
        codes, stats = quantize_int8(flat)
        codes_all, w1 = self._all_gather(codes)
        stats_all, w2 = self._all_gather(stats)

        def total():
            w1.wait()
            w2.wait()
            return dequantize_int8(codes_all, stats_all).sum(0).reshape(-1)[: flat.numel()].to(flat.dtype)
        return total


def nuq_levels(levels: int, device=None) -> torch.Tensor:
    """NUQSGD's ``levels + 1`` levels of the norm: ``0, 2^-(levels-1), ..., 1/2, 1``."""
    k = torch.arange(levels + 1, dtype=torch.float32, device=device)
    return torch.where(k > 0, torch.exp2(k - levels), torch.zeros_like(k))


def nuq_quantize(flat: torch.Tensor, levels: int, generator: torch.Generator | None = None,
                 chunk: int = NUQ_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, norms) of ``flat``, zero-padded to chunks of ``chunk``: per chunk its L2 norm
    (fp32), per value ``sign * k + levels`` (uint8, ``0 .. 2 levels``), level ``k`` drawn
    between the two levels around ``|x| / norm`` so that its mean is exactly that."""
    pad = (-flat.numel()) % chunk
    x = torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, chunk)
    norms = torch.linalg.vector_norm(x, dim=1)
    u = (x.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(0, 1)
    _, e = torch.frexp(u)                    # u = m 2^e, m in [1/2, 1): floor(log2 u) = e - 1
    lower = torch.where(u > 0, (e - 1 + levels).clamp(0, levels), torch.zeros_like(e))
    upper = (lower + 1).clamp_max(levels)
    table = nuq_levels(levels, flat.device)
    lo, hi = table[lower], table[upper]
    p = ((u - lo) / (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)).clamp_(0, 1)
    k = lower + (torch.rand(u.shape, generator=generator, device=u.device) < p).to(lower.dtype)
    codes = (torch.where(x < 0, -k, k) + levels).to(torch.uint8)
    return codes, norms


def nuq_dequantize(codes: torch.Tensor, norms: torch.Tensor, levels: int) -> torch.Tensor:
    """The values ``(codes, norms)`` of :func:`nuq_quantize` stand for (chunks x chunk)."""
    k = codes.long() - levels
    return torch.sign(k) * nuq_levels(levels, codes.device)[k.abs()] * norms[..., None]


def nuq_pack(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes two a byte when they fit 4 bits (``levels <= 7``); else as they are."""
    if 2 * levels > 15:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nuq_unpack(packed: torch.Tensor, levels: int) -> torch.Tensor:
    if 2 * levels > 15:
        return packed
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


class Nuq(Reducer):
    """``nuq:S``: NUQSGD's unbiased stochastic quantisation to exponentially spaced levels."""

    def __init__(self, group, axis: int, levels: int):
        super().__init__(group, axis)
        self.levels = levels
        self.generator: torch.Generator | None = None

    def reduce(self, index, flat, shapes):
        if self.generator is None or self.generator.device != flat.device:
            self.generator = torch.Generator(device=flat.device)
            self.generator.manual_seed(NUQ_SEED + dist.get_rank())
        codes, norms = nuq_quantize(flat, self.levels, self.generator)
        packed_all, w1 = self._all_gather(nuq_pack(codes, self.levels))
        norms_all, w2 = self._all_gather(norms)

        def total():
            w1.wait()
            w2.wait()
            got = nuq_dequantize(nuq_unpack(packed_all, self.levels), norms_all, self.levels)
            return got.sum(0).reshape(-1)[: flat.numel()].to(flat.dtype)
        return total


class Accordion(Reducer):
    """``accordion:KIND:A:B``: PowerSGD or top-k, setting ``B`` (less compressed) in critical
    regimes, ``A`` elsewhere, chosen per bucket from the change of its gradient's norm."""

    def __init__(self, group, axis: int, arg: tuple, interval: int = ACCORDION_INTERVAL,
                 eta: float = ACCORDION_ETA):
        super().__init__(group, axis)
        kind, low, high = arg
        make = PowerSGD if kind == "powersgd" else TopK
        self.sparse, self.dense = make(group, axis, low), make(group, axis, high)
        if kind == "powersgd":       # one error-feedback residual, whichever setting runs
            self.dense.state.error_dict = self.sparse.state.error_dict
        else:
            self.dense.errors = self.sparse.errors
        self.detector = RegimeDetector(interval, eta)      # a regime per bucket index
        self.history: list[float] = []            # per step: the share of buckets critical

    @property
    def critical(self) -> dict[int, bool]:
        """Each bucket's regime (absent: critical, the start)."""
        return self.detector.critical

    def reduce(self, index, flat, shapes):
        inner = self.dense if self.detector.is_critical(index) else self.sparse
        value = inner.reduce(index, flat, shapes)
        self._step_bytes += inner._step_bytes
        inner._step_bytes = 0

        def total():
            got = resolve(value)
            self.detector.add(index, got)
            return got
        return total

    def end_step(self) -> None:
        self.history.append(sum(self.detector.is_critical(i) for i in self._index.values())
                            / max(1, len(self._index)))
        self.sparse.end_step()
        self.dense.end_step()
        if self.detector.end_step():
            self._detect()
        super().end_step()

    def _detect(self) -> None:
        """Each bucket critical when its accumulated gradient's norm changed by ``eta`` or
        more since the last check (the ranks' norms averaged: all decide alike)."""
        idx, norms = self.detector.local_norms()
        dist.all_reduce(norms, group=self.group)
        self._step_bytes += norms.numel() * norms.element_size()
        self.detector.judge(dict(zip(idx, (norms / self.size).tolist())))

    def local_error(self, names: tuple[str, ...]) -> torch.Tensor | None:
        self.sparse._index = self.dense._index = self._index
        return self.sparse.local_error(names)


class LocalSGD(Reducer):
    """``local_sgd=H``: gradients stay local after the warm-up (each rank's scaled to its own
    batch's mean); :meth:`average` (after each optimizer step) averages the parameters every
    ``H`` steps (torch's ``PeriodicModelAverager``)."""

    def __init__(self, period: int, warmup: int, group, axis: int):
        super().__init__(group, axis)
        with warnings.catch_warnings():     # period 1 warns that DDP alone would do
            warnings.simplefilter("ignore", UserWarning)
            self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup,
                                                  process_group=group)

    @property
    def local(self) -> bool:
        """Whether this step's gradients stay local (the warm-up is over)."""
        return self.averager.step >= self.averager.warmup_steps

    def reduce(self, index, flat, shapes):
        if self.local:
            return flat.mul_(self.size)
        self._step_bytes += flat.numel() * flat.element_size()
        return dist.all_reduce(flat, group=self.group, async_op=True).get_future()

    def optimizer_step(self, step, params) -> bool:
        """The optimizer's step, then :meth:`average` (whether or not it stepped)."""
        params = list(params)
        stepped = step()
        self.average(params)
        return stepped

    def average(self, params) -> None:
        """After an optimizer step: average ``params`` over the data axis when it is time."""
        params = list(params)
        step = self.averager.step
        self.averager.average_parameters(params)
        if step >= self.averager.warmup_steps and (step - self.averager.warmup_steps) % self.averager.period == 0:
            self.wire_bytes += sum(p.numel() * p.element_size() for p in params if p.grad is not None)
