"""Run one op sharded on simulated ranks and compare it with the op on one device.

This is how every sharding rule is tested (``tests/test_rules_*.py``): each simulated rank
starts from the whole inputs, moves them to the strategy's input placements with the same
autograd-aware collectives the runtime uses, runs the localized op, brings every output
back to Replicate, and then runs backward with the same output gradient. The outputs and
every input gradient on every rank must equal those of the unsharded op.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.placement import Replicate
from autopar.ops.collectives import apply_step
from autopar.ops.comm import ThreadWorld
from autopar.sharding.redistribute import plan_steps
from autopar.sharding.registry import (
    OpCall, Strategy, TensorMeta, input_placements, localize, output_placements,
)

R = Replicate()


def call_from_tensors(op, args: tuple, kwargs: dict | None = None, name: str = "op"):
    """The OpCall of ``op(*args, **kwargs)`` plus the tensors in input order."""
    kwargs = kwargs or {}
    tensors: list[torch.Tensor] = []
    metas: list[TensorMeta] = []

    def conv(a):
        if isinstance(a, torch.Tensor):
            m = TensorMeta(tuple(a.shape), a.dtype)
            tensors.append(a)
            metas.append(m)
            return m
        return a

    margs = pytree.tree_map(conv, args)
    mkwargs = pytree.tree_map(conv, kwargs)
    out = op(*args, **kwargs)
    outs = tuple(TensorMeta(tuple(o.shape), o.dtype)
                 for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
    return OpCall(name, op, margs, mkwargs, tuple(metas), outs), tensors


def _grad_partial(combo, k) -> tuple[bool, ...]:
    return tuple(isinstance(s.inputs[k], Replicate)
                 and any(not isinstance(p, Replicate) for p in s.outputs) for s in combo)


def _zero_sum_noise(x: torch.Tensor, comm, axis: int, seed: int) -> torch.Tensor:
    """This rank's share of noise that sums to zero over ``axis``: added to a Partial input
    so that its terms are not "the value on rank 0, zeros elsewhere" (with those, an op
    with f(0) = 0, such as relu or mul, would pass a wrong P -> P strategy). ``x`` is the
    (replicated) value before the split; the noise scales with it."""
    gen = torch.Generator().manual_seed(7919 * seed + axis)
    z = torch.randn((comm.size(axis), *x.shape), generator=gen, dtype=x.dtype)
    scale = x.detach().abs().amax() if x.numel() else 0.0
    return ((z[comm.coord[axis]] - z.mean(0)) * scale).detach()


def run_sharded(call: OpCall, tensors: Sequence[torch.Tensor], combo: tuple[Strategy, ...],
                mesh_shape: tuple[int, ...], grad_seed: int = 0, no_grad: Sequence[int] = ()):
    """Per rank: (outputs brought back to R, gradients of the float inputs except the
    inputs numbered in ``no_grad``, e.g. buffers such as batch_norm's running stats)."""
    target, largs, lkwargs = localize(call, combo, tuple(mesh_shape))
    n = len(mesh_shape)

    def body(comm):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point() and k not in no_grad)
                  for k, t in enumerate(tensors)]
        local = {}
        for k, (meta, leaf) in enumerate(zip(call.inputs, leaves)):
            x = leaf
            for step in plan_steps((R,) * n, input_placements(combo, k), _grad_partial(combo, k)):
                before, x = x, apply_step(x, step)
                if step.kind == "to_partial" and x.is_floating_point():
                    x = x + _zero_sum_noise(before, comm, step.axis, seed=k)
            local[id(meta)] = x
        sub = lambda a: local[id(a)] if isinstance(a, TensorMeta) else a  # noqa: E731
        out = target(*pytree.tree_map(sub, largs), **pytree.tree_map(sub, lkwargs))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        full = []
        for k, o in enumerate(outs):
            for step in plan_steps(output_placements(combo, k), (R,) * n):
                o = apply_step(o, step)
            full.append(o)
        gen = torch.Generator().manual_seed(grad_seed)
        diff = [o for o in full if o.requires_grad]
        grads_out = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
        if diff:
            torch.autograd.backward(diff, grads_out)
        return [o.detach() for o in full], [l.grad if l.requires_grad else None for l in leaves]

    return ThreadWorld(mesh_shape).run(body)


def check_strategy(op, args: tuple, kwargs: dict | None, combo: tuple[Strategy, ...],
                   mesh_shape: tuple[int, ...], rtol: float = 1e-5, atol: float = 1e-5,
                   no_grad: Sequence[int] = ()) -> None:
    """Assert that ``op`` run under ``combo`` on ``mesh_shape`` equals ``op`` on one device,
    forward and backward, on every simulated rank. Inputs numbered in ``no_grad`` (tensor
    inputs in order) are not differentiated (buffers)."""
    call, tensors = call_from_tensors(op, args, kwargs)
    ref_in = [t.detach().clone().requires_grad_(t.is_floating_point() and k not in no_grad)
              for k, t in enumerate(tensors)]
    it = iter(ref_in)
    ref_args = pytree.tree_map(lambda a: next(it) if isinstance(a, torch.Tensor) else a, args)
    ref_kwargs = pytree.tree_map(lambda a: next(it) if isinstance(a, torch.Tensor) else a,
                                 kwargs or {})
    ref_out = [o for o in pytree.tree_leaves(op(*ref_args, **ref_kwargs))
               if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(0)
    diff = [o for o in ref_out if o.requires_grad]
    if diff:
        torch.autograd.backward(diff, [torch.randn(o.shape, generator=gen, dtype=o.dtype)
                                       for o in diff])
    label = f"{op} under {' x '.join(str(s) for s in combo)} on mesh {tuple(mesh_shape)}"
    for rank, (outs, grads) in enumerate(run_sharded(call, tensors, combo, mesh_shape,
                                                     no_grad=no_grad)):
        for k, (o, r) in enumerate(zip(outs, ref_out)):
            torch.testing.assert_close(o, r.detach(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"output {k} of {label}, rank {rank}: {m}")
        for k, (g, leaf) in enumerate(zip(grads, ref_in)):
            if leaf.requires_grad:
                ref_g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                g = g if g is not None else torch.zeros_like(leaf)
                torch.testing.assert_close(g, ref_g, rtol=rtol, atol=atol,
                                           msg=lambda m: f"grad of input {k} of {label}, rank {rank}: {m}")
