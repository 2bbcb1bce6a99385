"""The amax reductions of one fp8 GEMM under a placement (``pricing.fp8``'s linears and
``pricing.experts_fp8``'s expert GEMMs): the runtime's rule (``autopar.ops.fp8``), an
operand sharded on a dim its amax spans is max-reduced over that mesh axis; the token dims
of x and dy are per-rank rows."""
from __future__ import annotations

import math

from autopar.placement import Shard
from autopar.sharding.registry import input_placements, output_placements


def _sharded(placements, ndim: int, dims: set[int]) -> list[int]:
    """The mesh axes on which a tensor of ``ndim`` dims is sharded on one of ``dims``."""
    return [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % ndim in dims]


def amax_gathers(combo, ins, outs, mesh_shape, links, rowwise: bool, w_gathered: bool = False) -> tuple:
    """(pass, amax elements a rank contributes, group size, link) of each amax reduction of
    one fp8 linear placed ``combo`` (``ins`` / ``outs``: its local tensors). ``w_gathered``:
    W arrives from ZeRO-3's fp8 gather, whose scale is reduced once, in forward (the data
    axis's reduction priced with the gather, ``pricing.comm_costs``): none in backward."""
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
        if w_gathered:
            del wanted[2]
    out = []
    for when, placements, ndim, dims, elements in wanted:
        for a in _sharded(placements, ndim, dims):
            if mesh_shape[a] > 1:
                out.append((when, elements, mesh_shape[a], links[a]))
    return tuple(out)
