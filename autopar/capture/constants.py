"""Tensor constants made inside forward, as factory ops of the graph.

``torch.export`` lifts a tensor created in forward from Python data (``torch.tensor([-2])``,
or the index list of ``qkv[:, :, :, [-2]]`` in Falcon's attention) to an extra input of the
graph, a *lifted tensor constant* (``graph_signature.inputs_to_lifted_tensor_constants``,
values in ``ExportedProgram.constants``). autopar's graph has parameters, buffers and the
user's inputs as placeholders, nothing else: a constant placeholder would be taken for a
batch input. :func:`inline_constants` replaces each one by the factory op that makes it,
placed before its first reader, with the same FakeTensor ``val``:

- all elements equal: ``aten.full(shape, value, dtype=...)``;
- a 1-D arithmetic progression (``[0, 1, 2]``, ``[4, 2, 0]``): ``aten.arange(start, end, step)``.

Factory ops run replicated on every rank (and cost nothing to slice). Any other constant is
refused with a CaptureError that names it and says how to make it a buffer instead.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.capture.graph import CaptureError

__all__ = ["inline_constants"]

aten = torch.ops.aten



def _factory(value: torch.Tensor):
    """(op, args, kwargs) of a factory call that makes ``value``; None if there is none."""
    flat = value.detach().flatten()
    kw = {"dtype": value.dtype, "device": value.device}
    if flat.numel() == 0:
        return None
    first = flat[0].item()
    if bool((flat == flat[0]).all()):
        return aten.full.default, (list(value.shape), first), kw
    if value.ndim == 1 and not value.dtype.is_floating_point and value.dtype != torch.bool:
        step = int(flat[1] - flat[0])
        if step != 0 and bool((flat.diff() == step).all()):
            return aten.arange.start_step, (int(first), int(flat[-1]) + step, step), kw
    return None


def inline_constants(gm: GraphModule, constants: dict[str, str], values: dict) -> list[str]:
    """Replace the lifted tensor constants of ``gm`` (``constants``: placeholder -> constant
    name, ``values``: constant name -> tensor, as ``ExportedProgram`` gives them) by factory
    ops. Returns the placeholders replaced; raises CaptureError for one it cannot make."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = []
    for ph, name in constants.items():
        node = nodes.get(ph)
        value = values.get(name)
        if node is None or not isinstance(value, torch.Tensor):
            continue
        made = _factory(value)
        if made is None:
            shown = str(value.tolist())[:80]
            raise CaptureError(
                f"forward creates the tensor constant {name} = {shown} (shape "
                f"{list(value.shape)}, {value.dtype}); torch.export makes it an extra graph "
                f"input that autopar cannot tell from a batch.\nFix: create it once in "
                f"__init__ with self.register_buffer('...', torch.tensor(...), "
                f"persistent=False) and read the buffer in forward.")
        op, args, kwargs = made
        if not node.users:
            graph.erase_node(node)
            continue
        first = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first):
            new = graph.call_function(op, args, kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
        new.meta.update({k: v for k, v in first.meta.items()
                         if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done.append(ph)
    if done:
        graph.lint()
        gm.recompile()
    return done
