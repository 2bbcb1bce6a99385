"""The errors that mean "what you passed is wrong", as opposed to a bug in autopar.

Every error autopar raises about its user's input (a model it cannot capture, a pin it
cannot honour, a plan file it cannot read, a batch of another shape, a checkpoint of another
model) is an :class:`AutoparInputError`, whose message names the thing that is wrong and how
to fix it. The ``autopar`` command exits 2 on these and prints that one line; any other
exception escaping a command is a bug in autopar (exit 3, with the traceback).

Most subclasses live next to the code that raises them (``PlanError`` in
``autopar.plan_schema``, ``CaptureError`` in ``autopar.capture``, ``InfeasibleError`` in
``autopar.solver.ilp``, ``ClusterError`` in ``autopar.cost_models.hardware``, ...); those
raised from several layers are here. This module is at the bottom of the package so that
all of them can derive from it.
"""
from __future__ import annotations

__all__ = ["AutoparInputError", "ArgumentError", "CheckpointError", "PinError", "StaticCheckError"]


class AutoparInputError(ValueError):
    """Bad input from the user of autopar; the message says what and how to fix it."""


class ArgumentError(AutoparInputError, TypeError):
    """An argument of a public call (``autopar.plan``, ``autopar.parallelize``,
    ``pm.train_step``, ``pm.load_full_state_dict``, ...) of the wrong kind, type or shape.
    Also a ``TypeError``, as Python reports a call with arguments of the wrong kind."""


class CheckpointError(AutoparInputError):
    """A checkpoint path that is missing, is not an autopar / DCP checkpoint, or holds another
    model's tensors (``autopar.load_checkpoint``, ``autopar checkpoint``)."""


class PinError(AutoparInputError):
    """A pin (``data=``, ``tensor=``, ``pipeline=``, ... of ``autopar.plan`` /
    ``autopar.parallelize``, ``--pin`` of the command) that is malformed or cannot be honoured
    for this model and mesh."""


class StaticCheckError(RuntimeError):
    """A bug in autopar, found before anything runs: a rewritten per-rank program that does not
    type-check (``autopar.runtime.spmd_check``: a collective given a value of another placement,
    an op given inputs its sharding rule does not take, a local shape that is not the global
    one divided by the shard counts, a gradient reduced other than once) or whose ranks would
    issue different collectives (``autopar.runtime.static_verify``). Not an
    :class:`AutoparInputError`: the user's input is fine; the message says to report it with
    the plan file."""
