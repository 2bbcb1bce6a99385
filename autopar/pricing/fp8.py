"""``precision="fp8"``'s price of one fp8 linear under a placement: ``cost_models.fp8``'s
GEMMs and casts on the rank's local tensors, plus the amax reductions the placement implies
(the runtime's rule, ``autopar.ops.fp8``: an operand sharded on a dim its amax spans is
max-reduced over that mesh axis; the token dims of x and dy are per-rank rows). An option
reading x or W partial (a sum still to be made) is not one the runtime runs: priced INF, so
the solver never picks it.

Which linears may run in fp8 is ``autopar.analysis.fp8_layers``' choice, carried by the
problem (``Problem.fp8``: each representative node and its members' module names); every
other op is priced as under bf16. Of those, :func:`fp8_nodes` keeps the ones the options
make fp8: every one under ``fp8_layers="all"``, those a pinned list names (a repeated
layer's representative when any of its members is named: the repeats share one price), and
under no pin each is *chosen by price*: :func:`fp8_time` prices an option at the lesser of
its fp8 time and its bf16 time (the solver so sees the faster form of every placement),
and :func:`chosen_fp8_layers` reads the choice back for the plan: fp8 where, under the
placement the solver took, the fp8 GEMMs, casts and amax reductions cost less than bf16's
GEMMs (small local matrices stay bf16: casts are memory-bound, a GEMM's gain is in its
FLOPs).
"""
from __future__ import annotations

import math

from autopar.analysis.fp8_layers import check_fp8_layers
from autopar.cost_models.fp8 import fp8_linear_time
from autopar.ops.experts import EXPERTS_OP
from autopar.placement import Partial, Replicate
from autopar.pricing.comm_costs import INF, _local
from autopar.pricing.experts import experts_time
from autopar.pricing.experts_fp8 import experts_fp8_time
from autopar.pricing.fp8_amax import amax_gathers
from autopar.sharding.registry import input_placements, output_placements


def fp8_nodes(problem, options) -> dict:
    """The representatives of ``problem.fp8`` that ``options`` may run in fp8 -> their
    members' module names (module docstring); a pinned list naming a module that is no
    fp8-eligible linear is a ``PinError`` naming it."""
    pinned = options.fp8_layers
    if pinned is None or pinned == "all":
        return dict(problem.fp8)
    check_fp8_layers(pinned, {m for names in problem.fp8.values() for m in names})
    want = set(pinned)
    return {rep: names for rep, names in problem.fp8.items() if want & set(names)}


def fp8_gather_edges(problem, cost) -> frozenset[int]:
    """The indices of ``problem``'s edges that are ZeRO-3 gathers of an fp8 linear's weight
    moving float8 (``Options.fp8_gathers``, ``passes/fp8_gathers.py``): a parameter into
    input 1 (W) of a linear the options run in fp8 (:func:`fp8_nodes`). Only under a pinned
    ``fp8_layers``: a linear chosen by price may run bf16 and gather bf16, and its gather's
    price is the bf16 one (an overcharge where it then runs fp8)."""
    o = cost.options
    if not (cost.fp8 and o.fp8_gathers and o.fp8_layers is not None):
        return frozenset()
    nodes = fp8_nodes(problem, o)
    return frozenset(k for k, e in enumerate(problem.edges)
                     if e.dst in nodes and e.dst_in == 1 and problem.vars[e.src].kind == "param")


def fp8_linear_cost(cost, v, combo, ins, outs) -> tuple[float, float]:
    """(forward, backward) seconds of ``v`` placed ``combo`` run in fp8 under ``cost`` (a
    ``costing.CostModel``: its device, mesh, links, recipe and compile)."""
    if any(isinstance(p, Partial) for k in (0, 1) for p in input_placements(combo, k)):
        return INF, INF     # a partial sum has no amax of its own (passes/fp8_linears.py)
    rowwise = cost.options.fp8_scaling == "rowwise"
    n = gathered_in_fp8(cost, combo, ins[1])
    gathers = amax_gathers(combo, ins, outs, cost.mesh_shape, cost.links, rowwise, n > 1)
    return fp8_linear_time(v.call.op, ins, outs, v.call.args, v.call.kwargs, cost.cluster.device,
                           rowwise, gathers, compiled=cost.compiled,
                           w_shard=math.prod(ins[1].shape) / n if n > 1 else None)


