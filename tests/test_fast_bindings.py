"""passes/fast_bindings.py: the runtime program calls ATen ops through torch's Python
bindings. Every entry of its table is checked against its overload on sample inputs (the
ops dispatched, forward and backward; values; gradients; the name the generated code calls),
a wrong entry is caught, and a GPT's program with the bindings gives the very loss and
gradients of the same program with the overloads (fp32 and under bf16 autocast)."""
from __future__ import annotations

import pytest
import torch
from torch.fx.node import _get_qualified_name
from torch.utils._python_dispatch import TorchDispatchMode

import autopar.runtime.program_passes as program_passes
from autopar.api import plan_captured
from autopar.cost_models.hardware import parse_cluster
from autopar.passes.fast_bindings import BINDINGS, full_arguments
from autopar.runtime.thread_ranks import simulate

aten = torch.ops.aten


def _t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


X, W, B = _t(4, 8), _t(6, 8, seed=1), _t(6, seed=2)
Q, K, V = _t(2, 2, 5, 4), _t(2, 2, 5, 4, seed=1), _t(2, 2, 5, 4, seed=2)
WITH_ZERO = torch.tensor([[-1.0, 0.0, 2.0], [0.5, -0.0, -3.0]])
TOKENS = torch.tensor([[1, 3, 0], [5, 2, 3]])
LABELS = torch.tensor([0, 5, -100, 2])

# op -> sample calls (args, kwargs): defaults left out as the captured graph leaves them,
# and given where a binding could read them differently
SAMPLES = {
    aten.linear.default: [((X, W, B), {}), ((X, W), {})],
    aten.mm.default: [((X, W.t()), {})],
    aten.addmm.default: [((B, X, W.t()), {}), ((B, X, W.t()), {"beta": 0.5, "alpha": 2.0})],
    aten.bmm.default: [((Q[0], K[0].transpose(1, 2)), {})],
    aten.matmul.default: [((Q, K.transpose(-1, -2)), {}), ((X, W.t()), {})],
    aten.embedding.default: [((W, TOKENS), {}), ((W, TOKENS, 3), {})],
    aten.layer_norm.default: [((X, [8], X[0], X[1], 1e-5, False), {}), ((X, [8]), {})],
    aten.scaled_dot_product_attention.default: [((Q, K, V, None, 0.0, True), {}), ((Q, K, V), {}),
                                                ((Q, K, V), {"scale": 0.3})],
    aten.cross_entropy_loss.default: [((_t(4, 6), LABELS), {}),
                                      ((_t(4, 6), LABELS, None, 2, -100, 0.1), {})],
    aten.softmax.int: [((X, -1), {}), ((X, 0, torch.float64), {})],
    aten.dropout.default: [((X, 0.5, True), {}), ((X, 0.5, False), {})],
    aten.add.Tensor: [((X, X[0]), {}), ((X, 2.0), {}), ((X, X), {"alpha": 3})],
    aten.sub.Tensor: [((X, X[1]), {}), ((X, 1.5), {"alpha": 2})],
    aten.mul.Tensor: [((X, X[2]), {}), ((X, 0.5), {})],
    aten.div.Tensor: [((X, X[3].abs() + 1), {}), ((X, 4.0), {})],
    aten.neg.default: [((X,), {})],
    aten.rsqrt.default: [((X.abs() + 0.5,), {})],
    aten.exp.default: [((X,), {})],
    aten.tanh.default: [((X,), {})],
    aten.sigmoid.default: [((X,), {})],
    aten.relu.default: [((WITH_ZERO,), {})],
    aten.gelu.default: [((X,), {}), ((X,), {"approximate": "tanh"})],
    aten.silu.default: [((X,), {})],
    aten.mean.dim: [((X, [-1]), {}), ((X, [0], True), {}), ((X, [1]), {"dtype": torch.float64})],
    aten.sum.dim_IntList: [((X, [1]), {}), ((X, [0, 1], True), {})],
    aten.view.default: [((X, [2, 16]), {})],
    aten.reshape.default: [((X, [8, 4]), {}), ((X.t(), [32]), {})],
    aten.transpose.int: [((Q, 1, 2), {})],
    aten.t.default: [((X,), {})],
    aten.permute.default: [((Q, [0, 2, 1, 3]), {})],
    aten.unsqueeze.default: [((X, 1), {})],
    aten.select.int: [((X, 1, 3), {})],
    aten.split.Tensor: [((X, 3, 1), {}), ((X, 2), {})],
    aten.cat.default: [(([X, X[:2]],), {}), (([X, X], 1), {})],
    aten.clone.default: [((X,), {}), ((X,), {"memory_format": torch.contiguous_format})],
    aten.arange.start: [((0, 5), {}), ((2, 7), {"dtype": torch.int64, "device": torch.device("cpu"),
                                                   "pin_memory": False})],
}


