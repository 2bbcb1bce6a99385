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

aten = torch.ops.aten


class MicrobatchLossError(ValueError):
    """The captured loss is not a sum of micro-batch terms (or its denominator cannot be
    computed): pipelining it would not train to the single-device numbers."""


def _ops(*names: str) -> set:
    out = set()
    for n in names:
        packet = getattr(aten, n, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            out.add(getattr(packet, ov))
    return out


_CE = _ops("cross_entropy_loss")
_NLL = _ops("nll_loss_nd", "nll_loss", "nll_loss2d")
_NLL_FWD = _ops("nll_loss_forward", "nll_loss2d_forward")
# reduction's position in the schema
_POINTWISE = {op: pos for pos, names in ((2, ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                                              "kl_div", "soft_margin_loss")),
                                         (3, ("binary_cross_entropy",)),
                                         (4, ("binary_cross_entropy_with_logits",)))
              for op in _ops(*names)}
_MEAN = {aten.mean.default, aten.mean.dim}
_SUM = {aten.sum.default, aten.sum.dim_IntList}
# ops through which a partial (over micro-batches) value stays partial with any other
# argument a non-tensor
_LINEAR_UNARY = _ops("neg", "clone", "alias", "view", "reshape", "_unsafe_view", "squeeze",
                     "unsqueeze", "expand", "to", "_to_copy", "detach", "contiguous",
                     "select", "slice", "permute", "t", "transpose", "flatten", "lift_fresh_copy")
_ADD = _ops("add", "sub")
_MUL = _ops("mul")
_DIV = _ops("div")


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


def _arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _set_arg(node: fx.Node, pos: int, name: str, value) -> tuple[tuple, dict]:
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > pos:
        args[pos] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def _reduction_pos(node: fx.Node) -> tuple[int, str] | None:
    if node.target in _CE or node.target in _NLL or node.target in _NLL_FWD:
        return 3, "reduction"
    if node.target in _POINTWISE:
        return _POINTWISE[node.target], "reduction"
    return None


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _fake(node_target, args, kwargs, fake_mode):
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    with fake_mode:
        return node_target(*vals[0], **vals[1])


def _full_reduction(node: fx.Node) -> bool:
    """A sum / mean over every element of its input."""
    if node.target in (aten.sum.default, aten.mean.default):
        return True
    x = node.args[0]
    dims = _arg(node, 1, "dim")
    nd = _val(x).ndim
    if dims is None or dims == [] or dims == ():
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % max(nd, 1) for d in dims) == list(range(nd))


def _reduces_dim0(node: fx.Node) -> bool:
    dims = _arg(node, 1, "dim")
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    nd = max(_val(node.args[0]).ndim, 1)
    return any(d % nd == 0 for d in dims)


def _covers_dim0(node: fx.Node) -> bool:
    """A sum / mean that reduces dim 0 of its (non-scalar) input."""
    if _val(node.args[0]).ndim == 0:
        return False
    return _full_reduction(node) or _reduces_dim0(node)


