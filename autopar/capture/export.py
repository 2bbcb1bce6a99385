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

import itertools
import operator
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autopar.capture.cache import cached_capture
from autopar.capture.constants import inline_constants
from autopar.capture.experts import experts_as_ops
from autopar.capture.graph import CaptureError, Captured, _strip
from autopar.capture.hops import inline_higher_order_ops
from autopar.capture.inplace import functionalize_inplace, functionalize_view_writes
from autopar.capture.stamp import export_stamped
from autopar.errors import ArgumentError

_EXPORT_LOCK = threading.Lock()   # torch.export keeps global tracing state: one at a time

STACK_TRACE_SWITCH = hasattr(torch.fx.config, "do_not_emit_stack_traces")
"""Whether this torch can export without recording each node's Python stack
(``torch.fx.config.do_not_emit_stack_traces``: torch 2.13 and 2.15 have it, torch 2.11 does
not). Without it every export records the stacks: capture is slower, its graph the same, and
a refused graph's message names the source line from the first export. The one torch
version switch of capture (``tests/test_planning_shortcuts.py`` runs both branches)."""


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


from autopar.capture.causal_mask import causal_masks_to_flags  # noqa: E402
from autopar.capture.sequence_layout import balance_sequence, current_layout  # noqa: E402


def capture(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None,
            target: Any = None, stamp: bool = True) -> Captured:
    """Export ``model`` (and ``loss_fn(model(*example_inputs), target)``) to an ATen graph.
    A deep model is exported shallow and its repeated blocks stamped (``stamp.py``: the
    same graph, faster); ``stamp=False`` always exports it whole.

    >>> cap = capture(torch.nn.Linear(4, 2), (torch.randn(8, 4),))
    >>> [n.target for n in cap.gm.graph.nodes if n.op == "call_function"]
    [<OpOverload(op='aten.linear', overload='default')>]
    """
    example_inputs = check_arguments(model, example_inputs, loss_fn, target)
    args = example_inputs + ((_own_target(target, example_inputs),) if loss_fn is not None else ())
    wrapper = _WithLoss(model, loss_fn, len(example_inputs))
    c = current_layout()

    def fresh() -> Captured:
        with experts_as_ops(model):
            cap = _capture(model, example_inputs, loss_fn, target, stamp, args, wrapper)
        causal_masks_to_flags(cap)     # transformers' built causal masks: is_causal=True
        return balance_sequence(cap, c) if c else cap
    with experts_as_ops(model):   # the experts' templates registered, a cached graph's too
        pass
    return cached_capture(model, example_inputs, loss_fn, target, stamp, c, fresh)


def _own_target(target, example_inputs):
    """``target``, or a copy of it where it is one of ``example_inputs`` (a language model's
    tokens are its input and its target: ``hf_models.build``). Exported as one tensor
    passed twice, every read of it lands on the last placeholder, the target's: the model's
    embedding reads the target, so the whole model is the loss's tail (``analysis.stages``)
    and the full-batch graph has no pipeline cut (Mixtral 8x7B's chain 115 of its 2,673
    nodes, every cut crossing nothing); a copy gives each placeholder its own reads, as the
    micro-batch captures (``pipeline_search.split_batch``, which copies) always had."""
    if isinstance(target, torch.Tensor) and any(t is target for t in example_inputs):
        return target.clone()
    return target


def _capture(model, example_inputs, loss_fn, target, stamp, args, wrapper) -> Captured:
    errors = []
    for method in ("torch.export", "torch.fx.symbolic_trace + torch.export"):
        try:
            root = wrapper
            if method != "torch.export":
                traced = torch.fx.symbolic_trace(model)
                root = _WithLoss(traced, loss_fn, len(example_inputs))
            ep = ((stamp and method == "torch.export" and export_stamped(
                root, args, lambda r, a: _export(r, a, stack_traces=False)))
                or _export(root, args, stack_traces=False))
            try:
                return _from_program(ep, wrapper, len(example_inputs), loss_fn is not None, method)
            except CaptureError:  # say where in the source: again with the stack traces
                if not STACK_TRACE_SWITCH:
                    raise         # the first export recorded them already
                ep = _export(root, args, stack_traces=True)
                return _from_program(ep, wrapper, len(example_inputs), loss_fn is not None, method)
        except (CaptureError, ArgumentError):
            raise                 # export worked; the graph holds what autopar cannot plan
        except Exception as e:  # noqa: BLE001 - both causes are reported below
            errors.append((method, e))
    (m1, e1), (m2, e2) = errors
    _check_devices(model, args, e1)
    if loss_fn is not None:
        _check_loss_runs(model, example_inputs, loss_fn, target, e1)
    raise CaptureError(
        f"could not capture {type(model).__name__} as a graph.\n"
        f"  {m1}: {type(e1).__name__}: {_first_lines(e1)}\n"
        f"  {m2}: {type(e2).__name__}: {_first_lines(e2)}\n"
        "Fix: make the model's forward traceable — no Python branching on tensor values "
        "(use torch.where / torch.cond), no .item() / .tolist() / numpy calls on tensors, "
        "static shapes for the example inputs; HuggingFace models: pass use_cache=False."
    ) from e1


