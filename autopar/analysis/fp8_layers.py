"""Which GEMMs ``precision="fp8"`` runs in float8: the linear layers, not the output head.

A captured ``aten.linear(x, W, b)`` whose weight ``W`` is a parameter read by that linear
alone is an ``nn.Linear`` layer's (torchao's ``convert_to_float8_training`` swaps exactly
the ``nn.Linear`` modules). Kept in bf16, as torchtitan's float8 converter keeps its
``output`` layer: the head, i.e. a linear whose result reaches the graph's outputs (the
loss) through no other linear, and a weight read elsewhere too (a tied embedding and head:
the embedding reads it in bf16 as a table, not as a GEMM operand).
"""
from __future__ import annotations

import torch

from autopar.capture import Captured
from autopar.placement import Shard

aten = torch.ops.aten


def fp8_linears(cap: Captured) -> dict[str, str]:
    """The captured linear nodes ``precision="fp8"`` runs in fp8: node name -> the weight's
    parameter name in the model (its first alias)."""
    out = {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.linear.default:
            continue
        w = n.args[1]
        if getattr(w, "op", None) != "placeholder" or w.name not in cap.params or len(w.users) != 1:
            continue
        if _is_head(n):
            continue
        out[n.name] = cap.params[w.name][0]
    return out


def row_blocks(plan) -> int:
    """How many row blocks of the global batch a step of ``plan`` scales apart: its
    data-parallel degree (the mesh axes that shard the first input's rows) times its
    micro-batches (a pipeline's, or gradient accumulation's). Each block is a contiguous
    1/n of the batch (a rank's share of a micro-batch)."""
    placements = plan.nodes[plan.inputs[0]].output(0) if plan.inputs else ()
    data = 1
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == 0:
            data *= plan.mesh_shape[axis]
    return data * plan.n_microbatches


def _is_head(node) -> bool:
    """Whether no other linear reads anything computed from ``node`` (the last GEMM)."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target is aten.linear.default:
            return False
        todo.extend(n.users)
    return True
