"""The time of a mixture of experts' expert op (``autopar::moe_experts``) under one option.

Work. ``T`` tokens each routed to ``k`` experts make ``T k`` token-expert pairs; each pair
is one token through one expert's MLP: for every weight stack ``[E, A, B]`` a GEMM row of
``2 A B`` FLOPs. Under uniform routing (the assumption the router's load-balancing loss
trains toward: Fedus et al., "Switch Transformers", JMLR 2022, Sec. 2.2) a rank computes
``T k / n`` pairs, where ``n`` is the product of the mesh axes on which the option splits
anything (tokens, experts or both): tokens split on an axis divide the pairs among its
ranks; experts split divide them by expert. Routing is never quite uniform and the step
waits for the busiest rank: where experts are split, the pairs are multiplied by
``imbalance`` (>= 1; ``Options.expert_imbalance``, default 1). DeepSeek-V3 reports its
auxiliary-loss-free balancing keeping experts near uniform (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, Sec. 2.1.2 and Fig. 9); a user who has measured the busiest
expert's share sets the factor to it.

The grouped GEMM: each of the rank's ``E_local`` experts multiplies its ``rows = pairs /
E_local`` rows by each of its matrices, priced as ``E_local`` GEMMs of that shape by the
roofline (``cost_models.compute``), so small per-expert shapes pay their lower efficiency
and wave quantization; under tensor-sharded experts each GEMM is the rank's slice of the
expert's inner dim (its pairs not divided). Gathering the pairs' rows and scattering the results back are
memory-bound copies of ``pairs * H`` elements each way.

Dispatch. On an axis where tokens and experts are both split (the all-to-all form), each
rank sends its pairs' rows to the ranks holding their experts and receives the results:
two ``all_to_all`` of ``T_local k H`` elements forward (dispatch, combine) and two in
backward (the gradients, the same way back), priced on that axis's link by
``cost_models.comm`` (NVLink inside a node, InfiniBand across, as the cluster says). The
all-gather form's gather and reduce-scatter are edges the rewrite inserts around the op,
priced as every other edge.
"""
from __future__ import annotations

import math

import torch

from autopar.cost_models import comm as comm_model
from autopar.cost_models import compute as compute_model
from autopar.placement import Shard, local_shape
from autopar.sharding.registry import TensorMeta

aten = torch.ops.aten


def _pairs(call, combo, mesh_shape, imbalance):
    """(token-expert pairs this rank computes, axes splitting anything, axes splitting the
    experts, of them the all-to-all ones)."""
    hidden, index, n_tok = call.inputs[0], call.inputs[1], call.inputs[0].shape[0]
    # tokens or experts split on an axis divide its pairs; each expert split (its MLP's
    # inner dim, tensor-sharded experts) does not
    split = [a for a, s in enumerate(combo) if mesh_shape[a] > 1
             and (isinstance(s.inputs[0], Shard) or s.inputs[3] == Shard(0))]
    by_expert = [a for a in split if combo[a].inputs[3] == Shard(0)]
    dispatch = [a for a in by_expert if isinstance(combo[a].inputs[0], Shard)]
    pairs = n_tok * index.shape[-1] / math.prod(mesh_shape[a] for a in split)
    if by_expert:
        pairs *= max(1.0, imbalance)
    return pairs, split, by_expert, dispatch


def experts_saved_bytes(call, combo, mesh_shape, imbalance: float = 1.0) -> float:
    """Bytes one rank's experts keep for backward beyond the op's inputs, at the hidden
    state's dtype: per token-expert pair its gathered input row and its output row (``2 H``),
    and twice the output of each weight stack but the last (the GEMM's output, and the
    activation's: a gated MLP keeps ``gate_up`` (2I), ``act(gate)`` and the product (I each),
    which is ``2 x 2I``), as Hugging Face's grouped experts forward saves them."""
    pairs, *_ = _pairs(call, combo, mesh_shape, imbalance)
    h = call.inputs[0].shape[-1]
    matrices = [s for s in _local_stacks(call, combo, mesh_shape) if len(s.shape) == 3]
    # a stack's output width: its dim that is not the hidden size ([E, 2I, H] or, stored
    # transposed, [E, H, 2I])
    inner = sum(next((d for d in s.shape[1:] if d != h), h) for s in matrices[:-1])
    return pairs * (2 * h + 2 * inner) * call.inputs[0].dtype.itemsize


