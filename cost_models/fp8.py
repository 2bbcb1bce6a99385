"""The time of one fp8 linear (``precision="fp8"``; the runtime's ``autopar.ops.fp8``).

Three GEMMs (forward ``x W^T``, backward ``dy W`` and ``dy^T x``) at the device's fp8 peak
(``peak_flops["fp8"]``: 1,979 TFLOP/s dense on H100 / H200 / H800 SXM, NVIDIA's
datasheets), by the same roofline as any matmul (``compute.node_time``: wave quantization,
fill time), reading 1-byte operands and writing bf16; plus what the recipe adds:

- the casts, memory-bound: a cast of a bf16 tensor of n elements reads it for its amax
  (2n bytes), reads it again and writes fp8 (2n + n): 5n bytes, two kernels. The forward
  casts x and W; backward casts dy and W once under tensorwise (x's fp8 copy is reused; W
  is kept whole, not cast, so that ZeRO-3 can gather it again instead), under rowwise dy
  twice, W and x once more (each GEMM scales along its own contraction);
- the amax reductions: an operand sharded on a dim its amax spans gathers one fp32 amax per
  rank (tensorwise) or one per row (rowwise) over that mesh axis (``ops.fp8._max_over``: an
  all-gather, latency-bound), priced by ``comm.collective_time`` on the axis's link.

A device without an fp8 peak but with tensor cores (an A100) cannot run the recipe:
:func:`check_fp8` refuses it, naming the device and the fix.
"""
from __future__ import annotations

import math

import torch

from autopar.errors import PinError

from . import compute
from .comm import collective_time
from .devices import Device

CAST_BYTES_PER_ELEMENT = 5
"""Bytes one dynamic fp8 cast of a bf16 tensor moves per element (module docstring)."""
CAST_KERNELS = 2
"""The amax reduction and the scaled cast (torchao's eager ``hp_tensor_to_float8_dynamic``)."""


def check_fp8(device: Device) -> None:
    """Refuse ``precision="fp8"`` on a GPU without fp8 tensor cores."""
    if "fp8" not in device.peak_flops:
        raise PinError(f"precision='fp8' on {device.name}: the device has no fp8 tensor cores "
                       "(its datasheet lists no FP8 rate); pin precision='bf16', or plan for a "
                       "Hopper cluster (H100, H200, H800)")


def _meta(m, dtype):
    return type(m)(tuple(m.shape), dtype)


def cast_time(numel: float, device: Device) -> float:
    """Seconds of one dynamic fp8 cast of ``numel`` bf16 elements (module docstring)."""
    if numel <= 0:
        return 0.0
    bw = device.mem_bandwidth * device.mem_efficiency
    return CAST_BYTES_PER_ELEMENT * numel / bw + CAST_KERNELS * device.launch_overhead


def fp8_linear_time(op, ins, outs, args, kwargs, device: Device, rowwise: bool,
                    amax_gathers: tuple = ()) -> tuple[float, float]:
    """(forward, backward) seconds of one fp8 linear on this rank's local tensors ``ins``
    (x, W[, b]) and ``outs``; ``amax_gathers``: (pass, amax elements, group size, link)
    per reduction, ``pass`` "fwd" or "bwd" (module docstring)."""
    check_fp8(device)
    x, w = ins[0], ins[1]
    g_ins = [_meta(x, torch.float8_e4m3fn), _meta(w, torch.float8_e4m3fn),
             *(_meta(b, torch.bfloat16) for b in ins[2:])]
    g_outs = [_meta(o, torch.bfloat16) for o in outs]
    fwd, bwd = compute.node_time(op, g_ins, g_outs, args, kwargs, device, "fp8")
    nx, nw, ny = math.prod(x.shape), math.prod(w.shape), math.prod(outs[0].shape)
    fwd += cast_time(nx, device) + cast_time(nw, device)
    bwd += cast_time(ny, device) + cast_time(nw, device) if not rowwise else \
        2 * cast_time(ny, device) + cast_time(nw, device) + cast_time(nx, device)
    for when, elements, group, link in amax_gathers:
        t = collective_time("all_gather", 4.0 * elements * group, group, link)
        if when == "fwd":
            fwd += t
        else:
            bwd += t
    return fwd, bwd
