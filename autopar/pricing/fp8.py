"""``precision="fp8"``'s price of one fp8 linear under a placement: ``cost_models.fp8``'s
GEMMs and casts on the rank's local tensors, plus the amax reductions the placement implies
(the runtime's rule, ``autopar.ops.fp8``: an operand sharded on a dim its amax spans is
max-reduced over that mesh axis; the token dims of x and dy are per-rank rows). An option
reading x or W partial (a sum still to be made) is not one the runtime runs: priced INF, so
the solver never picks it.

Which linears run in fp8 is ``autopar.analysis.fp8_layers``' choice, carried by the problem
(``Problem.fp8``); every other op is priced as under bf16.
"""
from __future__ import annotations

import math

from autopar.cost_models.fp8 import fp8_linear_time
from autopar.placement import Partial, Shard
from autopar.pricing.comm_costs import INF
from autopar.sharding.registry import input_placements, output_placements


def _sharded(placements, ndim: int, dims: set[int]) -> list[int]:
    """The mesh axes on which a tensor of ``ndim`` dims is sharded on one of ``dims``."""
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim in dims]


def amax_gathers(combo, ins, outs, mesh_shape, links, rowwise: bool) -> tuple:
    """(pass, amax elements a rank contributes, group size, link) of each amax reduction of
    one fp8 linear placed ``combo`` (``ins`` / ``outs``: its local tensors)."""
    x, w, y = ins[0], ins[1], outs[0]
    xd, yd = len(x.shape), len(y.shape)
    rows = math.prod(x.shape[:-1])          # this rank's tokens
    n_local, k_local = w.shape[0], w.shape[1]
    if rowwise:      # per token over K; W per output row over K (fwd), per column over N (bwd)
        wanted = [("fwd", input_placements(combo, 0), xd, {xd - 1}, rows),
                  ("fwd", input_placements(combo, 1), 2, {1}, n_local),
                  ("bwd", input_placements(combo, 1), 2, {0}, k_local),
                  ("bwd", output_placements(combo, 0), yd, {yd - 1}, rows)]
    else:            # one amax per tensor: x's features, all of W (cast again in backward), dy's
        wanted = [("fwd", input_placements(combo, 0), xd, {xd - 1}, 1),
                  ("fwd", input_placements(combo, 1), 2, {0, 1}, 1),
                  ("bwd", input_placements(combo, 1), 2, {0, 1}, 1),
                  ("bwd", output_placements(combo, 0), yd, {yd - 1}, 1)]
    out = []
    for when, placements, ndim, dims, elements in wanted:
        for a in _sharded(placements, ndim, dims):
            if mesh_shape[a] > 1:
                out.append((when, elements, mesh_shape[a], links[a]))
    return tuple(out)


def fp8_time(cost, v, combo, ins, outs) -> tuple[float, float]:
    """(forward, backward) seconds of fp8 linear ``v`` placed ``combo`` under ``cost`` (a
    ``costing.CostModel``: its device, mesh, links and recipe)."""
    if any(isinstance(p, Partial) for k in (0, 1) for p in input_placements(combo, k)):
        return INF, INF     # a partial sum has no amax of its own (passes/fp8_linears.py)
    rowwise = cost.options.fp8_scaling == "rowwise"
    gathers = amax_gathers(combo, ins, outs, cost.mesh_shape, cost.links, rowwise)
    return fp8_linear_time(v.call.op, ins, outs, v.call.args, v.call.kwargs, cost.cluster.device,
                           rowwise, gathers)
