"""Which GEMMs ``precision="fp8"`` runs in float8: the linear layers, not the output head.

A captured ``aten.linear(x, W, b)`` whose weight ``W`` is a parameter read by that linear
alone, called by an ``nn.Linear`` module's forward (torchao's ``convert_to_float8_training``
swaps exactly the ``nn.Linear`` modules): the innermost module of the node's
``nn_module_stack`` (torch.export's) is an ``nn.Linear``. Not a module that calls
``F.linear`` on a weight of its own, which a swap of ``nn.Linear`` modules leaves in bf16: a
mixture of experts' router (transformers' ``MixtralTopKRouter``, whose precision decides
the routing; DeepSeek-V3's FP8 training keeps its MoE gating modules in BF16/FP32 too,
arXiv:2412.19437 Sec. 3.3.1), ``nn.MultiheadAttention``'s input and output projections. Kept in bf16, as torchtitan's float8 converter keeps its
``output`` layer: the head, i.e. a linear whose result reaches the graph's outputs (the
loss) through no other linear, and a weight read elsewhere too (a tied embedding and head:
the embedding reads it in bf16 as a table, not as a GEMM operand).

A mixture of experts' experts modules (each one ``autopar::moe_experts`` op) run their GEMMs
in fp8 too (:func:`fp8_experts`; ``autopar.ops.fp8_experts``: the per-expert ``gate_up`` and
``down`` GEMMs, as DeepSeek-V3 trained them, arXiv:2412.19437 Sec. 3.3), named by the
experts module (``"model.layers.1.mlp.experts"``), where their layout is one that runs
(``ops.fp8_experts.fp8_layout``) and the program is eager (a compiled program's experts op
differentiates its forward under ``torch.func``, which ``fp8_linear``'s autograd function
does not support: its experts stay bf16, and naming them is a ``PinError``).

Of those, the ones a plan runs in fp8 (:func:`planned_fp8_linears`,
:func:`planned_fp8_experts`) are its options' ``fp8_layers``: the user's list, ``"all"``, or
what the solver chose by price (``autopar.pricing.fp8``), named by the linear module (the
weight's name less ``.weight``) or the experts module.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from autopar.capture import Captured
from autopar.errors import PinError
from autopar.ops.experts import EXPERTS_OP, template
from autopar.ops.fp8_experts import fp8_layout
from autopar.placement import Shard

aten = torch.ops.aten


def fp8_linears(cap: Captured) -> dict[str, str]:
    """The captured linear nodes ``precision="fp8"`` runs in fp8: node name -> the weight's
    parameter name in the model (its first alias)."""
    out = {}
    feeds = _feeds_a_linear(cap.gm.graph)
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.linear.default:
            continue
        w = n.args[1]
        if getattr(w, "op", None) != "placeholder" or w.name not in cap.params or len(w.users) != 1:
            continue
        if n not in feeds or not _called_by_nn_linear(n):    # the head: no linear after it
            continue
        out[n.name] = cap.params[w.name][0]
    return out


def _called_by_nn_linear(node) -> bool:
    """Whether the innermost module of ``node``'s ``nn_module_stack`` is an ``nn.Linear`` (or
    a subclass that keeps its ``forward``: the one-device recipe,
    ``ops.fp8.use_fp8_linears``, replaces that forward, so a subclass with its own, Llama 4's
    router returning its scores and logits, is no fp8 linear); True where the capture kept
    no module stack (nothing to tell by)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return True
    kind = list(stack.values())[-1][1]
    if isinstance(kind, type):
        cls = kind
    else:
        module, _, name = str(kind).rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward


def module_name(weight: str) -> str:
    """The linear module of weight parameter ``weight`` (``"h.0.mlp.c_fc.weight"`` ->
    ``"h.0.mlp.c_fc"``): how ``fp8_layers`` names it."""
    return weight[:-len(".weight")] if weight.endswith(".weight") else weight


