"""Train a model on one device and under a plan, side by side, and compare the numbers.

The runs and the measure are autopar's own (``autopar.verify``, also behind
``autopar verify``); here a difference raises, naming the quantity: the loss of a step, the
gradient of a parameter at a step, or a weight after the SGD-with-momentum steps (measured
against how far it moved). :func:`zero_grad_on_step` plants a fault the comparison must
catch.
"""
from __future__ import annotations

import torch

from autopar.verify import (  # noqa: F401 - re-exported for the tests
    GRAD_RTOL, LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, Run, compare as measure, parallel_run,
    reference_run,
)

# the fault the tests plant: this LayerNorm weight's gradient zeroed on step 2 (of 0, 1, 2)
FAULT_PARAM, FAULT_STEP = "transformer.h.0.ln_1.weight", 2


def compare(ref, got, label: str = "") -> dict:
    """Raise AssertionError naming the worst quantity that differs; return the worst errors."""
    c = measure(ref, got)
    assert not c.problems, f"{label}: {'; '.join(c.problems)}"
    assert c.grad_err < GRAD_RTOL, (f"{label}: gradient mismatch for {c.grad_worst} at step "
                                    f"{c.grad_step}: rel err {c.grad_err:.2e}")
    assert c.loss_err < LOSS_RTOL, f"{label}: loss differs from one device: rel err {c.loss_err:.2e}"
    assert c.weight_err < WEIGHT_RTOL, (f"{label}: weight mismatch for {c.weight_worst} after "
                                        f"{len(got.losses)} steps: err {c.weight_err:.2e} of its change")
    return {"loss": c.loss_err, "grad": c.grad_err, "weight": c.weight_err}


def sharding_budget(replicated) -> float:
    """A memory budget replication does not fit, for the solver's own plan: the memory of
    ``replicated``, the data-parallel plan (every parameter replicated, the batch split), less
    0.4 of its replicated training state live through the step (parameters, AdamW moments;
    gradients too where they are not born after the activations are freed:
    ``Estimate.memory_phases``), which sharding over 2 ranks halves. Tiny models' free plans
    replicate everything; under this budget they shard."""
    phased = {k for g in replicated.estimate.memory_phases for k in g}
    state = sum(replicated.estimate.memory_bytes.get(k, 0) for k in ("params", "grads", "optimizer")
                if k not in phased)
    return replicated.estimate.memory_total - 0.4 * state


def zero_grad_on_step(pm, name: str = FAULT_PARAM, step: int = FAULT_STEP):
    """Plant a fault through the public path: a gradient hook on ``pm``'s (local) parameter
    ``name`` that zeroes its gradient in the ``step``-th backward (counting from 0) only.
    Every rank holding the parameter installs it, so the synchronised gradient is zero."""
    params = dict(pm.module.named_parameters())
    if name not in params:
        raise ValueError(f"{name} is not a parameter of this rank's module: {sorted(params)[:8]}")
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return torch.zeros_like(grad) if calls[0] == step + 1 else grad
    return params[name].register_hook(hook)


def zero_layernorm_grad_on_step_2(pm):
    """``autopar verify``'s ``setup=``: the planted fault (``tests.equivalence:...``)."""
    zero_grad_on_step(pm)
