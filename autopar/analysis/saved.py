"""What autograd keeps for backward: the saved activations of a captured graph.

A forward op does not keep its output for backward as a rule. Autograd saves, per op, the
tensors its backward formulas read, and only those of formulas it will run: a formula runs
for an input that requires a gradient, and an op none of whose inputs does (a mask, a
rotary table, anything no parameter reaches) records nothing at all. The source is
torch's ``tools/autograd/derivatives.yaml`` (shipped as
``torchgen/packaged/autograd/derivatives.yaml``): each entry lists, per differentiable
input, the formula of its gradient, and ``gen_variable_type.py`` saves a tensor a single
formula reads only when that formula's input needs a gradient (its ``guard_for``).

:data:`SAVES` is that table for the ops a captured graph holds, keyed by ATen op name:
``{differentiable inputs: what their gradient reads}``; names are the schema's argument
names, ``result`` / ``resultN`` the op's outputs, and ``+name`` a tensor the op computes
inside and saves without returning it (:data:`EXTRAS`: layer norm's mean and rstd, flash
attention's logsumexp, dropout's mask, cross-entropy's log-probabilities). Composite ops
the export keeps whole (``linear``, ``layer_norm``, ``scaled_dot_product_attention``,
``cross_entropy_loss``) are listed with what the ops they run save. An op not in the
table saves every tensor input and every output (conservative).

A view keeps its base: a saved view (``q`` of a split projection) keeps the storage of the
value it views, once however many views of it are saved. Ops that alias their input only
sometimes (``reshape``, ``flatten``, ``contiguous``, ``to``, ``dropout``) are views when the
shapes, strides and dtypes of the captured values say eager PyTorch returns a view, copies
otherwise (``repeat_kv``'s reshape of an expanded key copies, and attention saves the copy).

Fused attention (flash, memory-efficient) is assumed for ``scaled_dot_product_attention``:
inputs, output and logsumexp, never the scores; a graph that materialises the scores
(``matmul``, ``softmax``) keeps the softmax output as that graph says.

:func:`saved_activations` gives each op node a :class:`Kept` (which outputs backward
keeps, and the extras); :func:`saved_bytes` sums them over the graph (tests compare it
with what ``torch.autograd.graph.saved_tensors_hooks`` sees on an eager forward).
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from autopar.analysis.autocast import LOWER_PRECISION, sixteen_bit_values
from autopar.capture import Captured

# ---- the table --------------------------------------------------------------------------

# {op name: {differentiable inputs (space-separated): what their gradients read}}; every
# line after derivatives.yaml's entry of the op (or, for a composite op, of the ops it runs)
SAVES: dict[str, dict[str, str]] = {
    # matrix products: each operand's gradient reads the other (mm, addmm, bmm, matmul);
    # linear runs addmm / matmul on a view of its input and weight.t()
    "mm": {"self": "mat2", "mat2": "self"},
    "bmm": {"self": "mat2", "mat2": "self"},
    "matmul": {"self": "other", "other": "self"},
    "addmm": {"mat1": "mat2", "mat2": "mat1"},
    "baddbmm": {"batch1": "batch2", "batch2": "batch1"},
    "linear": {"input": "weight", "weight": "input"},
    "mul": {"self": "other", "other": "self"},
    "div": {"self": "other", "other": "self other"},
    # elementwise: the input or the result, as the formula reads it
    "gelu": {"self": "self"}, "silu": {"self": "self"}, "log": {"self": "self"},
    "sin": {"self": "self"}, "cos": {"self": "self"}, "erf": {"self": "self"},
    "abs": {"self": "self"}, "clamp": {"self": "self"}, "log1p": {"self": "self"},
    "square": {"self": "self"},
    "relu": {"self": "result"}, "rsqrt": {"self": "result"}, "sqrt": {"self": "result"},
    "exp": {"self": "result"}, "tanh": {"self": "result"}, "sigmoid": {"self": "result"},
    "reciprocal": {"self": "result"},
    "pow": {"self": "self exponent", "exponent": "self exponent result"},
    "softmax": {"self": "result"}, "_softmax": {"self": "result"},
    "log_softmax": {"self": "result"}, "_log_softmax": {"self": "result"},
    # selections read their indices (and the mask / condition)
    "embedding": {"weight": "indices"},
    # a mixture of experts' experts op (autopar.ops.experts): its inputs; what its experts
    # keep inside (per token-expert pair) is priced by autopar.pricing.experts.saved_bytes
    "moe_experts": {"hidden top_k_weights stacks": "hidden top_k_index top_k_weights"},
    "index": {"self": "indices"},
    "index_select": {"self": "index"},
    "gather": {"self": "index"},
    "where": {"self": "condition", "other": "condition"},
    "masked_fill": {"self": "mask", "value": "mask"},
    # norms: the input (and weight) plus per-row statistics
    "layer_norm": {"input weight bias": "input weight bias +norm_stats"},
    "native_layer_norm": {"input weight bias": "input weight bias result1 result2"},
    "rms_norm": {"input weight": "input weight +rms_rstd"},
    "_fused_rms_norm": {"input weight": "input weight result1"},
    # batch / group norm: input and weight (their per-channel statistics are negligible)
    "batch_norm": {"input weight bias": "input weight"},
    "native_batch_norm": {"input weight bias": "input weight"},
    "_native_batch_norm_legit": {"input weight bias": "input weight"},
    "_native_batch_norm_legit_functional": {"input weight bias": "input weight"},
    "group_norm": {"input weight bias": "input weight"},
    "convolution": {"input weight bias": "input weight"},
    "conv1d": {"input weight bias": "input weight"},
    "conv2d": {"input weight bias": "input weight"},
    "max_pool2d": {"self": "self +pool_indices"},
    "max_pool2d_with_indices": {"self": "self result1"},
    "avg_pool2d": {"self": "self"},
    "adaptive_avg_pool2d": {"self": "self"},
    # attention, fused (flash / memory-efficient): inputs, output, logsumexp
    "scaled_dot_product_attention": {"query key value": "query key value attn_mask result +lse"},
    "_scaled_dot_product_flash_attention_for_cpu": {"query key value": "query key value attn_mask result0 result1"},
    "_scaled_dot_product_flash_attention": {"query key value": "query key value result0 result1"},
    "_scaled_dot_product_efficient_attention": {
        "query key value attn_bias": "query key value attn_bias result0 result1"},
    # dropout (p > 0 in training; otherwise it returns its input): the mask
    "dropout": {"input": "+dropout_mask"},
    "native_dropout": {"input": "result1"},
    # losses: cross-entropy is log_softmax (saves its result) then nll_loss (reads it)
    "cross_entropy_loss": {"self": "target weight +log_probs"},
    "nll_loss": {"self": "self target weight"},
    "nll_loss_forward": {"self": "self target weight result1"},
    "nll_loss_nd": {"self": "self target weight"},
    "mse_loss": {"self target": "self target"},
}

# ops whose backward reads only sizes: they save nothing (reshape, flatten and contiguous
# when they copy: a clone)
for _name in ("reshape", "flatten", "contiguous", "add", "sub", "rsub", "neg", "sum", "mean", "cat", "stack", "clone", "_to_copy",
              "to", "type_as", "copy", "repeat", "cumsum", "triu", "tril", "flip", "roll",
              "constant_pad_nd", "pad", "slice_scatter", "select_scatter", "new_zeros",
              "zeros_like", "ones_like", "full_like", "fill", "lift_fresh_copy", "expand_copy"):
    SAVES[_name] = {}

# ops that return a view of their first tensor input (nothing saved; the view keeps its base)
VIEWS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "transpose", "permute", "t", "expand",
    "expand_as", "unsqueeze", "squeeze", "slice", "select", "narrow", "split",
    "split_with_sizes", "chunk", "unbind", "alias", "detach", "unflatten", "view_as",
    "as_strided", "diagonal", "movedim", "swapaxes", "lift_fresh", "unfold", "broadcast_tensors",
})
NON_DIFFERENTIABLE = frozenset({"detach", "zeros_like", "ones_like", "empty_like", "full_like",
                                "new_zeros", "new_ones", "new_empty", "new_full", "rand_like",
                                "randn_like", "_assert_tensor_metadata"})


@dataclass(frozen=True)
class Extra:
    """A tensor an op saves without returning it: ``nbytes`` (global), following the
    sharding of its input or output ``ref`` (("in", k) of the op's flattened tensor inputs,
    ("out", k)); ``fp32``: kept in fp32 under mixed precision (statistics, logsumexp)."""
    what: str
    ref: tuple[str, int]
    nbytes: float
    fp32: bool = False


def _rows(t) -> int:
    return max(1, t.numel() // max(1, t.shape[-1])) if t.dim() else 1


EXTRAS: dict[str, Callable[[Node, dict], "Extra | None"]] = {
    # native_layer_norm's result1, result2 (mean, rstd): fp32, one per normalised row
    "norm_stats": lambda n, a: Extra("mean, rstd", ("in", 0), 2 * 4.0 * _val(a["input"]).numel()
                                     / max(1, _numel(a["normalized_shape"])), True),
    "rms_rstd": lambda n, a: Extra("rstd", ("in", 0), 4.0 * _val(a["input"]).numel()
                                   / max(1, _numel(a["normalized_shape"])), True),
    # flash / efficient attention's logsumexp: fp32, one per query row and head
    "lse": lambda n, a: Extra("logsumexp", ("in", 0), 4.0 * _rows(_val(a["query"])), True),
    # native_dropout's result1: a bool mask of the output's size
    "dropout_mask": lambda n, a: Extra("mask", ("out", 0), float(_val(n).numel())),
    "pool_indices": lambda n, a: Extra("indices", ("out", 0), 8.0 * _val(n).numel()),
    # log_softmax(self): the input's size, in fp32 (autocast runs the loss in fp32)
    "log_probs": lambda n, a: Extra("log_softmax", ("in", 0), 4.0 * _val(a["self"]).numel(), True),
}


# The loss's backward runs first, while every saved tensor is alive: the gradients it makes
# are the step's peak beyond the saved bytes (an eager census of the GPT of
# benchmarks/precision_memory.py: saved 34.1 MiB, peak 37.1 MiB, the 3 MiB the logits and
# their two gradients). Input-sized fp32 tensors: cross-entropy makes nll_loss's gradient
# and log_softmax's; any other loss its input's gradient.
LOSS_GRADIENTS = {"cross_entropy_loss": 2}


# ---- the analysis -----------------------------------------------------------------------

@dataclass(frozen=True)
class Kept:
    """What backward keeps of one op node: the share of each output (1.0 kept, 0.0 not;
    an average over repeated-layer copies by :func:`merge`), and the extras it saves.
    ``transient``: not saved, but live at the step's peak beside every saved tensor: the
    gradients the loss's backward, the first backward op, makes (:data:`LOSS_GRADIENTS`)."""
    outputs: tuple[float, ...]
    extras: tuple[Extra, ...] = ()
    transient: tuple[Extra, ...] = ()
    # under mixed precision (``analysis.autocast``): each output's kept bytes over its
    # captured (fp32) bytes (0.5 a 16-bit value, 1.0 an fp32 one, 0 one only 16-bit ops
    # save, as their copies), and the 16-bit copies autocast makes of fp32 inputs this op
    # saves (one per op: autocast caches no activation's cast); None: not worked out
    mixed: tuple[float, ...] | None = None
    casts: tuple[Extra, ...] = ()

    def nbytes(self, outputs) -> float:
        """Global bytes, given the node's output metas (anything with ``nbytes``)."""
        return (sum(k * m.nbytes for k, m in zip(self.outputs, outputs))
                + sum(e.nbytes for e in self.extras))


