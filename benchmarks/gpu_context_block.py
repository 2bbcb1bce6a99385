"""Context-parallel attention's block math on one GPU against torch's fused SDPA.

    PYTHONPATH=. python3 benchmarks/gpu_context_block.py            # on a CUDA machine
    PYTHONPATH=. python3 benchmarks/gpu_context_block.py --dry      # on a CPU, tiny shapes

``autopar.ops.context_attention`` computes each (query piece, key block) pair with plain
matmuls that materialize the pair's scores (module docstring), so that it runs wherever
torch does; the cost model prices a context-parallel attention at the device's fused
attention efficiency (``autopar.pricing.context``). This measures what that assumption is
worth on a GPU: the whole sequence on one rank (context degree 1, the same per-pair code a
ring step runs), causal, bf16 with float32 accumulation, forward and backward, timed with
CUDA events (warm-up, median of the repeats) against ``F.scaled_dot_product_attention``
(torch's default backend) on the same tensors; and the numbers: the output and the q, k, v
gradients against SDPA's, relative to their norms.

One rank, one process: a ring of several ranks on one GPU would need thread ranks, whose
backward passes all run on the one CUDA autograd thread (the ring's barrier never meets).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.ops.comm import ThreadWorld, use_comm  # noqa: E402
from autopar.ops.context_attention import context_attention  # noqa: E402

SHAPES = ((1, 32, 8, 8192, 128), (1, 32, 8, 16384, 128), (1, 8, 8, 4096, 64))
"""(batch, query heads, key/value heads, sequence, head dim): Llama 3 8B's attention at
8k and 16k tokens (grouped-query, 4 query heads a K/V head), and a small one."""
DRY = ((1, 4, 2, 64, 16),)


def _time(fn, repeats: int, device) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            import time
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure(shape, device, dtype, repeats: int) -> dict:
    b, h, hkv, s, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    do = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g)
    comm = ThreadWorld((1,)).comm(0)

    def ours():
        with use_comm(comm):
            return context_attention(q, k, v, 0, causal=True, enable_gqa=hkv < h)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv < h)

    got = {}
    for name, fn in (("sdpa", sdpa), ("blocks", ours)):
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), do)
        got[name] = (out.detach(), [x.detach() for x in grads])

        def fwd(fn=fn):
            with torch.no_grad():
                fn()

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(), (q, k, v), do)
        t_f = _time(fwd, repeats, device)
        t_fb = _time(fwd_bwd, repeats, device)
        got[name + "_s"] = (t_f, t_fb - t_f)
    flops_f = 4 * b * h * s * s * d / 2          # causal: half the score matrix
    (o1, g1), (o2, g2) = got["sdpa"], got["blocks"]
    return {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
            "sdpa_fwd_s": got["sdpa_s"][0], "sdpa_bwd_s": got["sdpa_s"][1],
            "blocks_fwd_s": got["blocks_s"][0], "blocks_bwd_s": got["blocks_s"][1],
            "blocks_over_sdpa": [got["blocks_s"][0] / got["sdpa_s"][0],
                                 got["blocks_s"][1] / got["sdpa_s"][1]],
            "blocks_tflops": [flops_f / got["blocks_s"][0] / 1e12,
                              2.5 * flops_f / got["blocks_s"][1] / 1e12],
            "err_out": _rel(o2, o1), "err_grads": [_rel(x, y) for x, y in zip(g2, g1)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}")
    rows = []
    for shape in (SHAPES if cuda else DRY):
        r = measure(shape, device, dtype, args.repeats)
        rows.append(r)
        print(f"{r['shape']}: SDPA fwd {r['sdpa_fwd_s'] * 1e3:.2f} ms bwd {r['sdpa_bwd_s'] * 1e3:.2f} ms; "
              f"blocks fwd {r['blocks_fwd_s'] * 1e3:.2f} ms bwd {r['blocks_bwd_s'] * 1e3:.2f} ms "
              f"({r['blocks_over_sdpa'][0]:.2f}x / {r['blocks_over_sdpa'][1]:.2f}x SDPA's; "
              f"{r['blocks_tflops'][0]:.0f} / {r['blocks_tflops'][1]:.0f} TFLOP/s); "
              f"error out {r['err_out']:.1e}, dq/dk/dv {', '.join(f'{e:.1e}' for e in r['err_grads'])}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
