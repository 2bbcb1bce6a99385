"""Capture against the capture cache (issue 40, item 4): for each hf: model, the seconds of a
fresh capture (torch.export, stamping, inlining) and of reading the same graph from the
cache (``autopar/capture/cache.py``: the key, the file, the graph rebuilt), in one process,
with the graph's fingerprint compared. The cache goes to a fresh temporary folder.

    python benchmarks/capture_cache.py                                   # the default models
    python benchmarks/capture_cache.py hf:llama3-8b hf:mixtral-8x7b --batch 8 --seq 4096

Measured 2026-11-29 06:30-07:00 UTC on the shared 2-core machine under heavy load (load
average 15-27; the figures move with it), batch 8 x 4,096 tokens: Llama 3 8B (2,417 nodes,
1.0 MB entry) capture 34.6 s, from the cache 5.9 s (with the profiler on); Mixtral 8x7B
(2,673 nodes, 1.1 MB) 11.3 s, 1.9 s; DeepSeek-V3 (9,052 nodes, 7.9 MB; its layers are not
alike, so not stamped) 135.0 s, 11.3 s. Fingerprints equal in every row. At 07:05 (load
average 8-12), ``python benchmarks/capture_cache.py hf:mixtral-8x7b``: capture 40.8 s, from
the cache 2.28 s.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*",
                    default=["hf:llama3-8b", "hf:mixtral-8x7b", "hf:deepseek-v3"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-capture-cache-")
    os.environ.pop("AUTOPAR_CACHE", None)
    from autopar import cli_args
    from autopar.capture import cache, capture, fingerprint

    print(f"{'model':<18} {'nodes':>6} {'capture s':>10} {'cached s':>9} {'entry MB':>9}  same")
    for name in args.models:
        ex = cli_args.build_example(name, {"batch": args.batch, "seq": args.seq}, True)
        loss = ex.loss_fn if ex.target is not None else None
        with cache.caching() as use:
            t0 = time.perf_counter()
            fresh = capture(ex.model, ex.inputs, loss, ex.target)
            t1 = time.perf_counter()
            cached = capture(ex.model, ex.inputs, loss, ex.target)
            t2 = time.perf_counter()
        if use.hits != 1:
            print(f"{name:<18} not cached (hits {use.hits}, stored {use.stored})")
            continue
        size = sum(f.stat().st_size for f in (cache.cache_dir() / "captures").glob("*.pt"))
        for f in (cache.cache_dir() / "captures").glob("*.pt"):
            f.unlink()
        same = fingerprint(fresh) == fingerprint(cached)
        print(f"{name:<18} {len(fresh.gm.graph.nodes):>6} {t1 - t0:>10.1f} {t2 - t1:>9.2f} "
              f"{size / 1e6:>9.1f}  {same}", flush=True)


if __name__ == "__main__":
    main()
