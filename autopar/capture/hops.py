"""Higher-order ops in an exported graph: inline the ones that only set a mode, refuse the rest.

``torch.export`` (training IR) keeps a region of the forward that runs under another grad or
autocast mode as one call of a higher-order op (``torch.ops.higher_order``) on a nested
GraphModule held as an attribute of the graph (see ``torch/_export/passes/
replace_set_grad_with_hop_pass.py`` and ``replace_autocast_with_hop_pass.py``)::

    submod_3 = self.submod_1                                  # get_attr: no shape
    wrap_with_set_grad_enabled = higher_order.wrap_with_set_grad_enabled(False, submod_3, x, b)
    cos = wrap_with_set_grad_enabled[0]; sin = wrap_with_set_grad_enabled[1]

Hugging Face's rotary embeddings are such a region (``@torch.no_grad()`` and
``torch.autocast(enabled=False)``). autopar plans one flat graph of ATen ops, so
:func:`inline_higher_order_ops` copies the body of every

- ``wrap_with_set_grad_enabled(enabled, body, *args)`` and
- ``wrap_with_autocast(device, dtype, enabled=False, cache, body, *args)``

into the parent graph, nested regions included, each copied node keeping its ``meta`` (the
FakeTensor ``val``, ``nn_module_stack``, stack trace). The semantics are kept exactly:

- grad mode: a value computed with grad disabled has no gradient. Where such a value (a
  floating-point one that depends on a parameter) is read by an op that runs with grad
  enabled, or is a graph output, an ``aten.detach`` is put between them, so no gradient
  flows back into the region, as in eager.
- autocast: the graph is captured, and autopar trains, without autocast, so a region that
  *disables* autocast changes nothing and is inlined as is. A region that *enables* it would
  need the casts autocast inserts at run time; that is refused with a CaptureError.

Any other higher-order op (``cond``, ``while_loop``, ``map_impl``, ``scan``,
``tag_activation_checkpoint``, ``flex_attention``, ``invoke_subgraph``, ...) raises a
CaptureError that names it, the module it sits in, and what to change in the model.
"""
from __future__ import annotations

import copy
import operator
from typing import Iterable

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from autopar.capture.graph import CaptureError

__all__ = ["inline_higher_order_ops", "higher_order_ops"]

_INLINED = ("wrap_with_set_grad_enabled", "wrap_with_autocast")

# what to change, by higher-order op (the rest get a generic sentence)
_FIXES = {
    "cond": "a data-dependent branch (torch.cond, or an `if` on a tensor value that export "
            "turned into one): autopar plans one static graph; compute both sides and select "
            "with torch.where, or branch on a Python value fixed before capture",
    "while_loop": "a loop whose trip count depends on tensor values: unroll it to a fixed "
                  "count known before capture",
    "map_impl": "torch._higher_order_ops.map: replace the mapped function with a batched op "
                "or a Python loop over a fixed count",
    "scan": "torch scan: unroll the scan to a Python loop over the (fixed) sequence length",
    "associative_scan": "associative_scan: write the scan with cumsum / cumprod or an "
                        "unrolled loop",
    "tag_activation_checkpoint": "activation checkpointing (torch.utils.checkpoint, or "
                                 "model.gradient_checkpointing_enable()): turn it off "
                                 "(Hugging Face: model.gradient_checkpointing_disable()) and "
                                 "ask autopar for recomputation instead (recompute='full' or "
                                 "a list of layers)",
    "wrap_activation_checkpoint": "activation checkpointing: turn it off and ask autopar for "
                                  "recomputation instead (recompute='full')",
    "flex_attention": "flex attention: use scaled_dot_product_attention or eager attention "
                      "(Hugging Face: attn_implementation='sdpa' or 'eager')",
    "flex_attention_backward": "flex attention: use attn_implementation='sdpa' or 'eager'",
    "invoke_subgraph": "a nested compile region (torch.compiler.nested_compile_region): "
                       "call the function directly when capturing for autopar",
    "auto_functionalized": "a custom op that mutates its inputs: make it functional "
                           "(return new tensors) or register it without mutation",
    "auto_functionalized_v2": "a custom op that mutates its inputs: make it functional "
                              "(return new tensors) or register it without mutation",
    "with_effects": "an op with side effects (print, a custom effectful op): remove it from "
                    "forward",
}



def _hop_name(node: Node) -> str | None:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator):
        return getattr(t, "_name", None) or t.name()
    return None


def higher_order_ops(gm: GraphModule) -> list[tuple[str, str]]:
    """(node name, higher-order op name) of every higher-order op call in ``gm``'s graph."""
    return [(n.name, _hop_name(n)) for n in gm.graph.nodes if _hop_name(n)]


