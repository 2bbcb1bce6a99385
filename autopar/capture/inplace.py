"""In-place ATen ops in an exported graph, made out-of-place where that changes nothing.

``torch.export``'s training IR is not functionalized: ``hidden += residual`` (ResNet, T5,
Falcon, ...) stays ``aten.add_.Tensor(hidden, residual)``, and later readers of the value
read that node. autopar's sharding rules describe functional ops: an in-place op has none,
so it runs replicated (every such node gathers its input), and under a placement that hands
it a slice of a replicated tensor it would write into the tensor the slice views.

:func:`functionalize_inplace` turns ``op_(x, ...)`` into ``op(x, ...)`` when that is exact:

- ``x`` is the fresh result of an op that returns new memory (not a view, not an input of the
  graph — a parameter, buffer or user input — whose mutation the caller would see);
- no view of ``x`` is taken before the write (the view would see it; a view taken after
  reads the new node);
- the out-of-place op gives the same dtype (every tensor operand has ``x``'s dtype, and no
  float scalar meets an integer ``x``).

Readers of ``x`` placed after the in-place node then read the new node (in eager they would
see the written tensor). Anything else stays in place and runs replicated, as before.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

__all__ = ["functionalize_inplace", "functionalize_view_writes"]

aten = torch.ops.aten


def _schema(node: Node):
    t = node.target
    return t._schema if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) else None


def _functional_twin(node: Node):
    """``aten.add.Tensor`` for ``aten.add_.Tensor``; None for anything that is not an
    in-place op writing its first argument, or has no out-of-place twin."""
    s = _schema(node)
    if s is None or not s.arguments or not s.returns:
        return None
    a0 = s.arguments[0].alias_info
    if a0 is None or not a0.is_write or s.arguments[0].kwarg_only:
        return None
    packet = node.target.overloadpacket.__name__
    if not packet.endswith("_") or packet.startswith("_"):
        return None
    twin = getattr(getattr(aten, packet[:-1], None), node.target._overloadname, None)
    ts = getattr(twin, "_schema", None)
    if ts is None or (twin is not aten.detach.default   # detach_ -> detach: same value
                      and any(a.alias_info is not None for a in ts.arguments)):
        return None
    return twin


def _returns_alias(node: Node) -> bool:
    """The node's result may share memory with an input (a view, or an in-place result)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return _returns_alias(node.args[0])
    s = _schema(node)
    if s is None:
        return True                      # placeholders, get_attr, unknown callables
    return any(r.alias_info is not None for r in s.returns)


def _takes_view(user: Node, x: Node) -> bool:
    """``user`` may return a view of (or write into) ``x``."""
    s = _schema(user)
    if s is None:
        return user.op != "output" and not (
            user.op == "call_function" and user.target is operator.getitem)
    return any(r.alias_info is not None for r in s.returns) or any(
        a.alias_info is not None and a.alias_info.is_write for a in s.arguments)


_INDEX_ARGS = frozenset({"index", "indices", "mask"})   # read as positions, not promoted


