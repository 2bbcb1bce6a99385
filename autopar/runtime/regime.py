"""Accordion's detector of critical learning regimes (Agarwal et al. 2021), shared by its two
forms here: ``compress="accordion:..."`` (``autopar.runtime.updates.compression``: one regime per
gradient bucket, choosing how hard to compress it) and ``workers="accordion:W1:W2"``
(``autopar.runtime.updates.workers``: one regime for the whole model, choosing how many data
ranks train).

Every ``interval`` steps the norm of the gradient accumulated (summed) since the last check
is compared with the last check's; a relative change of at least ``eta`` marks the regime
critical until the next check. There is no earlier norm at the first check, and training
starts critical. The caller computes the norms (:meth:`RegimeDetector.local_norms`),
makes every rank agree on them (an all-reduce) and hands them to :meth:`RegimeDetector.judge`.
"""
from __future__ import annotations

from typing import Hashable

import torch

ACCORDION_INTERVAL = 10
"""Steps between Accordion's checks of the gradient norm (the paper checks once an epoch)."""
ACCORDION_ETA = 0.5
"""Accordion's threshold on the relative change of the gradient norm (the paper's eta)."""


class RegimeDetector:
    """Critical or not, by key (a bucket, or the whole model), from the change of the norm
    of the gradient accumulated over ``interval`` steps."""

    def __init__(self, interval: int = ACCORDION_INTERVAL, eta: float = ACCORDION_ETA):
        self.interval, self.eta = interval, eta
        self.critical: dict[Hashable, bool] = {}      # absent: critical (the start)
        self.norms: dict[Hashable, float] = {}        # the last check's norm, by key
        self._acc: dict[Hashable, torch.Tensor] = {}  # gradients summed since the last check
        self.steps = 0              # steps ended
        self._since = 0             # steps ended since the last check (or the start, a resume)

    def is_critical(self, key: Hashable) -> bool:
        return self.critical.get(key, True)

    def add(self, key: Hashable, grad: torch.Tensor) -> None:
        """Add this step's ``grad`` to the sum of ``key`` since the last check."""
        acc = self._acc.get(key)
        self._acc[key] = grad.detach().clone() if acc is None else acc.add_(grad)

    def end_step(self) -> bool:
        """End a step: whether a check is due now (``interval`` steps since the last, with
        gradients accumulated)."""
        self.steps += 1
        self._since += 1
        if self._since < self.interval:
            return False
        self._since = 0
        return bool(self._acc)

    def local_norms(self) -> tuple[list, torch.Tensor]:
        """(the keys accumulated, sorted; the norms of their sums, fp32, on this rank)."""
        keys = sorted(self._acc, key=repr)
        return keys, torch.stack([torch.linalg.vector_norm(self._acc[k].float()) for k in keys])

    def judge(self, norms: dict[Hashable, float]) -> None:
        """Set each key's regime from its norm (the same on every rank) against the last
        check's, and start accumulating again."""
        for key, n in norms.items():
            old = self.norms.get(key)
            self.critical[key] = old is None or abs(old - n) >= self.eta * max(old, 1e-30)
            self.norms[key] = n
        self._acc.clear()

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the regimes, the last norms, the steps. Not the gradient
        accumulated since the last check (a model-sized tensor)."""
        return {"critical": dict(self.critical), "norms": dict(self.norms), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next check is a full ``interval`` later (what
        was accumulated before the restart is lost)."""
        self.critical, self.norms = dict(state["critical"]), dict(state["norms"])
        self.steps, self._since = int(state["steps"]), 0
        self._acc.clear()
