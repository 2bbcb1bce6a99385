"""Communication cost: alpha-beta per collective, and the overlap of gradient sync.

For a group of ``n`` ranks over a :class:`~autopar.cost_models.devices.Link` of bus
bandwidth ``B`` and per-step latency ``alpha`` (ring algorithms; ``S`` in bytes):

==================  ========================================  ===========================
kind                bandwidth term                            latency term
==================  ========================================  ===========================
all_reduce          ``2 (n-1)/n * S / B``                     ``2 (n-1) alpha``
all_gather          ``(n-1)/n * S / B``, S = gathered size    ``(n-1) alpha``
reduce_scatter      ``(n-1)/n * S / B``, S = unreduced size   ``(n-1) alpha``
all_to_all          ``(n-1)/n * S / B``, S = local size       ``(n-1) alpha``
broadcast           ``S / B`` (pipelined ring)                ``(n-1) alpha``
send, recv          ``S / B``                                 ``alpha``
==================  ========================================  ===========================

On GPU links ``B`` grows with the message, ``B(S) = B * S / (S + half_bytes)``
(``Link.half_bytes``, ``gpus.py``): the bandwidth term becomes ``factor * (S + half_bytes) /
B``. ``B`` is nccl-tests' "busbw", which is defined so that exactly these factors turn it into
time; a group of one rank costs nothing. A link may add ``skew`` once per collective: the
wait for the last peer to leave its computation (CPU ranks; zero for GPUs). Pick the link with
:func:`~autopar.cost_models.hardware.axis_link`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .devices import Link

_BANDWIDTH_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}
_LATENCY_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
    "recv": lambda n: 1,
}
_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather",
            "reducescatter": "reduce_scatter", "alltoall": "all_to_all",
            "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all"}

COLLECTIVES = tuple(_BANDWIDTH_FACTOR)


def collective_time(kind: str, nbytes: float, group_size: int, link: Link, *,
                    skew: bool = True) -> float:
    """Seconds for one collective of ``kind`` moving ``nbytes`` over ``group_size`` ranks.

    ``skew``: add the link's wait for the last peer (``Link.skew``; zero on GPU links), for
    a collective that follows computation; one of a burst issued back to back (gradient
    buckets, a layer's parameter gathers) waits once for the burst, i.e. not of its own.

    >>> collective_time("all_reduce", 1e9, 8, Link(bandwidth=100e9, latency=0.0))
    0.0175
    """
    terms = collective_terms(kind, group_size, link)
    if terms.factor is None or nbytes <= 0:
        return 0.0
    return terms_time(terms, nbytes) + (link.skew if skew else 0.0)


class Terms(NamedTuple):
    """What :func:`collective_time` reads of a collective's kind, group and link, worked out
    once (a price table prices ~10^4-10^5 collectives of a few dozen such triples):
    ``factor * (S + half_bytes) / bandwidth + latency_s``; ``factor`` None: a group of one
    rank, which costs nothing."""
    factor: float | None
    half_bytes: float
    bandwidth: float
    latency_s: float


def collective_terms(kind: str, group_size: int, link: Link) -> Terms:
    """The :class:`Terms` of ``kind`` over ``group_size`` ranks of ``link``; raises
    ValueError for an unknown kind or a group of fewer than one rank."""
    key = kind.lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _BANDWIDTH_FACTOR:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    n = int(group_size)
    if n < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size} for {kind!r}")
    if n == 1:
        return Terms(None, 0.0, 1.0, 0.0)
    alpha, bandwidth = link.latency, link.bandwidth
    for kind_, a, b in getattr(link, "collectives", ()):
        if kind_ == key:      # this link's implementation of the collective (gloo)
            alpha, bandwidth = a, b
    # bus bandwidth grows with the message: bandwidth * S / (S + half_bytes) (gpus.py)
    return Terms(_BANDWIDTH_FACTOR[key](n), getattr(link, "half_bytes", 0.0), bandwidth,
                 _LATENCY_STEPS[key](n) * alpha)


def terms_time(terms: Terms, nbytes: float) -> float:
    """Seconds of one collective of ``terms`` moving ``nbytes``, without the link's skew
    (:func:`collective_time` with ``skew=False``, the same floating-point operations)."""
    if terms.factor is None or nbytes <= 0:
        return 0.0
    return terms.factor * (nbytes + terms.half_bytes) / terms.bandwidth + terms.latency_s


class GradSync(NamedTuple):
    """Gradient synchronization of one step: ``total`` seconds of communication, of which
    ``exposed`` are not hidden behind backward compute."""
    total: float
    exposed: float


#: DDP's default bucket size (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25).
DDP_BUCKET_BYTES = 25 * 2**20


def grad_sync_time(grad_bytes: float, group_size: int, link: Link, backward_time: float,
                   *, kind: str = "all_reduce",
                   bucket_bytes: float = DDP_BUCKET_BYTES) -> GradSync:
    """Time of the data-parallel gradient reduction, overlapped with backward as DDP does.

    Model: gradients (``grad_bytes`` per rank, full size: for ``reduce_scatter`` too) fill
    ``k = ceil(grad_bytes / bucket_bytes)`` equal buckets at an even pace over the
    ``backward_time`` that can overlap (with micro-batches: the LAST micro-batch's backward,
    since the reduction fires once per step). Bucket ``i`` is ready at
    ``backward_time * (i+1)/k``; buckets go one at a time on one stream, each taking
    ``t_b = collective_time(kind, grad_bytes/k, ...)``. The last one ends at
    ``max(backward_time/k + k*t_b, backward_time + t_b)`` (the maximum of a linear
    function of ``i`` sits at an end), so::

        total   = k * t_b
        exposed = max(t_b, total - backward_time * (1 - 1/k))

    The last bucket is never hidden. Slowdown of compute by concurrent communication
    kernels is not modelled.
    """
    if group_size <= 1 or grad_bytes <= 0:
        return GradSync(0.0, 0.0)
    k = max(1, math.ceil(grad_bytes / bucket_bytes))
    t_b = collective_time(kind, grad_bytes / k, group_size, link)
    total = k * t_b
    exposed = max(t_b, total - max(0.0, backward_time) * (1.0 - 1.0 / k))
    return GradSync(total, exposed)


# --- Compressed gradient reduction (pins compress= and local_sgd=) -------------------------
#: kernels compression adds (launches, each ``Device.launch_overhead``): per bucket (a
#: parameter pays its share of ``DDP_BUCKET_BYTES``) bf16 casts in and out; int8 min, max,
#: quantise, cast, dequantise, sum; top-k error add, abs, topk, gather, zero, index_add;
#: per matrix, PowerSGD's error feedback and three matmuls, plus torch's Gram-Schmidt
#: (about 4 per column of P and of Q).
_KERNELS = {"bf16": lambda r: 2, "int8": lambda r: 6, "topk": lambda r: 6,
            "powersgd": lambda r: 8 + 8 * r, "nuq": lambda s: 16}
#: nuq: norm, abs, divide, frexp, clamps, two level lookups, the draw, compare, codes, pack;
#: unpack, lookup, sign, scale, sum
INT8_CHUNK = 512     # autopar.runtime.updates.compression.INT8_CHUNK: one fp32 (min, scale) per chunk
NUQ_CHUNK = 512      # autopar.runtime.updates.compression.NUQ_CHUNK: one fp32 norm per chunk


def compressed_reduce_time(kind: str, arg: float, shape, itemsize: float, group_size: int,
                           link: Link, device) -> float:
    """Seconds to sum one parameter's gradient (``shape``, ``itemsize`` bytes a value) over
    ``group_size`` ranks, compressed by ``kind`` (``autopar.runtime.updates.compression``), as a
    bucketed gradient: the wire's bandwidth term (the bucket pays the latency) plus the
    compression's compute on ``device`` (memory passes, FLOPs, kernel launches: per
    bucket, of which the parameter pays its share, or per matrix for PowerSGD). Bytes on
    the wire per rank:

    - ``bf16``: an all-reduce of 2 bytes a value;
    - ``int8``: an all-gather of 1 byte a value and 8 per chunk of ``INT8_CHUNK``;
    - ``topk`` (fraction ``arg``): an all-gather of ``ceil(arg n)`` values and int32 indices;
    - ``powersgd`` (rank ``arg``): the gradient as a ``rows x cols`` matrix (``shape[0] x
      rest``); with ``r = min(rows, cols, arg)``, all-reduces of P (``rows r``) and Q
      (``cols r``) when ``(rows + cols) r`` is under half of ``rows cols`` (torch's test),
      else an exact all-reduce.
    - ``nuq`` (``arg`` levels): an all-gather of half a byte a value (a byte above 7
      levels) and 4 (a norm) per chunk of ``NUQ_CHUNK``;
    - ``accordion`` (``arg = (kind, A, B)``): ``kind`` at ``B``, the less compressed setting
      of critical regimes (an upper bound: the benchmark reports how often the cheaper
      ``A`` ran), plus adding the sum into its interval's accumulator.
    """
    if kind == "accordion":
        inner, _, dense = arg
        t = compressed_reduce_time(inner, dense, shape, itemsize, group_size, link, device)
        n_el = math.prod(shape) if len(shape) else 1
        return t + (0.0 if int(group_size) <= 1 else
                    3 * itemsize * n_el / (device.mem_bandwidth * device.mem_efficiency))
    n_el = math.prod(shape) if len(shape) else 1
    n = int(group_size)
    if n <= 1 or n_el == 0:
        return 0.0
    bw = lambda kind_, nbytes: (collective_time(kind_, nbytes, n, link, skew=False)  # noqa: E731
                                - collective_time(kind_, 1.0, n, link, skew=False))
    full = n_el * itemsize
    flops, passes = 0.0, 0.0      # passes: bytes through device memory
    if kind == "bf16":
        wire = bw("all_reduce", n_el * 2.0)
        # the runtime's passes: scale by the group size, cast, divide in bf16, cast back
        passes = (4 * itemsize + 8) * n_el
    elif kind == "int8":
        per_rank = n_el + 8.0 * math.ceil(n_el / INT8_CHUNK)
        wire = bw("all_gather", per_rank * n)
        passes = (3 * itemsize + 1) * n_el + n * (1 + itemsize) * n_el
    elif kind == "topk":
        k = max(1, math.ceil(arg * n_el))
        wire = bw("all_gather", k * (itemsize + 4.0) * n)
        # error add, abs, zeroing the sent; torch.topk's radix select reads the keys about
        # 8 times (a digit a pass, with counting); the scatter-add of every rank's entries
        passes = 12 * itemsize * n_el + n * k * (itemsize + 4.0)
    elif kind == "nuq":
        per_rank = n_el * (0.5 if arg <= 7 else 1.0) + 4.0 * math.ceil(n_el / NUQ_CHUNK)
        wire = bw("all_gather", per_rank * n)
        # quantise: about 10 fp32 passes (norm, abs, ratio, frexp, levels, draw, compare,
        # codes); each rank's codes unpacked, looked up, scaled and summed
        passes = (10 * 4 + itemsize) * n_el + n * (1 + 3 * 4) * n_el
    elif kind == "powersgd":
        rows = shape[0] if len(shape) else 1
        cols = n_el // rows
        r = min(rows, cols, int(arg))
        if (rows + cols) * r * 2 >= rows * cols:
            return bw("all_reduce", full)
        wire = bw("all_reduce", rows * r * itemsize) + bw("all_reduce", cols * r * itemsize)
        flops = 6.0 * rows * cols * r + 4.0 * (rows + cols) * r * r
        passes = 4 * itemsize * n_el
    else:
        raise ValueError(f"unknown gradient compression {kind!r}; known: {', '.join(_KERNELS)}")
    compute = (flops / (device.peak_flops["fp32"] * device.max_efficiency)
               + passes / (device.mem_bandwidth * device.mem_efficiency)
               + _KERNELS[kind](arg) * device.launch_overhead
               * (1.0 if kind == "powersgd" else min(1.0, full / DDP_BUCKET_BYTES)))
    return wire + compute


def averaging_time(kind: str, nbytes: float, group_size: int, link: Link, period: int = 1) -> float:
    """Seconds a step of BAGUA's model averaging (pin ``averaging=``,
    ``autopar.runtime.updates.averaging``) spends on one parameter of ``nbytes`` over ``group_size``
    data ranks, averaged every ``period`` steps, as the bandwidth term of a bucketed
    gradient (the bucket pays the latency): ``"decentralized"`` sends it to each ring
    neighbour (1 with 2 ranks, else 2; point-to-point, both at once on a full-duplex link
    still 2 sends of the rank's bytes; exposed: the runtime sends after the optimizer step);
    ``"async"`` all-reduces it (in the background: the overlap rule hides it behind backward
    as it does a gradient's)."""
    n = int(group_size)
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "decentralized":
        sends = 1 if n == 2 else 2
        t = sends * (collective_time("send", nbytes, 2, link, skew=False)
                     - collective_time("send", 1.0, 2, link, skew=False))
    elif kind == "async":
        t = (collective_time("all_reduce", nbytes, n, link, skew=False)
             - collective_time("all_reduce", 1.0, n, link, skew=False))
    else:
        raise ValueError(f"unknown model averaging {kind!r}; known: decentralized, async")
    return t / max(1, int(period))


def param_server_time(nbytes: float, group_size: int, servers: int, link: Link) -> float:
    """Seconds for one direction of a parameter server's traffic (``param_server=``,
    ``autopar.runtime.updates.param_server``): ``nbytes`` per rank (a push of gradients, or a pull of
    parameters) to or from ``servers`` servers that each own 1/servers of them; each server's
    link carries the ``group_size - 1`` other ranks' share (its own stays local), so the
    servers' links, each at ``link.bandwidth`` a direction, are the bottleneck, plus one
    latency per peer message."""
    if group_size <= 1:
        return 0.0
    share = nbytes / servers
    return (group_size - 1) * (share / link.bandwidth + link.latency)