def merge(kept: list[Kept]) -> Kept:
    """The average of the ``Kept`` of a node's repeated-layer copies (equal in practice)."""
    n = len(kept)
    outs = tuple(sum(k.outputs[i] for k in kept) / n for i in range(len(kept[0].outputs)))
    def mean(field):
        return tuple(Extra(e.what, e.ref, e.nbytes * sum(1 for k in kept if e in getattr(k, field)) / n, e.fp32)
                     for e in dict.fromkeys(e for k in kept for e in getattr(k, field)))
    mixed = None
    if all(k.mixed is not None for k in kept):
        mixed = tuple(sum(k.mixed[i] for k in kept) / n for i in range(len(kept[0].mixed)))
    casts = tuple(Extra(e.what, e.ref, sum(c.nbytes for k in kept for c in k.casts if c.ref == e.ref) / n)
                  for e in {c.ref: c for k in kept for c in k.casts}.values())
    return Kept(outs, mean("extras"), mean("transient"), mixed, casts)


def op_name(target) -> str:
    """``aten.mul.Tensor`` -> ``"mul"``; a Python callable (``operator.getitem``, which picks
    a piece of ``split_with_sizes``'s output) -> its ``__name__``, ``"getitem"``."""
    name = getattr(target, "_opname", None)
    if name:
        return name
    parts = str(target).split(".")
    return parts[-2] if len(parts) > 2 else getattr(target, "__name__", str(target))


