"""Compute cost of one ATen op: FLOPs, bytes moved, and a roofline time.

Every function takes one call as the sharding registry sees it: the op (an ATen
``OpOverload`` from a torch.export training-IR graph), its flattened tensor ``inputs`` and
``outputs`` as :class:`~autopar.sharding.registry.TensorMeta`, and ``args`` / ``kwargs`` with
``TensorMeta`` at tensor positions. Shapes are whatever the caller passes: the solver
passes LOCAL (per-rank) shapes in ``inputs`` / ``outputs`` and the GLOBAL call's ``args``,
so shapes are read only from ``inputs`` / ``outputs``; ``args`` / ``kwargs`` only give flags
(``is_causal``, ``transposed``, whether a bias or norm weight is present, an einsum
equation).

FLOP conventions (one multiply-add = 2 FLOPs; forward only):

=================  ========================================================================
family             forward FLOPs
=================  ========================================================================
matmul             ``2 * numel(out) * K`` (``2mnk`` for mm; bmm/matmul/linear alike),
                   ``+ numel(out)`` for a bias (linear with bias, addmm, baddbmm)
conv               ``2 * numel(out) * Cin/groups * prod(kernel)`` = ``2 N Cout Hout Wout Cin
                   kh kw`` (transposed: ``numel(input)`` in place of ``numel(out)``), + bias
attention (SDPA)   ``2 B H Sq Skv (D + Dv)`` = ``4 B H S^2 D`` (the two matmuls; softmax not
                   counted); causal: half of it (flash kernels skip masked blocks)
layer/group/batch  ``5 N`` (mean, subtract, square, sum, scale by rstd) ``+ N`` per affine
norm               weight and ``+ N`` per bias
rms_norm           ``3 N`` (square, sum, scale) ``+ N`` for the weight
softmax, log_sm    ``5 N`` (max, subtract, exp, sum, divide / log-subtract)
cross_entropy      ``5 N`` (log_softmax) ``+ rows`` (the nll pick and sum)
nll_loss           ``rows``
elementwise        ``numel(out)`` (dropout ``2 numel``: the mask and the multiply)
reductions         ``numel(input)`` (var/std/logsumexp ``3x``, norms ``2x``)
embedding, copies, 0
views
=================  ========================================================================

Bytes moved: every input read once and every output written once (the roofline's lower
bound: perfect on-chip reuse), except embedding (reads only the gathered rows), factories
(write only) and views (0: ``reshape`` is counted as a view; when it has to copy, that copy
is not costed).

Time (:func:`node_time`) is a roofline per kernel::

    t = max(flops / (peak * efficiency(flops)),  bytes / (mem_bandwidth * mem_efficiency))
        + kernels * launch_overhead

with ``efficiency(f) = max_efficiency * f / (f + peak * max_efficiency * fill_time)``: the
op rises to the device's large-GEMM efficiency as it grows, reaching half of it at
``peak * max_efficiency * fill_time`` FLOPs (the per-kernel fill / tail of wave
quantization; see ``gpus.py``). Algebraically ``flops / (peak * efficiency)`` is
``flops / (peak * max_efficiency) + fill_time``. Matmul-like ops (matmul, conv, attention)
run at ``peak_flops[dtype_key]`` (tensor cores); everything else at ``peak_flops["fp32"]``
(vector units).

On a GPU (``Device.sms`` set; the CPU's measured constants are untouched):

- a matmul's compute time is multiplied by its wave quantization (:func:`_tiles`): whole
  waves of output tiles over the SMs, partly empty edge tiles, the tile chosen as cuBLAS
  does (the largest that fills every SM); backward tiles grad-input and grad-weight apart,
  and runs at ``Device.matmul_backward_efficiency`` of the forward's rate (measured slower
  on Hopper in bf16, taken for fp8's GEMMs too);
- under a 16-bit ``dtype_key`` every fp32 tensor is moved at 16 bits (mixed precision over
  an fp32 capture), unless ``native`` (a 16-bit capture: its fp32 tensors are real);
- fused (flash) attention runs at ``Device.attention_efficiency`` (forward, backward),
  lower on short sequences where ``Device.attention_half_seq`` says so;
  unfused attention is its ops: the scores' matmuls, then mask, softmax and dropout, each
  memory-bound over ``b * heads * s^2`` elements forward and backward.

Backward, per family, as multiples of the forward (FLOPs, bytes) and its kernel count:

- matmul, conv: 2x FLOPs and bytes, 2 kernels (grad of both operands);
- attention: 2.5x FLOPs (5 matmuls against 2, FlashAttention-2 recomputes ``QK^T``), 2x bytes;
- norms: 2x FLOPs and bytes, 2 kernels (input grad, weight/bias grads);
- softmax, losses, unary elementwise: 1.5x bytes (read grad and saved tensor, write grad);
- binary elementwise (mul, div, ...): 2x; ``add``/``sub`` pass the gradient through and cost
  only the reduction of broadcast operands (``sub`` adds one negation);
- reductions: the expand of the grad (bytes of input + output);
- embedding: zero the weight grad and scatter-add the rows;
- copies, casts, gathers: 1x; factories, views, ops with no floating output: 0;
- dropout on a GPU: its one-byte mask too (written forward, read backward), 1x.

Recomputation of a node costs its forward time again.

Compiled (``compile=True``: each rank's program through TorchInductor), memory-bound ops
fuse. Inductor's scheduler merges a pointwise op into the kernel of the pointwise or
reduction op that produces its input, so the intermediate is read from registers, not
memory (Ansel et al., "PyTorch 2", ASPLOS 2024, Sec. 5: TorchInductor's "fusion" of
pointwise and reduction kernels). Priced per op, with ``fused_reads``: the tensor inputs
of a fusable op (:data:`FUSABLE`) whose producer, through views, is fusable too. Those
inputs' bytes leave its traffic (forward, and the same share of its backward's) and it
launches no kernel of its own. The producer still writes its output (autograd may save it,
another op may read it): a lower bound on what fusion saves. Matmuls, convolutions,
attention, embeddings, copies and gathers keep their own kernels.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .devices import Device
from .families import (
    ADD, ATTENTION, BINARY, CE_LOSS, CONV, COPY, DROPOUT, ELEMENTWISE, EMBEDDING, FACTORY,
    MATMUL, MATMUL_LIKE, MSE_LOSS, NLL_LOSS, NORM, REDUCTION, RMS_NORM, SOFTMAX, UNKNOWN_OPS,
    VIEW, family, op_name,
)

__all__ = ["FUSABLE", "UNKNOWN_OPS", "bytes_moved", "efficiency", "family", "flops", "moved_bytes",
           "node_time", "op_name"]

FUSABLE = frozenset((ELEMENTWISE, BINARY, ADD, DROPOUT, NORM, RMS_NORM, SOFTMAX, REDUCTION))
"""Families Inductor fuses into their producer's kernel when compiled (module docstring)."""