def _local_stacks(call, combo, mesh_shape) -> list:
    """The stacks' shapes on one rank (experts and each expert's inner dim split)."""
    out = []
    for k, s in enumerate(call.inputs[3:], 3):
        shape = local_shape(s.shape, [c.inputs[k] for c in combo], mesh_shape)
        out.append(TensorMeta(tuple(shape if shape is not None else s.shape), s.dtype))
    return out


def expert_gemms(call, combo, mesh_shape, imbalance: float = 1.0) -> tuple[int, list]:
    """(the rank's experts, and for each weight stack the (x [rows, B], W [A, B]) of each of
    its experts' GEMMs): ``rows`` the rank's pairs over its experts (module docstring)."""
    hidden = call.inputs[0]
    stacks = _local_stacks(call, combo, mesh_shape)
    pairs, *_ = _pairs(call, combo, mesh_shape, imbalance)
    e_local = stacks[0].shape[0]
    rows = max(1, round(pairs / e_local))
    return e_local, [(TensorMeta((rows, s.shape[2]), hidden.dtype), TensorMeta(tuple(s.shape[1:]), s.dtype))
                     for s in stacks if len(s.shape) == 3]


def gemms_time(call, combo, mesh_shape, device, dtype_key, imbalance: float = 1.0,
               native: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the rank's expert GEMMs alone (:func:`experts_time`'s)."""
    e_local, gemms = expert_gemms(call, combo, mesh_shape, imbalance)
    fwd = bwd = 0.0
    for x, w in gemms:
        (rows, b_dim), a_dim = x.shape, w.shape[0]
        f, b = compute_model.node_time(aten.mm.default, [x, TensorMeta((b_dim, a_dim), w.dtype)],
                                       [TensorMeta((rows, a_dim), x.dtype)],
                                       device=device, dtype_key=dtype_key, native=native)
        fwd, bwd = fwd + f * e_local, bwd + b * e_local
    return fwd, bwd


def experts_time(call, combo, mesh_shape, device, dtype_key, links, imbalance: float = 1.0,
                 native: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one option of an experts op on one rank."""
    hidden, h = call.inputs[0], call.inputs[0].shape[-1]
    pairs, *_ = _pairs(call, combo, mesh_shape, imbalance)
    fwd, bwd = gemms_time(call, combo, mesh_shape, device, dtype_key, imbalance, native)
    moved = TensorMeta((max(1, round(pairs)), h), hidden.dtype)
    f, b = compute_model.node_time(aten.index_select.default, [moved], [moved], device=device,
                                   dtype_key=dtype_key, native=native)
    fwd, bwd = fwd + 2 * f, bwd + 2 * b
    for t in dispatch_s(call, combo, mesh_shape, dtype_key, links, imbalance, native).values():
        fwd, bwd = fwd + 2 * t, bwd + 2 * t
    return fwd, bwd


def dispatch_s(call, combo, mesh_shape, dtype_key, links, imbalance: float = 1.0,
               native: bool = False) -> dict[int, float]:
    """Seconds of one of the option's all-to-alls (dispatch or combine, forward or backward)
    on each mesh axis that splits both tokens and experts: :func:`experts_time` pays two
    forward and two backward on each (the module docstring's "Dispatch"), which the plan's
    communication table shows as ``all_to_all`` on that axis (``PriceTable.self_comm``)."""
    hidden, index = call.inputs[0], call.inputs[1]
    _, split, _, dispatch = _pairs(call, combo, mesh_shape, imbalance)
    local_tok = hidden.shape[0] / math.prod(mesh_shape[a] for a in split
                                            if isinstance(combo[a].inputs[0], Shard))
    size = local_tok * index.shape[-1] * hidden.shape[-1] * _itemsize(hidden.dtype, dtype_key, native)
    return {a: comm_model.collective_time("all_to_all", size * max(1.0, imbalance), mesh_shape[a], links[a])
            for a in dispatch}


def _itemsize(dtype, dtype_key, native) -> int:
    if dtype_key in ("bf16", "fp16") and not native and dtype == torch.float32:
        return 2
    return dtype.itemsize