_CACHE: "weakref.WeakKeyDictionary[GraphModule, dict]" = weakref.WeakKeyDictionary()


def saved_activations(cap: Captured) -> dict[str, Kept]:
    """Op node name -> :class:`Kept`, for every op node with a tensor output (worked out
    once per graph)."""
    got = _CACHE.get(cap.gm)
    if got is None:
        got = _CACHE[cap.gm] = _analyse(cap)
    return got


def saved_bytes(cap: Captured, mixed: bool = False) -> float:
    """Global bytes backward keeps of ``cap``'s op nodes (parameters, buffers and inputs
    are not activations and are not counted); ``mixed``: as autocast runs the fp32 capture
    in 16 bits (``Kept.mixed``, its copies; the 16-bit weight copies are not counted)."""
    total = 0.0
    for name, kept in saved_activations(cap).items():
        outs = _outputs(cap.node(name))
        if not mixed:
            total += kept.nbytes(outs)
            continue
        total += sum(f * m.nbytes for f, m in zip(kept.mixed, outs))
        total += sum(e.nbytes if e.fp32 else e.nbytes / 2 for e in kept.extras + kept.casts)
    return total


def _analyse(cap: Captured) -> dict[str, Kept]:
    graph = cap.gm.graph
    grads: set[str] = set(cap.params)           # values that require a gradient
    base: dict[tuple[str, int], tuple[str, int] | None] = {}   # value -> its storage's producer
    kept: dict[tuple[str, int], bool] = {}
    kept_mixed: dict[tuple[str, int], bool] = {}     # the same under autocast
    casts: dict[str, list[Extra]] = {}               # op -> autocast's copies it saves
    extras: dict[str, list[Extra]] = {}
    placeholders = {n.name for n in graph.nodes if n.op == "placeholder"}
    low = sixteen_bit_values(cap.gm, set(cap.params), op_name)

    def value(a: Node) -> tuple[str, int]:
        if a.op == "call_function" and a.target is operator.getitem:
            src, k = a.args
            return value(src)[0], k
        return a.name, 0

    def storage(a: Node) -> tuple[str, int] | None:
        v = value(a)
        return None if v[0] in placeholders else base.get(v, v)

    def keep(a) -> None:
        for x in _nodes(a):
            s = storage(x)
            if s is not None:
                kept[s] = kept_mixed[s] = True

    def keep_as_run(node, a) -> None:
        """``keep(a)`` for the fp32 program; under autocast an op of its 16-bit list saves
        its copy of an fp32 input instead (a parameter's copy is the ``params`` term)."""
        lower = op_name(node.target) in LOWER_PRECISION
        for x in _nodes(a):
            s = storage(x)
            if s is not None:
                kept[s] = True
            fp32 = x.meta["val"].dtype.is_floating_point and value(x) not in low
            if lower and fp32:
                if not _of_parameter(x, set(cap.params)):
                    casts.setdefault(node.name, []).append(
                        Extra(f"16-bit copy of {x.name}", ("in", _input_index(node, x)),
                              float(x.meta["val"].nbytes)))
            elif s is not None:
                kept_mixed[s] = True

    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            if node.op == "call_function" and node.args[0].name in grads and _is_float(node):
                grads.add(node.name)
            continue
        outs = _outputs(node)
        if not outs:
            continue
        name = op_name(node.target)
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if (any(a.name in grads for a in inputs) and name not in NON_DIFFERENTIABLE
                and _is_float(node)):
            grads.add(node.name)
        if _aliases(node, name):
            # broadcast_tensors: output k views input k; any other view its first input
            srcs = node.args[0] if name == "broadcast_tensors" else [node.args[0]] * len(outs)
            for k, src in enumerate(srcs):
                base[(node.name, k)] = storage(src)
            continue
        if not any(a.name in grads for a in inputs):
            continue           # autograd records nothing: no input requires a gradient
        args = _named_args(node)
        rule = SAVES.get(name)
        if rule is None:       # unknown: every tensor input and every output
            for a in inputs:
                keep(a)
            for k in range(len(outs)):
                kept[(node.name, k)] = kept_mixed[(node.name, k)] = True
            continue
        for needs, reads in rule.items():
            if not any(a.name in grads for arg in needs.split() for a in _nodes(args.get(arg))):
                continue
            for what in reads.split():
                if what.startswith("+"):
                    e = EXTRAS[what[1:]](node, args)
                    if e is not None and e not in extras.setdefault(node.name, []):
                        extras[node.name].append(e)
                elif what.startswith("result"):
                    k = int(what[6:] or 0)
                    if k < len(outs):
                        kept[(node.name, k)] = kept_mixed[(node.name, k)] = True
                else:
                    keep_as_run(node, args.get(what))
    out = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and _outputs(node):
            n = len(_outputs(node))
            aliased = all((node.name, k) in base for k in range(n))
            mixed = tuple(0.0 if aliased or not kept_mixed.get((node.name, k), False)
                          else 0.5 if (node.name, k) in low else 1.0 for k in range(n))
            out[node.name] = Kept(tuple(0.0 if aliased else float(kept.get((node.name, k), False))
                                        for k in range(n)), tuple(extras.get(node.name, ())),
                                  _loss_gradients(cap, node), mixed, tuple(casts.get(node.name, ())))
    return out