class _Dispatched(TorchDispatchMode):
    """The ATen ops dispatched (forward and backward), with their arguments' dtypes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), dtypes))
        return func(*args, **(kwargs or {}))


def _run(fn, args, kwargs):
    """(ops dispatched, outputs, gradients of the float tensor inputs) of ``fn``, from fresh
    leaf copies of the inputs, the same random state, a fixed random cotangent."""
    def leaf(a):
        if isinstance(a, torch.Tensor):
            return a.detach().clone().requires_grad_(a.is_floating_point())
        return [leaf(x) for x in a] if isinstance(a, list) else a
    args = tuple(leaf(a) for a in args)
    leaves = [t for a in args for t in (a if isinstance(a, list) else [a])
              if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.default_generator.manual_seed(0)      # (dropout) the same random state
    with _Dispatched() as mode:
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])]
        diff = [o for o in outs if o.requires_grad]
        if diff:
            cot = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=o.dtype)
                   for i, o in enumerate(diff)]
            torch.autograd.backward(diff, cot)
    return mode.ops, [o.detach() for o in outs], [t.grad for t in leaves]


def check(op, binding, args, kwargs) -> list[str]:
    """How calling ``binding`` as the pass does differs from calling ``op``; [] if not."""
    problems = []
    try:
        if eval(_get_qualified_name(binding), {"torch": torch}) is not binding:
            problems.append(f"the generated code's {_get_qualified_name(binding)} is not the binding")
    except Exception as e:       # noqa: BLE001 (any failure to name it is a problem)
        problems.append(f"the binding has no name the generated code can call: {e}")
    full = full_arguments(op, args, kwargs)
    if full is None:
        return problems + ["the arguments do not fit the schema"]
    want = _run(op, args, kwargs)
    try:
        got = _run(binding, *full)
    except Exception as e:       # noqa: BLE001
        return problems + [f"the binding fails: {type(e).__name__}: {e}"]
    if got[0] != want[0]:
        problems.append(f"dispatches {got[0]}, the overload {want[0]}")
    for what, a, b in (("outputs", got[1], want[1]), ("gradients", got[2], want[2])):
        same = len(a) == len(b) and all(
            (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                         and x.shape == y.shape and torch.equal(x, y))
            for x, y in zip(a, b))
        if not same:
            problems.append(f"{what} differ")
    return problems


def test_every_binding_calls_its_overload():
    assert set(SAMPLES) == set(BINDINGS), "every entry needs sample calls (and only entries)"
    bad = {f"{op} {i}": p for op, calls in SAMPLES.items() for i, (a, k) in enumerate(calls)
           if (p := check(op, BINDINGS[op], a, k))}
    assert not bad, bad


def test_a_wrong_binding_is_caught():
    assert {"outputs differ", "gradients differ"} <= set(check(aten.tanh.default, torch.sigmoid, (X,), {}))
    # the same values through another op: caught by the ops dispatched
    nansum = check(aten.sum.dim_IntList, torch.nansum, (X, [1]), {})
    assert [p.split(" ")[0] for p in nansum] == ["dispatches"], nansum
    # a binding whose name in the generated code is another function (torch.functional.split)
    assert any("generated code" in p
               for p in check(aten.split.Tensor, torch._C._VariableFunctions.split, (X, 3, 1), {}))
    # a binding's own default differs from the schema's: the pass passes every argument
    logits, labels = SAMPLES[aten.cross_entropy_loss.default][0][0]
    assert torch._C._nn.cross_entropy_loss(logits, labels).shape == (4,)     # reduction "none"
    assert aten.cross_entropy_loss.default(logits, labels).shape == ()       # "mean"
    assert full_arguments(aten.cross_entropy_loss.default, (logits, labels), {})[0][3] == 1
    # positional parameters given by name, unknown names: left to the overload
    assert full_arguments(aten.linear.default, (X,), {"weight": W}) is None
    assert full_arguments(aten.gelu.default, (X,), {"approx": "tanh"}) is None


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_gpt_program_with_bindings_equals_overloads(captured, monkeypatch, precision):
    ex, cap = captured("gpt")
    plan = plan_captured(cap, parse_cluster("cpu:1"), 1,
                         pins={"precision": precision} if precision else {})

    def step(pm, comm):
        loss = pm.train_step(*ex.inputs, target=ex.target)
        targets = [n.target for gm in pm.runner.programs.values() for n in gm.graph.nodes
                   if n.op == "call_function"]
        return loss, {k: p.grad for k, p in pm.named_parameters()}, targets

    [(loss, grads, targets)] = simulate(cap, plan, ex.model, step)
    swapped = sum(t in set(BINDINGS.values()) for t in targets)
    left = sorted({str(t) for t in targets if t in BINDINGS})
    assert swapped > 40 and not left, (swapped, left)
    monkeypatch.setattr(program_passes, "fast_bindings", lambda gm: 0)
    [(loss0, grads0, targets0)] = simulate(cap, plan, ex.model, step)
    assert not set(targets0) & set(BINDINGS.values())
    assert loss.dtype == loss0.dtype and torch.equal(loss, loss0), (loss, loss0)
    assert grads.keys() == grads0.keys()
    for k in grads:
        assert torch.equal(grads[k], grads0[k]), k
