"""The time of one fp8 linear (``precision="fp8"``; the runtime's ``autopar.ops.fp8``).

Three GEMMs (forward ``x W^T``, backward ``dy W`` and ``dy^T x``) at the device's fp8 peak
(``peak_flops["fp8"]``: 1,979 TFLOP/s dense on H100 / H200 / H800 SXM, NVIDIA's
datasheets), by the same roofline as any matmul (``compute.node_time``: wave quantization,
fill time), reading 1-byte operands and writing bf16; plus what the recipe adds:

- the casts, memory-bound (:data:`CAST_TRAFFIC`: bytes per element of the operand and
  kernels, per pass). Eager, as ``ops.fp8.cast`` runs them (the ops of torchao's eager
  ``hp_tensor_to_float8_dynamic``, one kernel each): the amax ``t.abs()`` (reads 2n bytes
  of a bf16 tensor of n elements, writes 2n) and ``amax`` (2n); the cast ``t.float()``
  (2n + 4n), ``* scale`` (4n + 4n), ``clamp`` (4n + 4n), ``.to(fp8)`` (4n + n): 33n bytes
  in six kernels, with seven more on the scale's few elements (three ``_to_copy``,
  ``clamp``, the division as ``reciprocal`` and ``mul``, the returned ``reciprocal``;
  rowwise's power-of-two rounding three more: ``tests/test_fp8.py`` counts them). ``_scaled_mm`` wants its second operand column-major: backward copies the
  fp8 W (both recipes), x (tensorwise: its saved fp8 copy) and dy's transpose (2n each).
  The forward casts x and W; backward casts dy and W once under tensorwise (x's fp8 copy is
  reused; W is kept whole, not cast, so that ZeRO-3 can gather it again instead), under
  rowwise dy twice, W and x once more (each GEMM scales along its own contraction).
  Measured on an H200 (``benchmarks/results/gpu_check_nvidia-h200_session28.json``,
  ``fp8_gemms``, torch 2.11): the eager fp8 linear at 8,192 x 4,096 x 4,096 took 0.85 ms
  forward against bf16's 0.51, priced 0.27 ms at the 5 bytes an element once counted here
  (torchao's fused kernels, not this code); every shape ran 1.7-2.2x slower than bf16;
- compiled (``compile=True``), the bytes Inductor still moves, as torchao's own roofline of
  compiled float8 training counts them (torchao 0.14.0,
  ``torchao/testing/training/roofline_utils.py``, ``get_tensor_memory_traffic_ovhd_s``
  with ``fuse_with_prev`` for the activations: their amax pass fused into the kernel that
  produces them, as Inductor fuses a reduction into its pointwise producer, Ansel et al.,
  ASPLOS 2024, Sec. 5). Tensorwise: x and dy one cast kernel each, reading bf16 and
  writing the fp8 copy and its transpose (2n + 2n), and the amax's second stage; W its
  amax (2n) and a cast per pass (3n each), four kernels. Rowwise: x and dy write their
  fp8 rows and a bf16 transpose in one kernel (n + 2n, the read fused), then cast the
  transpose (3n); W casts its rows (3n), transposes (4n) and casts that (3n). The
  weight's reads are not fused (its producer, the optimizer step, is outside the graph);
- rowwise's backward rescale: torchao runs a rowwise GEMM without fast accumulation (its
  backward GEMMs, ``gemm_config_grad_input`` / ``gemm_config_grad_weight``, default
  ``use_fast_accum=False``) as cuBLAS's tensorwise GEMM with unit scales and then multiplies
  the bf16 output by the outer product of the two operands' row scales ("The rowwise
  CUTLASS-based kernel is so slow without fast-accum that we'd rather use the tensorwise
  cuBLAS-based kernel and do the scaling manually afterwards": torchao
  ``float8/float8_ops.py``, ``addmm_float8_unwrapped``, at 6243040, the commit of torchtitan's
  2025-06 async TP benchmark, and unchanged since). Inductor cannot fuse a pointwise epilogue
  into the cuBLAS call, so it is one more kernel a GEMM (pytorch/ao#2184) reading and writing
  the output: dx (x's elements) and dW (W's), :data:`RESCALE_TRAFFIC`. autopar's own runtime
  runs rowwise backward in the CUTLASS kernel without fast accumulation, which torchao
  measured slower still: for it this price is a lower bound;
- the amax reductions: an operand sharded on a dim its amax spans gathers one fp32 amax per
  rank (tensorwise) or one per row (rowwise) over that mesh axis (``ops.fp8._max_over``: an
  all-gather, latency-bound), priced by ``comm.collective_time`` on the axis's link.

A device without an fp8 peak but with tensor cores (an A100) cannot run the recipe:
:func:`check_fp8` refuses it, naming the device and the fix.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

from autopar.errors import PinError

from . import compute
from .comm import collective_time
from .devices import Device

CAST_BYTES_PER_ELEMENT = 33
"""Bytes one eager dynamic fp8 cast of a bf16 tensor moves per element (``ops.fp8.cast`` op
by op: 6 for the amax, 27 for the cast; module docstring)."""
CAST_KERNELS = 13
"""Its kernels: six over the tensor, seven on the scale (module docstring)."""
POWER_OF_2_KERNELS = 3
"""Rowwise's rounding of the scale to a power of two: ``log2``, ``floor``, ``exp2``."""
TRANSPOSE = (2, 1)
"""A column-major copy of an fp8 operand for ``_scaled_mm`` (read n, write n; one kernel)."""

