"""Activation offload's memory estimate against what the runtime holds (issue 44 item 2: within
15%), at world 1 on a CPU rank: the device-resident peak of one training step, counted as
live tensor storages under a ``TorchDispatchMode`` (``cost_models.profile.PeakMemory``),
with the host copies the offload hooks make left out (on a CPU host and device are one
memory, so the hooks' copies are told apart by where they are made: inside
``HostActivations._pack``), plus the master weights and optimizer state that live across
steps. ``benchmarks/offload_memory.py`` measures the GPU check's models the same way.

The GPT here has the shape of the GPU check's (``benchmarks/gpu_check.py``, offload section):
a vocabulary large beside the hidden size, so the loss's gradients at the start of backward
outweigh a layer brought back. On the H200 (2026-11-29) that shape peaked at 696 MiB against
an estimate of 935 (0.74x): the estimate added the offloaded layers in flight to the loss's
gradients, which are never live together (``cost_models.memory.step_phases``)."""
from __future__ import annotations

import torch

import autopar
from autopar.capture import capture
from autopar.cost_models.memory import peak_bytes
from autopar.cost_models.profile import PeakMemory
from autopar.ops.host_activations import HostActivations
from autopar.runtime.thread_ranks import simulate
from examples.models import gpt_factory

TOLERANCE = 0.15
"""Issue 44 item 2: the estimate within 15% of the measured peak."""


def device_peak(pm, opt, step, monkeypatch) -> float:
    """Bytes on the device at the peak of ``step()`` on a CPU rank: the storages made during
    it and alive at once (``PeakMemory``), less the offload hooks' host copies (made inside
    ``HostActivations._pack``, counted as the host's), plus what lives across steps (the
    parameters ``opt`` steps and its state)."""
    mem = PeakMemory()
    pack = HostActivations._pack

    def host_pack(self, t):
        with mem.uncounted():
            return pack(self, t)
    monkeypatch.setattr(HostActivations, "_pack", host_pack)
    state = sum(p.nbytes for p in pm.parameters()) + sum(
        t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    with mem:
        step()
    return state + mem.peak_bytes


def _measured_peak(cap, plan, ex, monkeypatch) -> tuple[float, int]:
    """(bytes on the device at a step's peak, tensors the hooks packed): a warm-up step
    (the optimizer's state), then one step measured by :func:`device_peak`."""
    def run(pm, comm):
        opt = torch.optim.SGD(pm.parameters(), lr=1e-3, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            pm.train_step(*ex.inputs, target=ex.target)
            pm.step(opt)
        step()
        opt.zero_grad(set_to_none=True)
        peak = device_peak(pm, opt, step, monkeypatch)
        hooks = pm.runner.programs["train"].meta.get("offload_host")
        return peak, hooks.packed if hooks is not None else 0

    (got,) = simulate(cap, plan, ex.model, run)
    return got


def test_offload_estimate_within_15_percent_of_the_measured_peak(monkeypatch):
    ex = gpt_factory(batch=8, n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=1024)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    plans = {off: autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:1",
                               precision="bf16", optimizer="sgd_momentum", recompute="none",
                               offload_activations=off)
             for off in ("none", "full")}
    measured = {off: _measured_peak(cap, p, ex, monkeypatch) for off, p in plans.items()}
    (base, packed0), (off, packed1) = measured["none"], measured["full"]
    assert packed0 == 0 and packed1 > 0           # the hooks ran in the offloaded plan only
    est = {k: p.estimate.memory_total for k, p in plans.items()}
    print({k: f"measured {measured[k][0] / 2**20:.2f} MiB, estimate {est[k] / 2**20:.2f} MiB"
           for k in plans})
    assert off < 0.8 * base                       # offload frees device memory
    for k in plans:
        assert abs(measured[k][0] / est[k] - 1) <= TOLERANCE, (k, measured[k][0], est[k])
    # the old rule (the offloaded layers in flight beside the loss's gradients) is off by
    # more than the tolerance here, as on the H200: this test tells the two apart
    m = plans["full"].estimate.memory_bytes
    additive = peak_bytes(m, ((*(k for k in m if k not in ("grads", "grad_buffers", "optimizer",
                                                            "inputs", "buffers")),),
                              ("grads", "grad_buffers")))
    assert additive > est["full"] and off / additive < 1 - TOLERANCE, (off, additive)