def _analyse(cap, g: fx.Graph):
    """(state per node, the batch reductions, the (add/sub node, arg index) of constant terms
    of the partial loss, the node where the partial loss stopped being one).

    States: ``C`` (no batch), ``B`` (per micro-batch values), ``P`` (a sum over the batch,
    partial over micro-batches). A ``P`` read non-linearly (``x - x.mean()`` inside the model,
    ``exp(loss)``) is a per-micro-batch value again (``B``), as batch statistics are."""
    inputs = set(cap.inputs)
    st: dict[fx.Node, str] = {}
    demoted: list[fx.Node] = []
    for n in g.nodes:
        if n.op == "placeholder":
            st[n] = "B" if n.name in inputs else "C"
            continue
        if n.op != "call_function":
            continue
        t = n.target
        tensors = [a for a in (n.args + tuple(n.kwargs.values())) if isinstance(a, fx.Node)]
        tensors += [a for a in n.all_input_nodes if a not in tensors]
        kinds = [st.get(a, "C") for a in tensors]
        red = _reduction_pos(n)
        if "P" not in kinds:
            if "B" not in kinds:
                st[n] = "C"
            elif red is not None and _arg(n, red[0], red[1], 1) in (1, 2):
                st[n] = "P"              # a loss reduced over its elements
            elif (t in _SUM or t in _MEAN) and _covers_dim0(n):
                st[n] = "P"
            else:
                st[n] = "B"
            continue
        if t in _SUM or t in _MEAN or t in _LINEAR_UNARY or t is operator.getitem:
            ok = len(tensors) == 1
        elif t in _MUL:
            ok = kinds.count("P") == 1 and "B" not in kinds
        elif t in _DIV:
            ok = kinds[0] == "P" and all(k == "C" for k in kinds[1:])
        elif t in _ADD:
            ok = "B" not in kinds
        else:
            ok = False
        st[n] = "P" if ok else "B"
        if not ok:
            demoted.append(n)
    out = next(n for n in g.nodes if n.op == "output")
    loss = out.args[0][0]
    # the last place a partial sum stopped being one on the way to the loss
    above: set[fx.Node] = set()
    todo = [loss]
    while todo:
        a = todo.pop()
        if a not in above:
            above.add(a)
            todo.extend(a.all_input_nodes)
    lost = next((d for d in reversed(demoted) if d in above), None)
    origins: list[fx.Node] = []
    consts: list[tuple[fx.Node, int]] = []
    seen: set[fx.Node] = set()
    stack = [loss] if st.get(loss) == "P" else []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        ins = [a for a in n.all_input_nodes if st.get(a) == "P"]
        if not ins:
            origins.append(n)          # a reduction over the batch
            continue
        if n.target in _ADD:
            consts += [(n, i) for i, a in enumerate(n.args[:2])
                       if (isinstance(a, fx.Node) and st.get(a, "C") == "C")
                       or (isinstance(a, (int, float)) and not isinstance(a, bool))]
        stack.extend(ins)
    return st, [n for n in g.nodes if n in set(origins)], consts, lost


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
    fake_mode = detect_fake_mode([n.meta.get("val") for n in g.nodes if n.op == "placeholder"])
    state, origins, consts, lost = _analyse(cap, g)
    loss = next(n for n in g.nodes if n.op == "output").args[0][0]
    if state.get(loss) != "P":
        if state.get(loss) == "C":
            spec.error = f"the loss {loss.name} does not depend on the batch"
        elif lost is not None:
            spec.error = (f"{lost.name} ({lost.target}) reads a sum over the batch in a way that is "
                          "not linear: the sum over micro-batches of the loss is not the global "
                          "batch's; write the loss as sums and means over samples")
        else:
            spec.error = f"the loss {loss.name} is not a sum or a mean over the samples of the batch"
        return cap
    last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
    den_outputs: list[fx.Node] = []
    k = 0

    def new_scale(shape, dtype, device) -> fx.Node:
        nonlocal last_ph, k
        with g.inserting_after(last_ph):
            ph = g.placeholder(f"loss_scale_{k}" if k else "loss_scale")
        k += 1
        with fake_mode:
            ph.meta["val"] = torch.empty(shape, dtype=dtype, device=device)   # meta models: meta
        last_ph = ph
        return ph

    def call(target, args, kwargs, like: fx.Node, before: fx.Node) -> fx.Node:
        with g.inserting_before(before):
            n = g.call_function(target, args, kwargs)
        n.meta["val"] = _fake(target, args, kwargs, fake_mode)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in like.meta:
                n.meta[key] = like.meta[key]
        return n

    for node, i in consts:               # P + c: each micro-batch adds c / m
        args = list(node.args)
        a = args[i]
        if isinstance(a, fx.Node):
            args[i] = call(aten.div.Tensor, (a, m), {}, node, node)
        else:
            args[i] = a / m
        node.args = tuple(args)

    for node in origins:
        red = _reduction_pos(node)
        if red is not None:
            if _arg(node, red[0], red[1], 1) != 1:
                continue                 # a sum: already its micro-batch's term
            users = list(node.users)
            if node.target in _NLL_FWD:
                if any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
                    spec.error = (f"{node.name} ({node.target}): its total_weight output is read; "
                                  "only the loss output can be split into micro-batches")
                    continue
            args, kwargs = _set_arg(node, red[0], red[1], 0)
            target = aten.nll_loss_nd.default if node.target in _NLL_FWD else node.target
            per = call(target, args, kwargs, node, node)
            shape, dtype = tuple(per.meta["val"].shape), per.meta["val"].dtype
            if not shape:
                spec.error = (f"{node.name} ({node.target}): a mean over one sample does not "
                              "split into micro-batches")
                g.erase_node(per)
                continue
            class_index = ((node.target in _CE or node.target in _NLL or node.target in _NLL_FWD)
                           and not _val(node.args[1]).dtype.is_floating_point)
            term = LossTerm(node.name, "", shape, dtype, "class" if class_index else "elements",
                            count=_numel(shape))
            if class_index:
                term.ignore_index = int(_arg(node, 4, "ignore_index", -100))
                weight = _arg(node, 2, "weight")
                term.outputs = (len(den_outputs), len(den_outputs) + 1 if weight is not None else -1)
                den_outputs.append(node.args[1])
                if weight is not None:
                    den_outputs.append(weight)
            scale = new_scale(shape, dtype, per.meta["val"].device)
            term.scale = scale.name
            mul = call(aten.mul.Tensor, (per, scale), {}, node, node)
            out = call(aten.sum.default, (mul,), {}, node, node)
            if node.target in _NLL_FWD:
                for u in users:
                    u.replace_all_uses_with(out)
                    g.erase_node(u)
            else:
                node.replace_all_uses_with(out)
            g.erase_node(node)
            spec.terms.append(term)
        elif node.target in _MEAN:
            x = node.args[0]
            shape, dtype = tuple(_val(x).shape), node.meta["val"].dtype
            count = _numel(shape) // max(_numel(node.meta["val"].shape), 1)   # elements per mean
            scale = new_scale(shape, dtype, _val(x).device)
            spec.terms.append(LossTerm(node.name, scale.name, shape, dtype, "elements", count=count))
            mul = call(aten.mul.Tensor, (x, scale), {}, node, node)
            if node.target is aten.mean.dim:
                args = (mul,) + tuple(node.args[1:])
                out = call(aten.sum.dim_IntList, args, dict(node.kwargs), node, node)
            else:
                out = call(aten.sum.default, (mul,), dict(node.kwargs), node, node)
            node.replace_all_uses_with(out)
            g.erase_node(node)

    g.lint()
    cap.gm.recompile()
    cap.inputs = list(cap.inputs) + spec.scale_inputs
    out_node = next(n for n in g.nodes if n.op == "output")
    cap.loss = out_node.args[0][0].name
    cap.__post_init__()
    if den_outputs and not spec.error:
        _denominator_graph(cap, spec, den_outputs, model)
    return cap


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
