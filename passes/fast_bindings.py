"""The per-rank program's last rewrite: ATen overloads called through torch's Python bindings.

The captured graph calls every op as an ``OpOverload`` (``torch.ops.aten.linear.default``):
a boxed call into the dispatcher, ~6-12 us slower per call on the host than the Python
binding the eager model calls (``torch._C._nn.linear``, ``torch.add``), which parses its
arguments and dispatches to the very same overload unboxed. On a small model that is most of
the rewritten graph's host overhead against eager (``benchmarks/runtime_overhead.py
--nproc 1``). :func:`fast_bindings` swaps each node whose op is in :data:`BINDINGS` for
its binding; the ops themselves do not change (the dispatcher, autocast, autograd and
``TorchDispatchMode`` see the same overload with the same arguments), so the program's
values and gradients are the same bit for bit.

An entry is a binding whose positional parameters are the schema's, in order, and whose
keyword-only ones carry the schema's names. A swapped node passes every argument, the
ones it left out at the schema's defaults (:func:`full_arguments`): a binding's own
defaults may differ (``torch._C._nn.cross_entropy_loss`` reduces with ``"none"`` unless
told). A node passing a positional parameter by name is left alone (the captured graph
passes them by position). ``tests/test_fast_bindings.py`` checks every entry on sample
inputs against its overload (the ops dispatched, values, gradients) and that the name the
generated code calls resolves to the binding itself. The runtime's programs are rewritten
(``autopar.runtime.parallel_module``, pipelined or not), after every other pass: capture,
the planner and the other passes see the overloads.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule

aten = torch.ops.aten

BINDINGS: dict[torch._ops.OpOverload, Callable] = {
    # matmuls, the transformer's ops
    aten.linear.default: torch._C._nn.linear,
    aten.mm.default: torch.mm,
    aten.addmm.default: torch.addmm,
    aten.bmm.default: torch.bmm,
    aten.matmul.default: torch.matmul,
    aten.embedding.default: torch.embedding,
    aten.layer_norm.default: torch.layer_norm,
    aten.scaled_dot_product_attention.default: torch._C._nn.scaled_dot_product_attention,
    aten.cross_entropy_loss.default: torch._C._nn.cross_entropy_loss,
    aten.softmax.int: torch.softmax,
    aten.dropout.default: torch.dropout,
    # element-wise
    aten.add.Tensor: torch.add,
    aten.sub.Tensor: torch.sub,
    aten.mul.Tensor: torch.mul,
    aten.div.Tensor: torch.div,
    aten.neg.default: torch.neg,
    aten.rsqrt.default: torch.rsqrt,
    aten.exp.default: torch.exp,
    aten.tanh.default: torch.tanh,
    aten.sigmoid.default: torch.sigmoid,
    aten.relu.default: torch.relu,
    aten.gelu.default: torch._C._nn.gelu,
    aten.silu.default: torch._C._nn.silu,
    aten.mean.dim: torch.mean,
    aten.sum.dim_IntList: torch.sum,
    # views and layout
    aten.view.default: torch.Tensor.view,
    aten.reshape.default: torch.reshape,
    aten.transpose.int: torch.transpose,
    aten.t.default: torch.t,
    aten.permute.default: torch.permute,
    aten.unsqueeze.default: torch.unsqueeze,
    aten.select.int: torch.select,
    aten.split.Tensor: torch.Tensor.split,
    aten.cat.default: torch.cat,
    aten.clone.default: torch.clone,
    # factories
    aten.arange.start: torch.arange,
}
"""ATen overload -> the Python binding that dispatches to it with the same arguments."""


def full_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``op``'s arguments as its binding takes them: every positional parameter by position,
    every keyword-only one by name, those not given at the schema's default; None when
    ``args``/``kwargs`` do not fit that form (a positional parameter passed by name, one
    without a default missing, an unknown name)."""
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    keyword = {a.name: a for a in params if a.kwarg_only}
    if len(args) > len(positional) or not set(kwargs) <= set(keyword):
        return None
    rest = positional[len(args):]
    if any(not a.has_default_value() for a in rest) or \
            any(k not in kwargs and not a.has_default_value() for k, a in keyword.items()):
        return None
    return (tuple(args) + tuple(a.default_value for a in rest),
            {k: kwargs[k] if k in kwargs else a.default_value for k, a in keyword.items()})


def fast_bindings(gm: GraphModule) -> int:
    """Call the ops of ``gm`` (and of the graph modules it calls, such as recomputed
    layers) that :data:`BINDINGS` holds through their Python bindings; returns how many
    nodes changed."""
    changed = 0
    for mod in gm.modules():
        if not isinstance(mod, GraphModule):
            continue
        here = 0
        for node in mod.graph.nodes:
            full = (full_arguments(node.target, node.args, node.kwargs)
                    if node.op == "call_function" and node.target in BINDINGS else None)
            if full is not None:
                node.target = BINDINGS[node.target]
                node.args, node.kwargs = full
                here += 1
        if here:
            mod.recompile()
            changed += here
    return changed