# --- helpers ------------------------------------------------------------------------------
def _nbytes(m) -> int:
    return math.prod(m.shape) * m.dtype.itemsize


def _numel(m) -> int:
    return math.prod(m.shape)


_arg_index_cache: dict[Any, dict[str, int]] = {}


def _arg(op, args: tuple, kwargs: dict, name: str, default=None):
    """Argument ``name`` of the call, positional or keyword, by the op's schema."""
    if name in kwargs:
        return kwargs[name]
    idx = _arg_index_cache.get(op)
    if idx is None:
        schema = getattr(op, "_schema", None)
        idx = {a.name: i for i, a in enumerate(schema.arguments)} if schema else {}
        _arg_index_cache[op] = idx
    i = idx.get(name)
    if i is not None and i < len(args):
        return args[i]
    return default


def _is_tensor(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


# --- FLOPs --------------------------------------------------------------------------------
def _matmul_flops(op, inputs, outputs, args, kwargs) -> float:
    name = op_name(op)
    out = _numel(outputs[0]) if outputs else 0
    if name == "einsum":
        return _einsum_flops(args, kwargs, inputs)
    if name == "linear":
        w = inputs[1]
        bias = _arg(op, args, kwargs, "bias")
        return 2.0 * out * w.shape[-1] + (out if _is_tensor(bias) else 0)
    if name in ("addmm", "baddbmm", "addmv", "_addmm_activation", "addbmm"):
        a = inputs[1]  # inputs: self (bias), mat1 / batch1, mat2 / batch2
        k = a.shape[-1]
        if name == "addbmm":  # sums over the batch too
            return 2.0 * out * k * a.shape[0] + out
        return 2.0 * out * k + out
    if name in ("outer", "ger"):
        return float(out)
    return 2.0 * out * inputs[0].shape[-1]  # mm, bmm, matmul, mv, dot: K = last dim of a


def _einsum_flops(args, kwargs, operands) -> float:
    equation = args[0] if args else kwargs["equation"]
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, t in zip(lhs, operands):
        if "..." in spec:  # name the ellipsis dims with upper-case letters, right-aligned
            n_ell = len(t.shape) - (len(spec) - 3)
            spec = spec.replace("...", "".join(chr(65 + i) for i in range(26 - n_ell, 26)))
        for c, s in zip(spec, t.shape):
            sizes[c] = max(sizes.get(c, 1), s)
    return (2.0 if len(operands) > 1 else 1.0) * math.prod(sizes.values())


def _conv_flops(op, inputs, outputs, args, kwargs) -> float:
    x, w = inputs[0], inputs[1]
    name = op_name(op)
    transposed = "transpose" in name or bool(_arg(op, args, kwargs, "transposed", False))
    per_out = math.prod(w.shape[1:])  # Cin/groups * prod(kernel)   (transposed: Cout/groups)
    n = _numel(x) if transposed else _numel(outputs[0])
    bias = _arg(op, args, kwargs, "bias")
    return 2.0 * n * per_out + (_numel(outputs[0]) if _is_tensor(bias) else 0)


def _attention_flops(op, inputs, outputs, args, kwargs) -> float:
    q, k, v = inputs[0], inputs[1], inputs[2]
    d, dv = q.shape[-1], v.shape[-1]
    rows = _numel(q) // d if d else 0  # B * H * Sq
    skv = k.shape[-2]
    f = 2.0 * rows * skv * (d + dv)
    if _arg(op, args, kwargs, "is_causal", False):
        f *= 0.5
    return f


def _norm_flops(op, inputs, outputs, args, kwargs) -> float:
    n = _numel(inputs[0])
    affine = _is_tensor(_arg(op, args, kwargs, "weight")) + _is_tensor(_arg(op, args, kwargs, "bias"))
    return 5.0 * n + affine * n


def _rms_norm_flops(op, inputs, outputs, args, kwargs) -> float:
    n = _numel(inputs[0])
    return 3.0 * n + (n if _is_tensor(_arg(op, args, kwargs, "weight")) else 0)


def _rows(x) -> int:
    """Rows of class scores: all but the class dim (dim 1 for rank >= 2)."""
    if len(x.shape) <= 1:
        return 1
    return _numel(x) // x.shape[1]


def _ce_flops(op, inputs, outputs, args, kwargs) -> float:
    x = inputs[0]
    return 5.0 * _numel(x) + _rows(x)


def _nll_flops(op, inputs, outputs, args, kwargs) -> float:
    return float(_rows(inputs[0]))


_REDUCTION_FACTOR = {"var": 3.0, "std": 3.0, "var_mean": 3.0, "std_mean": 3.0,
                     "logsumexp": 3.0, "norm": 2.0, "linalg_vector_norm": 2.0,
                     "frobenius_norm": 2.0}


def _reduction_flops(op, inputs, outputs, args, kwargs) -> float:
    return _REDUCTION_FACTOR.get(op_name(op), 1.0) * (_numel(inputs[0]) if inputs else 0)


def _out_flops(op, inputs, outputs, args, kwargs) -> float:
    return float(sum(_numel(o) for o in outputs))


def _zero(*_a) -> float:
    return 0.0


_FLOPS: dict[int, Callable[..., float]] = {
    VIEW: _zero, MATMUL: _matmul_flops, CONV: _conv_flops, ATTENTION: _attention_flops,
    NORM: _norm_flops, RMS_NORM: _rms_norm_flops,
    SOFTMAX: lambda op, i, o, a, k: 5.0 * _numel(i[0]),
    CE_LOSS: _ce_flops, NLL_LOSS: _nll_flops,
    MSE_LOSS: lambda op, i, o, a, k: 3.0 * _numel(i[0]),
    ELEMENTWISE: _out_flops, BINARY: _out_flops, ADD: _out_flops,
    DROPOUT: lambda op, i, o, a, k: 2.0 * _numel(i[0]),
    REDUCTION: _reduction_flops, EMBEDDING: _zero, COPY: _zero, FACTORY: _zero,
}


def flops(op, inputs, outputs, args: tuple = (), kwargs: dict | None = None) -> float:
    """Forward FLOPs of one call (conventions in the module docstring)."""
    return _FLOPS[family(op)](op, inputs, outputs, args, kwargs or {})


# --- bytes --------------------------------------------------------------------------------
def bytes_moved(op, inputs, outputs, args: tuple = (), kwargs: dict | None = None) -> float:
    """Forward memory traffic: inputs read once, outputs written once; views 0."""
    fam = family(op)
    if fam == VIEW:
        return 0.0
    if fam == FACTORY:
        if op_name(op).startswith("empty"):
            return 0.0
        return float(sum(_nbytes(o) for o in outputs))
    if fam == EMBEDDING:
        out = sum(_nbytes(o) for o in outputs)
        idx = sum(_nbytes(i) for i in inputs[1:])
        return float(2 * out + idx)  # read the gathered rows, write them, read the ids
    return float(sum(_nbytes(i) for i in inputs) + sum(_nbytes(o) for o in outputs))


def _backward(fam: int, op, inputs, outputs, f: float, b: float) -> tuple[float, float, int]:
    """(FLOPs, bytes, kernels) of the backward of one call."""
    if fam in (MATMUL, CONV):
        return 2.0 * f, 2.0 * b, 2
    if fam == ATTENTION:
        return 2.5 * f, 2.0 * b, 1
    if fam in (NORM, RMS_NORM):
        return 2.0 * f, 2.0 * b, 2
    if fam == ADD:
        out = outputs[0]
        fb, bb, kernels = 0.0, 0.0, 0
        for x in inputs:  # broadcast operands need their grad summed down to their shape
            if x.shape != out.shape:
                fb += _numel(out)
                bb += _nbytes(out) + _nbytes(x)
                kernels += 1
        if op_name(op) in ("sub", "rsub", "sub_") and len(inputs) > 1:
            fb += _numel(out)
            bb += 2 * _nbytes(out)
            kernels += 1
        return fb, bb, kernels
    if fam == BINARY:
        return 2.0 * f, 2.0 * b, 2
    if fam == REDUCTION:
        return float(_numel(inputs[0])), float(_nbytes(inputs[0]) + _nbytes(outputs[0])), 1
    if fam == EMBEDDING:
        w = inputs[0]  # zero its grad, then read and add the rows' grads (and the ids)
        return float(sum(_numel(o) for o in outputs)), float(_nbytes(w) + b), 2
    if fam in (COPY, DROPOUT):
        return f, b, 1
    # ELEMENTWISE, SOFTMAX, losses
    return 1.5 * f, 1.5 * b, 1


# --- time ---------------------------------------------------------------------------------
_DTYPE_KEY = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def efficiency(f: float, device: Device, dtype_key: str = "fp32") -> float:
    """Fraction of ``device.peak_flops[dtype_key]`` an op of ``f`` FLOPs reaches:
    ``max_efficiency * f / (f + f_half)``, ``f_half = peak * max_efficiency * fill_time``."""
    if f <= 0:
        return device.max_efficiency
    f_half = device.peak_flops[dtype_key] * device.max_efficiency * device.fill_time
    return device.max_efficiency * f / (f + f_half)


def _kernel_time(f: float, b: float, kernels: int, rate: float, bw: float,
                 device: Device, launched: bool = True) -> float:
    """Roofline seconds of ``kernels`` kernels; ``launched=False``: run inside another
    op's fused kernel (no launch of their own)."""
    if kernels == 0 or (f <= 0 and b <= 0):
        return 0.0
    # f / (peak * efficiency(f)) == f / rate + fill_time, per kernel
    t_compute = f / rate + kernels * device.fill_time if f > 0 else 0.0
    return max(t_compute, b / bw) + (kernels * device.launch_overhead if launched else 0.0)


def _half(m):
    """``m`` at 16 bits when it is a 32-bit float (mixed precision keeps activations so)."""
    if m.dtype == torch.float32:
        return type(m)(m.shape, torch.bfloat16)
    return m


def _as_moved(m, device: Device, dtype_key: str | None, native: bool):
    """``m`` as :func:`node_time` moves it: at 16 bits where it is a 32-bit float under a
    16-bit ``dtype_key`` on a GPU (mixed precision), unless ``native``."""
    if dtype_key in ("bf16", "fp16") and device.sms and not native:
        return _half(m)
    return m


def moved_bytes(m, device: Device, dtype_key: str | None, native: bool = False) -> int:
    """Bytes :func:`node_time` moves for tensor ``m`` read or written once."""
    return _nbytes(_as_moved(m, device, dtype_key, native))


# Output tiles cuBLAS chooses among, largest first (NVIDIA "Matrix Multiplication
# Background User's Guide", "Tile Quantization": 256x128, 128x128, 128x64, 64x64 ... "cuBLAS
# heuristics pick" the tile; smaller tiles reach less peak but fill more SMs).
_TILES = ((256, 128), (128, 128), (128, 64), (64, 64))


@functools.lru_cache(maxsize=65536)
def _tiles(rows: int, cols: int, batch: int, device: Device) -> float:
    """Wave quantization of one GEMM of ``batch`` x (rows x cols) outputs: the time of its
    ``ceil(waves)`` waves of whole tiles over the time of the work itself (>= 1; 1 when not
    modelled). The tile is the device's large-GEMM tile (``device.gemm_tile``) unless that
    leaves SMs idle in a single wave: then the largest smaller tile that fills every SM, as
    cuBLAS' heuristics do; a GEMM too small for even 64 x 64 tiles to fill the SMs is split
    along K (its smallness is priced by ``fill_time`` and the launch)."""
    tm0, tn0 = device.gemm_tile
    if not device.sms or not tm0 or rows <= 0 or cols <= 0:
        return 1.0
    sms = device.sms
    for tm, tn in (t for t in _TILES if t[0] <= tm0 and t[1] <= tn0):
        # a dimension smaller than the tile gets a smaller tile (64 the smallest assumed)
        tm, tn = min(tm, -(-rows // 64) * 64), min(tn, -(-cols // 64) * 64)
        tiles = batch * math.ceil(rows / tm) * math.ceil(cols / tn)
        if tiles >= sms:
            waves = tiles / sms
            fill = (rows * cols * batch) / (tiles * tm * tn)   # partly empty edge tiles
            return math.ceil(waves) / waves / fill
    return 1.0


def node_time(op, inputs, outputs, args: tuple = (), kwargs: dict | None = None,
              device: Device | None = None, dtype_key: str | None = "fp32", native: bool = False,
              fused_reads: frozenset = frozenset()) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one call on ``device`` by the roofline.

    ``dtype_key`` picks the matmul rate ("fp32", "tf32", "bf16", "fp16"); ``None`` takes
    it from the first floating input. Under a 16-bit ``dtype_key`` every 32-bit float
    tensor is moved at 16 bits (mixed precision: activations and weights in bf16/fp16),
    unless ``native``: the tensors carry the run's own dtypes (a graph captured in 16 bits,
    whose fp32 tensors the model made fp32 itself). On a GPU (``device.sms``) a GEMM's time
    includes wave quantization (:func:`_tiles`) and fused attention runs at
    ``device.attention_efficiency``. ``fused_reads``: indices of the tensor inputs a compiled
    program reads inside a fused kernel (module docstring; only for :data:`FUSABLE` ops).
    Recomputing the node costs the forward again.
    """
    if device is None:
        raise ValueError("node_time needs a device (e.g. gpus.A100_80GB)")
    kwargs = kwargs or {}
    fam = family(op)
    if fam == VIEW:
        return device.view_overhead, device.view_overhead
    f = _FLOPS[fam](op, inputs, outputs, args, kwargs)
    if dtype_key is None:
        dtype_key = next((_DTYPE_KEY[str(t.dtype)] for t in inputs
                          if str(t.dtype) in _DTYPE_KEY), "fp32")
    inputs = [_as_moved(m, device, dtype_key, native) for m in inputs]
    outputs = [_as_moved(m, device, dtype_key, native) for m in outputs]
    b = bytes_moved(op, inputs, outputs, args, kwargs)
    if fam == DROPOUT and device.sms and len(outputs) == 1:
        # the CUDA kernel behind dropout, ``aten::native_dropout(Tensor input, float p, bool?
        # train) -> (Tensor, Tensor)`` (torch's native_functions.yaml), also writes a bool
        # mask of the output's size, which backward reads (``native_dropout_backward``)
        b += _numel(outputs[0])
    if fam in MATMUL_LIKE:
        rate = device.peak_flops[dtype_key] * device.max_efficiency
    else:
        rate = device.peak_flops["fp32"] * device.max_efficiency
    bw = device.mem_bandwidth * device.mem_efficiency
    q_fwd = q_bwd = 1.0
    if fam == MATMUL and device.sms:
        q_fwd, q_bwd = _matmul_waves(op, inputs, outputs, device)
        q_bwd /= device.matmul_backward_efficiency     # measured in bf16 (gpus.py)
    elif fam == ATTENTION and device.sms and device.attention_efficiency[0] > 0:
        s = inputs[0].shape[-2] if inputs and len(inputs[0].shape) >= 2 else 0
        f_eff, b_eff = (e * (s / (s + s0) if s0 and s else 1.0)
                        for e, s0 in zip(device.attention_efficiency, device.attention_half_seq))
        rate_f = device.peak_flops[dtype_key] * f_eff
        rate_b = device.peak_flops[dtype_key] * b_eff
        fwd = _kernel_time(f, b, 1, rate_f, bw, device)
        fb, bb, kernels = _backward(fam, op, inputs, outputs, f, b)
        return fwd, _kernel_time(fb, bb, kernels, rate_b, bw, device)
    kept, launched = 1.0, True
    if fused_reads and fam in FUSABLE and b > 0:
        fused = sum(_nbytes(inputs[k]) for k in fused_reads if k < len(inputs))
        kept, launched = max(b - fused, 0.0) / b, False
    fwd = _kernel_time(f, b * kept, 1, rate / q_fwd, bw, device, launched)
    if fam == FACTORY or not any(o.dtype.is_floating_point for o in outputs):
        return fwd, 0.0
    fb, bb, kernels = _backward(fam, op, inputs, outputs, f, b)
    return fwd, _kernel_time(fb, bb * kept, kernels, rate / q_bwd, bw, device, launched)


def _matmul_waves(op, inputs, outputs, device: Device) -> tuple[float, float]:
    """(forward, backward) wave-quantization factors of a matmul (>= 1, on its compute
    time). Forward tiles the output (batch x M x N); backward tiles grad-input (M x K) and
    grad-weight (N x K), half of the backward FLOPs each. A linear's or mm's weight grad
    sums over all rows: one GEMM of N x K."""
    if not outputs or not inputs or len(outputs[0].shape) < 2 or len(inputs[0].shape) < 1:
        return 1.0, 1.0
    out, a = outputs[0].shape, inputs[0].shape
    name = op_name(op)
    if name in ("addmm", "baddbmm", "_addmm_activation") and len(inputs) > 1:
        a = inputs[1].shape
    k, n = a[-1], out[-1]
    if name in ("linear", "addmm", "mm", "_addmm_activation"):
        m, batch, wbatch = math.prod(out[:-1]), 1, 1
    else:
        m, batch = out[-2], math.prod(out[:-2])
        wbatch = batch
    fwd = _tiles(m, n, batch, device)
    bwd = 0.5 * _tiles(m, k, batch, device) + 0.5 * _tiles(n, k, wbatch, device)
    return fwd, bwd