_TW = (CAST_BYTES_PER_ELEMENT, CAST_KERNELS)
_RW = (CAST_BYTES_PER_ELEMENT, CAST_KERNELS + POWER_OF_2_KERNELS)


def _plus(*parts):
    return tuple(map(sum, zip(*parts)))


CAST_TRAFFIC = {
    # (recipe, compiled) -> {(pass, operand): (bytes per element, kernels)}; module docstring
    ("tensorwise", False): {("fwd", "x"): _TW, ("fwd", "w"): _TW, ("bwd", "dy"): _plus(_TW, TRANSPOSE),
                            ("bwd", "w"): _plus(_TW, TRANSPOSE), ("bwd", "x"): TRANSPOSE},
    ("rowwise", False): {("fwd", "x"): _RW, ("fwd", "w"): _RW, ("bwd", "dy"): _plus(_RW, _RW, TRANSPOSE),
                         ("bwd", "w"): _plus(_RW, TRANSPOSE), ("bwd", "x"): _plus(_RW, TRANSPOSE)},
    # torchao roofline_utils: input / grad_output [fused amax, stage 2, cast 2n + n + n];
    # weight [amax 2n, stage 2, cast 2n + n (fwd), cast 2n + n (bwd)]
    ("tensorwise", True): {("fwd", "x"): (4, 2), ("fwd", "w"): (5, 3),
                           ("bwd", "dy"): (4, 2), ("bwd", "w"): (3, 1)},
    # rowwise: input / grad_output [n + 2n (read fused), 2n + n]; weight [2n + n, 2n + 2n, 2n + n]
    ("rowwise", True): {("fwd", "x"): (3, 1), ("fwd", "w"): (3, 1),
                        ("bwd", "dy"): (6, 2), ("bwd", "w"): (7, 2), ("bwd", "x"): (3, 1)},
}
"""Bytes per element of each operand an fp8 linear's casts move, and their kernels, by
recipe, eager or compiled, per pass (module docstring: eager, ``ops.fp8``'s ops counted;
compiled, the traffic of torchao's roofline of compiled float8 training)."""

RESCALE_TRAFFIC = {False: (12, 2), True: (4, 1)}
"""compiled -> (bytes per element of a rowwise backward GEMM's bf16 output, kernels) of
torchao's rescale ``output *= a_inverse_scale * b_inverse_scale`` (module docstring). Eager:
the outer product of an (M, 1) and a (1, N) fp32 scale is written whole (4 bytes an
element), then the in-place multiply reads the output (2) and it (4) and writes the output
(2): 12 bytes, two kernels. Compiled: Inductor fuses the two into one pointwise kernel that
reads the output and writes it (2 + 2; the M + N scales are negligible)."""


def check_fp8(device: Device) -> None:
    """Refuse ``precision="fp8"`` on a GPU without fp8 tensor cores."""
    if "fp8" not in device.peak_flops:
        raise PinError(f"precision='fp8' on {device.name}: the device has no fp8 tensor cores "
                       "(its datasheet lists no FP8 rate); pin precision='bf16', or plan for a "
                       "Hopper cluster (H100, H200, H800)")


def _meta(m, dtype):
    return type(m)(tuple(m.shape), dtype)


def cast_time(numel: float, device: Device, bytes_per_element: float = CAST_BYTES_PER_ELEMENT,
              kernels: int = CAST_KERNELS) -> float:
    """Seconds of the casts of ``numel`` bf16 elements moving ``bytes_per_element`` each in
    ``kernels`` kernels (default: one eager dynamic fp8 cast; module docstring)."""
    if numel <= 0:
        return 0.0
    bw = device.mem_bandwidth * device.mem_efficiency
    return bytes_per_element * numel / bw + kernels * device.launch_overhead


