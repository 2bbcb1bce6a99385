"""Mixed precision's one graph rewrite: ZeRO-3 weights that only feed ops autocast runs in 16
bits are gathered in 16 bits.

Under ``precision="bf16"``/``"fp16"`` the per-rank programs run under ``torch.autocast``
(``autopar.runtime.precision``), which casts an fp32 weight to 16 bits where an op such as
``aten.linear`` reads it. A ZeRO-3 weight is gathered from its shards first; when every use
of the gathered weight is such an op (through views), casting the shard before the
all-gather gives the same 16-bit weight at half the bytes, and autograd then saves the
16-bit gathered weight (which ZeRO-3 gathers again in backward). A weight with another use
(a layer norm's, an embedding's, a tied weight read by an embedding and a head) keeps the
fp32 gather, as autocast keeps those ops in fp32.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar.ops import collectives

aten = torch.ops.aten

LOW_PRECISION_OPS = frozenset({
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten.baddbmm.default, aten.matmul.default, aten.conv1d.default, aten.conv2d.default,
    aten.conv3d.default, aten.convolution.default, aten.conv_transpose1d.default,
    aten.conv_transpose2d.input, aten.conv_transpose3d.input,
    aten.scaled_dot_product_attention.default,
})
"""ATen ops that autocast (CPU and CUDA) runs in the lower precision."""

VIEW_OPS = frozenset({aten.t.default, aten.transpose.int, aten.permute.default,
                      aten.view.default, aten.reshape.default, aten.unsqueeze.default,
                      aten.expand.default, aten.squeeze.dim})


def _only_low_precision_uses(node: Node) -> bool:
    if not node.users:
        return False
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in VIEW_OPS and user.args[0] is node:
            if not _only_low_precision_uses(user):
                return False
        elif user.target not in LOW_PRECISION_OPS:
            return False
    return True


def low_precision_gathers(gm: GraphModule, dtype: torch.dtype | None) -> list[str]:
    """Give every ZeRO-3 all-gather (``regather=True``) whose result only feeds 16-bit ops
    ``dtype=``; returns the nodes changed (none when ``dtype`` is None)."""
    if dtype is None:
        return []
    changed = []
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n.target is collectives.all_gather
                and n.kwargs.get("regather") and _only_low_precision_uses(n)):
            n.kwargs = {**n.kwargs, "dtype": dtype}
            changed.append(n.name)
    if changed:
        gm.recompile()
    return changed
