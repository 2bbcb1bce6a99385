"""What one call of an op costs per micro-batch however few its samples, under one option:
the pipeline search's per-sample prices of a small micro-batch keep it
(``autopar.solver.pipeline_costs.NodeCosts.weight_floor`` and ``.kernels``).

A price per sample, taken from the full batch's graph and scaled to a micro-batch, scales
away two things a micro-batch pays whole: a GEMM reads its whole weight whatever its rows
(:func:`floor_s`), and an experts op launches one GEMM per local expert and weight stack
(:func:`kernels`), each kernel paying its launch and fill. DeepSeek-V3's experts on 64
data-parallel ranks at one sample each were priced 1.10 s a micro-batch per sample against
their own 2.54 s (docs/measured.md, session 50).
"""
from __future__ import annotations

from autopar.cost_models import compute as compute_model
from autopar.ops.experts import EXPERTS_OP
from autopar.pricing.comm_costs import _local
from autopar.pricing.experts import expert_gemms
from autopar.pricing.problem import NodeVar
from autopar.sharding.registry import input_placements


def floor_s(cost, v: NodeVar, combo, fixed_inputs) -> tuple[float, float]:
    """(forward, backward) seconds one call of a matmul or an experts op takes at least
    whatever its batch under ``cost`` (a ``pricing.costing.CostModel``): reading its inputs
    ``fixed_inputs`` (indices into ``v.call.inputs``: its weights, values not computed from
    the batch) from device memory under ``combo``, at the bytes the roofline moves them
    (16-bit under mixed precision on a GPU, ``cost_models.compute.moved_bytes``), forward
    once and backward twice (the roofline's matmul backward moves twice the forward's bytes;
    an experts op's GEMMs are matmuls of its stacks). (0, 0) for other ops, which read no
    weight in full (an embedding reads its rows) or only small ones."""
    if v.call is None or not fixed_inputs or (
            v.call.op is not EXPERTS_OP and compute_model.family(v.call.op) != compute_model.MATMUL):
        return 0.0, 0.0
    dev = cost.cluster.device
    moved = sum(compute_model.moved_bytes(_local(v.call.inputs[k], input_placements(combo, k),
                                                 cost.mesh_shape), dev, cost.dtype_key, cost.native)
                for k in fixed_inputs)
    t = moved / (dev.mem_bandwidth * dev.mem_efficiency)
    return t, 2 * t


def kernels(cost, v: NodeVar, combo) -> tuple[int, int]:
    """(forward, backward) kernels one call of an op node launches, as its price counts them:
    an experts op one GEMM per local expert and weight stack forward and two backward
    (``pricing.experts.gemms_time``); every other op (1, 2)."""
    if v.call is not None and v.call.op is EXPERTS_OP:
        e_local, gemms = expert_gemms(v.call, combo, cost.mesh_shape, cost.expert_imbalance)
        return e_local * len(gemms), 2 * e_local * len(gemms)
    return 1, 2