def gathered_in_fp8(cost, combo, w) -> int:
    """The ranks ZeRO-3 gathers this fp8 linear's local W ``w`` from in fp8 under ``combo``
    (``passes/fp8_gathers.py``), or 1: as :func:`fp8_gather_edges` (pinned ``fp8_layers``,
    ``Options.fp8_gathers``), W read whole on the data axis of more than one rank and
    divisible there (so stored sharded), with no context axis (whose ZeRO-3 shards make a
    chain of two gathers, kept bf16; and a plan of context ranks alone, whose gather the
    edge prices in fp8, keeps bf16's W casts here: an overcharge)."""
    o, a = cost.options, cost.data_axis
    if not (cost.fp8 and o.fp8_gathers and o.fp8_layers is not None and (o.context or 1) == 1
            and a is not None and a < len(cost.mesh_shape)):
        return 1
    n = cost.mesh_shape[a]
    whole = isinstance(input_placements(combo, 1)[a], Replicate)
    return n if n > 1 and whole and any(d % n == 0 for d in w.shape) else 1


def runs_fp8(cost, v, combo, ins, outs) -> tuple[bool, tuple[float, float]]:
    """Whether ``v`` placed ``combo`` runs in fp8 under ``cost``, and its (forward,
    backward) seconds: pinned (``fp8_layers`` given), fp8; chosen by price, fp8 iff its
    fp8 step (forward + backward) is shorter than bf16's. An experts op (its GEMMs,
    ``pricing.experts_fp8``) alike; in a compiled program, bf16 (``analysis.fp8_layers``)."""
    if v.call.op is EXPERTS_OP:
        bf16 = experts_time(v.call, combo, cost.mesh_shape, cost.cluster.device, cost.dtype_key,
                            cost.links, cost.expert_imbalance, cost.native)
        if cost.compiled:
            return False, bf16
        fp8 = experts_fp8_time(cost, v.call, combo)
    else:
        fp8 = fp8_linear_cost(cost, v, combo, ins, outs)
    if cost.options.fp8_layers is not None:
        return True, fp8
    if v.call.op is not EXPERTS_OP:
        bf16 = cost._roofline(v, ins, outs)
    return (True, fp8) if sum(fp8) < sum(bf16) else (False, bf16)


def fp8_time(cost, v, combo, ins, outs) -> tuple[float, float]:
    """(forward, backward) seconds of fp8-eligible linear ``v`` placed ``combo`` under
    ``cost``: its fp8 time, or under no ``fp8_layers`` pin the lesser of fp8's and bf16's
    (module docstring)."""
    return runs_fp8(cost, v, combo, ins, outs)[1]


def chosen_fp8_layers(problem, choice: dict, cost) -> tuple[str, ...]:
    """The module names of the linears the solver's ``choice`` (node -> option index) runs
    in fp8 under ``cost`` (no ``fp8_layers`` pin: the price's choice, :func:`runs_fp8`)."""
    out = []
    for rep, names in problem.fp8.items():
        v = problem.vars.get(rep)
        if v is None or rep not in choice:
            continue
        combo = v.options[choice[rep]]
        ins = [_local(m, input_placements(combo, k), cost.mesh_shape) for k, m in enumerate(v.call.inputs)]
        outs = [_local(m, output_placements(combo, k), cost.mesh_shape) for k, m in enumerate(v.call.outputs)]
        if runs_fp8(cost, v, combo, ins, outs)[0]:
            out.extend(names)
    return tuple(sorted(out))