def _same_dtype(node: Node, x: Node) -> bool:
    xv = x.meta.get("val")
    if not isinstance(xv, torch.Tensor):
        return False
    names = [arg.name for arg in node.target._schema.arguments]
    operands = [a for i, a in enumerate(node.args[1:], 1) if names[i] not in _INDEX_ARGS]
    for a in operands + [v for k, v in node.kwargs.items() if k not in _INDEX_ARGS]:
        if isinstance(a, Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype != xv.dtype and v.ndim > 0:
                return False
            if isinstance(v, torch.Tensor) and v.ndim == 0 and (
                    v.dtype.is_floating_point and not xv.dtype.is_floating_point):
                return False
        elif isinstance(a, float) and not xv.dtype.is_floating_point:
            return False
    return True


def functionalize_inplace(gm: GraphModule) -> list[str]:
    """Rewrite the in-place ops of ``gm`` that can be made out-of-place exactly (in place on
    ``gm``); returns the names of the nodes rewritten."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = []
    for node in list(graph.nodes):
        twin = _functional_twin(node)
        if twin is None:
            continue
        x = node.args[0]
        if not isinstance(x, Node) or _returns_alias(x) or not _same_dtype(node, x):
            continue
        others = [u for u in x.users if u is not node]
        if any(_takes_view(u, x) for u in others if order[u] < order[node]):
            continue         # a view taken before the write would see it
        node.target = twin
        for u in others:
            if order[u] > order[node]:
                u.replace_input_with(x, node)
        done.append(node.name)
    if done:
        graph.lint()
        gm.recompile()
    return done


# a view of its first argument -> the functional op that writes a value into that view
_SCATTER_OF_VIEW = {aten.slice.Tensor: aten.slice_scatter.default,
                    aten.select.int: aten.select_scatter.default}
_WRITES = (aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor)


def functionalize_view_writes(gm: GraphModule) -> list[str]:
    """Rewrite writes into views of a fresh tensor as functional scatters (in place on
    ``gm``); returns the names of the write nodes replaced.

    ``y = x.new_zeros(x.shape); y[:, 1:] = x[:, :-1]; y[:, 0] = start`` (T5's and BART's
    ``shift_tokens_right`` for ``labels=``) is exported as ``copy_(slice(y), ...)`` and
    ``fill_(select(y), ...)``: nodes without users that change ``y`` through a view. A
    per-rank program keeps the nodes its outputs read, so such a write was dropped and the
    model read zeros (a wrong loss, silently, on any number of ranks). Here each becomes
    ``y' = slice_scatter(y, value, ...)`` (``select_scatter``; nested views scatter level by
    level), and the readers of ``y`` after the write read ``y'``. Only for a fresh ``y``
    (not an input of the graph, whose mutation the caller would see) and views read by
    nothing else; any other write stays as it was."""
    graph = gm.graph
    done = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _WRITES or node.users:
            continue
        chain, v = [], node.args[0]
        while isinstance(v, Node) and v.op == "call_function" and v.target in _SCATTER_OF_VIEW \
                and len(v.users) == 1:
            chain.append(v)
            v = v.args[0]
        base = v
        if not chain or not isinstance(base, Node) or _returns_alias(base):
            continue
        view = chain[0]
        shape, dtype = view.meta["val"].shape, view.meta["val"].dtype
        with graph.inserting_before(node):
            if node.target is aten.fill_.Scalar:
                value = graph.call_function(aten.full_like.default, (view, node.args[1]))
                _like(value, view, node)     # the view's shape: torch 2.15 reaches this branch
            else:
                value = node.args[1]
                src = value.meta.get("val") if isinstance(value, Node) else None
                if not isinstance(src, torch.Tensor):
                    continue
                if src.dtype != dtype:        # copy_ converts: so does the functional write
                    value = graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
                    _like(value, node.args[1], node, dtype)
                if tuple(src.shape) != tuple(shape):     # copy_ broadcasts
                    value = graph.call_function(aten.expand.default, (value, list(shape)))
                    _like(value, view, node)
            for level in chain:              # innermost view first, out to the base
                parent = level.args[0]
                value = graph.call_function(_SCATTER_OF_VIEW[level.target],
                                            (parent, value, *level.args[1:]))
                _like(value, parent, node)
        after, n = [], node.next
        while n.op != "root":
            after.append(n)
            n = n.next
        for reader in after:
            reader.replace_input_with(base, value)
        graph.erase_node(node)
        done.append(node.name)
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return done


def _like(new: Node, shaped: Node, origin: Node, dtype: torch.dtype | None = None) -> None:
    """``new`` has ``shaped``'s shape and dtype (or ``dtype``), and the write ``origin``'s
    place in the model."""
    new.meta.update({k: v for k, v in origin.meta.items() if k != "val"})
    val = shaped.meta["val"]
    if dtype is not None and val.dtype != dtype:
        with val.fake_mode:
            val = val.to(dtype)
    new.meta["val"] = val
