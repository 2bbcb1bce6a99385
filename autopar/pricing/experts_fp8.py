"""The experts op's price with its GEMMs in fp8 (``precision="fp8"``, ``ops.fp8_experts``).

The op's bf16 price (``pricing.experts.experts_time``: the grouped GEMMs, the rows' gather
and scatter, the all-to-all dispatch) with its GEMMs' share (``gemms_time``) replaced by
each expert's two GEMMs as fp8 linears (``cost_models.fp8.fp8_linear_time``: the GEMMs at
the device's fp8 peak, every cast of the recipe, and the amax reductions): the rank's
``E_local`` experts, each a ``[rows, B] x [A, B]^T`` linear of each stack, ``rows`` its
share of the rank's token-expert pairs (uniform routing, as the bf16 price assumes). The
dispatch's payload stays bf16, as the runtime sends it (DeepSeek-V3 dispatched in FP8,
Sec. 3.3; autopar does not: ``Run.lacks`` names it).

The amax reductions are those of each expert split over a mesh axis (tensor-sharded
experts, the ``tensor_axes`` of ``ops.fp8_experts``): ``gate_up`` split on its output rows
(its W and its output's gradient reduced), ``down`` on its input columns (its W and its
input reduced), as ``pricing.fp8.amax_gathers`` counts a column- then row-parallel pair.
An expert split by expert (dim 0 of the stacks) is whole on its rank: no reduction.
"""
from __future__ import annotations

import torch

from autopar.cost_models.fp8 import fp8_linear_time
from autopar.placement import Replicate, Shard
from autopar.pricing.experts import expert_gemms, experts_time, gemms_time
from autopar.pricing.fp8_amax import amax_gathers
from autopar.sharding.registry import Strategy, TensorMeta

aten = torch.ops.aten
R = Replicate()


def tensor_axes(combo, mesh_shape) -> tuple[int, ...]:
    """The mesh axes on which ``combo`` splits each expert (its stacks on a dim but 0)."""
    return tuple(a for a, s in enumerate(combo) if mesh_shape[a] > 1
                 and isinstance(s.inputs[3], Shard) and s.inputs[3].dim != 0)


def _gemm_combo(k: int, n_stacks: int, split: tuple[int, ...], n_axes: int) -> tuple:
    """Per mesh axis, the (x, W) -> y placements of stack ``k``'s GEMM (module docstring):
    the first of two stacks column-parallel, the second row-parallel, on the ``split`` axes."""
    first = k == 0 and n_stacks > 1
    out = []
    for a in range(n_axes):
        if a not in split:
            out.append(Strategy((R, R), (R,)))
        elif first:
            out.append(Strategy((R, Shard(0)), (Shard(1),)))
        else:
            out.append(Strategy((Shard(1), Shard(1)), (R,)))
    return tuple(out)


def experts_fp8_time(cost, call, combo) -> tuple[float, float]:
    """(forward, backward) seconds of experts op ``call`` placed ``combo`` with its GEMMs in
    fp8 under ``cost`` (a ``costing.CostModel``: device, mesh, links, recipe, compile)."""
    mesh, dev = cost.mesh_shape, cost.cluster.device
    rowwise = cost.options.fp8_scaling == "rowwise"
    whole = experts_time(call, combo, mesh, dev, cost.dtype_key, cost.links, cost.expert_imbalance, cost.native)
    gemm_bf16 = gemms_time(call, combo, mesh, dev, cost.dtype_key, cost.expert_imbalance, cost.native)
    e_local, gemms = expert_gemms(call, combo, mesh, cost.expert_imbalance)
    split = tensor_axes(combo, mesh)
    fwd, bwd = whole[0] - gemm_bf16[0], whole[1] - gemm_bf16[1]
    for k, (x, w) in enumerate(gemms):
        y = TensorMeta((x.shape[0], w.shape[0]), torch.bfloat16)
        g = _gemm_combo(k, len(gemms), split, len(mesh))
        gathers = amax_gathers(g, [x, w], [y], mesh, cost.links, rowwise)
        f, b = fp8_linear_time(aten.linear.default, [x, w], [y], (), {}, dev, rowwise, gathers,
                               compiled=cost.compiled)
        fwd, bwd = fwd + e_local * f, bwd + e_local * b
    return fwd, bwd