def check_fp8_layers(names, eligible) -> None:
    """Refuse an ``fp8_layers=`` list naming a module that is no fp8-eligible linear of the
    model (``eligible``: their module names), naming the unknown ones and the fix."""
    unknown = sorted(set(names) - set(eligible))
    if unknown:
        shown = sorted(eligible)
        listed = ", ".join(shown[:6]) + (f", ... ({len(shown)} in all)" if len(shown) > 6 else "")
        raise PinError(f"fp8_layers names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}, "
                       "which is no linear layer precision='fp8' can convert (nn.Linear, not "
                       "the head) nor experts module (ops.fp8_experts.fp8_layout); the "
                       f"model's are: {listed or 'none'}. Fix the names, pin "
                       "fp8_layers='all', or leave fp8_layers out (chosen by price)")


def fp8_experts(cap: Captured) -> dict[str, str]:
    """The captured experts ops whose GEMMs ``precision="fp8"`` can run in fp8 (module
    docstring): node name -> the experts module's name (its stacks' parameters' module)."""
    out = {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is not EXPERTS_OP:
            continue
        stacks = n.args[3]
        if not all(getattr(s, "op", None) == "placeholder" and s.name in cap.params for s in stacks):
            continue
        t = template(n.args[4])
        if fp8_layout(t.module, t.names):
            out[n.name] = cap.params[stacks[0].name][0].rpartition(".")[0]
    return out


def fp8_eligible(cap: Captured) -> set[str]:
    """The module names ``fp8_layers`` may name: the fp8 linears' and the experts'."""
    return {module_name(w) for w in fp8_linears(cap).values()} | set(fp8_experts(cap).values())


def planned_fp8_linears(cap: Captured, options) -> dict[str, str]:
    """The captured linear nodes a plan with ``options`` runs in fp8 (node -> weight name):
    those of :func:`fp8_linears` whose module ``options.fp8_layers`` names; all of them
    under ``"all"`` or None (a plan file from before the choice, when every one ran fp8)."""
    every = fp8_linears(cap)
    chosen = getattr(options, "fp8_layers", None)
    if chosen is None or chosen == "all":
        return every
    check_fp8_layers(chosen, fp8_eligible(cap))
    return {n: w for n, w in every.items() if module_name(w) in set(chosen)}


def planned_fp8_experts(cap: Captured, options) -> dict[str, str]:
    """The captured experts ops a plan with ``options`` runs in fp8 (node -> module name):
    those of :func:`fp8_experts` that ``options.fp8_layers`` names, every one under
    ``"all"``; none under None (a plan file from before the choice, when experts ran bf16)
    nor in a compiled program (module docstring), where naming one is a ``PinError``."""
    every = fp8_experts(cap)
    chosen = getattr(options, "fp8_layers", None)
    if getattr(options, "precision", None) != "fp8" or chosen is None:
        return {}
    if chosen != "all":
        check_fp8_layers(chosen, fp8_eligible(cap))
        every = {n: m for n, m in every.items() if m in set(chosen)}
    if getattr(options, "compile", False):
        if chosen != "all" and every:
            raise PinError(f"fp8_layers names the experts modules {sorted(every.values())[:3]} "
                           "under compile=True, whose experts op cannot run fp8 GEMMs (a "
                           "compiled program differentiates it under torch.func); pin "
                           "compile=False, or leave the experts out of fp8_layers")
        return {}
    return every


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


def _feeds_a_linear(graph) -> set:
    """The nodes from whose outputs some linear is computed (a linear among their users'
    users, transitively): one pass over ``graph`` backwards. A linear outside the set is a
    head (no other linear reads anything computed from it: the last GEMM)."""
    feeds: set = set()
    for n in reversed(graph.nodes):
        if any(u in feeds or (u.op == "call_function" and u.target is aten.linear.default)
               for u in n.users):
            feeds.add(n)
    return feeds
