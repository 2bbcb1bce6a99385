"""The table from a plan's update scheme to its runtime rule (:data:`RULES`), and
:func:`make_rule`, which ``ParallelModule`` builds its rule with.

A scheme is ``Options.update`` (``autopar.update_schemes``), keyed here by its pin; a plan
pins at most one (``param_server=`` takes ``staleness=`` as its parameter). Each maker
takes ``(options, comm, axis, params)`` (the data axis of ``comm``'s mesh, or None; the rank's parameters by attribute) and returns
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
"""Scheme (``UpdateScheme.pin``) -> the maker of its rule."""


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> UpdateRule:
    """The rule of ``options``' update scheme on the data axis ``axis`` of ``comm``
    (``ExactAllReduce`` when none is pinned or it has nothing to do on this plan)."""
    name = options.update.pin
    rule = RULES[name](options, comm, axis, params) if name is not None else None
    return rule if rule is not None else ExactAllReduce()
