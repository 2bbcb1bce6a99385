"""Train a model on one device and under a plan, side by side, and compare the numbers.

The runs and the measure are autopar's own (``autopar.verify``, also behind
``autopar verify``); here a difference raises, naming the quantity: the loss of a step, the
gradient of a parameter, or a weight after the SGD-with-momentum steps.
"""
from __future__ import annotations

from autopar.verify import (  # noqa: F401 - re-exported for the tests
    GRAD_RTOL, LOSS_RTOL, WEIGHT_RTOL, compare as measure, parallel_run, reference_run,
)


def compare(ref, got, label: str = "") -> dict:
    """Raise AssertionError naming the worst quantity that differs; return the worst errors."""
    c = measure(ref, got)
    assert not c.problems, f"{label}: {'; '.join(c.problems)}"
    assert c.grad_err < GRAD_RTOL, f"{label}: gradient mismatch for {c.grad_worst}: rel err {c.grad_err:.2e}"
    assert c.loss_err < LOSS_RTOL, f"{label}: loss differs from one device: rel err {c.loss_err:.2e}"
    assert c.weight_err < WEIGHT_RTOL, (f"{label}: weight mismatch for {c.weight_worst} after "
                                        f"{len(got[0])} steps: rel err {c.weight_err:.2e}")
    return {"loss": c.loss_err, "grad": c.grad_err, "weight": c.weight_err}
