"""The host link of this GPU, measured: pinned host <-> device copies (the activation-offload
and optimizer-offload path), alone and beside a bf16 GEMM on the compute stream (whether the
copy engine overlaps the tensor cores, and at what cost to each), and the per-tensor cost of
the offload hooks' pattern on small tensors (``torch.empty(pin_memory=True)`` + a
``non_blocking`` copy on a side stream + ``record_stream`` + an event).

    PYTHONPATH=. python3 benchmarks/host_link.py [--out FILE]     # on a GPU machine, ~20 s

Prints and writes JSON: GB/s each way at 64 MiB-1 GiB, the GEMM's time alone and with a copy
beside it, and microseconds per small offloaded tensor. cost_models/offload.py's host_link
constants cite what it measured."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed(fn, reps=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "copies": []}
    for mib in (64, 256, 1024):
        n = mib * 2**20
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d2h = timed(lambda: h.copy_(d, non_blocking=True))
        h2d = timed(lambda: d.copy_(h, non_blocking=True))
        out["copies"].append({"MiB": mib, "d2h_GBps": n / d2h / 1e9, "h2d_GBps": n / h2d / 1e9})
        print(f"{mib:5d} MiB: device->host {n / d2h / 1e9:6.1f} GB/s, host->device {n / h2d / 1e9:6.1f} GB/s", flush=True)
        del d, h
    # overlap: a GEMM on the compute stream, a 1 GiB copy on a side stream
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    n = 2**30
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    reps = 20
    gemm = timed(lambda: [a @ a for _ in range(reps)], reps=3, warmup=1)
    copy = timed(lambda: h.copy_(d, non_blocking=True), reps=3, warmup=1)

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            h.copy_(d, non_blocking=True)
        for _ in range(reps):
            a @ a
        torch.cuda.current_stream().wait_stream(side)
    together = timed(both, reps=3, warmup=1)
    out["overlap"] = {"gemms_s": gemm, "copy_1GiB_s": copy, "together_s": together,
                      "hidden_share": (gemm + copy - together) / min(gemm, copy)}
    print(f"overlap: {reps} GEMMs 8192^3 {gemm * 1e3:.2f} ms, 1 GiB copy {copy * 1e3:.2f} ms, together "
          f"{together * 1e3:.2f} ms (hidden {out['overlap']['hidden_share']:.0%} of the shorter)", flush=True)
    del a, d, h
    # the hooks' pattern per small tensor (host time, wall clock)
    for kib in (64, 1024, 8192):
        ts = [torch.randn(kib * 256, device=dev) for _ in range(64)]
        for rnd in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            keep = []
            for t in ts:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    host.copy_(t, non_blocking=True)
                    t.record_stream(side)
                    ev = side.record_event()
                keep.append((host, ev))
            host_s = time.perf_counter() - t0
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            del keep
        out.setdefault("per_tensor", []).append({"KiB": kib, "host_us": host_s / len(ts) * 1e6,
                                                "wall_us": wall / len(ts) * 1e6})
        print(f"offload pattern, {kib} KiB tensors: host {host_s / len(ts) * 1e6:.1f} us, "
              f"with the copies {wall / len(ts) * 1e6:.1f} us a tensor", flush=True)
    if args.out:
        open(args.out, "w").write(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