def _export(root: nn.Module, args: tuple, stack_traces: bool):
    """``torch.export.export(root, args, strict=False)``; ``stack_traces=False`` skips
    recording each node's Python stack (``torch.fx.config.do_not_emit_stack_traces``): about
    a tenth of a large model's capture, read only by the messages of a graph autopar refuses
    (``hops._where``), which :func:`capture` exports again with them."""
    with _EXPORT_LOCK:
        if not STACK_TRACE_SWITCH:       # torch 2.11: always with the stacks
            return torch.export.export(root, args, strict=False)
        before = torch.fx.config.do_not_emit_stack_traces
        torch.fx.config.do_not_emit_stack_traces = not stack_traces
        try:
            return torch.export.export(root, args, strict=False)
        finally:
            torch.fx.config.do_not_emit_stack_traces = before


def check_arguments(model, example_inputs, loss_fn, target) -> tuple:
    """``example_inputs`` as a tuple, after checking the arguments every planning call takes
    (``autopar.plan``, ``autopar.parallelize``, ``autopar.coverage``): an ArgumentError
    names the argument and the fix."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"model is a {type(model).__name__}, not a torch.nn.Module: pass the "
                            "module (wrap a function in an nn.Module whose forward calls it)")
    if isinstance(example_inputs, torch.Tensor):
        raise ArgumentError(f"example_inputs is one tensor of shape {list(example_inputs.shape)}; "
                            "pass a tuple of the model's positional inputs: (x,)")
    if not isinstance(example_inputs, (tuple, list)):
        raise ArgumentError(f"example_inputs is a {type(example_inputs).__name__}; pass a tuple of "
                            "the model's positional inputs, e.g. (x,) or (input_ids, mask)")
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise ArgumentError(
                f"example_inputs[{i}] is a {type(t).__name__}: autopar plans and runs models whose "
                "positional inputs are tensors; pass each tensor as its own input (wrap the model: "
                "a module whose forward(x, a, b) calls model(x, (a, b)) or model(x, k=3))")
    if loss_fn is not None and not callable(loss_fn):
        raise ArgumentError(f"loss_fn is a {type(loss_fn).__name__}, not a function: pass "
                            "loss_fn(output, target) -> scalar (e.g. F.cross_entropy), or None")
    if loss_fn is not None and target is None:
        raise ArgumentError("loss_fn was given without a target: pass target= (an example "
                            "target batch) so the loss can be captured with the model")
    if loss_fn is None and target is not None:
        raise ArgumentError("target= was given without loss_fn: pass loss_fn= (the loss of the "
                            "model's output and the target), or drop target= (a model that "
                            "returns its own loss takes its labels among example_inputs)")
    return tuple(example_inputs)


def _check_devices(model: nn.Module, args: tuple, error: BaseException) -> None:
    """Export failed: if the model and the example tensors are on different devices (a
    model on meta with inputs on the CPU), say so instead of a capture problem."""
    devices = {t.device.type for t in itertools.chain(model.parameters(), model.buffers())}
    given = {t.device.type for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
    if len(devices | given) > 1 and devices:
        raise ArgumentError(
            f"the model is on {sorted(devices)} but example_inputs / target are on {sorted(given)} "
            f"({type(error).__name__}): put them on one device; for a model on the meta device, "
            "make the example tensors on meta too (torch.empty(shape, dtype=..., device='meta'): "
            "planning reads only shapes)") from error


def _describe(value) -> str:
    shapes = [f"Tensor{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
              for t in pytree.tree_leaves(value)]
    return shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes[:6]) + ")"


def check_loss_outside(cap: Captured, loss_fn: Callable) -> None:
    """A ``loss_fn`` that runs outside the graph (no example target: it is called on the
    replicated output at each step), tried now on meta tensors of the model's output, so a
    loss that is not a scalar is reported when planning, not at the first step. One that
    needs a real target (``loss_fn(out, None)`` raises) is not judged here."""
    def meta(name):
        v = cap.node(name).meta.get("val")
        return torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") \
            if isinstance(v, torch.Tensor) else v
    try:
        out = pytree.tree_unflatten([meta(n) for n in cap.output], cap.model_output_spec)
        with torch.no_grad():
            got = loss_fn(out, None)
    except Exception:  # noqa: BLE001 - it needs the step's target: checked at the first step
        return
    if not (isinstance(got, torch.Tensor) and got.ndim == 0 and got.is_floating_point()):
        raise ArgumentError(f"loss_fn returned {_describe(got)}, not a scalar: return one "
                            "number of floating dtype, e.g. reduce with .mean() or .sum() (a "
                            "reduction='none' loss cannot be trained as it is)")


def _check_loss_runs(model, example_inputs: tuple, loss_fn, target, error: BaseException) -> None:
    """Export of the model with its loss failed: if the model alone exports, the loss is
    what failed, and the error names loss_fn, target and the model's output."""
    try:
        with _EXPORT_LOCK:
            ep = torch.export.export(_WithLoss(model, None, len(example_inputs)), example_inputs,
                                     strict=False)
        out = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
        out_vals = [o.meta.get("val") for o in out[len(out) // 2:] if isinstance(o, torch.fx.Node)]
    except Exception:  # noqa: BLE001 - the model fails too: the error below says so
        return
    raise CaptureError(
        f"loss_fn(output, target) failed: {type(error).__name__}: {_first_lines(error)}\n"
        f"  the model's output is {_describe(out_vals)}, target is {_describe(target)}.\n"
        "Fix: pass a target= that loss_fn accepts with this output (the example target of the "
        "same batch as example_inputs), or a loss_fn that takes (output, target).") from error


def _first_lines(e: BaseException, n: int = 3) -> str:
    return " | ".join(str(e).strip().splitlines()[:n])[:400]


def _from_program(ep, wrapper: nn.Module, n_inputs: int, has_loss: bool, method: str) -> Captured:
    sig = ep.graph_signature
    gm = ep.graph_module
    inline_higher_order_ops(gm, sig.inputs_to_parameters)   # grad-mode, autocast-off regions
    functionalize_view_writes(gm)                           # y[:, 1:] = x -> slice_scatter
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
    n_first = ep.call_spec.out_spec.child(0).num_leaves
    _outputs_before_broadcast(gm, out_node, n_first)
    outs = list(out_node.args[0])
    loss_node, model_outs = outs[0], outs[n_first:]
    loss_val = loss_node.meta.get("val") if isinstance(loss_node, torch.fx.Node) else None
    is_scalar = isinstance(loss_val, torch.Tensor) and loss_val.ndim == 0 and loss_val.is_floating_point()
    if has_loss and not is_scalar:
        raise ArgumentError(f"loss_fn returned {_describe(loss_val)}, not a scalar: return one "
                            "number of floating dtype, e.g. reduce with .mean() or .sum() (a "
                            "reduction='none' loss cannot be trained as it is)")
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


def _outputs_before_broadcast(gm: torch.fx.GraphModule, out_node, n_first: int) -> None:
    """A model output export returns as the loss's broadcast of it with the target
    (``mse_loss``: ``broadcast_tensors([out, target])[0]``, the same values when the shapes
    already agree) is returned as the output itself, so the forward program does not read
    the target."""
    outs = list(out_node.args[0])
    for k in range(n_first, len(outs)):
        o = outs[k]
        if not (isinstance(o, torch.fx.Node) and o.target is operator.getitem):
            continue
        base, i = o.args
        if not (isinstance(base, torch.fx.Node) and base.target is torch.ops.aten.broadcast_tensors.default):
            continue
        src = base.args[0][i]
        if isinstance(src, torch.fx.Node) and tuple(src.meta["val"].shape) == tuple(o.meta["val"].shape):
            outs[k] = src
    out_node.args = (tuple(outs),)
