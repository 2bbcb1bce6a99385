"""Activation offload's memory on a CPU rank against the plan's estimate, at the GPU check's
model sizes (``benchmarks/gpu_check_ops.py`` ``MODELS``), so the H200's offload section
(``benchmarks/gpu_check.py``) can be compared with a CPU run term by term.

    PYTHONPATH=. python3 benchmarks/offload_memory.py [--size gpu|dry] [--cluster 1x1xH200]
                                                     [--models gpt,llama] [--offload full,none]

Each model is planned at world 1 in bf16 with SGD and momentum (the GPU check's pins) for
``--cluster`` (default the H200 the GPU check ran on; the estimate needs no GPU), then one
warm-up step and one measured step run on this CPU (ranks simulated as threads). The
measured peak is the live tensor storages of the step at once (``PeakMemory``), less the
offload hooks' host copies (on a CPU host and device are one memory), plus the master
weights and momentum that live across steps. About 70 s a model at ``--size gpu`` on 2 cores; ``tests/test_offload_memory.py``
checks a small GPT the same way."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.cost_models.profile import PeakMemory  # noqa: E402
from autopar.ops.host_activations import HostActivations  # noqa: E402
from autopar.runtime.thread_ranks import simulate  # noqa: E402
from gpu_check_ops import batches, build_model  # noqa: E402

MiB = 2**20


def device_peak(pm, opt, step) -> float:
    """Bytes on the device at the peak of ``step()`` (module docstring)."""
    mem = PeakMemory()
    pack = HostActivations._pack

    def host_pack(self, t):
        with mem.uncounted():
            return pack(self, t)
    HostActivations._pack = host_pack
    try:
        state = sum(p.nbytes for p in pm.parameters()) + sum(
            t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        with mem:
            step()
    finally:
        HostActivations._pack = pack
    return state + mem.peak_bytes


def measure(name: str, size: str, cluster: str, offload: str) -> dict:
    model, loss_fn, batch, seq, vocab = build_model(name, size)
    x, y = batches(1, batch, seq, vocab)[0]
    cap = capture(model, (x,), loss_fn, y)
    plan = autopar.plan(model, (x,), loss_fn, target=y, cluster=cluster, world_size=1, precision="bf16",
                        optimizer="sgd_momentum", offload_activations=offload)

    def run(pm, comm):
        opt = torch.optim.SGD(pm.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            pm.train_step(x, target=y)
            pm.step(opt)
        step()
        opt.zero_grad(set_to_none=True)
        return device_peak(pm, opt, step)

    (peak,) = simulate(cap, plan, model, run)
    est = plan.estimate
    return {"model": name, "offload": offload, "peak": peak, "estimate": est.memory_total,
            "terms": dict(est.memory_bytes), "phases": est.memory_phases}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpu", choices=("gpu", "dry"))
    ap.add_argument("--cluster", default="1x1xH200")
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--offload", default="full,none")
    args = ap.parse_args()
    for name in args.models.split(","):
        for off in args.offload.split(","):
            r = measure(name, args.size, args.cluster, off)
            terms = ", ".join(f"{k} {b / MiB:.2f}" for k, b in r["terms"].items())
            print(f"{name} offload={off}: measured {r['peak'] / MiB:.2f} MiB, estimate "
                  f"{r['estimate'] / MiB:.2f} MiB ({r['peak'] / r['estimate']:.3f}x); terms (MiB): {terms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