def _where(node: Node) -> str:
    """The module path (and source line) a node comes from, for messages."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        path = f"module {path or '<root>'} ({cls.rsplit('.', 1)[-1]})"
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = next((t.strip() for t in reversed(trace)
                 if t.strip().startswith("File ") and "<eval_with_key>" not in t), "")
    return ", ".join(x for x in (path, line) if x) or "unknown location"


def _refuse(node: Node, name: str, detail: str = "") -> Exception:
    fix = _FIXES.get(name, "autopar inlines only grad-mode and autocast-off regions; rewrite "
                           "this part of forward with plain tensor ops")
    return CaptureError(
        f"the exported graph calls the higher-order op torch.ops.higher_order.{name} "
        f"(node {node.name}, {_where(node)}){detail}; autopar plans a flat graph of ATen ops "
        f"and cannot shard through it.\nFix: {fix}.")


def _subgraph(gm: GraphModule, node: Node, body: Node, name: str) -> GraphModule:
    if not (isinstance(body, Node) and body.op == "get_attr"):
        raise _refuse(node, name, f" with a body that is not a subgraph attribute ({body!r})")
    sub = gm
    for part in str(body.target).split("."):
        sub = getattr(sub, part)
    if not isinstance(sub, GraphModule):
        raise _refuse(node, name, f" whose body {body.target} is a {type(sub).__name__}")
    return sub


def _fresh_attr(gm: GraphModule, base: str) -> str:
    i, name = 0, base
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _inline_one(gm: GraphModule, node: Node, sub: GraphModule, args: tuple,
                grad_enabled: bool, no_grad: set[Node], ctx: dict[Node, bool]) -> None:
    """Copy ``sub``'s body before ``node``, its placeholders bound to ``args``; point the
    users of ``node`` (getitems, or the node itself for a single output) at the copies."""
    graph = gm.graph
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(args):
        raise _refuse(node, _hop_name(node), f" with {len(args)} operands for a body of "
                                             f"{len(phs)} inputs")
    env: dict[Node, object] = dict(zip(phs, args))
    result = None
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = map_arg(sn.args[0], lambda n: env[n])
                continue
            if sn.op == "get_attr":        # a nested body (or constant) of the subgraph
                obj = sub
                for part in str(sn.target).split("."):
                    obj = getattr(obj, part)
                attr = _fresh_attr(gm, str(sn.target).replace(".", "_"))
                if isinstance(obj, torch.nn.Module):
                    gm.add_submodule(attr, obj)
                else:
                    setattr(gm, attr, obj)
                new = graph.get_attr(attr)
                new.meta = copy.copy(sn.meta)
            else:
                new = graph.node_copy(sn, lambda n: env[n])
            env[sn] = new
            if _hop_name(new):
                ctx[new] = grad_enabled        # a nested region runs in this one's mode
            if not grad_enabled:
                no_grad.add(new)
    outs = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        elif len(outs) == 1 and isinstance(result, Node):
            user.replace_input_with(node, result)
        else:
            raise _refuse(node, _hop_name(node), f" whose tuple result is read by {user.name} "
                                                 f"without indexing")
    graph.erase_node(node)


def _detach_no_grad_values(gm: GraphModule, no_grad: set[Node], requires_grad: set[Node]) -> int:
    """Put ``aten.detach`` between a value computed with grad disabled (floating point, and
    depending on a parameter, so it could carry a gradient) and each reader that runs with
    grad enabled. Returns the number of detaches inserted."""
    graph = gm.graph
    # which nodes depend on a parameter (a value that requires grad), in graph order
    depends = set(requires_grad)
    for n in graph.nodes:
        if n not in depends and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    inserted = 0
    for n in list(graph.nodes):
        if n not in no_grad or n not in depends:
            continue
        val = n.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue
        readers = [u for u in n.users if u not in no_grad
                   and not (u.op == "call_function" and u.target is operator.getitem)]
        if not readers:
            continue
        with graph.inserting_after(n):
            d = graph.call_function(torch.ops.aten.detach.default, (n,))
        d.meta = {k: v for k, v in n.meta.items() if k != "val"}
        d.meta["val"] = val.detach()
        for u in readers:
            u.replace_input_with(n, d)
        inserted += 1
    return inserted


def inline_higher_order_ops(gm: GraphModule, requires_grad: Iterable[str] = ()) -> list[str]:
    """Inline every grad-mode and autocast-off region of ``gm`` into its graph (in place).

    ``requires_grad``: the placeholders whose values carry gradients (the parameters); a
    value computed from them with grad disabled gets an ``aten.detach`` where grad-enabled
    code reads it. Returns the names of the higher-order op calls inlined; raises
    CaptureError naming any other higher-order op.
    """
    graph = gm.graph
    # refuse first, before changing anything, the first op that cannot be inlined
    for n in graph.nodes:
        name = _hop_name(n)
        if name is not None and name not in _INLINED:
            raise _refuse(n, name)
    inlined: list[str] = []
    no_grad: set[Node] = set()
    ctx: dict[Node, bool] = {}           # region call -> grad mode it runs in (top: enabled)
    bodies: set[str] = set()
    while True:
        node = next((n for n in graph.nodes if _hop_name(n)), None)
        if node is None:
            break
        name = _hop_name(node)
        outer = ctx.pop(node, True)
        if name == "wrap_with_set_grad_enabled":
            enabled, body, *args = node.args
            inner = bool(enabled)
        elif name == "wrap_with_autocast":
            device, dtype, enabled, _cache, body, *args = node.args
            if enabled:
                raise CaptureError(
                    f"the exported graph runs node {node.name} ({_where(node)}) under "
                    f"torch.autocast({device!r}, dtype={dtype}, enabled=True) (higher-order op "
                    f"torch.ops.higher_order.wrap_with_autocast); autopar trains in fp32 and "
                    f"would drop the casts autocast makes at run time.\nFix: remove the autocast "
                    f"region from forward (plan mixed precision with precision='bf16' instead).")
            inner = outer
        else:
            raise _refuse(node, name)   # a nested region holding another op
        sub = _subgraph(gm, node, body, name)
        bodies.add(str(body.target))
        _inline_one(gm, node, sub, tuple(args), inner, no_grad, ctx)
        if not body.users:
            graph.erase_node(body)
        inlined.append(node.name)
    if inlined:
        phs = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        _detach_no_grad_values(gm, no_grad, {phs[p] for p in requires_grad if p in phs})
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        for attr in sorted(bodies):
            if attr not in used and isinstance(getattr(gm, attr, None), GraphModule):
                gm.delete_submodule(attr)
        graph.lint()
        gm.recompile()
    return inlined