FUSED_CASTS_ENV = "AUTOPAR_FP8_CASTS"
"""``AUTOPAR_FP8_CASTS=fused``: price every fp8 cast as fused (:data:`CAST_TRAFFIC`'s compiled
traffic, and the compiled rescale), eager programs too. Not a runtime: autopar's eager casts
are the op-by-op ones. For pricing runs of stacks whose casts are fused kernels whatever the
program (Transformer Engine's cast-transpose, DeepSeek's, torchtitan compiled beside context
parallelism, which autopar refuses to compile): ``benchmarks/published_runs.py`` sets it
while it prices such a row (:func:`fused_casts`). An environment variable, so that the
search's worker processes see it too."""


def _fused(compiled: bool) -> bool:
    return bool(compiled) or os.environ.get(FUSED_CASTS_ENV) == "fused"


@contextlib.contextmanager
def fused_casts():
    """While open, fp8 casts are priced fused (:data:`FUSED_CASTS_ENV`)."""
    before = os.environ.get(FUSED_CASTS_ENV)
    os.environ[FUSED_CASTS_ENV] = "fused"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FUSED_CASTS_ENV, None)
        else:
            os.environ[FUSED_CASTS_ENV] = before


def casts_time(nx: float, nw: float, ny: float, device: Device, rowwise: bool,
               compiled: bool = False, w_shard: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one fp8 linear's casts: x of ``nx`` elements, W of
    ``nw``, dy of ``ny`` (:data:`CAST_TRAFFIC`; fused when ``compiled`` or under
    :func:`fused_casts`). ``w_shard``: W arrives cast by ZeRO-3's fp8 gather
    (``passes/fp8_gathers.py``, tensorwise), which casts this rank's shard of ``w_shard``
    elements instead, the same cast, in forward and again for backward's gather; eager,
    backward still copies the gathered fp8 W column-major (``ops.fp8._mm``)."""
    fused = _fused(compiled)
    table = CAST_TRAFFIC[("rowwise" if rowwise else "tensorwise", fused)]
    numel = {"x": nx, "w": nw if w_shard is None else w_shard, "dy": ny}
    out = {"fwd": 0.0, "bwd": 0.0}
    for (when, operand), (b, k) in table.items():
        if w_shard is not None and (when, operand) == ("bwd", "w") and not fused:
            b, k = _TW          # the shard's cast again; the column-major copy is of W, below
            out[when] += cast_time(nw, device, *TRANSPOSE)
        out[when] += cast_time(numel[operand], device, b, k)
    return out["fwd"], out["bwd"]


def rescale_time(nx: float, nw: float, device: Device, compiled: bool = False) -> float:
    """Seconds of rowwise's two backward rescales, of dx (``nx`` elements) and dW (``nw``)
    (:data:`RESCALE_TRAFFIC`)."""
    b, k = RESCALE_TRAFFIC[_fused(compiled)]
    return cast_time(nx, device, b, k) + cast_time(nw, device, b, k)


def fp8_linear_time(op, ins, outs, args, kwargs, device: Device, rowwise: bool,
                    amax_gathers: tuple = (), compiled: bool = False,
                    w_shard: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one fp8 linear on this rank's local tensors ``ins``
    (x, W[, b]) and ``outs``; ``amax_gathers``: (pass, amax elements, group size, link)
    per reduction, ``pass`` "fwd" or "bwd"; ``compiled``: its casts as Inductor runs them
    (module docstring); ``w_shard``: W gathered in fp8, its shard's elements
    (:func:`casts_time`)."""
    check_fp8(device)
    x, w = ins[0], ins[1]
    g_ins = [_meta(x, torch.float8_e4m3fn), _meta(w, torch.float8_e4m3fn),
             *(_meta(b, torch.bfloat16) for b in ins[2:])]
    g_outs = [_meta(o, torch.bfloat16) for o in outs]
    fwd, bwd = compute.node_time(op, g_ins, g_outs, args, kwargs, device, "fp8")
    nx, nw, ny = math.prod(x.shape), math.prod(w.shape), math.prod(outs[0].shape)
    cf, cb = casts_time(nx, nw, ny, device, rowwise, compiled, w_shard)
    fwd, bwd = fwd + cf, bwd + cb
    if rowwise:
        bwd += rescale_time(nx, nw, device, compiled)
    for when, elements, group, link in amax_gathers:
        t = collective_time("all_gather", 4.0 * elements * group, group, link)
        if when == "fwd":
            fwd += t
        else:
            bwd += t
    return fwd, bwd
