"""``benchmarks/gpu_check.py``'s ``fp8_gemms`` section: ``precision="fp8"``'s linear
(``autopar.ops.fp8.fp8_linear``: the casts, the amaxes and the three ``torch._scaled_mm``
GEMMs) timed forward and backward on this device under each recipe, against its price
(``cost_models.fp8.fp8_linear_time`` for this GPU) and against the bf16 linear it replaces
(timed, and ``cost_models.compute.node_time``). The shapes are Llama-3-8B's projections at
8,192 tokens and a square 8,192 one; ``--dry`` times one 64-wide shape on the CPU (the
numbers mean nothing there, the code path is the GPU run's).
"""
from __future__ import annotations

import time

import torch

FP8_SHAPES = {
    "gpu": [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 8192, 8192)],
    "dry": [(64, 64, 64)],
}
"""(tokens M, in features K, out features N) of the linears timed."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _seconds(fn, dev: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / reps


def _fwd_bwd(linear, x, w, gy, dev, reps, warmup) -> tuple[float, float]:
    """(forward s, backward s) of ``linear(x, w)``: the forward alone, then forward and
    backward together, less the forward."""
    with torch.no_grad():
        fwd = _seconds(lambda: linear(x, w), dev, reps, warmup)

    def step():
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        linear(xx, ww).backward(gy)
    both = _seconds(step, dev, reps, warmup)
    return fwd, max(both - fwd, 0.0)


def section_fp8_gemms(ctx) -> dict:
    from autopar.cost_models import compute
    from autopar.cost_models.fp8 import fp8_linear_time
    from autopar.ops.fp8 import fp8_linear
    from autopar.sharding.registry import TensorMeta
    aten = torch.ops.aten
    dev, device = ctx.device, ctx.cost_device
    reps, warmup = (3, 1) if ctx.dry else (10, 3)
    out = {"device": device.name, "peak_fp8_flops": device.peak_flops.get("fp8"),
           "peak_bf16_flops": device.peak_flops["bf16"], "shapes": []}
    for m, k, n in FP8_SHAPES[ctx.size]:
        if ctx.budget.left() < 20:
            out["shapes"].append({"shape": [m, k, n], "skipped": "time budget spent"})
            continue
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.float32)
        gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        ins = [TensorMeta((m, k), torch.bfloat16), TensorMeta((n, k), torch.bfloat16)]
        outs = [TensorMeta((m, n), torch.bfloat16)]
        row = {"shape": [m, k, n], "flops_fwd": 2 * m * n * k}
        bf16 = lambda a, b: torch.nn.functional.linear(a, b.to(torch.bfloat16))  # noqa: E731
        f, b = _fwd_bwd(bf16, x, w, gy, dev, reps, warmup)
        pf, pb = compute.node_time(aten.linear.default, ins, outs, (), {}, device, "bf16", native=True)
        row["bf16"] = {"fwd_s": f, "bwd_s": b, "predicted_fwd_s": pf, "predicted_bwd_s": pb}
        for recipe in ("tensorwise", "rowwise"):
            try:
                f, b = _fwd_bwd(lambda a, c, r=recipe: fp8_linear(a, c, None, r), x, w, gy, dev, reps, warmup)
                pf, pb = fp8_linear_time(aten.linear.default, ins, outs, (), {}, device, recipe == "rowwise")
                row[recipe] = {"fwd_s": f, "bwd_s": b, "predicted_fwd_s": pf, "predicted_bwd_s": pb,
                               "ratio_fwd": f / pf, "ratio_bwd": b / pb if pb else None,
                               "speedup_over_bf16": (row["bf16"]["fwd_s"] + row["bf16"]["bwd_s"]) / (f + b)}
            except Exception as e:  # noqa: BLE001 - recorded, the next recipe runs
                row[recipe] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        print(f"  fp8 {m}x{k}x{n}: " + ", ".join(
            f"{r} {row[r]['fwd_s'] * 1e3:.3f}+{row[r]['bwd_s'] * 1e3:.3f} ms "
            f"(pred {row[r]['predicted_fwd_s'] * 1e3:.3f}+{row[r]['predicted_bwd_s'] * 1e3:.3f})"
            if "fwd_s" in row[r] else f"{r} -" for r in ("bf16", "tensorwise", "rowwise")), flush=True)
        out["shapes"].append(row)
        del x, w, gy
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out
