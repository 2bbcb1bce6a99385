"""The reducer of the update-scheme pins ``staleness=``, ``param_server=``, ``learners=``,
``averaging=`` (issue 31) and ``workers=``, in place of ``compression.make_reducer``'s:
:func:`make_update_reducer`."""
from __future__ import annotations

from autopar.errors import ArgumentError
from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.averaging import make_averaging
from autopar.runtime.compression import data_group
from autopar.runtime.crossbow import LocalGrads
from autopar.runtime.param_server import ParamServer
from autopar.runtime.stale import Stale
from autopar.runtime.workers import make_workers


def make_update_reducer(options: Options, comm: Comm, axis: int | None, params: dict):
    """``autopar.runtime.stale.Stale`` (``staleness=``), ``param_server.ParamServer``
    (``param_server=``, with ``staleness=`` if pinned) or ``crossbow.LocalGrads``
    (``learners=``), ``averaging.make_averaging``'s (``averaging=``, BAGUA) or
    ``workers.ActiveWorkers`` (``workers=``, Accordion's batch-size form) on the data axis
    ``axis``; None when none is pinned."""
    if options.workers is not None:
        return make_workers(options, comm, axis)
    if options.averaging is not None:
        if axis is None or comm.size(axis) == 1:
            return None
        return make_averaging(options.averaging, options.averaging_period or 1,
                              data_group(comm, axis), axis)
    s, k, m = options.staleness, options.param_server, options.learners
    if s is None and k is None and m is None:
        return None
    name = "param_server" if k is not None else "staleness" if s is not None else "learners"
    if axis is None:
        if m is not None:
            return None         # one rank: the learners' gradients are local anyway
        raise ArgumentError(f"{name}= works on the data-parallel axis and this plan has none: "
                            "pin data= (the number of data-parallel ranks) too")
    group = data_group(comm, axis)
    if k is not None:
        return ParamServer(group, axis, k, params, staleness=s or 0)
    if s is not None:
        return Stale(group, axis, s)
    if comm.size(axis) == 1:
        return None
    return LocalGrads(group, axis)
