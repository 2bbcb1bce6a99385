"""Which reductions of a captured loss sum over the batch, so that the loss can be split
into micro-batch terms (``autopar.analysis.microbatch_loss``).

Values from the batch are ``B``, from parameters and constants only ``C``; a reduction over
the batch dim of a ``B`` value (a loss op with ``mean`` / ``sum``, a ``sum`` / ``mean`` over
dim 0 or over every element, a ``histc`` / ``bincount`` count) is ``P``, partial over
micro-batches. ``P`` stays ``P``
through linear ops (``P ± P``, ``P * C``, ``P / C``, views, casts, sums and means); read any
other way it is a per-micro-batch value again: ``B`` where a per-sample value takes part
(``x - x.mean()`` inside a model is a batch statistic, per micro-batch as BatchNorm's), ``S``
where only sums over the batch do (a statistic of the whole batch with no per-sample dim
left: a mixture of experts' load-balancing loss, the product of two batch means). An ``S``
stays ``S`` through anything, reductions included (its dim 0 is no batch), so a loss that
adds one is no sum over the batch. :func:`analyse` labels every node and walks back from
the loss to the batch reductions it is a linear function of.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten


def _ops(*names: str) -> set:
    out = set()
    for n in names:
        packet = getattr(aten, n, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            out.add(getattr(packet, ov))
    return out


CE = _ops("cross_entropy_loss")
NLL = _ops("nll_loss_nd", "nll_loss", "nll_loss2d")
NLL_FWD = _ops("nll_loss_forward", "nll_loss2d_forward")
# reduction's position in the schema
POINTWISE = {op: pos for pos, names in ((2, ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                                              "kl_div", "soft_margin_loss")),
                                         (3, ("binary_cross_entropy",)),
                                         (4, ("binary_cross_entropy_with_logits",)))
              for op in _ops(*names)}
MEAN = {aten.mean.default, aten.mean.dim}
# counts over every element (a router's tokens per expert): sums over the batch too
HIST = _ops("histc", "bincount")
SUM = {aten.sum.default, aten.sum.dim_IntList}
# ops through which a partial (over micro-batches) value stays partial with any other
# argument a non-tensor
LINEAR_UNARY = _ops("neg", "clone", "alias", "view", "reshape", "_unsafe_view", "squeeze",
                     "unsqueeze", "expand", "to", "_to_copy", "detach", "contiguous",
                     "select", "slice", "permute", "t", "transpose", "flatten", "lift_fresh_copy")
ADD = _ops("add", "sub")
MUL = _ops("mul")
DIV = _ops("div")


@dataclass
class Linearity:
    """What :func:`analyse` found."""
    state: dict                      # node -> "C", "B" or "P"
    origins: list                    # the batch reductions the loss is linear in, graph order
    consts: list                     # (add / sub node, arg index) of constant terms
    lost: fx.Node | None             # where a partial sum stopped being one, on the way


def arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def set_arg(node: fx.Node, pos: int, name: str, value) -> tuple[tuple, dict]:
    args, kwargs = list(node.args), dict(node.kwargs)
    if len(args) > pos:
        args[pos] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def reduction_pos(node: fx.Node) -> tuple[int, str] | None:
    if node.target in CE or node.target in NLL or node.target in NLL_FWD:
        return 3, "reduction"
    if node.target in POINTWISE:
        return POINTWISE[node.target], "reduction"
    return None


def val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def fake_value(node_target, args, kwargs, fake_mode):
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    with fake_mode:
        return node_target(*vals[0], **vals[1])


def _full_reduction(node: fx.Node) -> bool:
    """A sum / mean over every element of its input."""
    if node.target in (aten.sum.default, aten.mean.default):
        return True
    x = node.args[0]
    dims = arg(node, 1, "dim")
    nd = val(x).ndim
    if dims is None or dims == [] or dims == ():
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % max(nd, 1) for d in dims) == list(range(nd))


def _reduces_dim0(node: fx.Node) -> bool:
    dims = arg(node, 1, "dim")
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    nd = max(val(node.args[0]).ndim, 1)
    return any(d % nd == 0 for d in dims)


def _covers_dim0(node: fx.Node) -> bool:
    """A sum / mean that reduces dim 0 of its (non-scalar) input."""
    if val(node.args[0]).ndim == 0:
        return False
    return _full_reduction(node) or _reduces_dim0(node)


def _label(inputs: set[str], g: fx.Graph) -> tuple[dict, list]:
    """Every node's state, and the nodes where a ``P`` was read non-linearly (demoted)."""
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
        red = reduction_pos(n)
        if "P" not in kinds:
            if "S" in kinds and "B" not in kinds:
                st[n] = "S"
            elif "B" not in kinds and "S" not in kinds:
                st[n] = "C"
            elif red is not None and arg(n, red[0], red[1], 1) in (1, 2):
                st[n] = "P"              # a loss reduced over its elements
            elif ((t in SUM or t in MEAN) and _covers_dim0(n)) or t in HIST:
                st[n] = "P"
            else:
                st[n] = "B"
            continue
        if t in SUM or t in MEAN or t in LINEAR_UNARY or t is operator.getitem:
            ok = len(tensors) == 1
        elif t in MUL:
            ok = kinds.count("P") == 1 and "B" not in kinds and "S" not in kinds
        elif t in DIV:
            ok = kinds[0] == "P" and all(k == "C" for k in kinds[1:])
        elif t in ADD:
            ok = "B" not in kinds and "S" not in kinds
        else:
            ok = False
        st[n] = "P" if ok else "B" if "B" in kinds else "S"
        if not ok:
            demoted.append(n)
    return st, demoted


def analyse(cap, g: fx.Graph) -> "Linearity":
    """The state of every node, the batch reductions, the (add/sub node, arg index) of
    constant terms of the partial loss, the node where the partial loss stopped being one.

    States: ``C`` (no batch), ``B`` (per micro-batch values), ``P`` (a sum over the batch,
    partial over micro-batches), ``S`` (a function of batch sums, per micro-batch). A ``P`` read non-linearly (``x - x.mean()`` inside the model,
    ``exp(loss)``) is a per-micro-batch value again (``B``), as batch statistics are."""
    st, demoted = _label(set(cap.inputs), g)
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
        if n.target in ADD:
            consts += [(n, i) for i, a in enumerate(n.args[:2])
                       if (isinstance(a, fx.Node) and st.get(a, "C") == "C")
                       or (isinstance(a, (int, float)) and not isinstance(a, bool))]
        stack.extend(ins)
    return Linearity(st, [n for n in g.nodes if n in set(origins)], consts, lost)
