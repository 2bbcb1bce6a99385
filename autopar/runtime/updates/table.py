"""The table from a plan's update scheme to its runtime rule (:data:`RULES`), and
:func:`make_rule`, which ``ParallelModule`` builds its rule with.

A scheme is named by its pin; a plan pins at most one (``autopar.options`` refuses the
rest), except ``param_server=`` with ``staleness=`` (the servers apply the pushed gradients
that late): ``param_server`` then. Each maker takes ``(options, comm, axis, params)``
(the data axis of ``comm``'s mesh, or None; the rank's parameters by attribute) and returns
the rule, or None where the scheme has nothing to do on this plan (no data axis, or one
data rank), which is the exact all-reduce.
"""
from __future__ import annotations

from typing import Callable

from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.updates import (
    averaging, compression, crossbow, hogwild, param_server, stale, workers,
)
from autopar.runtime.updates.rule import ExactAllReduce, UpdateRule

Maker = Callable[[Options, Comm, "int | None", dict], "UpdateRule | None"]

RULES: dict[str, Maker] = {
    "workers": workers.make_rule,
    "averaging": averaging.make_rule,
    "param_server": param_server.make_rule,    # with staleness= when both are pinned
    "staleness": stale.make_rule,
    "learners": crossbow.make_rule,
    "local_sgd": compression.make_local_sgd,
    "compress": compression.make_compressed,
    "hogwild": hogwild.make_rule,              # refuses: Hogwild runs no plan
}
"""Scheme (its pin) -> the maker of its rule, in the order :func:`scheme_of` looks."""


def scheme_of(options: Options) -> str | None:
    """The update scheme ``options`` pin (a key of :data:`RULES`), or None (the exact
    all-reduce; ``compress="none"`` and ``"auto"`` left unchosen are none)."""
    for name in RULES:
        set_ = options.compression is not None if name == "compress" else getattr(options, name) is not None
        if set_:
            return name
    return None


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> UpdateRule:
    """The rule of ``options``' update scheme on the data axis ``axis`` of ``comm``
    (``ExactAllReduce`` when none is pinned or it has nothing to do on this plan)."""
    name = scheme_of(options)
    rule = RULES[name](options, comm, axis, params) if name is not None else None
    return rule if rule is not None else ExactAllReduce()
