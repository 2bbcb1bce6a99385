"""Pretrained weights: each rank's peak host memory while ``autopar.parallelize`` builds its
module, against the rank's shard bytes and the whole model's bytes.

A GPT (``gpt2-124m`` by default: 124M parameters, 498 MB in fp32) is written once as
weights (``--kind``: a ``torch.save`` file, a ``.safetensors`` directory or an autopar DCP
checkpoint) and planned once (``tensor=2`` on 2 ranks, saved as a plan file so that no rank
runs the solver inside the measurement). Then two torchrun launches of 2 gloo ranks build
the module from the same plan:

- ``weights``: the model built under ``torch.device("meta")``, ``parallelize(...,
  weights=path)``: each rank reads its shards;
- ``materialised``: each rank builds the whole model on the CPU (random init, as a user
  would before ``load_state_dict``) and ``parallelize`` cuts its shards out of it.

Measured per rank, as growth over the resident set just before the call (MB = 1e6 bytes):

- ``peak RSS``: ``ru_maxrss`` after the call: every page the process touched, the clean
  page-cache pages of a memory-mapped weights file included (those the kernel can drop);
- ``peak anon``: the largest ``RssAnon`` of ``/proc/self/status`` sampled every 5 ms during
  the call: the process's own memory (tensors), without the mapped file.

Shard bytes: the rank's local parameters and buffers.

    python benchmarks/pretrained_memory.py                    # torch file, ~2-4 min on 2 busy cores
    python benchmarks/pretrained_memory.py --kind safetensors
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MB = 1e6


def _example(args, meta: bool):
    from examples.models import EXAMPLES
    with torch.device("meta") if meta else torch.device("cpu"):
        return EXAMPLES["gpt"](batch=2, seq_len=args.seq, config=args.config)


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024 / MB
    return out


class AnonPeak:
    """The largest ``RssAnon`` seen while open, sampled by a thread."""

    def __enter__(self):
        self.peak, self._stop = _status()["RssAnon"], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status()["RssAnon"])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])


def rank_main(args) -> None:
    """One rank: build the module from ``args.plan`` (with or without weights); write what
    it measured to ``args.out``.<rank>."""
    import torch.distributed as dist

    import autopar
    ex = _example(args, meta=True)              # inputs (shapes only matter) and the meta model
    tokens = torch.zeros(ex.inputs[0].shape, dtype=torch.long)
    dist.init_process_group("gloo")
    dist.barrier()
    before = _status()
    with AnonPeak() as anon:
        if args.mode == "weights":
            pm = autopar.parallelize(ex.model, (tokens,), ex.loss_fn, target=tokens, plan=args.plan,
                                     weights=args.weights)
        else:
            real = _example(args, meta=False).model
            pm = autopar.parallelize(real, (tokens,), ex.loss_fn, target=tokens, plan=args.plan)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB   # Linux: KiB
    shard = sum(t.numel() * t.element_size() for t in list(pm.module.parameters()) + list(pm.module.buffers()))
    full = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    res = {"rank": dist.get_rank(), "mode": args.mode, "peak_rss_mb": peak - before["VmRSS"],
           "peak_anon_mb": anon.peak - before["RssAnon"], "shard_mb": shard / MB, "full_mb": full / MB}
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def write_weights(args, tmp: str) -> str:
    ex = _example(args, meta=False)
    sd = ex.model.state_dict()
    if args.kind == "torch":
        path = os.path.join(tmp, "model.pt")
        torch.save(sd, path)
    elif args.kind == "safetensors":
        from safetensors.torch import save_file
        path = os.path.join(tmp, "hf")
        os.makedirs(path)
        save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"},   # tied
                  os.path.join(path, "model.safetensors"))
    else:
        from autopar.checkpoint import import_state_dict
        path = os.path.join(tmp, "ckpt")
        import_state_dict(sd, path)
    return path


def launch(args, mode: str, weights: str, plan: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"{mode}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(args.port + (mode == "weights")),
           os.path.abspath(__file__), "--rank-mode", mode, "--weights", weights, "--plan", plan,
           "--out", out, "--config", args.config, "--seq", str(args.seq)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{mode} launch failed:\n{proc.stderr[-4000:]}")
    return [json.load(open(f"{out}.{r}")) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("torch", "safetensors", "dcp"), default="torch")
    ap.add_argument("--config", default="gpt2-124m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--rank-mode", dest="mode", default=None)
    ap.add_argument("--weights"), ap.add_argument("--plan"), ap.add_argument("--out")
    args = ap.parse_args()
    if args.mode:
        rank_main(args)
        return
    import autopar
    from autopar.runtime.weights import capture_view
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_weights(args, tmp)
        ex = _example(args, meta=True)
        plan = os.path.join(tmp, "plan.json")
        tokens = torch.zeros(ex.inputs[0].shape, dtype=torch.long)
        # the graph parallelize(weights=) runs: the meta model seen as the CPU one
        with capture_view(ex.model, (tokens,), tokens) as (x, y):
            autopar.plan(ex.model, x, ex.loss_fn, target=y, cluster="cpu:2", tensor=2).save(plan)
        rows = launch(args, "weights", weights, plan, tmp) + launch(args, "materialised", weights, plan, tmp)
    print(f"GPT {args.config}, tensor=2 on 2 gloo ranks, weights as {args.kind}; MB = 1e6 bytes")
    print(f"{'mode':<13} {'rank':>4} {'shard':>9} {'full model':>11} {'peak anon':>10} "
          f"{'anon/shard':>11} {'peak RSS':>9} {'RSS/shard':>10}")
    for r in rows:
        print(f"{r['mode']:<13} {r['rank']:>4} {r['shard_mb']:>6.1f} MB {r['full_mb']:>8.1f} MB "
              f"{r['peak_anon_mb']:>7.1f} MB {r['peak_anon_mb'] / r['shard_mb']:>11.2f} "
              f"{r['peak_rss_mb']:>6.1f} MB {r['peak_rss_mb'] / r['shard_mb']:>10.2f}")


if __name__ == "__main__":
    main()
