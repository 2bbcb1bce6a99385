"""Mesh axes and their roles as one value (``autopar.mesh_roles.MeshRoles``), and attention
recognised by one predicate (``autopar.ops.attention.is_attention``).

MeshRoles: the axis names every other list derives from (``options.MESH_AXIS_PINS``,
``elastic.MODEL_AXES``), the pinned meshes the solver lays out (``solver.meshes``) with
names and roles that agree, and the roles read back from a plan (``explain``'s prices).
is_attention: true for the attention op the capture leaves in the graph, whichever way
``F.scaled_dot_product_attention`` is called; false for matmuls and for attention written
with them."""
from __future__ import annotations

import os
import sys
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.capture import capture
from autopar.elastic import MODEL_AXES
from autopar.mesh_roles import AXIS_NAMES, NO_ROLES, STAGE_AXES, MeshRoles
from autopar.ops.attention import SDPA, is_attention
from autopar.options import MESH_AXIS_PINS, Options
from autopar.solver.meshes import mesh_candidates

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.models import EXAMPLES  # noqa: E402

aten = torch.ops.aten


# ---- MeshRoles ----------------------------------------------------------------------------

def test_axis_names_are_the_fields_and_every_list_derives_from_them():
    assert AXIS_NAMES == tuple(f.name for f in fields(MeshRoles))[:-1]
    assert AXIS_NAMES == ("data", "context", "expert", "tensor", "pipeline", "branch")
    assert STAGE_AXES == ("data", "context", "expert", "tensor")
    assert MESH_AXIS_PINS == AXIS_NAMES
    assert MODEL_AXES == tuple(n for n in AXIS_NAMES if n != "data")
    options = {f.name for f in fields(Options)}
    assert set(AXIS_NAMES) <= options, set(AXIS_NAMES) - options


@pytest.mark.parametrize("sizes,shape,roles", [
    ({"data": 2, "tensor": 4}, (2, 4), MeshRoles(data=0, tensor=1)),
    ({"data": 1, "tensor": 4}, (4,), MeshRoles(tensor=0)),
    ({}, (1,), MeshRoles(data=0)),
    ({"data": 2, "context": 2, "expert": 2, "tensor": 2}, (2, 2, 2, 2),
     MeshRoles(data=0, context=1, expert=2, tensor=3)),
    ({"tensor": 2, "context": 4}, (4, 2), MeshRoles(context=0, tensor=1)),
])
def test_lay_out_orders_the_axes_outer_to_inner(sizes, shape, roles):
    got_shape, got = MeshRoles.lay_out(sizes)
    assert (got_shape, got) == (shape, roles)
    for name in STAGE_AXES:
        assert got.degree(name, got_shape) == sizes.get(name, 1)


def test_lay_out_and_axis_names_refuse_what_is_no_stage_mesh():
    with pytest.raises(ValueError, match=r"\['pipeline'\]"):
        MeshRoles.lay_out({"data": 2, "pipeline": 2})
    with pytest.raises(ValueError, match="tensor axis is 2, outside a mesh of 2 axes"):
        MeshRoles(data=0, tensor=2).axis_names(2)


@pytest.mark.parametrize("world,pins,shape,axes", [
    (8, {"data": 2, "tensor": 4}, (2, 4), ("data", "tensor")),
    (8, {"context": 2, "tensor": 2}, (2, 2, 2), ("data", "context", "tensor")),
    (8, {"expert": 4, "expert_dispatch": "all-gather"}, (2, 4), ("data", "expert")),
    (4, {"tensor": 4}, (4,), ("tensor",)),
    (4, {"zero": 3}, (4,), ("data",)),
])
def test_pinned_meshes_name_their_axes_by_their_roles(world, pins, shape, axes):
    opts = Options.from_pins(pins)
    (got_shape, got_axes, roles), = mesh_candidates(world, opts, None)
    assert (got_shape, got_axes) == (shape, axes)
    assert roles.axis_names(len(got_shape)) == got_axes
    assert roles == MeshRoles.of_axes(got_axes, opts.expert_dispatch)
    assert roles.dispatch == opts.expert_dispatch
    for name in ("data", "tensor", "expert", "context"):
        if name in pins:
            assert roles.degree(name, got_shape) == pins[name]


def test_free_meshes_have_no_roles():
    got = mesh_candidates(4, Options(), None)
    assert [(s, a) for s, a, _ in got] == [((4,), ("axis0",)), ((2, 2), ("axis0", "axis1"))]
    assert all(r == NO_ROLES for _, _, r in got)
    assert MeshRoles.of_axes(("axis0", "axis1")) == NO_ROLES


def test_roles_of_a_plan():
    ex = EXAMPLES["mlp"](batch=8)
    plan = autopar.plan(ex.model, ex.inputs, loss_fn=ex.loss_fn, target=ex.target,
                        cluster="cpu:4", data=2, tensor=2)
    roles = MeshRoles.of_plan(plan)
    assert roles == MeshRoles(data=0, tensor=1)
    assert roles.axis_names(len(plan.mesh_shape)) == tuple(plan.mesh_axes)


def test_roles_key_programs_apart():
    """Hashable and equal by value: the solver keys problems and ILPs by them."""
    a, b = MeshRoles(data=0, tensor=1), MeshRoles(data=0, tensor=1)
    assert a == b and hash(a) == hash(b)
    assert len({a, MeshRoles(data=1, tensor=0), a.with_dispatch("all-to-all")}) == 3


# ---- is_attention -------------------------------------------------------------------------

class Attention(nn.Module):
    """One attention call: ``kind`` picks how ``F.scaled_dot_product_attention`` is called,
    or ``"matmul"`` writes attention with matmuls and softmax."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k = v = x.view(b, s, 4, 4).transpose(1, 2)
        if self.kind == "matmul":
            y = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v
        elif self.kind == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "mask":
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.kind == "dropout":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        elif self.kind == "gqa":
            y = F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, scale=0.5)
        return y.transpose(1, 2).reshape(b, s, 16)


def _attention_nodes(kind: str) -> list:
    cap = capture(Attention(kind), (torch.randn(2, 8, 16),), lambda y, t: (y - t).pow(2).mean(),
                  torch.zeros(2, 8, 16))
    return [n for n in cap.gm.graph.nodes if n.op == "call_function" and is_attention(n.target)]


@pytest.mark.parametrize("kind", ["plain", "causal", "mask", "dropout", "gqa"])
def test_every_sdpa_call_is_captured_as_attention(kind):
    (node,) = _attention_nodes(kind)
    assert node.target is SDPA


def test_matmuls_are_not_attention():
    assert _attention_nodes("matmul") == []
    for op in (aten.mm.default, aten.bmm.default, aten.matmul.default, aten._softmax.default):
        assert not is_attention(op)
    # the fused kernels under the op read other arguments (no mask at position 3)
    assert not is_attention(aten._scaled_dot_product_flash_attention_for_cpu.default)
