"""How a plan's data-parallel update is made: one module a scheme, one contract, one table.

- ``rule``: :class:`UpdateRule`, the contract every scheme's rule keeps (start / reduce /
  end_step of a bucket, train, optimizer_step under ``lr_scale``, global_grads,
  state_dict / load_state_dict, each with the exact all-reduce's default), and
  :class:`ExactAllReduce`, the rule when no scheme is pinned;
- ``table``: :data:`RULES`, from scheme (``Options.update``, ``autopar.update_schemes``,
  by its pin) to the maker of its rule, and
  :func:`make_rule`, which ``runtime.parallel_module.ParallelModule`` builds its rule with;
- a module a scheme: ``compression`` (``compress=``, ``local_sgd=``), ``averaging``
  (``averaging=``), ``stale`` (``staleness=``), ``param_server`` (``param_server=``),
  ``crossbow`` (``learners=``), ``workers`` (``workers=``), ``hogwild`` (``hogwild=``, an
  entry point of its own: ``autopar.hogwild``).

A new scheme is a class in ``autopar.update_schemes`` (its pins, what it refuses), a module
here with its rule (a subclass of :class:`UpdateRule`, or of ``rule.Reducer`` when it sums
buckets itself) and a row of :data:`RULES`, and its price;
``ParallelModule`` and ``runtime.dcp_state`` call the contract and need no change.
"""
from autopar.runtime.updates.rule import ExactAllReduce, Reducer, UpdateRule, data_group
from autopar.runtime.updates.table import RULES, make_rule

__all__ = ["ExactAllReduce", "RULES", "Reducer", "UpdateRule", "data_group", "make_rule"]