def _loss_gradients(cap: Captured, node: Node) -> tuple[Extra, ...]:
    if node.name != cap.loss or not node.all_input_nodes:
        return ()
    x = node.all_input_nodes[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        return ()
    k = LOSS_GRADIENTS.get(op_name(node.target), 1)
    return (Extra("loss gradients", ("in", 0), 4.0 * k * x.numel(), True),)


# ---- helpers ----------------------------------------------------------------------------

def _val(a):
    return a.meta["val"] if isinstance(a, Node) else a


def _of_parameter(x: Node, params: set[str]) -> bool:
    """``x`` is a parameter or a view of one (``t``, ``view``, ... back to its placeholder)."""
    while x.op == "call_function" and x.args and isinstance(x.args[0], Node) \
            and _aliases(x, op_name(x.target)):
        x = x.args[0]
    return x.op == "placeholder" and x.name in params


def _input_index(node: Node, x: Node) -> int:
    """``x``'s place among ``node``'s flattened tensor inputs (``OpCall.inputs``' order)."""
    leaves = [a for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                            is_leaf=lambda y: isinstance(y, Node))
              if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return leaves.index(x)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _outputs(node: Node) -> list:
    return [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]


def _is_float(node: Node) -> bool:
    return any(v.dtype.is_floating_point or v.dtype.is_complex for v in _outputs(node))


def _nodes(a) -> list[Node]:
    return [x for x in pytree.tree_leaves(a, is_leaf=lambda x: isinstance(x, Node))
            if isinstance(x, Node) and isinstance(x.meta.get("val"), torch.Tensor)]


def _named_args(node: Node) -> dict:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    named = {a.name: v for a, v in zip(schema.arguments, node.args)}
    named.update(node.kwargs)
    return named


def _aliases(node: Node, name: str) -> bool:
    """Eager PyTorch returns a view of the first input (no storage of its own)."""
    if name in VIEWS:
        return True
    if not node.args or not isinstance(node.args[0], Node):
        return False
    x, y = _val(node.args[0]), _val(node)
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    if name in ("reshape", "flatten"):
        return _viewable(x, tuple(y.shape)) or _heads_last(node.args[0])
    if name == "contiguous":
        return x.is_contiguous() or _heads_last(node.args[0])
    if name in ("to", "type_as"):     # to(): self when nothing changes, else _to_copy
        return x.dtype == y.dtype and x.device == y.device and not _named_args(node).get("copy", False)
    if name == "dropout":             # returns its input unless p > 0 in training
        args = _named_args(node)
        return not (args.get("train") and 0 < float(args.get("p", 0.0)))
    return False


FUSED_ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention",
                             "_scaled_dot_product_flash_attention_for_cpu"})


def _heads_last(a: Node) -> bool:
    """``a`` is a fused attention's output with heads and sequence swapped back
    (``transpose(1, 2)``): flash and memory-efficient kernels write their output in
    (batch, sequence, heads, dim) order, so that is contiguous however the capture's device
    (meta) laid it out, and the reshape that follows is a view."""
    if not (a.op == "call_function" and op_name(a.target) == "transpose"
            and sorted(int(d) % 4 for d in a.args[1:3]) == [1, 2]):
        return False
    src = a.args[0]
    if src.op == "call_function" and src.target is operator.getitem:
        src = src.args[0]
    return src.op == "call_function" and op_name(src.target) in FUSED_ATTENTION


def _viewable(x: torch.Tensor, shape: tuple) -> bool:
    try:
        torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta").view(shape)
        return True
    except RuntimeError:
        return False
