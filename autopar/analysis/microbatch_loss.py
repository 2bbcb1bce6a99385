"""Micro-batch losses: each micro-batch's graph outputs a partial term of the global loss.

A pipeline (or any gradient accumulation) runs the captured graph once per micro-batch. The
step's loss is then the SUM of the micro-batch outputs and gradients are never divided by
``m``: the micro-batches are one more partial-sum dimension, as a data-parallel mesh axis is
for the sharding rules (``autopar.sharding.rules.losses``). For that to hold, every mean over
samples in the loss must divide by the count of the WHOLE global batch, not the micro-batch's
(the mean of micro-batch means is the global mean only for equal counts: it is wrong for
padded targets with ``ignore_index``, class weights and ``reduction="sum"``).

:func:`rewrite` (applied by ``solver.pipeline_search.capture_microbatch`` to the graph
captured at micro-batch size) first finds where the loss sums over the batch. Values from
the batch are ``B``, from parameters and constants only ``C``; a reduction over the batch
dim of a ``B`` value (a loss op with ``mean`` / ``sum``, a ``sum`` / ``mean`` over dim 0 or
over every element) is ``P``, partial over micro-batches. ``P`` stays ``P`` through linear
ops (``P ± P``, ``P * C``, ``P / C``, views, casts, sums and means); read any other way it
is a per-micro-batch value again (``B``: ``x - x.mean()`` inside a model is a batch
statistic, per micro-batch as BatchNorm's). The loss must come out ``P``; then walking back
from it through ``P`` values gives the batch reductions, and only those are rewritten:

- every mean-reducing one — ATen's ``cross_entropy_loss`` / ``nll_loss*`` with class-index
  targets (``weight``, ``ignore_index``, ``label_smoothing``) or probability targets, the
  pointwise losses (mse, l1, smooth_l1, huber, kl_div, soft_margin, bce, bce_with_logits),
  ``mean`` — becomes ``sum(values * scale)`` (over the same dims), where ``scale`` is a new
  graph input (appended to ``cap.inputs`` after the target, the shape of the values) every
  element of which is ``1 / D``, ``D`` the denominator of the global batch: for class-index
  CE / NLL the sum over non-ignored targets of ``weight[target]`` (their count without
  ``weight``) over all micro-batches — torch's label-smoothing mean divides by the same —,
  otherwise the count of elements per mean times ``m``;
- a constant added to the partial loss (``P + C``, a regulariser) becomes ``C / m``;
- sums stay as they are.

The scale is an input, not a scalar inside the graph, so the solver shards it like the
values it multiplies (the batch on the data axis) and nothing crosses ranks for it; every
element holds the same value, so any split of it is right. :func:`denominator_inputs`
computes the scales of a step from the whole global batch (every rank has it). A target
computed inside the graph (a Hugging Face model shifting its labels) is evaluated per
micro-batch on the unsharded captured graph, ancestors of the target only.

A loss that is not a sum of micro-batch terms (``exp(loss)``, ``loss * loss``) is left as
it is with the reason recorded: planning still works, and :func:`denominator_inputs` (the
pipeline's step) raises ``MicrobatchLossError`` naming the op.

Left as is: a division by a batch size baked into the graph as a number
(``F.kl_div(..., reduction="batchmean")``, ``loss.sum() / x.size(0)``) divides by the
micro-batch size, as the graph captured at that size says.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx
from torch._guards import detect_fake_mode

from autopar.analysis.batch_linearity import (
    CE, MEAN, NLL, NLL_FWD, Linearity, analyse, arg, fake_value, reduction_pos, set_arg, val,
)
from autopar.errors import AutoparInputError

aten = torch.ops.aten


class MicrobatchLossError(AutoparInputError):
    """The captured loss is not a sum of micro-batch terms (or its denominator cannot be
    computed): pipelining it would not train to the single-device numbers."""


@dataclass
class LossTerm:
    """One rewritten mean: the scale input ``scale`` (shape ``shape`` at micro-batch size)."""
    node: str                        # the node of the rewritten loss (before the rewrite)
    scale: str                       # the new placeholder
    shape: tuple[int, ...]           # per-element loss at micro-batch size
    dtype: torch.dtype
    kind: str                        # "class" (count of non-ignored targets) or "elements"
    count: int = 1                   # "elements": elements per mean in one micro-batch
    ignore_index: int = -100
    outputs: tuple[int, int] = (-1, -1)   # index of (target, weight) in the denominator graph


@dataclass
class MicrobatchLoss:
    """What :func:`rewrite` did to a Captured graph (``cap.microbatch_loss``)."""
    m: int
    terms: list[LossTerm] = field(default_factory=list)
    error: str = ""                  # why the loss is not a sum of micro-batch terms
    graph: Any = None                # fx.GraphModule: targets and weights from the inputs
    graph_inputs: list[str] = field(default_factory=list)   # its placeholders
    values: dict[str, torch.Tensor] = field(default_factory=dict)   # buffers it reads

    @property
    def scale_inputs(self) -> list[str]:
        return [t.scale for t in self.terms]


def rewrite(cap, m: int, model: torch.nn.Module | None = None):
    """Rewrite ``cap`` (captured at micro-batch size, ``m`` micro-batches a step) in place so
    that the sum over micro-batches of its loss is the loss of the global batch; returns
    ``cap`` with ``cap.microbatch_loss`` set (a :class:`MicrobatchLoss`). ``model``'s buffers
    are kept (by reference) for denominators that read them (class weights in a buffer).
    A loss that is not a sum of micro-batch terms is left as it is, the reason recorded."""
    spec = MicrobatchLoss(m=m)
    cap.microbatch_loss = spec
    if not cap.has_loss or not cap.loss:
        return cap
    g = cap.gm.graph
    found = analyse(cap, g)
    loss = next(n for n in g.nodes if n.op == "output").args[0][0]
    if found.state.get(loss) != "P":
        spec.error = _why_not_partial(loss, found)
        return cap
    r = _Rewriter(g, spec, m)
    for node, i in found.consts:         # P + c: each micro-batch adds c / m
        r.divide_constant(node, i)
    for node in found.origins:
        if reduction_pos(node) is not None:
            r.loss_op(node)
        elif node.target in MEAN:
            r.mean(node)
    g.lint()
    cap.gm.recompile()
    cap.inputs = list(cap.inputs) + spec.scale_inputs
    out_node = next(n for n in g.nodes if n.op == "output")
    cap.loss = out_node.args[0][0].name
    # a model that returns its own loss returns the node just replaced: its outputs too
    outs = out_node.args[0][1:]
    if len(outs) == len(cap.output):
        cap.output = [o.name if isinstance(o, fx.Node) else name for name, o in zip(cap.output, outs)]
    cap.__post_init__()
    if r.den_outputs and not spec.error:
        _denominator_graph(cap, spec, r.den_outputs, model)
    return cap


def _why_not_partial(loss: fx.Node, found: Linearity) -> str:
    if found.state.get(loss) == "C":
        return f"the loss {loss.name} does not depend on the batch"
    if found.lost is not None:
        return (f"{found.lost.name} ({found.lost.target}) reads a sum over the batch in a way "
                "that is not linear: the sum over micro-batches of the loss is not the global "
                "batch's; write the loss as sums and means over samples")
    return f"the loss {loss.name} is not a sum or a mean over the samples of the batch"


class _Rewriter:
    """The edits of :func:`rewrite` on graph ``g``: new scale inputs, new nodes with their
    fake values and the module metadata of the node they replace."""

    def __init__(self, g: fx.Graph, spec: MicrobatchLoss, m: int):
        self.g, self.spec, self.m = g, spec, m
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in g.nodes if n.op == "placeholder"])
        self.last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
        self.den_outputs: list[fx.Node] = []     # targets and weights the denominators read

    def new_scale(self, shape, dtype, device) -> fx.Node:
        k = len(self.spec.terms)
        with self.g.inserting_after(self.last_ph):
            ph = self.g.placeholder(f"loss_scale_{k}" if k else "loss_scale")
        with self.fake_mode:
            ph.meta["val"] = torch.empty(shape, dtype=dtype, device=device)   # meta models: meta
        self.last_ph = ph
        return ph

    def call(self, target, args, kwargs, like: fx.Node) -> fx.Node:
        """A new node computing ``target(*args, **kwargs)`` just before ``like``."""
        with self.g.inserting_before(like):
            n = self.g.call_function(target, args, kwargs)
        n.meta["val"] = fake_value(target, args, kwargs, self.fake_mode)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                n.meta[key] = like.meta[key]
        return n

    def divide_constant(self, node: fx.Node, i: int) -> None:
        args = list(node.args)
        a = args[i]
        args[i] = self.call(aten.div.Tensor, (a, self.m), {}, node) if isinstance(a, fx.Node) else a / self.m
        node.args = tuple(args)

    def loss_op(self, node: fx.Node) -> None:
        """A loss op reducing by mean becomes ``sum(loss_none * scale)``; sums stay."""
        red = reduction_pos(node)
        if arg(node, red[0], red[1], 1) != 1:
            return                        # a sum: already its micro-batch's term
        users = list(node.users)
        nll_fwd = node.target in NLL_FWD
        if nll_fwd and any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
            self.spec.error = (f"{node.name} ({node.target}): its total_weight output is read; "
                               "only the loss output can be split into micro-batches")
            return
        args, kwargs = set_arg(node, red[0], red[1], 0)
        per = self.call(aten.nll_loss_nd.default if nll_fwd else node.target, args, kwargs, node)
        shape, dtype = tuple(per.meta["val"].shape), per.meta["val"].dtype
        if not shape:
            self.spec.error = (f"{node.name} ({node.target}): a mean over one sample does not "
                               "split into micro-batches")
            self.g.erase_node(per)
            return
        term = self._term(node, shape, dtype)
        scale = self.new_scale(shape, dtype, per.meta["val"].device)
        term.scale = scale.name
        out = self.call(aten.sum.default, (self.call(aten.mul.Tensor, (per, scale), {}, node),), {}, node)
        for u in users if nll_fwd else ():
            u.replace_all_uses_with(out)
            self.g.erase_node(u)
        if not nll_fwd:
            node.replace_all_uses_with(out)
        self.g.erase_node(node)
        self.spec.terms.append(term)

    def _term(self, node: fx.Node, shape, dtype) -> LossTerm:
        class_index = (node.target in CE or node.target in NLL or node.target in NLL_FWD) \
            and not val(node.args[1]).dtype.is_floating_point
        term = LossTerm(node.name, "", shape, dtype, "class" if class_index else "elements",
                        count=_numel(shape))
        if class_index:
            term.ignore_index = int(arg(node, 4, "ignore_index", -100))
            weight = arg(node, 2, "weight")
            n = len(self.den_outputs)
            term.outputs = (n, n + 1 if weight is not None else -1)
            self.den_outputs += [node.args[1]] + ([weight] if weight is not None else [])
        return term

    def mean(self, node: fx.Node) -> None:
        """``mean(x)`` over the batch becomes ``sum(x * scale)`` over the same dims."""
        x = node.args[0]
        shape, dtype = tuple(val(x).shape), node.meta["val"].dtype
        count = _numel(shape) // max(_numel(node.meta["val"].shape), 1)   # elements per mean
        scale = self.new_scale(shape, dtype, val(x).device)
        self.spec.terms.append(LossTerm(node.name, scale.name, shape, dtype, "elements", count=count))
        mul = self.call(aten.mul.Tensor, (x, scale), {}, node)
        if node.target is aten.mean.dim:
            out = self.call(aten.sum.dim_IntList, (mul,) + tuple(node.args[1:]), dict(node.kwargs), node)
        else:
            out = self.call(aten.sum.default, (mul,), dict(node.kwargs), node)
        node.replace_all_uses_with(out)
        self.g.erase_node(node)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _denominator_graph(cap, spec: MicrobatchLoss, outputs: list[fx.Node], model) -> None:
    """A graph of the ancestors of every class-index target and weight, from the inputs."""
    need: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = []
    buffers = dict(model.named_buffers()) if model is not None else {}
    for n in cap.gm.graph.nodes:
        if n not in need:
            continue
        if n.op == "placeholder":
            if n.name in cap.params:
                spec.error = (f"the loss's target or class weight reads the parameter "
                              f"{cap.params[n.name][0]!r}: its denominator cannot be computed "
                              "before the step")
                return
            if n.name not in cap.inputs and n.name not in cap.buffers:
                spec.error = (f"the loss's target or class weight reads {n.name}, a tensor "
                              "constant of the loss function: register it as a buffer of the model")
                return
            if n.name in cap.buffers:
                spec.values[n.name] = buffers.get(cap.buffers[n.name])
            names.append(n.name)
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outputs))
    spec.graph = fx.GraphModule(torch.nn.Module(), g)
    spec.graph_inputs = names


def denominator_inputs(cap, inputs: Sequence[torch.Tensor], target, m: int) -> tuple[torch.Tensor, ...]:
    """The scale inputs of one step (``cap.microbatch_loss.scale_inputs`` in order), from the
    whole global batch ``inputs`` / ``target``: each of shape ``(m * s0, *s)`` where ``(s0,
    *s)`` is the micro-batch's, filled with ``1 / D`` (``D`` the global denominator), so
    that splitting it along dim 0 gives each micro-batch its input. Raises
    ``MicrobatchLossError`` if the loss is not a sum of micro-batch terms."""
    spec: MicrobatchLoss | None = getattr(cap, "microbatch_loss", None)
    if spec is None:
        return ()
    if spec.error:
        raise MicrobatchLossError(f"pipelining this loss would not train to the single-device "
                                  f"numbers: {spec.error}")
    if spec.m != m:
        raise MicrobatchLossError(f"the graph was rewritten for {spec.m} micro-batches, the step "
                                  f"runs {m}")
    den: list[float] = []
    vals = None
    if spec.graph is not None:
        given = dict(zip(cap.inputs, tuple(inputs) + ((target,) if target is not None else ())))
        chunks = {n: given[n].tensor_split(m, dim=0) for n in spec.graph_inputs if n in given}
        vals = []
        device = next((c[0].device for c in chunks.values()), None)
        with torch.no_grad():
            for i in range(m):
                args = [chunks[n][i] if n in chunks else spec.values[n].to(device)
                        for n in spec.graph_inputs]
                vals.append(spec.graph(*args))
    for term in spec.terms:
        if term.kind == "elements":
            den.append(float(term.count * m))
            continue
        ti, wi = term.outputs
        # summed where the batch is (the rank's device)
        total = torch.zeros((), dtype=torch.float64, device=vals[0][ti].device if vals else None)
        for out in vals:
            t = out[ti]
            valid = t != term.ignore_index
            if wi < 0:
                total += valid.sum()
            else:
                w = out[wi].to(torch.float64)
                total += (w[torch.where(valid, t, torch.zeros_like(t))] * valid).sum()
        den.append(float(total))
    res = []
    for term, d in zip(spec.terms, den):
        shape = (term.shape[0] * m,) + tuple(term.shape[1:])
        res.append(torch.full(shape, 1.0 / d if d else float("nan"), dtype=term.dtype))
    return tuple(res)
