"""Capture a model (plus its loss) as one torch.fx graph of ATen ops with shapes.

``torch.export.export(strict=False)`` gives the training IR: high-level ATen ops
(``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``, ...) with a
FakeTensor in ``node.meta["val"]`` on every node, so nothing is allocated and a model on the
meta device captures as fast as a real one. Where export fails we try once more on a
``torch.fx.symbolic_trace`` of the model; if that fails too the error says why and how to
fix it.

The loss is part of the graph: we export ``loss_fn(model(*inputs), target)``, so the solver
shards the loss like any other op, and the forward-only module is the same graph cut at the
model's output.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autopar.capture.constants import inline_constants
from autopar.capture.graph import CaptureError, Captured, _strip
from autopar.capture.hops import inline_higher_order_ops
from autopar.capture.inplace import functionalize_inplace

_EXPORT_LOCK = threading.Lock()   # torch.export keeps global tracing state: one at a time


class _WithLoss(nn.Module):
    """``forward(*inputs, target) -> (loss, output)``; or ``(output, output)`` without a loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, n_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args):
        inputs, rest = args[: self.n_inputs], args[self.n_inputs:]
        out = self.model(*inputs)
        if self.loss_fn is None:
            return out, out
        return self.loss_fn(out, *rest), out


def capture(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None,
            target: Any = None) -> Captured:
    """Export ``model`` (and ``loss_fn(model(*example_inputs), target)``) to an ATen graph.

    >>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(8, 4),))
    >>> [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    [<OpOverload(op='aten.linear', overload='default')>]
    """
    example_inputs = tuple(example_inputs)
    if loss_fn is not None and target is None:
        raise ValueError("loss_fn was given without a target: pass target= (an example "
                         "target batch) so the loss can be captured with the model")
    args = example_inputs + ((target,) if loss_fn is not None else ())
    wrapper = _WithLoss(model, loss_fn, len(example_inputs))
    errors = []
    for method in ("torch.export", "torch.fx.symbolic_trace + torch.export"):
        try:
            root = wrapper
            if method != "torch.export":
                traced = torch.fx.symbolic_trace(model)
                root = _WithLoss(traced, loss_fn, len(example_inputs))
            with _EXPORT_LOCK:
                ep = torch.export.export(root, args, strict=False)
            return _from_program(ep, wrapper, len(example_inputs), loss_fn is not None, method)
        except CaptureError:
            raise                 # export worked; the graph holds what autopar cannot plan
        except Exception as e:  # noqa: BLE001 - both causes are reported below
            errors.append((method, e))
    (m1, e1), (m2, e2) = errors
    raise CaptureError(
        f"could not capture {type(model).__name__} as a graph.\n"
        f"  {m1}: {type(e1).__name__}: {_first_lines(e1)}\n"
        f"  {m2}: {type(e2).__name__}: {_first_lines(e2)}\n"
        "Fix: make the model's forward traceable — no Python branching on tensor values "
        "(use torch.where / torch.cond), no .item() / .tolist() / numpy calls on tensors, "
        "static shapes for the example inputs; HuggingFace models: pass use_cache=False."
    ) from e1


def _first_lines(e: BaseException, n: int = 3) -> str:
    return " | ".join(str(e).strip().splitlines()[:n])[:400]


def _from_program(ep, wrapper: nn.Module, n_inputs: int, has_loss: bool, method: str) -> Captured:
    sig = ep.graph_signature
    gm = ep.graph_module
    inline_higher_order_ops(gm, sig.inputs_to_parameters)   # grad-mode, autocast-off regions
    functionalize_inplace(gm)                               # x += y -> x + y where exact
    inline_constants(gm, sig.inputs_to_lifted_tensor_constants, ep.constants)  # torch.tensor(...) in forward
    # Aliases: torch.export keeps one placeholder per tensor; name every parameter that is it.
    by_id: dict[int, list[str]] = {}
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(_strip(name))
    state = dict(wrapper.named_parameters(remove_duplicate=False))
    params = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    used: dict[int, str] = {}
    for ph, target in sig.inputs_to_parameters.items():
        if nodes[ph].users:
            used.setdefault(id(state.get(target)), ph)
    for ph, target in sig.inputs_to_parameters.items():
        key = id(state.get(target))
        if not nodes[ph].users and key in used:
            gm.graph.erase_node(nodes[ph])   # a tied weight exported twice: keep the used one
            continue
        params[ph] = by_id.get(key, [_strip(target)])
    buffers = {ph: _strip(t) for ph, t in sig.inputs_to_buffers.items()}
    user_inputs = list(sig.user_inputs)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    n_first = ep.call_spec.out_spec.child(0).num_leaves
    loss_node, model_outs = outs[0], outs[n_first:]
    loss_val = loss_node.meta.get("val") if isinstance(loss_node, torch.fx.Node) else None
    is_scalar = isinstance(loss_val, torch.Tensor) and loss_val.ndim == 0 and loss_val.is_floating_point()
    for n in gm.graph.nodes:
        if n.op != "output" and "val" not in n.meta:
            raise CaptureError(f"node {n.name} ({n.target}) has no shape information after export")
    cap = Captured(
        gm=gm, params=params, buffers=buffers, inputs=user_inputs, n_model_inputs=n_inputs,
        loss=loss_node.name if (has_loss or is_scalar) else "",
        output=[o.name for o in model_outs if isinstance(o, torch.fx.Node)],
        output_spec=ep.call_spec.out_spec, has_loss=has_loss or is_scalar,
        takes_target=has_loss, method=method)
    return cap
